"""The one file layer (gpuvfio.files), tried as an attacker would: one test per way a hostile tree,
state directory or output directory led gpuvfio to write or read outside its root, wait forever,
read without bound, act on a damaged journal or end in a traceback (issue 22).

Every command runs as a real process with a timeout: a hang fails the test, it does not stall it."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from gpuvfio.files import Tree
from gpuvfio.errors import UnsafePathError
from tests.conftest import ANSIBLE_MODULE_DRIVER, REPO, gpu_workstation, untouched

GPU = "0000:01:00.0"
TIMEOUT = 60


def gpuvfio(*args: str, env: dict | None = None, timeout: float = TIMEOUT):
    """The CLI as a real process; also prints its peak memory (KiB) as the last stderr line."""
    # VmHWM, not ru_maxrss: ru_maxrss survives execve, so a child of a large pytest starts at its size.
    code = ("import sys\nfrom gpuvfio.cli import main\ncode = main(sys.argv[1:])\n"
            "hwm = [l.split()[1] for l in open('/proc/self/status') if l.startswith('VmHWM:')]\n"
            "sys.stderr.write(f'maxrss={hwm[0]}\\n')\nsys.exit(code)\n")
    proc = subprocess.run([sys.executable, "-c", code, *args], capture_output=True, text=True, timeout=timeout,
                          cwd=REPO, env={**os.environ, "PYTHONPATH": REPO, **(env or {})}, stdin=subprocess.DEVNULL)
    lines = proc.stderr.splitlines()
    rss = int(lines[-1].split("=")[1]) if lines and lines[-1].startswith("maxrss=") else 0
    return proc.returncode, proc.stdout, "\n".join(lines[:-1]) + "\n" if rss else proc.stderr, rss


def one_line(err: str) -> bool:
    return "Traceback" not in err and len(err.strip().splitlines()) == 1


@pytest.fixture
def ws(tmp_path):
    return gpu_workstation(tmp_path / "host")


def device_dir(ws) -> str:
    return os.path.realpath(os.path.join(ws.root, "sys", "bus", "pci", "devices", GPU))


# -- writes outside the root ----------------------------------------------------------------------
@pytest.mark.parametrize("linked", ["var", "var/lib/gpuvfio"])
def test_the_state_dir_is_never_written_through_a_link(ws, outside, linked):
    """On main a tree whose var (or var/lib/gpuvfio) linked out got journal.json and lock written
    through the link: with var -> /var, restore would overwrite the live journal."""
    path = os.path.join(ws.root, linked)
    os.makedirs(os.path.dirname(path), exist_ok=True)
    os.symlink(str(outside), path)
    for args in (["restore"], ["bind", GPU, "--dry-run"], ["persist", GPU]):
        code, _out, err, _ = gpuvfio("--root", ws.root, *args)
        assert code == 2 and one_line(err) and "link" in err, (args, err)
    assert untouched(outside)


@pytest.mark.parametrize("linked", ["etc/modules-load.d", "etc/udev", "etc/systemd", "etc"])
def test_persist_never_writes_through_a_linked_etc_directory(ws, outside, linked):
    """On main only the last path component was opened with O_NOFOLLOW: persist created and
    unpersist deleted files through linked etc/ directories."""
    path = os.path.join(ws.root, linked)
    os.makedirs(os.path.dirname(path), exist_ok=True)
    os.symlink(str(outside), path)
    for args in (["persist", GPU], ["unpersist", GPU, "--dry-run"]):
        code, _out, err, _ = gpuvfio("--root", ws.root, *args)
        assert code == 2 and one_line(err), (args, code, err)
    assert untouched(outside)


def test_persist_dry_run_never_shows_a_linked_file_from_outside(ws, outside):
    """On main persist --dry-run printed a linked file's target as the diff's old side."""
    os.makedirs(os.path.join(ws.root, "etc", "modprobe.d"))
    os.symlink(str(outside / "secret"), os.path.join(ws.root, "etc", "modprobe.d", "gpuvfio-vfio.conf"))
    code, out, err, _ = gpuvfio("--root", ws.root, "persist", GPU, "--dry-run", "--json")
    assert "CANARY-SECRET" not in out + err
    assert code == 2 and one_line(err) and "link" in err


def test_a_testbed_report_replaces_links_in_out_never_writes_through_them(tmp_path, outside):
    """On main testbed report wrote its PNGs with a plain open() through links placed in OUT."""
    from tests.testbed_data import write_synthetic

    out = tmp_path / "out"
    write_synthetic(str(out))
    code, _o, err, _ = gpuvfio("testbed", "report", str(out), timeout=300)
    assert code == 0, err
    written = [name for name in os.listdir(out) if name.endswith((".png", ".md", ".html")) or name == "results.json"]
    assert any(name.endswith(".png") for name in written)
    for name in written:
        os.unlink(out / name)
        os.symlink(str(outside / "secret"), out / name)
    code, _o, err, _ = gpuvfio("testbed", "report", str(out), timeout=300)
    assert code == 0, err
    assert untouched(outside)
    assert all(not os.path.islink(out / name) for name in written)


# -- FIFOs: nothing waits on one ---------------------------------------------------------------
FIFO_PLACES = [
    ("device attribute", lambda ws: os.path.join(device_dir(ws), "vendor"), ["list"]),
    ("device attribute", lambda ws: os.path.join(device_dir(ws), "numa_node"), ["doctor"]),
    ("cmdline", lambda ws: os.path.join(ws.root, "proc", "cmdline"), ["doctor"]),
    ("cpulist", lambda ws: os.path.join(ws.root, "sys", "devices", "system", "node", "node0", "cpulist"), ["topo"]),
    ("os-release", lambda ws: os.path.join(ws.root, "etc", "os-release"), ["doctor"]),
    ("pci.ids", lambda ws: os.path.join(ws.root, "usr", "share", "misc", "pci.ids"), ["list"]),
    ("journal", lambda ws: os.path.join(ws.root, "var", "lib", "gpuvfio", "journal.json"), ["status"]),
    ("lock", lambda ws: os.path.join(ws.root, "var", "lib", "gpuvfio", "lock"), ["restore"]),
    ("persist file", lambda ws: os.path.join(ws.root, "etc", "modules-load.d", "gpuvfio-vfio.conf"),
     ["persist", GPU, "--dry-run"]),
]


@pytest.mark.parametrize("what, where, args", FIFO_PLACES, ids=[f"{p[0]}-{p[2][0]}" for p in FIFO_PLACES])
def test_a_fifo_is_never_waited_on(ws, what, where, args):
    """On main a FIFO wherever gpuvfio read blocked it forever (35 hangs from one cause)."""
    path = where(ws)
    os.makedirs(os.path.dirname(path), exist_ok=True)
    if os.path.lexists(path):
        os.unlink(path)
    os.mkfifo(path)
    code, _out, err, _ = gpuvfio("--root", ws.root, *args, timeout=30)
    assert code == 2 and one_line(err) and "FIFO" in err, (what, code, err)


def test_a_fifo_as_testbed_spec_or_result_is_not_waited_on(tmp_path):
    spec = tmp_path / "spec.toml"
    os.mkfifo(spec)
    code, _out, err, _ = gpuvfio("testbed", "plan", str(spec), timeout=30)
    assert code == 2 and one_line(err) and "FIFO" in err
    out = tmp_path / "out"
    (out / "results" / "pt").mkdir(parents=True)
    os.mkfifo(out / "results" / "pt" / "rep-0.json")
    (out / "results" / "pt" / "rep-1.json").write_text("{}")
    code, _out, err, _ = gpuvfio("testbed", "report", str(out), timeout=30)
    assert code == 2 and one_line(err)


# -- unbounded reads ------------------------------------------------------------------------------
def test_a_journal_linked_to_dev_zero_is_refused_not_read(ws):
    """On main a journal linked to /dev/zero ended in MemoryError."""
    state = os.path.join(ws.root, "var", "lib", "gpuvfio")
    os.makedirs(state)
    os.symlink("/dev/zero", os.path.join(state, "journal.json"))
    code, _out, err, rss = gpuvfio("--root", ws.root, "status")
    assert code == 2 and one_line(err) and "kept as is" in err
    assert rss < 300_000


@pytest.mark.parametrize("rel, args", [("proc/cpuinfo", ["doctor"]), ("usr/share/misc/pci.ids", ["list"])])
def test_a_huge_host_file_is_refused_with_bounded_memory(ws, rel, args):
    """On main a 1 GB /proc/cpuinfo took doctor to 3.1 GB, a 1 GB pci.ids took list to 2.1 GB."""
    path = os.path.join(ws.root, rel)
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path, "wb") as handle:
        handle.truncate(1 << 30)  # sparse: costs no disk
    code, _out, err, rss = gpuvfio("--root", ws.root, *args)
    assert code == 2 and one_line(err) and "larger than" in err
    assert rss < 300_000, rss


def test_a_huge_file_as_root_is_refused_before_it_is_read(tmp_path):
    """On main --root given a 1 GB file was read whole before its header was checked."""
    big = tmp_path / "big.host"
    with open(big, "wb") as handle:
        handle.truncate(1 << 30)
    code, _out, err, rss = gpuvfio("--root", str(big), "list")
    assert code == 2 and one_line(err) and "not a gpuvfio host fixture" in err
    assert rss < 300_000, rss


# -- reads outside the root ----------------------------------------------------------------------
def test_dump_host_never_copies_a_linked_attribute_or_proc(ws, outside):
    """On main dump-host copied a linked attribute's target (and a linked /proc) into the recording."""
    vendor = os.path.join(device_dir(ws), "subsystem_vendor")
    if os.path.lexists(vendor):
        os.unlink(vendor)
    os.symlink(os.path.relpath(str(outside / "secret"), os.path.dirname(vendor)), vendor)
    code, out, err, _ = gpuvfio("--root", ws.root, "dump-host", "-")
    assert "CANARY-SECRET" not in out + err and code == 2 and one_line(err)
    os.unlink(vendor)
    (outside / "cmdline").write_text("CANARY-SECRET\n")
    os.rename(os.path.join(ws.root, "proc"), os.path.join(str(outside), "proc-moved"))
    os.symlink(os.path.relpath(str(outside), ws.root), os.path.join(ws.root, "proc"))
    code, out, err, _ = gpuvfio("--root", ws.root, "dump-host", "-")
    assert "CANARY-SECRET" not in out + err and code == 2 and one_line(err) and "outside" in err


