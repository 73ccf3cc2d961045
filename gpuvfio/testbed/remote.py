"""A testbed on a remote hypervisor ([host] in the spec): gpuvfio runs there, driven over SSH.

Why gpuvfio itself runs on the hypervisor instead of being remote-controlled step by
step: every host change (vfio binding, vGPU creation, scheduler policy, libvirt define)
is then made by the same journaled code, under the hypervisor's own lock, and the
guest's SSH forward (127.0.0.1 there) is reachable. A dropped connection cannot leave a
half-applied plan: the remote run is started on a pty (as ``ssh -t`` does), so closing
the channel hangs it up and it tears its variant down like on Ctrl-C.

plan: ``gpuvfio dump-host -`` there; the plan is computed here on that record.
run:  a scratch directory there (``mktemp -d`` under [host] workdir, named in
      OUT/remote.json until it is gone); the spec and the results recorded here so far go
      up (tar), so an interrupted run resumes even when the scratch is gone; ``gpuvfio
      testbed run --here`` runs there and its progress streams back; the results come back
      (tar: identity.json and results/<variant>/rep-N.json only) into OUT; the scratch is
      removed once they are here. A run whose connection dropped leaves its scratch; the
      next run from the same OUT refuses while it still runs, else fetches it first.
"""

from __future__ import annotations

import dataclasses
import io
import json
import tarfile

from gpuvfio import strictjson
from gpuvfio.errors import GpuvfioError, InputError
from gpuvfio.user_files import read_regular, user_dir
from gpuvfio.guest.ssh import ConnectionLost, Session, SshError
from gpuvfio.ops.context import Context
from gpuvfio.ops.inventory import host_from_record
from gpuvfio.ops.targets import configured
from gpuvfio.testbed.plan import TestbedPlan, plan
from gpuvfio.testbed.report import REP, RESULT_LIMIT, out_tree
from gpuvfio.testbed.run import STEPS_FILE, recorded_results
from gpuvfio.testbed.spec import MAX_VARIANTS, NAME, SPEC_LIMIT, RemoteHost, Spec

MAX_MEMBERS = MAX_VARIANTS * 1001 + 2  # results/<variant>/rep-N.json of every variant, their folders, identity
RUN_FOREVER = 30 * 24 * 3600.0  # a testbed may run for days; progress is streamed meanwhile


def session_for(ctx: Context, remote: RemoteHost) -> Session:
    """The session to the remote hypervisor, with the admin's SSH config applied as for guests.
    ``ctx``: this machine's (its runner starts ssh -G, its state dir records a host key trusted
    on first use, its clock bounds the waits)."""
    target = configured(dataclasses.replace(remote.ssh, notes=[]), remote.ssh_config, given=set(remote.given),
                        run=ctx.run)
    return ctx.ssh(target)


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


def plan_remote(ctx: Context, spec: Spec, *, yes: bool = False) -> TestbedPlan:
    """The plan for a remote hypervisor, from its recorded host (nothing changes there; libvirt
    there is not asked: the run asks it). ``ctx``: this machine's (session_for)."""
    with session_for(ctx, spec.host) as session:
        record = fetch_host_record(session, spec.host)
    with host_from_record(record) as host:
        host.files_checked_by_run = True  # the ROM and UEFI files a spec names are there, not here
        report = plan(Context(host=host), spec, yes=yes)
    report.host = spec.host.label()
    return report


def pack_results(spec_path: str, out: str) -> bytes:
    """spec.toml plus every result already recorded in OUT and the identity they were measured
    on (the run there refuses a selection that means other GPUs now), as a tar stream (regular
    files only: root on the hypervisor unpacks it, and a symlink there would be written through)."""
    buffer = io.BytesIO()
    with tarfile.open(fileobj=buffer, mode="w") as tar:
        spec_text = read_regular(spec_path, SPEC_LIMIT)
        if spec_text is None:
            raise InputError(f"{spec_path}: no such file")
        _add(tar, "spec.toml", spec_text)
        results = recorded_results(out)
        tree = out_tree(out)
        identity = read_regular(tree.path("identity.json")) if results else None
        if identity is not None:
            _add(tar, "out/identity.json", identity)
        for relative in results:
            data = tree.read(relative, RESULT_LIMIT)
            if data is not None:  # gone since it was listed: not sent
                _add(tar, f"out/{relative}", data)
    return buffer.getvalue()


def _add(tar: tarfile.TarFile, name: str, data: bytes) -> None:
    info = tarfile.TarInfo(name)
    info.size, info.mode = len(data), 0o600
    tar.addfile(info, io.BytesIO(data))


