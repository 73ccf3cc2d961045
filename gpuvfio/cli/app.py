"""The typer application: global options, how errors and results leave the process.

One parser for every command (typer). Commands live in the modules beside this one and only
parse, call gpuvfio.ops (or gpuvfio.testbed) and print; this module turns gpuvfio's typed
errors into one line on stderr and an exit status, once:

  0  done
  1  refused (the host's state does not allow it; a dry run that the real run would refuse)
     or a check / step failed
  2  bad input (malformed address, option, spec; unusable root; unreadable host files)
"""

from __future__ import annotations

import errno
import sys
from typing import Annotated, Callable, Optional

import typer

from gpuvfio import __version__
from gpuvfio.cli.lazy import VERBOSE_HELP, GlobalOptions, LazyGroup
from gpuvfio.cli.output import printable, rich_console
from gpuvfio.errors import GpuvfioError
from gpuvfio.files import silence_stdout
from gpuvfio.settings import COMPLETE_ENV, ROOT_ENV, Settings

SUMMARY = "GPU passthrough provisioning for KVM hosts: inventory, doctor, binding, domains, verification."

# -h as well as --help, on every command and group (click's help_option_names, inherited by
# subcommands through their context).
HELP_OPTIONS = {"help_option_names": ["-h", "--help"]}
COMPLETE_VAR = COMPLETE_ENV
# The root knows each command by its index (gpuvfio.cli.lazy); a command's module loads when it runs.
app = typer.Typer(name="gpuvfio", cls=LazyGroup, help=SUMMARY, no_args_is_help=True, add_completion=False,
                  pretty_exceptions_enable=False, rich_markup_mode=None, context_settings=HELP_OPTIONS)

RootOption = Annotated[
    Optional[str],
    typer.Option("--root", envvar=ROOT_ENV, metavar="DIR",
                 help="Host root to inspect (a directory like /, or a host fixture file). Default /."),
]
JsonOption = Annotated[bool, typer.Option("--json", help="Print one JSON object instead of text.")]


def _version(value: bool) -> None:
    if value:
        sys.stdout.write(f"gpuvfio {__version__}\n")
        raise typer.Exit(0)


@app.callback()
def global_options(
    root: RootOption = None,
    verbose: Annotated[bool, typer.Option("--verbose", "-v", help=VERBOSE_HELP)]
    = False,
    version: Annotated[bool, typer.Option("--version", callback=_version, is_eager=True,
                                          help="Print gpuvfio's version and exit.")] = False,
) -> None:
    GlobalOptions.root = root
    GlobalOptions.verbose = verbose  # a -v after the command sets it again as that command parses


def root_of(command_root: str | None) -> str | None:
    """The command's --root, else the global one (both also read GPUVFIO_ROOT)."""
    return command_root if command_root is not None else GlobalOptions.root


def emit_json(data) -> None:
    # No indent: json's C encoder only runs without it (3x faster on a large host).
    # ensure_ascii (json's default, kept on purpose): every character outside printable ASCII
    # -- C0, DEL, C1 with U+009B, the bidi controls, any non-ASCII -- is written as a \uXXXX
    # escape, so the output is valid JSON whose values load back intact and a terminal showing
    # it raw receives nothing it would act on.
    import json  # here, where it is used: --help, completion and text output need none

    sys.stdout.write(json.dumps(data, ensure_ascii=True) + "\n")


def say(line: str) -> None:
    """A line for the person at the terminal (stderr), prefixed like every gpuvfio message;
    what it quotes (a host's names, a guest's words) comes through printable()."""
    try:
        sys.stderr.write(f"gpuvfio: {printable(line)}\n")
        sys.stderr.flush()
    except (OSError, ValueError):
        # On a remote run stderr is a pty that goes away on hangup: a progress line that cannot
        # be written must not stop the teardown that follows it.
        pass


class TerminalProgress:
    """Progress on a terminal: a step that starts ("NAME ...") shows as a spinner with its
    elapsed time until the next line ends it; every other line is printed as it comes. In a
    pipe gpuvfio prints the lines themselves (say), one per step.

    A terminal that goes away (a remote run's pty hung up: OpenSSH, and dropbear since 2022,
    close it when the connection drops, and each write then fails with EIO) ends the progress
    quietly, as say does: what follows -- the teardown of a testbed variant -- must still run."""

    current = None  # the one live progress of this process (stopped before errors are printed)

    def __init__(self, console=None) -> None:
        self.console = console or rich_console(stderr=True)
        self.status = None
        self.gone = False  # the terminal went away: nothing more is written

    def __call__(self, line: str) -> None:
        if self.gone:
            return
        try:
            self._show(line)
        except (OSError, ValueError):
            self.gone = True
            self.stop()

    def _show(self, line: str) -> None:
        self.stop()
        if line.endswith(" ..."):
            step = printable(line[:-4], "markup")
            self.status = self.console.status(f"gpuvfio: {step}", spinner="dots")
            self.status.start()
            TerminalProgress.current = self
            return
        self.console.print(f"gpuvfio: {printable(line, 'markup')}", soft_wrap=True, highlight=False)

    def stop(self) -> None:
        status, self.status = self.status, None
        TerminalProgress.current = None
        if status is not None:
            try:
                status.stop()  # ends its refresh thread even where the line it clears has nowhere to go
            except (OSError, ValueError):
                self.gone = True