# -- a damaged journal is never acted on ---------------------------------------------------------
JOURNAL_HELD = {"version": 1, "devices": {GPU: {"original_driver": "nvidia", "original_override": None, "group": 1}}}


@pytest.mark.parametrize("text, words", [
    ('{"version": 1, "devices": {"%s": {"original_driver": "nvidia", "original_override": null, "group": 1}}, '
     '"devices": {}}' % GPU, "appears twice"),
    (b'{"version": 1, "devices": {}, "services_stopped": ["\xff"]}', "not UTF-8"),
    ('{"version": 1, "devices": {}, "operation": ' + "[" * 100_000 + "]" * 100_000 + "}", "nested too deeply"),
    ('{"version": 1, "devices": {}, "broken": {"%s": {"reason": "\\ud800", "since": 1}}}' % GPU, "lone surrogate"),
    ('{"version": 1, "devices": {}, "broken": {"%s": {"reason": "x", "since": NaN}}}' % GPU, "NaN"),
])
def test_a_damaged_journal_is_kept_named_and_never_acted_on(ws, text, words):
    """On main a journal with a repeated "devices" key was read last-key-wins: restore said
    "nothing to restore", exited 0 and rewrote the journal empty while the GPU was on vfio-pci."""
    state = os.path.join(ws.root, "var", "lib", "gpuvfio")
    os.makedirs(state)
    path = os.path.join(state, "journal.json")
    data = text if isinstance(text, bytes) else text.encode()
    with open(path, "wb") as handle:
        handle.write(data)
    for args in (["restore"], ["bind", GPU]):
        code, _out, err, _ = gpuvfio("--root", ws.root, *args)
        assert code == 2 and one_line(err) and words in err and path in err, (args, err)
    with open(path, "rb") as handle:
        assert handle.read() == data