def _wanted(name: str) -> bool:
    """The only entries a result archive may hold: identity.json, results/<variant>/rep-N.json
    and the variant's record of its steps (testbed.run.STEPS_FILE)."""
    parts = name.split("/")
    if parts == ["identity.json"] or parts == ["results"]:
        return True
    if len(parts) >= 2 and parts[0] == "results" and NAME.fullmatch(parts[1]):
        return len(parts) == 2 or (len(parts) == 3 and (bool(REP.fullmatch(parts[2])) or parts[2] == STEPS_FILE))
    return False


def unpack_results(data: bytes, out: str) -> list[str]:
    """Extract the hypervisor's OUT into ours: only the expected names, as regular files."""
    names = []
    try:
        with tarfile.open(fileobj=io.BytesIO(data), mode="r:") as tar:
            members = []
            for count, member in enumerate(tar, start=1):
                if count > MAX_MEMBERS:
                    raise GpuvfioError(f"refusing the result archive from the hypervisor: more than {MAX_MEMBERS} "
                                       "entries")
                name = member.name.removeprefix("./").rstrip("/")
                if name in ("", "."):
                    continue
                if not _wanted(name) or not (member.isfile() or (member.isdir() and name.count("/") < 2)):
                    raise GpuvfioError(f"refusing a result archive entry from the hypervisor: {member.name!r}")
                members.append((name, member))
            tree = out_tree(out)
            for name, member in members:
                if member.isdir():
                    tree.make_dir(name)
                    continue
                if member.size > RESULT_LIMIT:
                    raise GpuvfioError(f"refusing a result archive entry from the hypervisor: {name} is "
                                       f"{member.size} bytes")
                tree.write(name, tar.extractfile(member).read().decode("utf-8"))
                names.append(name)
    except (tarfile.TarError, UnicodeDecodeError) as exc:
        raise GpuvfioError(f"the result archive from the hypervisor is damaged: {exc}") from None
    except OSError as exc:
        raise GpuvfioError(f"cannot write the results into {out}: {exc.strerror or exc}") from None
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


# Shell snippets run there with the scratch directory as $1 (argv lists, quoted by Session.run).
_STATE = ('[ -d "$1" ] || exit 3; pid=$(cat "$1/pid" 2>/dev/null) || exit 0; '
          'kill -0 "$pid" 2>/dev/null && { echo "$pid"; exit 4; }; exit 0')
_STOP = ('i=0; while [ ! -s "$1/pid" ] && [ $i -lt 50 ]; do sleep 0.2; i=$((i+1)); done; '
         'pid=$(cat "$1/pid" 2>/dev/null) || exit 0; kill -TERM "$pid" 2>/dev/null; '
         'while kill -0 "$pid" 2>/dev/null; do sleep 0.2; done')
_FETCH = 'cd "$1/out" 2>/dev/null || exit 0; tar -c -f - .'


class _Scratch:
    """The run's scratch directory there, remembered in OUT/remote.json until it is fetched
    and removed: a run that lost its connection is picked up by the next one."""

    def __init__(self, session, remote: RemoteHost, out: str, progress) -> None:
        self.session, self.remote, self.out, self.progress = session, remote, out, progress
        self.tree = out_tree(out)
        self.record = self.tree.path("remote.json")
        self.label = session.target.label()
        self.path: str | None = None

    def _valid(self, path: str) -> bool:
        prefix = f"{self.remote.workdir.rstrip('/')}/gpuvfio-testbed."
        return isinstance(path, str) and path.startswith(prefix) and "/" not in path[len(prefix):] \
            and "\n" not in path and ".." not in path

    def make(self) -> str:
        pattern = f"{self.remote.workdir.rstrip('/')}/gpuvfio-testbed.XXXXXXXX"
        path = _checked(self.session, ["mktemp", "-d", pattern], "mktemp").decode().strip()
        if not self._valid(path):
            raise GpuvfioError(f"mktemp on {self.label} answered an unexpected path: {path!r}")
        self.path = path
        self.tree.write("remote.json", json.dumps({"host": self.label, "scratch": path}))
        self.progress(f"{self.label}: scratch directory {path}")
        return path

    def fetch(self) -> list[str]:
        archive = _checked(self.session, ["sh", "-c", _FETCH, "fetch", self.path], "fetching results",
                           timeout=600)
        return unpack_results(archive, self.out) if archive else []

    def remove(self) -> None:
        try:
            status, _out, err = self.session.run(["rm", "-rf", "--", self.path], timeout=120)
        except SshError as exc:
            status, err = 1, str(exc)
        if status:
            self.progress(f"{self.label}: could not remove {self.path} ({err.strip()}); the next run retries")
            return
        self.tree.remove("remote.json")

    def pick_up_earlier(self) -> None:
        """An earlier run from this OUT whose scratch is still there: refuse while it runs,
        else fetch what it measured and remove it."""
        try:
            data = self.tree.read("remote.json", 4096)
            if data is None:
                return
            earlier = strictjson.strict_loads(data)
        except (ValueError, GpuvfioError):
            raise GpuvfioError(f"{self.record} is damaged; remove it (it names an earlier run's scratch "
                               "directory on the hypervisor)") from None
        if not isinstance(earlier, dict):
            raise GpuvfioError(f"{self.record} is damaged (not a JSON object); remove it (it names an earlier "
                               "run's scratch directory on the hypervisor)")
        if earlier.get("host") != self.label or not self._valid(earlier.get("scratch")):
            raise GpuvfioError(f"{self.record} names a run on {earlier.get('host')}, not {self.label}; "
                               "use another --out, or remove it")
        self.path = earlier["scratch"]
        status, out, _err = self.session.run(["sh", "-c", _STATE, "state", self.path])
        if status == 4:
            raise GpuvfioError(f"an earlier run from {self.out} is still going on {self.label} "
                               f"(pid {out.strip()}, in {self.path}); wait for it or stop it first")
        if status == 0:
            self.progress(f"{self.label}: fetching the results of an earlier run from {self.path}")
            self.fetch()
            self.remove()
        else:
            self.tree.remove("remote.json")


