"""The one way gpuvfio starts a local process (a structure test holds every other module to it;
the in-guest payload, which runs inside guests with the stdlib only, aside).

A command is an argument list, never a shell line. It runs in a session of its own with stdin
from /dev/null (nothing it starts can wait on the terminal), under a deadline, with each of its
outputs bounded; past the deadline or the bound, its whole process group is killed (what it
started goes too, so no child keeps the pipes open) and the error says which. A failure is one
line.

:class:`Runner` is what a Context holds (``ctx.run``): ``run(argv, timeout)`` for a command's
stdout, ``run.finish(...)`` for its exit status and both outputs. Both go through its one
``start`` function (``run_here``: this machine), so a Context built around a recording
``start`` sees every command gpuvfio would run, and runs none.
"""

from __future__ import annotations

import os
import selectors
import signal
import subprocess
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field

from gpuvfio.clock import SYSTEM_CLOCK
from gpuvfio.errors import GpuvfioError

OUTPUT_LIMIT = 16 << 20  # per stream: the verifier's JSON and the probe's lines are far smaller


class CommandError(GpuvfioError):
    """A command that did not finish as a command should. ``reason``: the message without the
    command's label, for callers that name the command their own way."""

    def __init__(self, label: str, reason: str) -> None:
        super().__init__(f"{label}: {reason}")
        self.label = label
        self.reason = reason


class CommandNotStarted(CommandError):
    """The program could not be started (not found, not executable)."""

    def __init__(self, program: str, reason: str) -> None:
        GpuvfioError.__init__(self, f"cannot run {program}: {reason}")
        self.label = program
        self.reason = reason


class CommandTimeout(CommandError):
    """No end within the timeout: it was killed; whatever it was doing may or may not be done."""


class CommandOutputLimit(CommandError):
    """More output than the caller allows: it was killed."""


class CommandFailed(CommandError):
    """It ran and exited with a status other than 0 (``status``: negative for a signal)."""

    def __init__(self, label: str, reason: str, status: int) -> None:
        super().__init__(label, reason)
        self.status = status


@dataclass(frozen=True)
class Command:
    argv: tuple[str, ...]
    timeout: float  # seconds until it must have exited
    env: Mapping[str, str] | None = None  # None: this process's environment
    limit: int = OUTPUT_LIMIT  # bytes of stdout, and of stderr, it may print
    label: str = ""  # how errors name it ("": its first three arguments)

    def __post_init__(self) -> None:
        if not self.argv or not all(isinstance(a, str) for a in self.argv):
            raise GpuvfioError(f"a command is a non-empty list of strings, not {list(self.argv)!r}")
        if not self.label:
            object.__setattr__(self, "label", " ".join(self.argv[:3]))


@dataclass(frozen=True)
class Finished:
    status: int  # the exit status; negative: killed by that signal
    stdout: bytes
    stderr: bytes


def last_line(data: bytes, limit: int = 200) -> str:
    """The last non-empty line a command printed, safe to put in a one-line message."""
    lines = [line.strip() for line in data.decode("utf-8", "replace").splitlines() if line.strip()]
    last = "".join(c if c.isprintable() else "?" for c in (lines[-1] if lines else ""))
    return last[:limit] + ("..." if len(last) > limit else "")


def _kill(proc: subprocess.Popen) -> None:
    try:
        os.killpg(proc.pid, signal.SIGKILL)  # its own session: children holding the pipes go too
    except OSError:
        pass
    proc.wait()


def run_here(command: Command) -> Finished:
    """Run ``command`` to its end on this machine: the real thing behind every Runner."""
    try:
        proc = subprocess.Popen(list(command.argv), stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                                stderr=subprocess.PIPE, env=None if command.env is None else dict(command.env),
                                start_new_session=True, close_fds=True)
    except OSError as exc:
        raise CommandNotStarted(command.argv[0], exc.strerror or str(exc)) from None
    out, err = bytearray(), bytearray()
    # A real process runs in real time: its deadline is on the real clock, whatever clock the
    # Context has (a test that fakes a command fakes Runner.start instead).
    monotonic = SYSTEM_CLOCK.monotonic
    deadline = monotonic() + command.timeout
    finished = False
    with selectors.DefaultSelector() as selector:
        selector.register(proc.stdout, selectors.EVENT_READ, out)
        selector.register(proc.stderr, selectors.EVENT_READ, err)
        try:
            while selector.get_map():
                left = deadline - monotonic()
                if left <= 0:
                    raise CommandTimeout(command.label, f"no answer within {command.timeout:g}s")
                for key, _events in selector.select(left):
                    chunk = os.read(key.fileobj.fileno(), 65536)
                    if not chunk:
                        selector.unregister(key.fileobj)
                        continue
                    key.data.extend(chunk)
                    if len(key.data) > command.limit:
                        raise CommandOutputLimit(command.label, f"more than {command.limit} bytes of output")
            try:
                status = proc.wait(timeout=max(deadline - monotonic(), 0.01))
            except subprocess.TimeoutExpired:
                raise CommandTimeout(command.label, f"did not exit within {command.timeout:g}s") from None
            finished = True
        finally:  # an error here, or an interrupt (its own session does not get the terminal's)
            if not finished:
                _kill(proc)
            proc.stdout.close()
            proc.stderr.close()
    return Finished(status, bytes(out), bytes(err))


@dataclass(frozen=True)
class Runner:
    """Local commands, all through ``start`` (a test gives one that records and answers)."""

    start: Callable[[Command], Finished] = field(default=run_here)

    def finish(self, argv: Sequence[str], timeout: float, *, env: Mapping[str, str] | None = None,
               limit: int = OUTPUT_LIMIT, label: str = "") -> Finished:
        """Exit status and both outputs, whatever the status."""
        return self.start(Command(tuple(argv), timeout, env, limit, label))

    def __call__(self, argv: Sequence[str], timeout: float, env: Mapping[str, str] | None = None) -> str:
        """stdout of a command that must exit 0; otherwise a one-line CommandError (its last
        stderr line, or its status)."""
        command = Command(tuple(argv), timeout, env)
        done = self.start(command)
        if done.status:
            said = last_line(done.stderr) or f"exit {done.status}"
            raise CommandFailed(f"{command.label} failed", said, done.status)
        return done.stdout.decode("utf-8", "replace")


@dataclass
class Actions:
    """What gpuvfio may do beyond sysfs writes (load a module, stop or start a service): on the
    live host, commands through a Runner (gpuvfio.ops.context.live_actions); injected so tests
    use a simulated kernel."""

    modprobe: Callable[[str], None]
    stop_service: Callable[[str], None]
    start_service: Callable[[str], None]
