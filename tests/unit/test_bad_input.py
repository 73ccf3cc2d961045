"""Bad input: one line on stderr, exit status 2, no traceback; never read outside <root>/sys."""

import os

import pytest

from gpuvfio.errors import UnsafePathError
from gpuvfio.host.root import HostRoot
from gpuvfio.host.inventory import read_inventory
from tests.conftest import run_gpuvfio


def assert_one_line_error(result, *fragments):
    assert result.code == 2, (result.code, result.err)
    lines = result.err.strip().splitlines()
    assert len(lines) == 1, result.err
    assert lines[0].startswith("gpuvfio: error: ")
    assert "Traceback" not in result.err
    for fragment in fragments:
        assert fragment in lines[0]


def test_root_not_a_directory(cli, tmp_path):
    assert_one_line_error(cli("list", "--root", str(tmp_path / "nope")), "not a directory")


def test_root_without_sys(cli, tmp_path):
    assert_one_line_error(cli("--root", str(tmp_path), "list"), "missing", "sys/bus/pci/devices")


def test_malformed_address(cli, workstation):
    assert_one_line_error(cli("--root", workstation.root, "list", "0000:01:00.9"), "not a PCI address")
    assert_one_line_error(cli("--root", workstation.root, "list", "../../etc"), "not a PCI address")


def test_unknown_address(cli, workstation):
    assert_one_line_error(cli("--root", workstation.root, "list", "0000:07:00.0"), "no such PCI function")


def test_unknown_option_is_one_line(cli):
    assert_one_line_error(cli("list", "--frobnicate"), "--frobnicate")


@pytest.mark.parametrize("name", ["uevent", "vendor"])
def test_unreadable_attribute(cli, workstation, name):
    """The uevent read first, or (a recording without one) the vendor attribute."""
    path = workstation.functions[min(workstation.functions)].path
    if name != "uevent":
        os.unlink(os.path.join(path, "uevent"))
    os.unlink(os.path.join(path, name))
    os.mkdir(os.path.join(path, name))  # a directory where the kernel has a file: the tree is not sysfs
    assert_one_line_error(cli("--root", workstation.root, "list", "--all"), name)


def test_device_link_leading_out_of_sys_is_refused(cli, workstation, tmp_path):
    outside = tmp_path / "outside" / "0000:09:00.0"
    outside.mkdir(parents=True)
    for name, value in (("vendor", "0x10de"), ("device", "0x2330"), ("class", "0x030200")):
        (outside / name).write_text(value + "\n")
    link = os.path.join(workstation.root, "sys", "bus", "pci", "devices", "0000:09:00.0")
    os.symlink(os.path.relpath(outside, os.path.dirname(link)), link)
    assert_one_line_error(cli("--root", workstation.root, "list", "--all"), "outside")


def test_absolute_symlink_is_refused(workstation):
    link = os.path.join(workstation.root, "sys", "bus", "pci", "devices", "0000:0a:00.0")
    os.symlink("/sys/devices/pci0000:00", link)
    with pytest.raises(UnsafePathError):
        read_inventory(HostRoot(workstation.root))


@pytest.mark.parametrize("name", ["uevent", "vendor"])
def test_attribute_symlink_is_not_followed(workstation, tmp_path, name):
    fn = workstation.functions[min(workstation.functions)]
    secret = tmp_path / "secret"
    with open(os.path.join(fn.path, name)) as handle:
        secret.write_text(handle.read())
    if name != "uevent":
        os.unlink(os.path.join(fn.path, "uevent"))
    os.unlink(os.path.join(fn.path, name))
    os.symlink(str(secret), os.path.join(fn.path, name))
    with pytest.raises(UnsafePathError):
        read_inventory(HostRoot(workstation.root))


def test_sys_symlink_to_live_host_is_refused(tmp_path):
    (tmp_path / "r").mkdir()
    os.symlink("/sys", tmp_path / "r" / "sys")
    with pytest.raises(UnsafePathError):
        HostRoot(str(tmp_path / "r"))


