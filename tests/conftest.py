import gc
import json
import os
import shutil
import subprocess
import sys

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)

from tests.hostbuilder import BAR32, BAR64_PREF, GiB, HostBuilder, KiB, MiB  # noqa: E402


@pytest.fixture(autouse=True, scope="session")
def _one_command_tree_per_process():
    """Typer turns the app into click's command tree on every call of ``app(...)`` (inspecting every
    command's signature: up to ~0.9 s on 2 cores). A real gpuvfio process does that once; this suite runs
    thousands of commands in one process, so it keeps the first tree of each app, as that process
    would. Nothing in a click command changes when it runs: each call gets a new click Context."""
    import typer.main

    build = typer.main.get_command
    trees: dict[int, tuple] = {}

    def get_command(typer_instance):
        key = id(typer_instance)
        if key not in trees:  # the app is kept alongside: its id is never reused
            trees[key] = (typer_instance, build(typer_instance))
        return trees[key][1]

    typer.main.get_command = get_command
    yield
    typer.main.get_command = build


class CliResult:
    def __init__(self, code, out, err):
        self.code, self.out, self.err = code, out, err

    def json(self):
        return json.loads(self.out)


@pytest.fixture
def cli(capsys):
    """Run the CLI in-process (fast) and return exit code, stdout and stderr."""
    from gpuvfio.cli import main

    def run(*args: str) -> CliResult:
        code = main(list(args))
        captured = capsys.readouterr()
        return CliResult(code, captured.out, captured.err)

    return run


def run_gpuvfio(*args: str, env: dict | None = None) -> CliResult:
    """The CLI as a real process (for tracebacks, exit codes, start-up)."""
    proc = subprocess.run([sys.executable, "-m", "gpuvfio", *args], capture_output=True, text=True,
                          cwd=REPO, env={**os.environ, "PYTHONPATH": REPO, **(env or {})}, timeout=120)
    return CliResult(proc.returncode, proc.stdout, proc.stderr)


def run_on_pty(args: list[str], env: dict, columns: int | None = None) -> bytes:
    """gpuvfio ARGS with stdin, stdout and stderr on a pty (``columns`` x 50 when given): every
    byte the terminal received."""
    import fcntl
    import pty
    import struct
    import termios

    master, slave = pty.openpty()
    if columns is not None:
        fcntl.ioctl(slave, termios.TIOCSWINSZ, struct.pack("HHHH", 50, columns, 0, 0))
    proc = subprocess.Popen([sys.executable, "-m", "gpuvfio", *args], stdin=slave, stdout=slave, stderr=slave,
                            cwd=REPO, env=env, close_fds=True)
    os.close(slave)
    chunks = []
    while True:
        try:
            data = os.read(master, 65536)
        except OSError:  # EIO: the child closed the terminal
            break
        if not data:
            break
        chunks.append(data)
    os.close(master)
    proc.wait(timeout=120)
    return b"".join(chunks)


# The Ansible collection gpuvfio.gpuvfio in the checkout, and where its modules lie (by their short
# names: facts, device, domain, verify, host_info).
ANSIBLE_COLLECTIONS = os.path.join(REPO, "playbooks", "collections")
ANSIBLE_MODULES_DIR = os.path.join(ANSIBLE_COLLECTIONS, "ansible_collections", "gpuvfio", "gpuvfio", "plugins",
                                   "modules")

# Runs an Ansible module file as Ansible does (the collection importable as ansible_collections.*,
# the arguments handed in): argv REPO MODULE ARGS-JSON. ansible-core 2.19 reads arguments through
# patch_module_args only.
ANSIBLE_MODULE_DRIVER = r"""
import json, os, runpy, sys
sys.path.insert(0, os.path.join(sys.argv[1], "playbooks", "collections"))
from ansible.module_utils import basic
try:
    from ansible.module_utils.testing import patch_module_args  # ansible-core >= 2.19
except ImportError:
    import contextlib

    @contextlib.contextmanager
    def patch_module_args(args):
        basic._ANSIBLE_ARGS = json.dumps({"ANSIBLE_MODULE_ARGS": args}).encode()
        yield
"""


def open_fds() -> int:
    """How many file descriptors this process holds, counted after a garbage collection: a file
    object another test dropped is closed whenever the collector runs, which would change a count
    taken before and after a call that must leave none open."""
    gc.collect()
    return len(os.listdir("/proc/self/fd"))


