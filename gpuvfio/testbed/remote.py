"""A testbed on a remote hypervisor ([host] in the spec): gpuvfio runs there, driven over SSH.

Why gpuvfio itself runs on the hypervisor instead of being remote-controlled step by
step: every host change (vfio binding, vGPU creation, scheduler policy, libvirt define)
is then made by the same journaled code, under the hypervisor's own lock, and the
guest's SSH forward (127.0.0.1 there) is reachable. A dropped connection cannot leave a
half-applied plan: the remote run is started on a pty (as ``ssh -t`` does), so closing
the channel hangs it up and it tears its variant down like on Ctrl-C.

plan: ``gpuvfio dump-host -`` there; the plan is computed here on that record.
run:  a scratch directory there (``mktemp -d`` under [host] workdir); the spec and the
      results recorded here so far go up (tar), so an interrupted run resumes even when
      the scratch is gone; ``gpuvfio testbed run --here`` runs there and its progress
      streams back; the results come back (tar) into OUT; the scratch is removed.
"""

from __future__ import annotations

import io
import os
import tarfile
import tempfile

from gpuvfio.errors import GpuvfioError
from gpuvfio.ssh import SshError
from gpuvfio.testbed.spec import RemoteHost, Spec

RUN_FOREVER = 30 * 24 * 3600.0  # a testbed may run for days; progress is streamed meanwhile


def session_for(remote: RemoteHost, default_known_hosts: str | None):
    from gpuvfio.ssh import Session, SshTarget

    target = SshTarget(remote.address, remote.port, remote.user, remote.key, remote.known_hosts,
                       remote.trust_on_first_use, connect_timeout=30.0)
    return Session(target, default_known_hosts)


def remote_argv(remote: RemoteHost, *args: str) -> list[str]:
    root = ["--root", remote.root] if remote.root else []
    return [*remote.gpuvfio, *args, *root]


def _checked(session, argv: list[str], what: str, **kwargs) -> bytes:
    status, out, err = session.run_bytes(argv, **kwargs)
    if status != 0:
        last = (err or out).decode("utf-8", "replace").strip().splitlines()
        raise GpuvfioError(f"{what} on {session.target.label()} failed (exit {status})"
                           + (f": {last[-1]}" if last else ""))
    return out


def fetch_host_record(session, remote: RemoteHost) -> str:
    return _checked(session, remote_argv(remote, "dump-host", "-"), "gpuvfio dump-host",
                    timeout=300).decode("utf-8")


def plan_remote(spec: Spec, default_known_hosts: str | None) -> dict:
    """The plan for a remote hypervisor, from its recorded host (nothing changes there)."""
    from gpuvfio.commands import open_host
    from gpuvfio.testbed.plan import plan

    with session_for(spec.host, default_known_hosts) as session:
        record = fetch_host_record(session, spec.host)
    with tempfile.TemporaryDirectory(prefix="gpuvfio-remote-") as scratch:
        path = os.path.join(scratch, "host.fixture")
        with open(path, "w", encoding="utf-8") as handle:
            handle.write(record)
        with open_host(path) as (host, _label):
            report = plan(host, spec)
    report["host"] = spec.host.label()
    return report


def _pack(spec_path: str, out: str) -> bytes:
    """spec.toml plus every result already recorded in OUT, as a tar stream."""
    buffer = io.BytesIO()
    with tarfile.open(fileobj=buffer, mode="w") as tar:
        tar.add(spec_path, arcname="spec.toml")
        results = os.path.join(out, "results")
        if os.path.isdir(results):
            tar.add(results, arcname="out/results")
    return buffer.getvalue()


def _unpack(data: bytes, out: str) -> list[str]:
    """Extract the remote OUT into ours: plain files and directories only, nothing outside."""
    names = []
    with tarfile.open(fileobj=io.BytesIO(data), mode="r:") as tar:
        members = tar.getmembers()
        for member in members:
            parts = os.path.normpath(member.name).split(os.sep)
            if member.name.startswith("/") or ".." in parts or not (member.isfile() or member.isdir()):
                raise GpuvfioError(f"refusing a result archive entry from the hypervisor: {member.name!r}")
        for member in members:
            target = os.path.join(out, os.path.normpath(member.name))
            if member.isdir():
                os.makedirs(target, exist_ok=True)
                continue
            os.makedirs(os.path.dirname(target), exist_ok=True)
            source = tar.extractfile(member)
            from gpuvfio.journal import atomic_write

            atomic_write(target, source.read().decode("utf-8"))
            names.append(os.path.normpath(member.name))
    return names