def run_remote(ctx: Context, spec: Spec, out: str, *, connect: str | None = None, yes: bool = False,
               progress=lambda line: None) -> dict:
    """The testbed run on the remote hypervisor the spec names. ``ctx``: this machine's
    (session_for)."""
    remote = spec.host
    user_dir(out, create=True)
    interrupted = False
    with session_for(ctx, remote) as session:
        scratch = _Scratch(session, remote, out, progress)
        label = scratch.label
        scratch.pick_up_earlier()
        archive = pack_results(spec.path, out)  # OUT is checked (bad input) before anything is made there
        path = scratch.make()
        _checked(session, ["tar", "-x", "-C", path, "-f", "-"], "uploading the spec", stdin=archive)
        command = remote_argv(remote, "testbed", "run", f"{path}/spec.toml", "--out", f"{path}/out", "--here",
                              *(["--connect", connect] if connect else []), *(["--yes"] if yes else []))
        # The pid file lets us signal the run and wait for its teardown; exec keeps gpuvfio the
        # session leader, which a hangup of the pty (a dropped connection) reaches.
        wrapper = ["sh", "-c", 'echo $$ > "$1/pid" && shift && exec "$@"', "gpuvfio-testbed", path, *command]
        status, tail = 0, b""
        try:
            status, tail, _ = session.run_bytes(wrapper, timeout=RUN_FOREVER, pty=True, on_output=_Lines(progress))
        except KeyboardInterrupt:
            # Closing the channel alone does not hang a pty up on every server (dropbear keeps
            # it while the child lives): signal the run ourselves, then wait for its teardown.
            interrupted = True
            progress(f"{label}: interrupted; waiting for the hypervisor to tear the variant down")
            try:
                session.run(["sh", "-c", _STOP, "stop", path], timeout=900)
            except (KeyboardInterrupt, SshError):
                raise GpuvfioError(f"interrupted again: the run on {label} may still be tearing down in {path}; "
                                   f"the next run from {out} fetches its results") from None
        except ConnectionLost as exc:
            raise GpuvfioError(f"{exc}; the run there was hung up and tears itself down; its results stay in "
                               f"{path} on {label}, and the next run from {out} fetches them") from None
        except SshError as exc:
            raise GpuvfioError(f"{exc}; its results stay in {path} on {label}, and the next run from {out} "
                               "fetches them") from None
        fetched = scratch.fetch()  # on failure the scratch stays, remote.json names it
        scratch.remove()
    if interrupted:
        raise GpuvfioError(f"testbed run interrupted; {label} tore everything down; results so far are in {out}; "
                           "run it again to resume")
    if status != 0:
        last = [line.strip() for line in tail.decode("utf-8", "replace").splitlines() if line.strip()]
        failure = InputError if status == InputError.exit_code else GpuvfioError  # bad input there is bad input
        raise failure(f"testbed run on {label} failed (exit {status})" + (f": {last[-1]}" if last else "")
                      + f"; results so far are in {out}")
    return {"host": label, "files": sorted(fetched)}
