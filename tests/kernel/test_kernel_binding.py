"""Kernel lane: ``gpuvfio bind / status / restore`` against a real kernel's sysfs.

One guest script (emulated IOMMU, GPU-host-shaped topology; run last in the boot
the GPU-host modules share, tests/kernel/conftest.py) dry-runs and binds the
two-function "GPU" group to vfio-pci, binds again, restores, crashes a bind
half-way (tests.lanes.paused_bind, then SIGKILL) twice and restores after each,
binds and restores the driverless edu device, and feeds bad addresses.  The
script records every command's exit status, output and the driver links into
``$OUT``; each test below checks one part of that record.

The guest's root is ``/`` (real sysfs), so gpuvfio loads vfio-pci itself; the
state directory is the default /var/lib/gpuvfio (a tmpfs overlay in the guest).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from tests.lanes import kernel as kl

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
FN0, FN1, EDU, ROOT_PORT = kl.GPU_FN0, kl.GPU_FN1, kl.EDU, kl.GPU_ROOT_PORT
BAD_FUNCTION = "0000:01:00.9"  # function 9 does not exist (0-7)
ABSENT = "0000:0f:00.0"  # well-formed, no such device in the guest
CRASHES = {"unbind": "after the first unbind", "probe": "after the first probe"}


def _cli_missing() -> str | None:
    """The lane costs a boot; don't pay it when the commands aren't there at all."""
    for command in ("bind", "restore", "status"):
        try:
            proc = subprocess.run([sys.executable, "-m", "gpuvfio", command, "--help"], cwd=REPO,
                                  env=dict(os.environ, PYTHONPATH=REPO), capture_output=True,
                                  text=True, timeout=60)
        except (OSError, subprocess.TimeoutExpired) as exc:
            return f"gpuvfio CLI not runnable: {exc}"
        if proc.returncode != 0:
            return (f"gpuvfio {command} CLI not available: "
                    + (proc.stderr.strip().splitlines() or ["?"])[-1])
    return None


pytestmark = [
    pytest.mark.skipif(kl.skip_reason() is not None, reason=str(kl.skip_reason())),
]

# --- The guest script ---------------------------------------------------------------
#
# Under TCG one ``python -m gpuvfio ...`` costs 10-35 s in the guest, ~80 % of it
# importing typer/pydantic/gpuvfio over 9p (measured with cProfile: each stat ~5 ms,
# each open ~11 ms; virtme-ng mounts the root without a cache mode).  So the script
# is Python: it imports the CLI once and runs each gpuvfio command in a forked
# child that calls ``gpuvfio.cli.main(argv)`` -- what ``python -m gpuvfio`` runs --
# with stdin, stdout and stderr on files; the child's exit status is the command's.
# The crash runs' bind (tests.lanes.paused_bind's main) is forked the same way and
# killed there.  The bad-input commands always run as real ``python -m gpuvfio``
# processes, and GPUVFIO_KL_SUBPROCESS=1 runs every command that way (slow; full fidelity).
#
# Naming in $OUT: <name>.rc / <name>.out / <name>.err for each gpuvfio run;
# <name>.drivers ("ADDR|driver or -|driver_override") and <name>.vfio (ls /dev/vfio)
# for each snapshot of the devices; "errors" collects tracebacks of the script itself
# (each part carries on after a failure of the one before); "timings" the seconds
# each command took.

_GUEST = r'''
import json, os, signal, subprocess, sys, time, traceback

sys.dont_write_bytecode = True
os.environ["PYTHONDONTWRITEBYTECODE"] = "1"
os.environ["PYTHONPATH"] = REPO
os.environ.pop("GPUVFIO_ROOT", None)
sys.path.insert(0, REPO)
os.chdir(REPO)
OUT = os.environ["OUT"]
SUBPROCESS = ALL_SUBPROCESS  # the host's GPUVFIO_KL_SUBPROCESS=1 (the guest has its own environment)


def put(name, text):
    with open(os.path.join(OUT, name), "w") as f:
        f.write(text)


def log(name, text):
    with open(os.path.join(OUT, name), "a") as f:
        f.write(text)


class part:
    """Run one part; a failure is recorded in $OUT/errors and the script goes on."""

    def __init__(self, label):
        self.label = label

    def __enter__(self):
        return self

    def __exit__(self, kind, exc, tb):
        if kind is not None:
            log("errors", f"--- {self.label}\n" + "".join(traceback.format_exception(kind, exc, tb)))
        return True


# No libvirtd runs in this guest: binds say so explicitly (--connect none) instead of being
# refused for a libvirt that does not answer.
# Preload what the commands import, so each forked child starts warm.
with part("preload"):
    from gpuvfio.cli import main as gpuvfio_main  # the command line (each command loads on use)
    import tests.lanes.paused_bind  # the crash runs' bind, forked as the commands are
    for optional in ("pydantic", "libvirt", "rich.console", "rich.table"):
        try:
            __import__(optional)
        except ImportError:
            pass
    PRELOADED = True
if not globals().get("PRELOADED"):  # run real processes rather than nothing
    SUBPROCESS = True

# typer imports more (pydantic's lazy attributes) while it parses arguments: parse
# each command's options once here, on an address that fails before any action.
with part("warm-up"):
    import contextlib, io

    warm_up = (["bind", BAD_FUNCTION, "--connect", "none", "--dry-run", "--json", "--timeout", "10",
                "--lock-timeout", "1"],
               ["restore", BAD_FUNCTION, "--json", "--timeout", "10", "--lock-timeout", "1"],
               ["status", "--help"], ["reset", BAD_FUNCTION, "--connect", "none", "--json"])
    for argv in () if SUBPROCESS else warm_up:
        sink = io.StringIO()
        with contextlib.redirect_stdout(sink), contextlib.redirect_stderr(sink):
            gpuvfio_main(argv)
        log("warmup", f"$ gpuvfio {' '.join(argv)}\n{sink.getvalue()}")


def _child(argv, name, env, module):
    os.environ.update(env)
    for fd, path, flags in ((0, os.devnull, os.O_RDONLY),
                            (1, os.path.join(OUT, name + ".out"), os.O_WRONLY | os.O_CREAT | os.O_TRUNC),
                            (2, os.path.join(OUT, name + ".err"), os.O_WRONLY | os.O_CREAT | os.O_TRUNC)):
        new = os.open(path, flags, 0o644)
        os.dup2(new, fd)
        os.close(new)
    code = 1
    try:
        code = gpuvfio_main(list(argv)) if module == "gpuvfio" else __import__(module, fromlist=["main"]).main(list(argv))
    except BaseException:
        traceback.print_exc()
    finally:
        for stream in (sys.stdout, sys.stderr):
            try:
                stream.flush()
            except Exception:
                pass
    os._exit(code)


def start(name, *argv, env=None, real=False, module="gpuvfio"):
    """Start ``gpuvfio ARGV`` (or MODULE's ``main(ARGV)``, as ``python -m MODULE ARGV`` runs it);
    returns a handle for finish()."""
    env = dict(env or {})
    began = time.monotonic()
    if real or SUBPROCESS:
        with open(os.path.join(OUT, name + ".out"), "w") as out, \
                open(os.path.join(OUT, name + ".err"), "w") as err:
            proc = subprocess.Popen([sys.executable, "-m", module, *argv], stdin=subprocess.DEVNULL,
                                    stdout=out, stderr=err, env=dict(os.environ, **env))
        return name, proc.pid, proc, began
    sys.stdout.flush()
    sys.stderr.flush()
    pid = os.fork()
    if pid == 0:
        try:
            _child(argv, name, env, module)
        finally:
            os._exit(99)
    return name, pid, None, began


def finish(handle):
    name, pid, proc, began = handle
    if proc is not None:
        rc = proc.wait()
        rc = 128 - rc if rc < 0 else rc
    else:
        _, status = os.waitpid(pid, 0)
        rc = 128 + os.WTERMSIG(status) if os.WIFSIGNALED(status) else os.WEXITSTATUS(status)
    put(name + ".rc", f"{rc}\n")
    log("timings", f"{time.monotonic() - began:7.2f} {name}\n")
    return rc


def gv(name, *argv, env=None, real=False):
    return finish(start(name, *argv, env=env, real=real))


def driver_of(address):
    link = f"/sys/bus/pci/devices/{address}/driver"
    return os.path.basename(os.readlink(link)) if os.path.lexists(link) else None


def snap(name):
    lines = []
    for address in (FN0, FN1, EDU, RP):
        try:
            override = open(f"/sys/bus/pci/devices/{address}/driver_override").read().strip()
        except OSError:
            override = "?"
        lines.append(f"{address}|{driver_of(address) or '-'}|{override}\n")
    put(name + ".drivers", "".join(lines))
    put(name + ".vfio", "".join(n + "\n" for n in sorted(os.listdir("/dev/vfio")))
        if os.path.isdir("/dev/vfio") else "")
    put(name + ".vfio_loaded", "yes\n" if os.path.isdir("/sys/bus/pci/drivers/vfio-pci") else "no\n")


def step_number(plan_name, kind, address):
    """1-based number of the plan's first step of KIND on ADDRESS, else 0."""
    try:
        with open(os.path.join(OUT, plan_name + ".out")) as f:
            steps = json.load(f)["steps"]
    except (OSError, ValueError, KeyError):
        return 0
    return next((i + 1 for i, s in enumerate(steps) if s["kind"] == kind and s["address"] == address), 0)


def wait_step(journal, k, pid, timeout=120.0):
    """Poll the journal until step K is done; 'done', or why not."""
    deadline = time.monotonic() + timeout
    state = "no journal"
    while time.monotonic() < deadline:
        try:
            with open(journal) as f:
                state = (json.load(f).get("operation") or {})["steps"][k - 1]["state"]
        except (OSError, ValueError, KeyError, IndexError, TypeError) as exc:
            state = f"unreadable ({type(exc).__name__})"
        if state == "done":
            return "done"
        try:  # exited (a zombie until finish() reaps it)?
            with open(f"/proc/{pid}/stat") as f:
                exited = f.read().rpartition(")")[2].split()[0] == "Z"
        except OSError:
            exited = True
        if exited:
            return f"exited (step {k}: {state})"
        time.sleep(0.1)
    return f"timeout (step {k}: {state})"


# The default state directory if the guest can write it, else one under /tmp.
STATE = "/var/lib/gpuvfio"
try:
    os.makedirs(STATE, exist_ok=True)
    if not os.access(STATE, os.W_OK):
        raise OSError("not writable")
except OSError:
    STATE = "/tmp/gpuvfio-state"
    os.environ["GPUVFIO_STATE_DIR"] = STATE
put("state_dir", STATE + "\n")

with part("setup"):
    put("groups", "".join(f"{a} {os.path.basename(os.readlink(f'/sys/bus/pci/devices/{a}/iommu_group'))}\n"
                          for a in (FN0, EDU)))
    put("uname", os.uname().release + "\n")
    snap("initial")

# 1. dry run
with part("1 dry run"):
    gv("dry", "bind", FN0, "--connect", "none", "--dry-run", "--json")
    snap("dry")

# 2. bind
with part("2 bind"):
    gv("bind", "bind", FN0, "--connect", "none", "--json")
    snap("bind")
    gv("bind_status", "status", "--json")

# 3. bind again
with part("3 bind again"):
    gv("again", "bind", FN0, "--connect", "none")
    snap("again")

# 4. restore
with part("4 restore"):
    gv("restore", "restore", "--json")
    snap("restore")
    gv("restore_status", "status", "--json")

# 5. crash half-way, then restore
for kind in ("unbind", "probe"):
    c = f"crash_{kind}"
    with part(c):
        # Unload vfio-pci so the plan is that of part 1 again (modprobe first); K comes
        # from a fresh dry run all the same, and the tests compare it with part 1's.
        proc = subprocess.run(["modprobe", "-r", "vfio_pci"], capture_output=True, text=True)
        put(c + ".rmmod", f"rc={proc.returncode}\n{proc.stdout}{proc.stderr}")
        gv(c + ".plan", "bind", FN0, "--connect", "none", "--dry-run", "--json")
        k = step_number(c + ".plan", kind, FN0)
        put(c + ".k", f"{k}\n")
        if k > 0:
            # gpuvfio bind FN0 --connect none, stopped after step k by its Context's hook.
            handle = start(c + ".bind", FN0, str(k), module="tests.lanes.paused_bind")
            put(c + ".wait", wait_step(os.path.join(STATE, "journal.json"), k, handle[1]) + "\n")
            try:
                os.kill(handle[1], signal.SIGKILL)
            except ProcessLookupError:
                pass
            finish(handle)
            snap(c + ".mid")
            with open(os.path.join(STATE, "journal.json")) as f:
                put(c + ".journal", f.read())
    with part(c + " restore"):
        gv(c + ".status", "status", "--json")
        gv(c + ".restore", "restore", "--json")
        snap(c + ".after")
        gv(c + ".status_after", "status", "--json")

# 6. the lone edu device (no driver)
with part("6 edu"):
    gv("edu_bind", "bind", EDU, "--connect", "none", "--json")
    snap("edu_bind")
    gv("edu_status", "status", "--json")
    # The kernel's own reset of a device gpuvfio holds (reset_method as this kernel offers it),
    # then a device it does not hold, refused.
    try:
        put("edu.reset_method", open(f"/sys/bus/pci/devices/{EDU}/reset_method").read())
    except OSError as exc:
        put("edu.reset_method", f"unreadable: {exc}\n")
    gv("edu_reset", "reset", EDU, "--connect", "none", "--json")
    put("edu.config_after_reset", open(f"/sys/bus/pci/devices/{EDU}/config", "rb").read(4).hex() + "\n")
    gv("fn0_reset", "reset", FN0, "--connect", "none")
    gv("edu_restore", "restore", "--json")
    snap("edu_restore")
    gv("edu_status_after", "status", "--json")

# 7. bad input, as real processes
with part("7 bad input"):
    gv("bad_function", "bind", BAD_FUNCTION, "--connect", "none", real=True)
    gv("absent", "bind", ABSENT, "--connect", "none", real=True)
    snap("final")

put("finished", "finished\n")
'''

SCRIPT = (f"#!{sys.executable}\n"
          f"REPO = {REPO!r}\n"
          f"FN0, FN1, EDU, RP = {FN0!r}, {FN1!r}, {EDU!r}, {ROOT_PORT!r}\n"
          f"BAD_FUNCTION, ABSENT = {BAD_FUNCTION!r}, {ABSENT!r}\n"
          f"ALL_SUBPROCESS = {os.environ.get('GPUVFIO_KL_SUBPROCESS') == '1'!r}\n"
          + _GUEST)


GPU_HOST_PART = kl.Part("binding", SCRIPT, timeout=900, changes_host=True)


@pytest.fixture(scope="module")
def guest(request):
    reason = _cli_missing()
    if reason:
        pytest.skip(reason)
    result = request.getfixturevalue("gpu_host_boot")[GPU_HOST_PART.name]
    print(f"kernel lane binding script: {result.seconds:.1f}s")
    print("seconds per gpuvfio command in the guest:\n" + result.files.get("timings", "(none)"))
    assert result.returncode == 0, result.stderr
    return result


# --- Reading the record -------------------------------------------------------------

class Record:
    def __init__(self, files: dict[str, str]):
        self.files = files

    def text(self, name: str) -> str:
        assert name in self.files, f"the guest did not write {name}"
        return self.files[name]

    def rc(self, name: str) -> int:
        value = self.text(name + ".rc").strip()
        return int(value)

    def run(self, name: str) -> str:
        """A one-line summary of a gpuvfio run, for assertion messages."""
        return (f"[{name}] rc={self.files.get(name + '.rc', '?').strip()}\n"
                f"stdout: {self.files.get(name + '.out', '')[:3000]}\n"
                f"stderr: {self.files.get(name + '.err', '')[-3000:]}")

    def json(self, name: str) -> dict:
        out = self.text(name + ".out")
        try:
            return json.loads(out)
        except ValueError:
            pytest.fail(f"not JSON:\n{self.run(name)}")

    def drivers(self, name: str) -> dict[str, tuple[str | None, str | None]]:
        """address -> (driver or None, driver_override file text)."""
        out = {}
        for line in self.text(name + ".drivers").splitlines():
            addr, drv, override = line.split("|", 2)
            out[addr] = (None if drv == "-" else drv, override)
        return out

    def driver(self, name: str, address: str) -> str | None:
        return self.drivers(name)[address][0]

    def vfio_nodes(self, name: str) -> set[str]:
        return set(self.files.get(name + ".vfio", "").split())

    def group(self, address: str) -> str:
        groups = dict(line.split() for line in self.text("groups").splitlines())
        return groups[address]


@pytest.fixture(scope="module")
def rec(guest) -> Record:
    return Record(guest.files)


def _status_devices(rec: Record, name: str) -> dict[str, dict]:
    assert rec.rc(name) == 0, rec.run(name)
    return {d["address"]: d for d in rec.json(name)["devices"]}


ORIGINAL = {FN0: kl.GPU_FN0_DRIVER, FN1: kl.GPU_FN1_DRIVER}


# --- 0. the run itself ----------------------------------------------------------------

def test_script_ran_to_the_end(guest, rec):
    assert "finished" in guest.files, f"guest script stopped early:\n{guest.stderr[-3000:]}"
    assert "errors" not in guest.files, "guest script failed in places:\n" + guest.files["errors"]
    initial = rec.drivers("initial")
    assert initial[FN0][0] == kl.GPU_FN0_DRIVER
    assert initial[FN1][0] == kl.GPU_FN1_DRIVER
    assert initial[EDU][0] is None
    assert rec.group(FN0) != rec.group(EDU)
    assert rec.text("initial.vfio_loaded").strip() == "no", "vfio-pci loaded before gpuvfio ran"


# --- 1. dry run -----------------------------------------------------------------------

def test_dry_run_plan_devices(rec):
    assert rec.rc("dry") == 0, rec.run("dry")
    plan = rec.json("dry")
    assert plan["devices"] == [FN0, FN1]
    assert plan.get("result") == "dry_run"
    assert plan.get("refused") == [], plan.get("refused")


def test_dry_run_plan_steps(rec):
    steps = rec.json("dry")["steps"]
    got = [(s["kind"], s["address"]) for s in steps]
    assert got == [("modprobe", None), ("override", FN0), ("override", FN1), ("unbind", FN0),
                   ("unbind", FN1), ("probe", FN0), ("probe", FN1)], got
    assert steps[0]["name"] == "vfio-pci"
    assert [s["name"] for s in steps if s["kind"] == "unbind"] == [kl.GPU_FN0_DRIVER, kl.GPU_FN1_DRIVER]
    # The crash points of part 5, numbered as in this plan.
    assert steps[4 - 1]["kind"] == "unbind" and steps[6 - 1]["kind"] == "probe"


def test_dry_run_changed_nothing(rec):
    assert rec.drivers("dry") == rec.drivers("initial")
    assert rec.text("dry.vfio_loaded").strip() == "no", "a dry run loaded vfio-pci"
    assert rec.vfio_nodes("dry") <= {"vfio"}


# --- 2. bind --------------------------------------------------------------------------

def test_bind_exits_0(rec):
    assert rec.rc("bind") == 0, rec.run("bind")
    report = rec.json("bind")
    assert report["result"] == "applied"
    assert report["devices"] == [FN0, FN1]


def test_bind_both_functions_on_vfio_pci(rec):
    drivers = rec.drivers("bind")
    assert drivers[FN0] == ("vfio-pci", "vfio-pci"), rec.run("bind")
    assert drivers[FN1] == ("vfio-pci", "vfio-pci"), rec.run("bind")


def test_bind_creates_group_node(rec):
    assert rec.group(FN0) in rec.vfio_nodes("bind"), rec.vfio_nodes("bind")
    assert "vfio" in rec.vfio_nodes("bind")


def test_bind_status_lists_originals(rec):
    devices = _status_devices(rec, "bind_status")
    assert set(devices) == {FN0, FN1}
    for addr, original in ORIGINAL.items():
        assert devices[addr]["original_driver"] == original
        assert devices[addr]["driver"] == "vfio-pci"
        assert devices[addr]["group"] == int(rec.group(FN0))
    assert rec.json("bind_status")["unfinished_operation"] is None


def test_bind_leaves_root_port_on_pcieport(rec):
    assert rec.driver("initial", ROOT_PORT) == "pcieport"
    assert rec.driver("bind", ROOT_PORT) == "pcieport"


def test_bind_leaves_other_devices_alone(rec):
    assert rec.drivers("bind")[EDU] == rec.drivers("initial")[EDU]


# --- 3. bind again --------------------------------------------------------------------

def test_bind_again_nothing_to_do(rec):
    assert rec.rc("again") == 0, rec.run("again")
    assert "nothing to do" in rec.text("again.err"), rec.run("again")
    assert rec.drivers("again") == rec.drivers("bind")


# --- 4. restore -----------------------------------------------------------------------

def test_restore_exits_0(rec):
    assert rec.rc("restore") == 0, rec.run("restore")
    report = rec.json("restore")
    assert set(report["restored"]) == {FN0, FN1}
    assert report["failed"] == {}


def test_restore_original_drivers(rec):
    drivers = rec.drivers("restore")
    assert drivers[FN0][0] == kl.GPU_FN0_DRIVER, rec.run("restore")
    assert drivers[FN1][0] == kl.GPU_FN1_DRIVER, rec.run("restore")


def test_restore_clears_driver_override(rec):
    drivers = rec.drivers("restore")
    assert drivers[FN0][1] == "(null)"
    assert drivers[FN1][1] == "(null)"


def test_restore_removes_group_node(rec):
    assert rec.group(FN0) not in rec.vfio_nodes("restore"), rec.vfio_nodes("restore")


def test_restore_status_empty(rec):
    assert _status_devices(rec, "restore_status") == {}
    assert rec.json("restore_status")["unfinished_operation"] is None


# --- 5. crash half-way, restore -------------------------------------------------------

@pytest.mark.parametrize("kind", list(CRASHES))
def test_crash_paused_at_planned_step(rec, kind):
    c = f"crash_{kind}"
    assert rec.rc(f"{c}.plan") == 0, rec.run(f"{c}.plan")
    plan_steps = rec.json(f"{c}.plan")["steps"]
    k = int(rec.text(f"{c}.k"))
    assert k > 0, f"no {kind} step for {FN0} in the plan: {plan_steps}"
    # vfio-pci was unloaded before the crash run, so the plan is that of part 1 again.
    assert [(s["kind"], s["address"]) for s in plan_steps] == \
        [(s["kind"], s["address"]) for s in rec.json("dry")["steps"]], rec.text(f"{c}.rmmod")
    assert k == {"unbind": 4, "probe": 6}[kind]
    assert rec.text(f"{c}.wait").strip() == "done", (rec.text(f"{c}.wait"), rec.text(f"{c}.bind.err"))
    assert rec.rc(f"{c}.bind") == 137, f"bind was not killed at the pause: {rec.text(f'{c}.bind.err')}"
    journal = json.loads(rec.text(f"{c}.journal"))
    states = [s["state"] for s in journal["operation"]["steps"]]
    assert states == ["done"] * k + ["pending"] * (len(states) - k), states


@pytest.mark.parametrize("kind", list(CRASHES))
def test_crash_half_way_state(rec, kind):
    drivers = rec.drivers(f"crash_{kind}.mid")
    if kind == "unbind":  # FN0 unbound, FN1 still on its host driver; both overridden
        want = {FN0: (None, "vfio-pci"), FN1: (kl.GPU_FN1_DRIVER, "vfio-pci")}
    else:  # FN0 on vfio-pci, FN1 unbound
        want = {FN0: ("vfio-pci", "vfio-pci"), FN1: (None, "vfio-pci")}
    assert {a: drivers[a] for a in want} == want


@pytest.mark.parametrize("kind", list(CRASHES))
def test_crash_status_shows_unfinished_operation(rec, kind):
    c = f"crash_{kind}"
    devices = _status_devices(rec, f"{c}.status")
    assert set(devices) == {FN0, FN1}
    for addr, original in ORIGINAL.items():
        assert devices[addr]["original_driver"] == original
    pending = rec.json(f"{c}.status")["unfinished_operation"]
    assert pending is not None, rec.run(f"{c}.status")
    assert pending["kind"] == "bind"
    k = int(rec.text(f"{c}.k"))
    states = [s["state"] for s in pending["steps"]]
    assert states[:k] == ["done"] * k and set(states[k:]) <= {"pending"}, states


@pytest.mark.parametrize("kind", list(CRASHES))
def test_crash_restore_returns_originals(rec, kind):
    c = f"crash_{kind}"
    assert rec.rc(f"{c}.restore") == 0, rec.run(f"{c}.restore")
    assert set(rec.json(f"{c}.restore")["restored"]) == {FN0, FN1}
    drivers = rec.drivers(f"{c}.after")
    assert drivers[FN0] == (kl.GPU_FN0_DRIVER, "(null)"), rec.run(f"{c}.restore")
    assert drivers[FN1] == (kl.GPU_FN1_DRIVER, "(null)"), rec.run(f"{c}.restore")
    assert rec.group(FN0) not in rec.vfio_nodes(f"{c}.after")
    assert _status_devices(rec, f"{c}.status_after") == {}
    assert rec.json(f"{c}.status_after")["unfinished_operation"] is None


# --- 6. the driverless edu device -----------------------------------------------------

def test_edu_bind(rec):
    assert rec.rc("edu_bind") == 0, rec.run("edu_bind")
    report = rec.json("edu_bind")
    assert report["devices"] == [EDU]
    assert [s["kind"] for s in report["steps"]] == ["override", "probe"], report["steps"]
    assert rec.drivers("edu_bind")[EDU] == ("vfio-pci", "vfio-pci")
    assert rec.group(EDU) in rec.vfio_nodes("edu_bind")
    devices = _status_devices(rec, "edu_status")
    assert set(devices) == {EDU}
    assert devices[EDU]["original_driver"] is None


def test_edu_restore(rec):
    assert rec.rc("edu_restore") == 0, rec.run("edu_restore")
    assert rec.drivers("edu_restore")[EDU] == (None, "(null)")
    assert rec.group(EDU) not in rec.vfio_nodes("edu_restore")
    assert _status_devices(rec, "edu_status_after") == {}


# --- 7. bad input ---------------------------------------------------------------------

def test_edu_reset_through_the_kernel(rec):
    methods = rec.text("edu.reset_method").split()
    assert methods and "unreadable:" not in methods, rec.text("edu.reset_method")
    assert rec.rc("edu_reset") == 0, rec.run("edu_reset")
    report = rec.json("edu_reset")
    assert report["method"] == "function" and report["devices"] == {EDU: None}
    assert len(report["reset"]) == 1 and report["reset"][0].startswith("sys/devices/pci0000:00/")
    assert report["reset"][0].endswith(f"/{EDU}/reset")
    # The device answers after the kernel reset it: QEMU's edu is 1234:11e8.
    assert rec.text("edu.config_after_reset").strip() == "3412e811"


def test_reset_refuses_a_device_gpuvfio_does_not_hold(rec):
    assert rec.rc("fn0_reset") == 1, rec.run("fn0_reset")
    assert "not held" in rec.text("fn0_reset.err") and "Traceback" not in rec.text("fn0_reset.err")


@pytest.mark.parametrize("name", ["bad_function", "absent"])
def test_bad_address_exit_2_one_line(rec, name):
    assert rec.rc(name) == 2, rec.run(name)
    lines = rec.text(name + ".err").splitlines()
    assert len(lines) == 1 and lines[0].startswith("gpuvfio: error:"), rec.run(name)
    assert rec.text(name + ".out") == ""


def test_bad_input_changed_nothing(rec):
    assert rec.drivers("final") == rec.drivers("initial"), "devices not back where they started"