# -- edges ---------------------------------------------------------------------------------------
@pytest.mark.parametrize("args", [["list"], ["restore"]])
def test_an_empty_root_variable_is_bad_input_not_the_live_host(args):
    """On main GPUVFIO_ROOT="" fell back to / (--root '' was refused; the variable was not)."""
    for value in ("", "  "):
        code, _out, err, _ = gpuvfio(*args, env={"GPUVFIO_ROOT": value})
        assert code == 2 and one_line(err) and "empty" in err, (args, value, err)


def test_link_cycles_and_very_deep_paths_are_one_line(ws):
    """On main these ended in RecursionError."""
    devices = os.path.join(ws.root, "sys", "bus", "pci", "devices")
    os.symlink("cycle-b", os.path.join(devices, "cycle-a"))
    os.symlink("cycle-a", os.path.join(devices, "cycle-b"))
    os.symlink("cycle-a", os.path.join(devices, "0000:0f:00.0"))
    code, _out, err, _ = gpuvfio("--root", ws.root, "list")
    assert code == 2 and one_line(err) and "symlinks" in err
    os.unlink(os.path.join(devices, "0000:0f:00.0"))
    deep = os.path.join(ws.root, "sys", "devices", "pci0000:00", *(["d"] * 300))
    os.makedirs(deep)
    os.symlink(os.path.relpath(deep, devices), os.path.join(devices, "0000:0f:00.0"))
    code, _out, err, _ = gpuvfio("--root", ws.root, "list")
    assert code == 2 and one_line(err) and "path components" in err


