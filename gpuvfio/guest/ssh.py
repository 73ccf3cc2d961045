"""SSH into guests with paramiko: pinned host keys, retries while booting, quoted commands.

Host keys: an unknown key is rejected unless the user pins it (``--known-hosts FILE``)
or asks for trust on first use, which records the key it saw (in the given known_hosts
file, else ``<state dir>/known_hosts``) and says so. A key that differs from a recorded
one is always rejected. Commands are argument lists joined with shlex quoting; output
is read to the end before the exit status is asked for (testinfra's order, so a full
pipe cannot deadlock the remote side).
"""

from __future__ import annotations

import os
import shlex
import socket
from dataclasses import dataclass, field

from gpuvfio.clock import SYSTEM_CLOCK, Clock
from gpuvfio.errors import GpuvfioError, InputError
from gpuvfio.settings import Settings
from gpuvfio.user_files import for_another_program, read_regular, user_file


class SshError(GpuvfioError):
    pass


class HostKeyError(SshError):
    pass


class JumpChannelError(SshError):
    """The ProxyJump host is up but cannot reach the target (yet): retried until the timeout."""


class ConnectionLost(SshError):
    """The SSH connection itself went away (not just the command)."""


@dataclass
class SshTarget:
    host: str
    port: int = 22
    user: str = "root"
    key: str | None = None
    known_hosts: str | None = None
    trust_on_first_use: bool = False
    connect_timeout: float = 120.0
    notes: list[str] = field(default_factory=list)
    identity_files: tuple[str, ...] = ()  # from the SSH config, when no key is given
    pinned_files: tuple[str, ...] = ()  # more known_hosts files to trust (the SSH config's); never written
    jump: "SshTarget | None" = None  # ProxyJump: reached through this host's direct-tcpip channel

    def label(self) -> str:
        return f"{self.user}@{self.host}:{self.port}"


def _known_hosts_name(host: str, port: int) -> str:
    return host if port == 22 else f"[{host}]:{port}"


NOT_SSH = "not an SSH server"
# The most a guest or a remote host may send for one command (stdout and stderr together): the
# probe's report, a dump-host recording, a testbed's results archive are a few MiB at most.
OUTPUT_LIMIT = 16 << 20
# What paramiko (SSHClient._auth, 3.x) raises when it has no key, agent or password to try.
NO_KEY = "No authentication methods available"


def banner_state(host: str, port: int) -> str | None:
    """None when something on host:port sends an SSH banner ("SSH-...") right now, else why not:
    the name is not resolved, the connection is refused or times out, the peer closes before
    its banner (slirp accepts connections before the guest's server listens), or it is not an
    SSH server at all (it sent something else first)."""
    try:
        with socket.create_connection((host, port), timeout=2) as sock:
            sock.settimeout(2)
            data = b""
            while len(data) < 4:
                chunk = sock.recv(256)
                if not chunk:
                    return "connection closed before an SSH banner (the server is not up yet)"
                data += chunk
            if data.startswith(b"SSH-"):
                return None
            shown = data[:24].decode("ascii", "replace").splitlines()[0] if data else ""
            return f"{NOT_SSH} (it sent {shown!r})"
    except (socket.gaierror, UnicodeError):
        return f"name {host!r} not resolved"
    except ConnectionRefusedError:
        return "connection refused"
    except (socket.timeout, TimeoutError):
        return "timed out (no answer)"
    except OSError as exc:
        return exc.strerror or str(exc)


def _fingerprint(key) -> str:
    import base64
    import hashlib

    digest = hashlib.sha256(key.asbytes()).digest()
    return "SHA256:" + base64.b64encode(digest).decode().rstrip("=")