def test_bad_fixture_file(cli, tmp_path):
    bad = tmp_path / "bad.host"
    bad.write_text("hello\n")
    assert_one_line_error(cli("--root", str(bad), "list"), "not a gpuvfio host fixture")
    evil = tmp_path / "evil.host"
    evil.write_text("# gpuvfio host fixture v1\nF ../../etc/x 1\n")
    assert_one_line_error(cli("--root", str(evil), "list"), "unsafe path")
    assert not (tmp_path / "etc").exists()


def test_real_process_has_no_traceback(tmp_path):
    result = run_gpuvfio("list", "--root", str(tmp_path))
    assert_one_line_error(result, "missing")


@pytest.mark.parametrize("make", [
    lambda tmp: "/dev/null",
    lambda tmp: str(tmp),
    lambda tmp: (os.symlink("/dev/null", tmp / "link.host"), str(tmp / "link.host"))[1],
    lambda tmp: (os.mkfifo(tmp / "fifo"), str(tmp / "fifo"))[1],
])
def test_dump_host_never_replaces_what_is_not_a_regular_file(cli, tmp_path, make):
    """On main dump-host renamed over whatever OUT was: a device node, a directory (traceback)."""
    from tests.make_samples import sample_path

    out = make(tmp_path)
    before = os.lstat(out)
    result = cli("--root", sample_path("workstation"), "dump-host", out)
    assert result.code == 2 and "cannot write" in result.err and "Traceback" not in result.err
    assert os.lstat(out).st_mode == before.st_mode and os.lstat(out).st_ino == before.st_ino


def test_dump_host_replaces_a_regular_file(cli, tmp_path):
    from tests.make_samples import sample_path

    out = tmp_path / "ws.host"
    out.write_text("old")
    assert cli("--root", sample_path("workstation"), "dump-host", str(out)).code == 0
    assert out.read_text().startswith("# gpuvfio host fixture v1")


@pytest.mark.parametrize("journal, fragment", [
    ({"version": 1, "devices": {"0000:01:00.0": {"original_driver": "../../../x"}}}, "original_driver"),
    ({"version": 1, "devices": {"0000:01:00.0": "nvidia"}}, "not an object"),
    ({"version": 1, "devices": {"01:00.0": {}}}, "not a PCI address"),
    ({"version": 1, "devices": {}, "services_stopped": ["sshd"]}, "services_stopped"),
    ({"version": 1, "devices": {}, "mdevs": {"x": {}}}, "not a UUID"),
    ({"version": 1, "devices": {}, "vgpus": {"0000:41:00.4": {"type": "593"}}}, "type"),
    ({"version": 1, "devices": {}, "schedulers": {"0000:41:00.0": {"policy": "random"}}}, "policy"),
    ({"version": 1, "devices": {}, "operation": {"steps": "all"}}, "operation"),
    ({"version": 1, "devices": {}, "colour": "red"}, "unknown field"),
    ({"version": 1, "devices": {}, "broken": {"0000:01:00.0": {"reason": 7}}}, "broken"),
])
def test_a_journal_of_the_wrong_shape_is_kept_and_not_acted_on(cli, workstation, tmp_path, monkeypatch, journal,
                                                              fragment):
    """On main valid JSON with wrong inner types gave tracebacks in status, restore and vgpu remove."""
    import json

    state = tmp_path / "state"
    state.mkdir()
    (state / "journal.json").write_text(json.dumps(journal))
    monkeypatch.setenv("GPUVFIO_STATE_DIR", str(state))
    for args in (["status"], ["restore"], ["vgpu", "remove", "0000:41:00.4"], ["bind", "0000:01:00.0", "--dry-run"]):
        result = cli("--root", workstation.root, *args)
        assert result.code == 2 and "corrupt" in result.err and fragment in result.err, (args, result.err)
        assert len(result.err.strip().splitlines()) == 1
    assert json.loads((state / "journal.json").read_text()) == journal


def test_a_state_dir_that_is_a_file_is_one_line(cli, workstation, tmp_path, monkeypatch):
    state = tmp_path / "state"
    state.write_text("not a directory")
    monkeypatch.setenv("GPUVFIO_STATE_DIR", str(state))
    result = cli("--root", workstation.root, "restore")
    assert result.code == 2 and "not a directory" in result.err and "Traceback" not in result.err