CANARY = "CANARY-SECRET\n"


@pytest.fixture
def outside(tmp_path):
    """A canary directory beside the tree under test, holding one file, ``secret``: nothing in it
    may be written, removed or read through a link (untouched says so)."""
    canary = tmp_path / "outside"
    canary.mkdir()
    (canary / "secret").write_text(CANARY)
    return canary


def untouched(canary) -> bool:
    return sorted(os.listdir(canary)) == ["secret"] and (canary / "secret").read_text() == CANARY


def gpu_workstation(root) -> HostBuilder:
    """A small host: root port -> GPU + audio (one group), a chipset group shared with a NIC."""
    b = HostBuilder(str(root))
    b.iommu("intel", 1)
    b.cpuinfo("Intel(R) Core(TM) i9-13900K", 46)
    cpus = b.cpu_topology(1, 8, 2)
    b.numa_node(0, cpus[0], 64, {2048: (512, 512)})
    rb = b.root_bus(numa=0)
    b.function(rb, "0000:00:00.0", "8086", "a700", "060000")
    peg = b.bridge(rb, "0000:00:01.0", "8086", "a70d", secondary_bus=1, link=(4, 16))
    b.function(peg, "0000:01:00.0", "10de", "2684", "030000", driver="nvidia", link=(4, 16),
               bars=[(0, 16 * MiB, BAR32), (1, 32 * GiB, BAR64_PREF), (3, 32 * MiB, BAR64_PREF)],
               boot_vga=False, multifunction=True)
    b.function(peg, "0000:01:00.1", "10de", "22ba", "040300", driver="snd_hda_intel",
               bars=[(0, 16 * KiB, BAR32)])
    shared = b.new_group()
    pch = b.bridge(rb, "0000:00:1c.0", "8086", "7a38", secondary_bus=3, link=(3, 1), group=shared)
    b.function(pch, "0000:03:00.0", "8086", "15f3", "020000", driver="igc", link=(2, 1), group=shared,
               bars=[(0, 1 * MiB, BAR32)])
    pch2 = b.bridge(rb, "0000:00:1c.4", "8086", "7a3c", secondary_bus=4, link=(4, 4), group=shared)
    b.function(pch2, "0000:04:00.0", "10de", "2504", "030000", driver="nvidia", link=(4, 4), group=shared,
               bars=[(0, 16 * MiB, BAR32), (1, 8 * GiB, BAR64_PREF)])
    b.function(pch2, "0000:04:00.1", "10de", "228e", "040300", driver="snd_hda_intel", group=shared)
    b.modules(["nvidia", "snd_hda_intel", "igc"])
    return b


@pytest.fixture
def workstation(tmp_path):
    root = tmp_path / "host"
    builder = gpu_workstation(root)
    return builder


# Each folder of tests/ is a lane, and its marker: `pytest -m unit` is `make test-fast`. A lane
# other than unit needs more than Python (libvirtd, QEMU, a kernel to boot, a wheel build).
LANES = ("unit", "daemon", "kernel", "nested", "package")
REQUIRED_LANES = ("daemon", "kernel", "nested", "package")
TESTS = os.path.join(REPO, "tests")


def lane_of(path) -> str | None:
    """The lane folder a test file sits in (tests/<lane>/...), or None."""
    rel = os.path.relpath(str(path), TESTS).split(os.sep)
    return rel[0] if len(rel) > 1 and rel[0] in LANES else None


def pytest_sessionstart(session):
    """make test runs the lane folders by name: a test module beside them would never run."""
    import glob

    stray = sorted(glob.glob(os.path.join(TESTS, "test_*.py")))
    if stray:
        raise pytest.UsageError("test modules outside a lane folder (tests/<lane>/): "
                                + ", ".join(os.path.relpath(p, REPO) for p in stray))


# Test files of many independent, long tests without module fixtures: spread over every worker.
# Whole, the longest of them (test_file_layer.py, 37 s of work) could be the last unit left
# while the other worker waits.
SPREAD = {"test_hostile.py", "test_fuzz.py", "test_file_layer.py", "test_output.py", "test_testbed.py",
          "test_vgpu_scheduler.py", "test_binding.py", "test_output_escaping.py", "test_benchmarks.py"}