class Session:
    def __init__(self, target: SshTarget, default_known_hosts: str | None = None, *,
                 clock: Clock = SYSTEM_CLOCK, record=None, recorded=None) -> None:
        """``record(line)`` and ``recorded()``: how a key trusted on first use is added to
        ``default_known_hosts`` and how that file is read (the Context's: through its state dir,
        no link followed); None: by its path."""
        if not 0 < target.port < 65536:
            raise InputError(f"SSH port out of range: {target.port}")
        if target.key and not for_another_program(target.key):
            raise InputError(f"SSH key file not found: {target.key}")
        if target.known_hosts and not target.trust_on_first_use and not for_another_program(target.known_hosts):
            raise InputError(f"known_hosts file not found: {target.known_hosts}")
        self.target = target
        self.record_to = target.known_hosts or default_known_hosts
        self.client = None
        self.jump_session: Session | None = None
        self.clock = clock  # the Context's (Context.ssh): connection waits and command deadlines
        self.agent = Settings.from_environment().ssh_agent  # read once, not on each connection attempt
        # A known_hosts the user named goes by its path, unless it is the default file itself.
        own = not target.known_hosts or path_is(target.known_hosts, default_known_hosts)
        self.record, self.recorded = (record, recorded) if own else (None, None)

    def connect(self) -> "Session":
        import logging

        # While a guest boots, slirp accepts connections before sshd listens and paramiko's
        # transport thread logs each failed banner read as an error with a traceback: our
        # retries are the expected path, the final failure is reported by us, once.
        logging.getLogger("paramiko").setLevel(logging.CRITICAL)
        target = self.target
        deadline = self.clock.monotonic() + target.connect_timeout
        delay = 0.1
        while True:
            # A booting guest: poll for the server's banner, which is cheap, often; start the
            # SSH handshake once it is there. (Full attempts with a long backoff used to land
            # up to 4 s after the guest was ready.)
            # Through a jump host the target is not reachable from here: no banner to poll.
            waiting = None if target.jump else banner_state(target.host, target.port)
            if waiting is not None and waiting.startswith(NOT_SSH):
                raise SshError(f"{target.label()}: {waiting}")
            if waiting is not None:
                last = waiting
            else:
                last = self._handshake()
                if last is None:
                    return self
            delay = self._pause_before_retry(deadline, delay, last)

    def _handshake(self) -> Exception | None:
        """One SSH handshake with the target: None once connected (``self.client`` is set), else
        the failure that a later try may get past (a guest still booting). A failure that no
        waiting mends (a host key refused, authentication refused, no key to offer) is raised."""
        import paramiko

        target = self.target
        client = paramiko.SSHClient()
        self._load_host_keys(client)
        client.set_missing_host_key_policy(_Policy(self))
        try:
            keys = [target.key] if target.key else list(target.identity_files)
            sock = self._through_jump()
            client.connect(target.host, port=target.port, username=target.user, key_filename=keys or None,
                           timeout=5, banner_timeout=15, auth_timeout=20,
                           allow_agent=self.agent, look_for_keys=not keys,
                           sock=sock)
            # Like ServerAliveInterval: traffic on an idle connection, so a dropped one is
            # noticed while a long command (a remote testbed run) waits.
            client.get_transport().set_keepalive(15)
            self.client = client
            return None
        except HostKeyError:
            client.close()
            raise
        except paramiko.BadHostKeyException as exc:
            client.close()
            raise HostKeyError(f"host key of {target.label()} changed ({_fingerprint(exc.key)}, expected "
                               f"{_fingerprint(exc.expected_key)}): refusing to connect") from None
        except JumpChannelError as exc:  # the jump host cannot reach the guest yet (still booting)
            client.close()
            return exc
        except paramiko.AuthenticationException as exc:
            client.close()
            if "timeout" not in str(exc).lower():
                raise SshError(f"authentication to {target.label()} failed: {exc}") from None
            # A server that has only just started (a guest still booting, all the more under
            # emulation) can take longer than auth_timeout to answer: try again.
            return exc
        except (OSError, socket.timeout, paramiko.SSHException, EOFError) as exc:
            client.close()
            if str(exc) == NO_KEY:  # nothing to offer: no waiting makes one appear
                raise SshError(f"authentication to {target.label()} failed: no key to offer (give an SSH "
                               "key, an IdentityFile in the SSH config, or an agent)") from None
            return exc

    def _pause_before_retry(self, deadline: float, delay: float, last) -> float:
        """Sleep ``delay`` and return the next, longer one (up to 1 s); SshError, naming ``last``
        (why the latest try failed), when the deadline would pass first."""
        if self.clock.monotonic() + delay > deadline:
            raise SshError(f"{self.target.label()} did not answer SSH within {self.target.connect_timeout:g}s "
                           f"(last error: {last})")
        self.clock.sleep(delay)
        return min(delay * 1.5, 1.0)

    def _load_host_keys(self, client) -> None:
        """The known_hosts files into ``client``, in a fixed order, gpuvfio's own first: paramiko
        keeps the first key of a type it reads for a host. The default file is read as the
        Context reads its state dir (``recorded``), no link followed."""
        import paramiko

        target = self.target
        for path in dict.fromkeys(p for p in (target.known_hosts, self.record_to, *target.pinned_files)
                                  if p and (self._own(p) or for_another_program(p))):
            try:
                _load_known_hosts(client.get_host_keys(), path, self.recorded() if self._own(path) else None)
            except (paramiko.SSHException, paramiko.hostkeys.InvalidHostKey, GpuvfioError, UnicodeError,
                    ValueError, TypeError) as exc:
                client.close()
                raise SshError(f"cannot read the host keys in {path}: {exc}") from None

    def _own(self, path: str) -> bool:
        return self.recorded is not None and path_is(path, self.record_to)

    def _through_jump(self):
        """A channel to the target through the ProxyJump host (its own session, same host-key
        policy), or None for a direct connection."""
        if self.target.jump is None:
            return None
        if self.jump_session is None:
            self.jump_session = Session(self.target.jump, self.record_to, clock=self.clock,
                                        record=self.record, recorded=self.recorded).connect()
        try:
            return self.jump_session.client.get_transport().open_channel(
                "direct-tcpip", (self.target.host, self.target.port), ("127.0.0.1", 0), timeout=10)
        except Exception as exc:  # noqa: BLE001 - paramiko's ChannelException and transport errors
            raise JumpChannelError(f"{self.target.jump.label()} cannot open a channel to {self.target.label()}: "
                                   f"{exc}") from None

    def run(self, argv: list[str], *, timeout: float = 120.0, stdin: bytes | None = None) -> tuple[int, str, str]:
        """Run ``argv`` (quoted) and return (exit status, stdout, stderr)."""
        status, out, err = self.run_bytes(argv, timeout=timeout, stdin=stdin)
        return status, out.decode("utf-8", "replace"), err.decode("utf-8", "replace")

    def run_bytes(self, argv: list[str], *, timeout: float = 120.0, stdin: bytes | None = None,
                  on_output=None, pty: bool = False) -> tuple[int, bytes, bytes]:
        """Run ``argv`` (quoted); (exit status, stdout bytes, stderr bytes).

        ``on_output`` gets each chunk of output as it arrives (for progress lines).
        ``pty``: ask for a terminal, so that closing the channel (Ctrl-C here, a lost
        connection) hangs the remote command up -- ``ssh -t``; output then arrives merged
        on stdout. The exit status is asked for only after all output was read.

        What a guest or remote host sends is bounded: past OUTPUT_LIMIT bytes of stdout and
        stderr together the command is refused (SshError, one line) and its channel closed;
        a streamed command (``on_output``) keeps only the last OUTPUT_LIMIT bytes instead.
        """
        import paramiko

        if self.client is None:
            raise SshError("not connected")
        command = shlex.join(argv)
        channel = self._open_session()
        channel.settimeout(timeout)
        try:
            if pty:
                channel.get_pty(term="dumb", width=200)
            channel.exec_command(command)
            if stdin is not None:
                channel.sendall(stdin)
                channel.shutdown_write()
            out, err = self._read_output(channel, argv[0], timeout, on_output)
            status = channel.recv_exit_status()
            if status == -1:  # paramiko's value when the channel closed without an exit status
                raise self._no_exit_status(argv[0])
        except socket.timeout:
            raise SshError(f"{argv[0]} on {self.target.label()} did not finish within {timeout:g}s") from None
        except (paramiko.SSHException, OSError) as exc:
            raise ConnectionLost(f"{argv[0]} on {self.target.label()}: connection lost ({exc})") from None
        finally:
            channel.close()
        return status, out.getvalue(), err.getvalue()

    def _open_session(self):
        """A new session channel on the connection."""
        import paramiko

        for attempt in range(6):
            # A server that has just come up (dropbear right after boot) may refuse the
            # first channel although authentication succeeded: retry briefly.
            try:
                return self.client.get_transport().open_session(timeout=10)
            except (paramiko.SSHException, OSError, AttributeError) as exc:
                transport = self.client.get_transport() if self.client else None
                if attempt == 5 or transport is None or not transport.is_active():
                    raise SshError(f"SSH session to {self.target.label()} lost: {exc}") from None
                self.clock.sleep(0.5 * (attempt + 1))

    def _read_output(self, channel, name: str, timeout: float, on_output) -> tuple[_Bounded, _Bounded]:
        """The command's stdout and stderr, read until it has exited and both are drained
        (``name``: the command, for the errors); within ``timeout`` seconds and, unless streamed
        to ``on_output``, OUTPUT_LIMIT bytes."""
        out, err = _Bounded(on_output is not None), _Bounded(on_output is not None)
        deadline = self.clock.monotonic() + timeout
        while True:
            if channel.recv_ready() or channel.recv_stderr_ready():
                stream = out if channel.recv_ready() else err
                chunk = channel.recv(65536) if stream is out else channel.recv_stderr(65536)
                stream.write(chunk)
                if on_output is not None:
                    on_output(chunk)
                elif out.size + err.size > OUTPUT_LIMIT:
                    raise SshError(f"{name} on {self.target.label()} sent more than "
                                   f"{OUTPUT_LIMIT >> 20} MiB of output; refused")
            elif channel.exit_status_ready() and not channel.recv_ready() and not channel.recv_stderr_ready():
                return out, err
            else:
                if self.clock.monotonic() > deadline:
                    raise SshError(f"{name} on {self.target.label()} did not finish within {timeout:g}s")
                self.clock.sleep(0.01)

    def _no_exit_status(self, name: str) -> SshError:
        """Why the command ``name`` ended without an exit status."""
        transport = self.client.get_transport() if self.client else None
        if transport is not None and transport.is_active():
            # paramiko drops the exit-signal message: the command died of a signal.
            return SshError(f"{name} on {self.target.label()} was terminated by a signal")
        return ConnectionLost(f"{name} on {self.target.label()}: connection lost before it finished")

    def close(self) -> None:
        if self.client is not None:
            self.client.close()
            self.client = None
        if self.jump_session is not None:
            self.jump_session.close()
            self.jump_session = None

    def __enter__(self) -> "Session":
        return self.connect()

    def __exit__(self, *exc) -> None:
        self.close()