@pytest.mark.parametrize("name, text, fragment", [
    ("results/pt/rep-1.json", "[1, 2]", "not a JSON object"),
    ("results/pt/rep-1.json", '{"variant": "pt", "kind": "passthrough", "metrics": {"h2d_gbps": "fast"}}',
     "not a finite number"),
    ("results/pt/rep-1.json", '{"variant": "pt", "kind": "passthrough", "metrics": {"h2d_gbps": NaN}}',
     "NaN is not a JSON number"),
    ("results/pt/rep-1.json", '{"kind": "passthrough", "metrics": {}}', "variant is not a name"),
    ("identity.json", "[]", "not a testbed identity"),
    ("identity.json", "{", "unreadable"),
])
def test_damaged_testbed_results_are_one_line(cli, tmp_path, name, text, fragment):
    out = tmp_path / "out"
    good = out / "results" / "pt" / "rep-0.json"
    good.parent.mkdir(parents=True)
    good.write_text('{"variant": "pt", "kind": "passthrough", "metrics": {"h2d_gbps": 25.0}}')
    (out / name).write_text(text)
    result = cli("testbed", "report", str(out))
    assert_one_line_error(result, fragment)
    assert sorted(p.name for p in out.iterdir()) == ["identity.json", "results"] if name == "identity.json" \
        else ["results"]


def test_verify_expect_device_is_a_device_argument(cli, workstation):
    """--expect-device takes what every device argument takes, checked before SSH is tried: a bad
    selector is bad input, a slot the host does not have matches nothing."""
    base = ("--root", workstation.root, "verify", "--ssh-host", "127.0.0.1", "--ssh-port", "9", "--timeout", "0.1")
    assert_one_line_error(cli(*base, "--expect-device", "01:00.9"), "not a PCI address")
    assert_one_line_error(cli(*base, "--expect-device", "pci_0000_01_00"), "not a PCI address")
    assert_one_line_error(cli(*base, "--expect-device", "1f:1f"), "no PCI function on this host matches 1f:1f")
    reached_ssh = cli(*base, "--expect-device", "01:00")  # the slot expands; then nothing answers on port 9
    assert reached_ssh.code == 1 and "did not answer SSH" in reached_ssh.err, reached_ssh.err


@pytest.mark.parametrize("option, value, fragment", [
    ("--min-gbps", "nan", "'nan' is not a number"), ("--link-efficiency", "0", "--link-efficiency must be from 0.01"),
    ("--size-mib", "0", "--size-mib"), ("--copies", "1001", "--copies")])
def test_attach_takes_the_verifiers_gates_and_checks_them_first(cli, workstation, monkeypatch, tmp_path, option,
                                                                value, fragment):
    """attach verifies with the same gates as verify; a bad one is bad input before anything is
    read or changed (no state directory, no journal)."""
    state = tmp_path / "state"
    monkeypatch.setenv("GPUVFIO_STATE_DIR", str(state))
    result = cli("--root", workstation.root, "attach", "0000:01:00.0", "--name", "g", option, value)
    assert_one_line_error(result, fragment)
    assert not state.exists()


def test_connect_none_is_asking_no_libvirt_in_every_command(cli, workstation):
    """--connect none (asked no libvirt) was taken by bind and refused by verify and xml as an
    unsafe URI, pointing at GPUVFIO_ALLOW_UNSAFE_URI. Now a command that can do without libvirt
    goes on without it, one that needs it says so in one line."""
    root = ("--root", workstation.root)
    offline = cli(*root, "xml", "01:00.0", "--name", "offline", "--firmware", "bios", "--connect", "none")
    assert offline.code == 0 and "<domain" in offline.out, offline.err
    for args, words in ((("xml", "01:00.0", "--name", "d", "--define"), "--define needs libvirt"),
                        (("attach", "01:00.0", "--name", "d", "--dry-run"), "attach needs libvirt"),
                        (("verify", "some-domain"), "finding the guest by its domain needs libvirt"),
                        (("detach", "some-domain", "--dry-run"), "detach needs libvirt")):
        refused = cli(*root, *args, "--connect", "none")
        assert refused.code == 2 and f"{words}; --connect none asks none" in refused.err, (args, refused.err)
        assert "UNSAFE" not in refused.err