# Test files that build a wheel from the checkout (pip wheel; the role's install task).
WHEEL_BUILDS = {"test_package.py", "test_lowest_versions.py", "test_playbooks.py"}


def pytest_collection_modifyitems(config, items):
    """The folder's marker on every test in it; a lane marker written on a test must be its folder's."""
    for item in items:
        lane = lane_of(item.path)
        stray = sorted({m.name for m in item.iter_markers() if m.name in LANES} - {lane})
        if stray:
            raise pytest.UsageError(f"{item.nodeid}: marked {', '.join(stray)} but in the "
                                    f"{lane or 'no'} lane folder: move the file or drop the mark")
        if lane:
            item.add_marker(lane)
        if item.path.name in WHEEL_BUILDS:
            # setuptools builds a wheel inside the source tree (build/, *.egg-info): two builds of
            # the checkout at once race there, so the files that build one share a worker.
            item.add_marker(pytest.mark.xdist_group("wheel builds"))
        elif item.path.name not in SPREAD:
            # pytest-xdist --dist loadgroup: a file's tests stay on one worker (its module fixtures
            # -- a built wheel, an Ansible fleet -- are made once), except SPREAD's.
            item.add_marker(pytest.mark.xdist_group(os.path.relpath(str(item.path), TESTS)))


def _required(path) -> bool:
    return os.environ.get("GPUVFIO_REQUIRE_LANES") == "1" and lane_of(path) in REQUIRED_LANES


def _lane_required(path) -> str:
    return f"{lane_of(path)} lane required (GPUVFIO_REQUIRE_LANES=1)"


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    """With GPUVFIO_REQUIRE_LANES=1 (set by `make test`), a skipped test of a lane other than unit
    fails: CI must not go green because the lane quietly could not run."""
    outcome = yield
    report = outcome.get_result()
    if report.skipped and _required(item.path):
        report.outcome = "failed"
        report.longrepr = f"{_lane_required(item.path)} but skipped: {report.longrepr}"


@pytest.hookimpl(hookwrapper=True)
def pytest_make_collect_report(collector):
    """The same for a whole module skipped at import (``pytest.skip(allow_module_level=True)``)."""
    outcome = yield
    report = outcome.get_result()
    if report.skipped and _required(collector.path):
        report.outcome = "failed"
        report.longrepr = f"{_lane_required(collector.path)} but skipped: {report.longrepr}"


def pytest_addoption(parser):
    parser.addoption("--regenerate", action="store_true", default=False,
                     help="rewrite golden files (tests/golden/) from the current output")


@pytest.fixture
def regenerate(request):
    return request.config.getoption("--regenerate")


def golden_text(path: str, text: str, regenerate: bool) -> str:
    """The golden file's text, for the caller to compare ``text`` with as it needs (exact JSON,
    canonical XML). With --regenerate ``text`` is written there first; a missing golden file is
    written too, and fails the test until it is reviewed and committed."""
    if regenerate or not os.path.exists(path):
        os.makedirs(os.path.dirname(path), exist_ok=True)
        with open(path, "w", encoding="utf-8") as handle:
            handle.write(text)
        if not regenerate:
            pytest.fail(f"golden file {path} was missing and has been written; review and commit it")
    with open(path, encoding="utf-8") as handle:
        return handle.read()


def build_fakecuda(out, *, nccl: bool = True, old_driver: bool = False) -> str:
    """tests/fakecuda into directory ``out``: libcuda.so.1 (+ the libnvidia-ml.so.1 link to it) and,
    with ``nccl``, libnccl.so.2 (tests/fakecuda/fakenccl.c, which drives the libcuda.so.1 next to it).
    ``old_driver`` builds libcuda without cuMemHostGetDevicePointer_v2 and cuGetErrorName.
    $FAKECUDA_CFLAGS adds compiler flags (e.g. -fsanitize=address, to debug the stand-in)."""
    if shutil.which("gcc") is None:
        pytest.skip("gcc not installed")
    os.makedirs(out, exist_ok=True)
    here = os.path.join(REPO, "tests", "fakecuda")
    lib = os.path.join(out, "libcuda.so.1")
    extra = os.environ.get("FAKECUDA_CFLAGS", "").split()
    # The soname lets a test preload it in-process (ctypes) where pynvml then finds it by name;
    # -Bsymbolic keeps each loaded copy's calls to itself inside that copy.
    subprocess.run(["gcc", "-shared", "-fPIC", "-O1", "-Wall", "-Werror", "-Wl,-Bsymbolic",
                    "-Wl,-soname,libnvidia-ml.so.1", *(["-DFAKECUDA_OLD_DRIVER"] if old_driver else []), *extra,
                    "-o", lib, os.path.join(here, "fakecuda.c")], check=True)
    os.symlink("libcuda.so.1", os.path.join(out, "libnvidia-ml.so.1"))
    if nccl:
        subprocess.run(["gcc", "-shared", "-fPIC", "-O1", "-Wall", "-Werror", "-Wl,-soname,libnccl.so.2", *extra,
                        "-o", os.path.join(out, "libnccl.so.2"), os.path.join(here, "fakenccl.c"), "-ldl"],
                       check=True)
    return str(out)