KNOWN_HOSTS_LIMIT = 4 << 20


class _Bounded:
    """One output stream of a command: all of it up to OUTPUT_LIMIT (the caller refuses more),
    or, streamed (``tail``), its last OUTPUT_LIMIT bytes."""

    def __init__(self, tail: bool) -> None:
        self.tail = tail
        self.chunks: list[bytes] = []
        self.size = 0

    def write(self, chunk: bytes) -> None:
        self.chunks.append(chunk)
        self.size += len(chunk)
        while self.tail and self.size - len(self.chunks[0]) >= OUTPUT_LIMIT:
            self.size -= len(self.chunks.pop(0))

    def getvalue(self) -> bytes:
        return b"".join(self.chunks)


def path_is(path: str, other: str | None) -> bool:
    return other is not None and os.path.abspath(path) == os.path.abspath(other)


def _load_known_hosts(keys, path: str, data: bytes | None = None) -> None:
    """Add a known_hosts file's keys to paramiko's HostKeys as HostKeys.load does (the first key
    of a type recorded for a host wins), read through the file layer (``data``: read already, by
    the Context's state dir): a regular file only (a FIFO there is not waited on), bounded.
    Markers (@cert-authority, @revoked) are refused: paramiko cannot honour them, and skipping a
    @revoked line would trust a revoked key."""
    import paramiko

    data = (read_regular(path, KNOWN_HOSTS_LIMIT) if data is None else data) or b""
    for number, line in enumerate(data.decode("utf-8").splitlines(), 1):
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        if line.startswith("@"):
            raise ValueError(f"line {number}: {line.split()[0][:20]} markers are not supported")
        entry = paramiko.hostkeys.HostKeyEntry.from_line(line, number)
        if entry is None:
            continue
        for host in entry.hostnames:
            known = keys.lookup(host)
            if known is None or entry.key.get_name() not in known:
                keys.add(host, entry.key.get_name(), entry.key)


class _Policy:
    """paramiko MissingHostKeyPolicy: reject, or trust on first use and record."""

    def __init__(self, session: Session) -> None:
        self.session = session

    def missing_host_key(self, client, hostname, key) -> None:
        target = self.session.target
        name = _known_hosts_name(target.host, target.port)
        if not target.trust_on_first_use:
            raise HostKeyError(f"unknown host key for {name} ({key.get_name()} {_fingerprint(key)}); pin it "
                               "with --known-hosts FILE or accept it once with --trust-on-first-use")
        path, line = self.session.record_to, f"{name} {key.get_name()} {key.get_base64()}"
        if path and self.session.record is not None:
            self.session.record(line)
        elif path:
            tree, file_name = user_file(path)
            tree.make_dir()
            earlier = tree.text(file_name, KNOWN_HOSTS_LIMIT) or ""
            if earlier and not earlier.endswith("\n"):
                earlier += "\n"
            tree.write(file_name, f"{earlier}{line}\n", 0o600)
        target.notes.append(f"trusted on first use: {name} {key.get_name()} {_fingerprint(key)}"
                            + (f", recorded in {path}" if path else ""))
        client.get_host_keys().add(name, key.get_name(), key)