def stop_progress() -> None:
    if TerminalProgress.current is not None:
        TerminalProgress.current.stop()


def progress_for(as_json: bool) -> Callable[[str], None]:
    """Progress for people on stderr: on a terminal live (TerminalProgress), in a pipe one line
    per step; with --json only when --verbose asks for it (then as lines)."""
    if as_json and not GlobalOptions.verbose:
        return lambda line: None
    if not as_json and sys.stderr.isatty():
        return TerminalProgress()
    return say


def main(argv: list[str] | None = None) -> int:
    """Run one command; the exit status (errors already reported on stderr)."""
    try:
        code = _command(argv)
    finally:
        stop_progress()
    return _flushed(code)


def _command(argv: list[str] | None) -> int:
    try:
        if Settings.from_environment().completion:
            # typer's completion classes answer the shell's request (typer.completion)
            from typer.completion import completion_init
            completion_init()
        code = app(args=argv, standalone_mode=False, prog_name="gpuvfio")
        return code if isinstance(code, int) else 0
    except GpuvfioError as exc:
        _error(str(exc))
        return exc.exit_code
    except typer.Exit as exc:
        return exc.exit_code
    except SystemExit as exc:  # shell completion answers, then exits (typer.core shell_complete)
        if type(sys.stdout).__name__ == "PacifyFlushWrapper":
            # click met EPIPE (the reader of a pipe went away), wrapped stdout and exited 1
            # (click.core.BaseCommand.main); for gpuvfio that is done, as for lspci | head.
            silence_stdout()
            return 0
        return exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 1)
    except (typer.Abort, KeyboardInterrupt):
        _error("interrupted")
        return 130
    except BrokenPipeError:
        # The reader went away (gpuvfio list | head -1): quietly done, as lspci is. What is
        # still buffered goes nowhere, so the interpreter's own flush at exit cannot fail.
        silence_stdout()
        return 0
    except OSError as exc:  # the output could not be written (a full disk, gpuvfio list > /dev/full)
        if exc.errno not in UNWRITABLE:
            raise
        return _unwritable(exc)
    except Exception as exc:  # noqa: BLE001 - click's usage errors, below
        # typer vendors click privately (typer._click): its usage errors are recognised by
        # their interface, not by a class imported from a private module.
        if not (hasattr(exc, "format_message") and isinstance(getattr(exc, "exit_code", None), int)):
            raise
        if type(exc).__name__ == "NoArgsIsHelpError":
            sys.stdout.write(exc.format_message() + "\n")
            return 2
        _error(exc.format_message().splitlines()[0] + (f" (see {_command_path(exc)} -h)" if exc.exit_code == 2 else ""))
        return exc.exit_code


def _flushed(code: int) -> int:
    """``code``, once what stdout still buffers is written: a reader gone is done (as above), an
    output that cannot be written fails the command, in one line."""
    try:
        sys.stdout.flush()
    except BrokenPipeError:
        silence_stdout()
    except ValueError:
        pass  # stdout closed (a test's capture)
    except OSError as exc:
        if exc.errno not in UNWRITABLE:
            raise
        return _unwritable(exc)
    return code


# what write(2) says when the output's file or device cannot take it (write(2), Linux man-pages 6.9)
# (EBADF: stdout opened for reading only, gpuvfio list 1</dev/null; EAGAIN: a non-blocking pipe full)
UNWRITABLE = frozenset({errno.ENOSPC, errno.EDQUOT, errno.EFBIG, errno.EIO, errno.EBADF, errno.EAGAIN})


def _unwritable(exc: OSError) -> int:
    """Stdout could not take the output: said in one line, and stdout pointed at /dev/null so that
    the interpreter's own flush at exit does not fail again with a traceback."""
    silence_stdout()
    _error(f"could not write the output: {exc.strerror or exc}")
    return 1


def _command_path(exc) -> str:
    """The command a usage error belongs to (``gpuvfio bind``), whose -h says what it takes."""
    ctx = getattr(exc, "ctx", None)
    path = getattr(ctx, "command_path", "") if ctx is not None else ""
    return path if path.startswith("gpuvfio") else "gpuvfio"


def _error(message: str) -> None:
    """The one error line: what it quotes (a link's target, a directory's name, a guest's
    answer, an argument) comes through printable()."""
    stop_progress()  # the spinner's line is cleared before the error is written
    sys.stderr.write(f"gpuvfio: error: {printable(message)}\n")


def run() -> None:
    """The console script and ``python -m gpuvfio``."""
    sys.exit(main())