@pytest.fixture(scope="session")
def fakecuda_libdir(tmp_path_factory):
    """tests/fakecuda built as libcuda.so.1 + libnvidia-ml.so.1 + libnccl.so.2: stand-in driver
    and NCCL libraries for LD_LIBRARY_PATH (no GPU here; knobs in tests/fakecuda/fakecuda.c and
    fakenccl.c); the vGPU scheduler state lives in $FAKENVML_SCHED."""
    return build_fakecuda(tmp_path_factory.mktemp("fakecuda"))


@pytest.fixture(scope="session")
def fakecuda_nonccl_libdir(tmp_path_factory):
    """The stand-in driver without libnccl.so.2: a guest that has no NCCL."""
    return build_fakecuda(tmp_path_factory.mktemp("fakecuda-nonccl"), nccl=False)


@pytest.fixture(scope="session")
def fakecuda_old_libdir(tmp_path_factory):
    """The stand-in driver as an old one: no cuMemHostGetDevicePointer_v2, no cuGetErrorName
    (libcuda.so.1 + libnvidia-ml.so.1, no NCCL)."""
    return build_fakecuda(tmp_path_factory.mktemp("fakecuda-old"), nccl=False, old_driver=True)


@pytest.fixture
def ssh_lane():
    """tests/lanes/hypervisor.py, to start dropbear servers on this machine with; without what it
    needs the test skips, or fails under make test (GPUVFIO_REQUIRE_LANES=1)."""
    from tests.lanes import hypervisor as hv

    reason = hv.skip_reason()
    if reason:
        if os.environ.get("GPUVFIO_REQUIRE_LANES") == "1":
            pytest.fail(reason + "; required under make test")
        pytest.skip(reason)
    return hv


@pytest.fixture
def hypervisor(tmp_path, ssh_lane):
    """This machine behind a dropbear server on 127.0.0.1 (tests/lanes/hypervisor.py); its
    sessions get a state dir of their own. Without dropbear: skipped, or failed under make test."""
    hv = ssh_lane
    state = tmp_path / "remote-state"
    state.mkdir()
    server = hv.start(str(tmp_path / "hv"), env={"GPUVFIO_STATE_DIR": str(state)})
    yield server
    server.stop()


@pytest.fixture(scope="module")
def daemon():
    """A private libvirtd (+ virtlogd) for one daemon-lane module (tests/lanes/daemon.py)."""
    from tests.lanes import daemon as dl

    gen = dl.libvirt_daemon()
    started = next(gen)
    try:
        yield started
    finally:
        for _ in gen:  # teardown and its leftover checks
            pass


def need_tool(tool_ok: bool, what: str) -> None:
    """A tool a lane needs (ansible, ansible-lint, vagrant): without it the test skips, or
    fails under make test (GPUVFIO_REQUIRE_LANES=1): a check that could not run is no pass."""
    if tool_ok:
        return
    message = f"{what} is not installed (Makefile: see the fleet lane's packages)"
    if os.environ.get("GPUVFIO_REQUIRE_LANES") == "1":
        pytest.fail(message + "; required under make test")
    pytest.skip(message)


def venv_which(name: str) -> str | None:
    """A program from this venv first (ansible-playbook, ansible-lint), then from PATH."""
    return shutil.which(name, path=os.path.dirname(sys.executable) + os.pathsep + os.environ.get("PATH", ""))
