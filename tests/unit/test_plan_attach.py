"""attach's plan is what attach does (issue 23 items 1 and 2): ``attach --dry-run``, the run,
Ansible's check mode and ``testbed plan`` all come from gpuvfio.ops.attach_plan.

The dry run changes nothing (the tree, the state dir, libvirt's domains, the lock), needs no
--yes and exits as the run would; a refusal in the plan is the run's refusal in the same words;
(tests/daemon/test_plan_attach_run.py: the run records exactly the plan's steps);
the testbed's plan of a passthrough variant is the
plan ``attach --dry-run`` prints for the same guest.
"""

from __future__ import annotations

import hashlib
import os

import pytest

from gpuvfio.guest.expect import Gates
from tests.make_samples import sample_path

libvirt = pytest.importorskip("libvirt")

GPU, AUDIO = "0000:01:00.0", "0000:01:00.1"
SAMPLES = ["workstation", "dgx-h100", "epyc-mixed", "pcie-switch", "iommu-off"]


def tree_digest(root: str) -> str:
    """Every name, link target, file content and mode beneath ``root`` (a dry run must leave
    all of them as they were)."""
    digest = hashlib.sha256()
    for directory, dirs, files in sorted(os.walk(root)):
        dirs.sort()
        for name in sorted(dirs + files):
            path = os.path.join(directory, name)
            st = os.lstat(path)
            digest.update(f"{os.path.relpath(path, root)}\0{st.st_mode}\0".encode())
            if os.path.islink(path):
                digest.update(os.readlink(path).encode())
            elif os.path.isfile(path):
                with open(path, "rb") as handle:
                    digest.update(handle.read())
    return digest.hexdigest()


@pytest.fixture
def foreign_domain():
    """libvirt's process-wide test driver (test:///default) holding a domain gpuvfio did not
    define, named ``vm-foreign``; the connection stays open for the test."""
    conn = libvirt.open("test:///default")
    xml = ("<domain type='test'><name>vm-foreign</name><memory>1048576</memory><vcpu>1</vcpu>"
           "<os><type>hvm</type></os></domain>")
    dom = conn.defineXML(xml)
    yield conn
    dom.undefine()
    conn.close()


def kernel_file(tmp_path) -> str:
    """A kernel the attach plan finds on this machine (issue 33 item 2: a guest that can boot)."""
    path = tmp_path / "vmlinuz"
    path.write_bytes(b"\0" * 512)
    return str(path)


def _domains(conn) -> list[str]:
    return sorted(d.name() for d in conn.listAllDomains(0))


def test_attach_dry_run_changes_nothing_needs_no_yes_and_lists_the_runs_steps(cli, workstation, tmp_path,
                                                                              monkeypatch, foreign_domain):
    state = tmp_path / "state"
    monkeypatch.setenv("GPUVFIO_STATE_DIR", str(state))
    before, domains = tree_digest(workstation.root), _domains(foreign_domain)
    result = cli("--root", workstation.root, "attach", "01:00", "--name", "vm1", "--dry-run", "--json",
                 "--connect", "test:///default", "--ssh-host", "192.0.2.7", "--virt-type", "qemu", "--firmware", "bios",
                 "--kernel", kernel_file(tmp_path))
    assert result.code == 0, result.err
    plan = result.json()
    assert plan["operation"] == "attach" and plan["result"] == "planned" and plan["refused"] == []
    assert [s["kind"] for s in plan["steps"]] == ["bind", "define", "start", "wait for ssh", "verify"]
    assert plan["steps"][0]["detail"].startswith(f"move {GPU}, {AUDIO} to vfio-pci")
    assert plan["bind"]["moving"] == [GPU, AUDIO] and "<hostdev" in plan["xml"]
    assert plan["placement"]["cells"][0]["node"] == 0 and plan["placement"]["cells"][0]["host_cpus"]
    assert plan["verify"]["bandwidth_floor"] == Gates().to_json() and "Gen3 x16 10.8 GB/s" in Gates().to_json()
    # Nothing changed: not the tree, not the state dir (never created: no journal, no lock), not libvirt.
    assert tree_digest(workstation.root) == before
    assert not state.exists()
    assert _domains(foreign_domain) == domains
    # In text, the plan, then one line: nothing changed.
    text = cli("--root", workstation.root, "attach", "01:00", "--name", "vm1", "--dry-run",
               "--connect", "test:///default", "--ssh-host", "192.0.2.7", "--virt-type", "qemu", "--firmware", "bios",
                 "--kernel", kernel_file(tmp_path))
    assert text.code == 0 and "attach vm1: planned" in text.out and "1. bind: move" in text.out
    assert "dry run: nothing changed; the run takes 5 steps" in text.err