def test_a_deeply_nested_testbed_spec_is_one_line(tmp_path):
    spec = tmp_path / "spec.toml"
    spec.write_text("x = " + "[" * 50_000 + "]" * 50_000 + "\n")
    code, _out, err, _ = gpuvfio("testbed", "plan", str(spec))
    assert code == 2 and one_line(err) and "nested too deeply" in err
    spec.write_bytes(b"[run]\nname = '\xff'\n")
    code, _out, err, _ = gpuvfio("testbed", "plan", str(spec))
    assert code == 2 and one_line(err) and "UTF-8" in err


def test_a_persist_file_that_is_not_utf8_is_one_line(ws):
    path = os.path.join(ws.root, "etc", "modules-load.d", "gpuvfio-vfio.conf")
    os.makedirs(os.path.dirname(path))
    with open(path, "wb") as handle:
        handle.write(b"vfio-pci\xff\n")
    code, _out, err, _ = gpuvfio("--root", ws.root, "persist", GPU, "--dry-run")
    assert code == 2 and one_line(err) and "UTF-8" in err and path in err


# -- the layer itself ----------------------------------------------------------------------------
def test_the_layer_walks_beneath_its_top_without_links(tmp_path, outside):
    top = tmp_path / "top"
    (top / "a").mkdir(parents=True)
    (top / "a" / "file").write_text("inside")
    os.symlink(str(outside), top / "a" / "linked")
    tree = Tree(str(top))
    assert tree.read("a/file") == b"inside"
    for rel in ("a/linked/secret", "a/linked/new"):
        with pytest.raises(UnsafePathError, match="link"):
            tree.read(rel)
        with pytest.raises(UnsafePathError, match="link"):
            tree.write(rel, "x")
    with pytest.raises(UnsafePathError):
        tree.read("../outside/secret")
    with pytest.raises(UnsafePathError):
        tree.read("/etc/passwd")
    tree.write("made/deep/file", "new")  # parents made one component at a time
    assert (top / "made" / "deep" / "file").read_text() == "new"
    os.symlink(str(outside / "secret"), top / "replaced")
    tree.write("replaced", "mine")  # the link is replaced, its target untouched
    assert not os.path.islink(top / "replaced") and untouched(outside)
    with pytest.raises(UnsafePathError, match="larger than 3 bytes"):
        tree.read("a/file", 3)
    assert tree.read("a/file", 3, head=True) == b"ins"
    assert json.loads(json.dumps(tree.listdir("a"))) == ["file", "linked"]


ANSIBLE_DRIVER = ANSIBLE_MODULE_DRIVER + """
with patch_module_args(json.loads(sys.argv[3])):
    runpy.run_path(os.path.join(sys.argv[1], "playbooks", "collections", "ansible_collections", "gpuvfio", "gpuvfio",
                                "plugins", "modules", sys.argv[2] + ".py"), run_name="__main__")
"""

@pytest.mark.parametrize("check", [False, True])
def test_the_ansible_device_module_never_persists_through_a_linked_etc(ws, outside, check):
    """On main the Ansible device module, like persist, wrote through linked etc/ directories."""
    pytest.importorskip("ansible")  # make test installs it; test_fleet fails closed without it
    os.makedirs(os.path.join(ws.root, "etc"), exist_ok=True)
    os.symlink(str(outside), os.path.join(ws.root, "etc", "udev"))
    args = {"root": ws.root, "devices": [GPU], "state": "persisted", "_ansible_check_mode": check}
    proc = subprocess.run([sys.executable, "-c", ANSIBLE_DRIVER, REPO, "device", json.dumps(args)],
                          capture_output=True, text=True, timeout=TIMEOUT, cwd=REPO,
                          env={**os.environ, "PYTHONPATH": REPO}, stdin=subprocess.DEVNULL)
    result = json.loads(proc.stdout)
    assert result.get("failed") and "link" in result["msg"] and "Traceback" not in proc.stderr, result
    assert untouched(outside)
