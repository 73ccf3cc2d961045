"""The process's own files, outside any tree: its stdout once its reader is gone, and its
scratch directories."""

from __future__ import annotations

import contextlib
import os
import sys

from gpuvfio.settings import Settings

__all__ = ["silence_stdout", "scratch_dir"]


def silence_stdout() -> None:
    """Point stdout's descriptor at /dev/null: its reader is gone (a closed pipe), and what is
    still buffered must not raise BrokenPipeError again when the interpreter flushes at exit
    (Python's documented way: docs.python.org/3/library/signal.html, "Note on SIGPIPE")."""
    try:
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        os.close(devnull)
    except (OSError, ValueError, AttributeError):
        pass  # stdout is not a real descriptor (captured by a test): nothing to silence


@contextlib.contextmanager
def scratch_dir(prefix: str):
    """A private temporary directory (0700), removed with everything in it afterwards (rmtree
    does not follow links). Memory-backed /dev/shm when it is there and TMPDIR is not set: a
    recorded host is thousands of small files."""
    import tempfile  # here, where it is used: the root command and a live host's reads need none

    scratch = "/dev/shm" if os.access("/dev/shm", os.W_OK) and not Settings.from_environment().tmpdir_set else None
    with tempfile.TemporaryDirectory(prefix=prefix, dir=scratch) as directory:
        yield directory