class _Lines:
    """Progress arrives in chunks (CR LF on a pty); hand on whole lines."""

    def __init__(self, progress) -> None:
        self.progress, self.pending = progress, b""

    def __call__(self, chunk: bytes) -> None:
        self.pending += chunk
        *lines, self.pending = self.pending.split(b"\n")
        for line in lines:
            text = line.decode("utf-8", "replace").rstrip("\r")
            if text:
                self.progress(text.removeprefix("gpuvfio: "))


def run_remote(spec: Spec, out: str, *, default_known_hosts: str | None, connect: str | None = None,
               progress=lambda line: None) -> dict:
    remote = spec.host
    os.makedirs(out, exist_ok=True)
    interrupted = False
    with session_for(remote, default_known_hosts) as session:
        label = session.target.label()
        pattern = f"{remote.workdir.rstrip('/')}/gpuvfio-testbed."
        scratch = _checked(session, ["mktemp", "-d", pattern + "XXXXXXXX"], "mktemp").decode().strip()
        if not scratch.startswith(pattern) or "\n" in scratch:
            raise GpuvfioError(f"mktemp on {label} answered an unexpected path: {scratch!r}")
        progress(f"{label}: scratch directory {scratch}")
        status, tail, scratch_kept = 0, b"", False
        try:
            _checked(session, ["tar", "-x", "-C", scratch, "-f", "-"], "uploading the spec", stdin=_pack(spec.path, out))
            command = remote_argv(remote, "testbed", "run", f"{scratch}/spec.toml", "--out", f"{scratch}/out",
                                  "--here", *(["--connect", connect] if connect else []))
            # The pid file lets us wait for the teardown after a hangup; exec keeps gpuvfio
            # the session leader that the pty's hangup reaches.
            wrapper = ["sh", "-c", 'echo $$ > "$1/pid" && shift && exec "$@"', "gpuvfio-testbed", scratch, *command]
            try:
                status, tail, _ = session.run_bytes(wrapper, timeout=RUN_FOREVER, pty=True,
                                                    on_output=_Lines(progress))
            except KeyboardInterrupt:
                # Closing the channel alone does not hang a pty up on every server (dropbear
                # keeps it open while the child lives; a dropped connection does hang it up):
                # signal the run ourselves, then wait until its teardown is over.
                interrupted = True
                progress(f"{label}: interrupted; waiting for the hypervisor to tear the variant down")
                session.run(["sh", "-c", 'pid=$(cat "$1/pid" 2>/dev/null) || exit 0; kill -TERM "$pid"; '
                                         'while kill -0 "$pid" 2>/dev/null; do sleep 0.2; done', "stop", scratch],
                            timeout=900)
            except SshError as exc:
                scratch_kept = True
                raise GpuvfioError(f"{exc}; the run there was hung up and tears itself down; its results stay in "
                                   f"{scratch} on {label}; run it again to resume") from None
            archive = _checked(session, ["sh", "-c", 'cd "$1/out" 2>/dev/null || exit 0; tar -c -f - .', "fetch",
                                         scratch], "fetching results", timeout=600)
            fetched = _unpack(archive, out) if archive else []
        finally:
            if not scratch_kept:
                session.run(["rm", "-rf", "--", scratch], timeout=120)
    if interrupted:
        raise GpuvfioError(f"testbed run interrupted; {label} tore everything down; results so far are in {out}; "
                           "run it again to resume")
    if status != 0:
        last = [line.strip() for line in tail.decode("utf-8", "replace").splitlines() if line.strip()]
        raise GpuvfioError(f"testbed run on {label} failed (exit {status})" + (f": {last[-1]}" if last else "")
                           + f"; results so far are in {out}")
    return {"host": label, "files": sorted(fetched)}