def test_a_refused_attach_plan_is_the_runs_refusal_in_the_same_words(cli, workstation, tmp_path, monkeypatch,
                                                                     foreign_domain):
    """A domain of that name that gpuvfio did not define: the dry run shows the plan and exits 1
    with the error line the run prints, and the run changes nothing either."""
    monkeypatch.setenv("GPUVFIO_STATE_DIR", str(tmp_path / "state"))
    args = ["--root", workstation.root, "attach", GPU, "--name", "vm-foreign", "--connect", "test:///default",
            "--ssh-host", "192.0.2.7", "--virt-type", "qemu", "--firmware", "bios", "--kernel", kernel_file(tmp_path)]
    before = tree_digest(workstation.root)
    dry = cli(*args, "--dry-run", "--json")
    run = cli(*args)
    assert dry.code == run.code == 1, (dry.err, run.err)
    plan = dry.json()
    assert plan["result"] == "refused"
    assert plan["refused"] == ["domain vm-foreign exists and was not created by gpuvfio; pick another --name"]
    error_line = [line for line in run.err.splitlines() if "error:" in line]
    assert error_line == [line for line in dry.err.splitlines() if "error:" in line]
    assert error_line == ["gpuvfio: error: refused: " + plan["refused"][0]]
    assert tree_digest(workstation.root) == before


def test_a_dry_run_without_the_yes_the_run_needs_shows_the_plan_then_exits_as_the_run(cli, workstation, tmp_path,
                                                                                      monkeypatch):
    """-d 10de: reaches two GPUs (four functions): the run is refused without --yes; the dry run
    shows its plan (the confirmation among its refusals) and exits 1 with the run's words."""
    monkeypatch.setenv("GPUVFIO_STATE_DIR", str(tmp_path / "state"))
    dry = cli("--root", workstation.root, "attach", "-d", "10de:", "--name", "vm2", "--dry-run", "--json",
              "--ssh-host", "192.0.2.7", "--firmware", "bios")
    assert dry.code == 1
    plan = dry.json()
    confirm = [c for c in plan["checks"] if c["id"] == "confirm"]
    assert confirm and "add --yes to act on all of them" in confirm[0]["message"]
    assert dry.err.strip().splitlines()[-1] == f"gpuvfio: error: {confirm[0]['message']}"


@pytest.mark.parametrize("sample", SAMPLES)
def test_attach_dry_run_on_every_sample_host(cli, sample, tmp_path, monkeypatch):
    """A recording answers a dry run as a directory does; libvirt is not asked for a recorded
    host (the plan says so); exit 0 with steps, or 1 with the refusals the plan names."""
    monkeypatch.setenv("GPUVFIO_STATE_DIR", str(tmp_path / "state"))
    listing = cli("--root", sample_path(sample), "list", "--json").json()
    gpus = [d["address"] for d in listing["devices"] if d["vendor_id"] == "10de" and d["class_id"].startswith("03")]
    assert gpus, sample
    result = cli("--root", sample_path(sample), "attach", gpus[0], "--name", "t", "--dry-run", "--json",
                 "--ssh-host", "192.0.2.7", "--firmware", "bios")
    assert result.code in (0, 1), result.err
    plan = result.json()
    assert {"id": "libvirt", "status": "warn",
            "message": "libvirt not asked: the host root is not this machine (--connect URI asks one)", "overridable": False} \
        in plan["checks"]
    if result.code == 0:
        assert plan["result"] == "planned" and plan["steps"][0]["kind"] in ("bind", "define")
    else:
        assert plan["result"] == "refused" and plan["refused"]
        assert result.err.strip().splitlines()[-1] == "gpuvfio: error: refused: " + "; ".join(plan["refused"])
    assert not (tmp_path / "state").exists()


def test_testbed_plan_shows_for_each_variant_the_plan_attach_dry_run_prints(cli, workstation, tmp_path,
                                                                            monkeypatch):
    monkeypatch.setenv("GPUVFIO_STATE_DIR", str(tmp_path / "state"))
    spec = tmp_path / "spec.toml"
    disk = tmp_path / "g.qcow2"
    disk.write_bytes(b"QFI\xfb")
    spec.write_text(f'[guest]\ndisk = "{disk}"\nvcpus = 2\nmemory = "2G"\nfirmware = "bios"\n'
                    '[guest.ssh]\nport = 2222\n\n[run]\ngpus = ["01:00"]\n\n[[variant]]\nname = "pt"\nkind = "passthrough"\n'
                    'hugepages = "none"\n')
    testbed = cli("--root", workstation.root, "testbed", "plan", str(spec), "--json", "--yes")
    assert testbed.code == 0, testbed.err
    (variant,) = testbed.json()["variants"]
    # [guest.ssh] port: QEMU user networking forwards 127.0.0.1:port to the guest's SSH.
    dry = cli("--root", workstation.root, "attach", "01:00", "--name", "gpuvfio-tb-pt", "--vcpus", "2",
              "--memory", "2G", "--firmware", "bios", "--hugepages", "none",
              "--disk", str(disk), "--user-net-ssh-port", "2222",
              "--ssh-host", "127.0.0.1", "--ssh-port", "2222", "--ssh-user", "root", "--dry-run", "--json")
    assert dry.code == 0, dry.err
    assert variant["plan"] == dry.json()
    assert variant["refused"] == [] and [s["kind"] for s in variant["plan"]["steps"]] == [
        "bind", "define", "start", "wait for ssh", "verify"]


def test_the_text_dry_run_shows_everything_the_run_does(cli, workstation, tmp_path, monkeypatch):
    """Issue 33 item 5: the text plan shows the bind's own steps with their sysfs files, the
    placement (vCPU to host CPU, memory node, page size), verify's thresholds, and the domain
    against libvirt (new here; --show-xml prints it whole)."""
    monkeypatch.setenv("GPUVFIO_STATE_DIR", str(tmp_path / "state"))
    args = ["--root", workstation.root, "attach", "01:00", "--name", "vm-shown", "--dry-run", "--connect",
            "test:///default", "--ssh-host", "192.0.2.7", "--virt-type", "qemu", "--firmware", "bios",
            "--kernel", kernel_file(tmp_path), "--min-gbps", "20"]
    text = cli(*args)
    assert text.code == 0, text.err
    out = text.out
    assert "Bind steps:" in out and f"{GPU}: driver_override <- vfio-pci (/sys/bus/pci/devices/{GPU}/driver_override)" \
        in out and f"{GPU}: unbind from nvidia (/sys/bus/pci/drivers/nvidia/unbind)" in out
    placement = cli(*args, "--json").json()["placement"]["cells"][0]
    pins = ", ".join(f"{v}->{c}" for v, c in zip(placement["vcpus"], placement["host_cpus"]))
    assert f"cell 0: vCPU->host CPU {pins}; memory {placement['memory_kib'] // 1024} MiB on node 0" in out
    assert "Verify: each GPU's link at least what its host slot allows" in out and ">= 20 GB/s per direction" in out
    assert "Domain: new, none of that name in libvirt (--show-xml prints its XML)" in out and "<domain" not in out
    whole = cli(*args, "--show-xml")
    assert whole.code == 0 and "Domain XML:" in whole.out and "<hostdev mode='subsystem' type='pci'" in whole.out


def test_xml_define_dry_run_shows_what_it_would_define(cli, workstation, tmp_path, monkeypatch):
    monkeypatch.setenv("GPUVFIO_STATE_DIR", str(tmp_path / "state"))
    result = cli("--root", workstation.root, "xml", GPU, "--name", "vm-new-xml", "--define", "--dry-run",
                 "--connect", "test:///default", "--virt-type", "qemu", "--firmware", "bios")
    assert result.code == 0, result.err
    assert "vm-new-xml: would_define" in result.err + result.out
    assert "+ <domain type='qemu'" in result.out and "+ </domain>" in result.out
