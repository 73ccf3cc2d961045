import os
import subprocess

import pytest

from gpuvfio.host.fixture import load_fixture
from tests.conftest import HostBuilder


def test_list_json_contract(cli, workstation):
    result = cli("--root", workstation.root, "list", "--json")
    assert result.code == 0, result.err
    data = result.json()
    assert [d["address"] for d in data["devices"]] == ["0000:01:00.0", "0000:01:00.1", "0000:04:00.0",
                                                       "0000:04:00.1"]
    gpu = data["devices"][0]
    assert {k: gpu[k] for k in ("vendor_id", "device_id", "class_id", "driver", "iommu_group", "numa_node")} == {
        "vendor_id": "10de", "device_id": "2684", "class_id": "030000", "driver": "nvidia",
        "iommu_group": 2, "numa_node": 0}
    # Without --all: the groups that contain NVIDIA functions, with their bridges and strangers.
    groups = {g["id"]: g for g in data["groups"]}
    assert sorted(groups) == [2, 3]
    assert groups[2] == {"id": 2, "devices": ["0000:01:00.0", "0000:01:00.1"], "viable": True, "problems": []}
    assert not groups[3]["viable"] and "0000:00:1c.0" in groups[3]["devices"]


def test_list_all_has_every_function_and_group(cli, workstation):
    data = cli("--root", workstation.root, "list", "--all", "--json").json()
    assert len(data["devices"]) == len(workstation.functions)
    assert {g["id"] for g in data["groups"]} == {f.group for f in workstation.functions.values()}


def test_list_table_for_people(cli, workstation):
    result = cli("--root", workstation.root, "list")
    assert result.code == 0
    assert "0000:01:00.0" in result.out and "GeForce RTX 4090" in result.out
    assert "not viable" in result.err and "igc" in result.err  # notes on stderr: stdout is data lines
    assert "0000:00:1c.0" not in result.out  # bridges only with --all


def test_env_root(cli, workstation, monkeypatch):
    monkeypatch.setenv("GPUVFIO_ROOT", workstation.root)
    assert cli("list", "--json").json()["devices"][0]["address"] == "0000:01:00.0"


def test_no_iommu_list_ok_doctor_fails(cli, tmp_path):
    b = HostBuilder(str(tmp_path))
    b.iommu(None)
    b.cmdline("ro quiet intel_iommu=off")
    rb = b.root_bus()
    b.function(rb, "0000:00:02.0", "10de", "1db4", "030200", driver="nvidia")
    listed = cli("--root", b.root, "list", "--json")
    assert listed.code == 0 and listed.json()["groups"] is None
    assert listed.json()["devices"][0]["iommu_group"] is None
    doctor = cli("--root", b.root, "doctor", "--json")
    assert doctor.code == 1
    checks = {c["id"]: c for c in doctor.json()["checks"]}
    assert checks["iommu"]["status"] == "fail" and "intel_iommu=off" in checks["iommu"]["summary"]
    assert checks["iommu"]["fix"]


def test_doctor_json_ids(cli, workstation):
    result = cli("--root", workstation.root, "doctor", "--json")
    checks = {c["id"]: c for c in result.json()["checks"]}
    required = {"iommu", "acs_override", "vfio_modules", "hugepages", "hugepages_near_gpus", "interrupt_remapping",
                "nvidia_holders", "boot_vga"}
    assert required <= set(checks)
    assert all(c["status"] in ("ok", "warn", "fail", "skip") and c["summary"] for c in checks.values())
    assert result.code == 0, checks
    assert checks["gpu_groups"]["status"] == "warn" and "igc" in checks["gpu_groups"]["summary"]


def test_dump_host_roundtrip(cli, workstation, tmp_path):
    out = tmp_path / "ws.host"
    result = cli("--root", workstation.root, "dump-host", str(out))
    assert result.code == 0 and "records" in result.err
    text = out.read_text()
    assert text.startswith("# gpuvfio host fixture v1\n")
    replay = load_fixture(text, str(tmp_path / "replay"))
    original = cli("--root", workstation.root, "list", "--all", "--json").json()
    replayed = cli("--root", replay, "list", "--all", "--json").json()
    assert replayed == original
    assert cli("--root", str(out), "list", "--all", "--json").json() == original
    recorded = cli("--root", str(out), "doctor", "--json").json()
    live = cli("--root", workstation.root, "doctor", "--json").json()
    # The same checks, but gpuvfio's journal: the host's own state, not in a recording.
    journal = [c for c in recorded["checks"] if c["id"] == "journal"]
    assert [c["status"] for c in journal] == ["skip"]
    assert {**recorded, "checks": [c for c in recorded["checks"] if c["id"] != "journal"]} == {
        **live, "checks": [c for c in live["checks"] if c["id"] != "journal"]}


def test_dump_host_to_stdout(cli, workstation):
    result = cli("--root", workstation.root, "dump-host", "-")
    assert result.code == 0 and result.out.startswith("# gpuvfio host fixture v1")
    assert "L sys/bus/pci/devices/0000:01:00.0 " in result.out


def test_dump_into_missing_directory(cli, workstation, tmp_path):
    result = cli("--root", workstation.root, "dump-host", str(tmp_path / "no" / "x.host"))
    assert result.code == 2 and "not a directory" in result.err
    assert not os.path.exists(tmp_path / "no")


def _command_paths():
    import typer.main

    from gpuvfio.cli import app

    paths = []

    def walk(command, path):
        paths.append(path)
        for name, sub in sorted(getattr(command, "commands", {}).items()):
            walk(sub, path + [name])

    walk(typer.main.get_command(app), [])
    return paths


@pytest.mark.parametrize("path", _command_paths(), ids=lambda p: " ".join(p) or "gpuvfio")
def test_every_command_takes_dash_h(cli, path):
    """-h works on every command and group, as --help does (issue 15: -h worked at the top only)."""
    short, long = cli(*path, "-h"), cli(*path, "--help")
    assert short.code == 0 and short.out.startswith("Usage: gpuvfio"), (path, short.err)
    assert short.out == long.out


def _complete(cli, monkeypatch, words: str) -> list[str]:
    monkeypatch.setenv("_GPUVFIO_COMPLETE", "complete_bash")
    monkeypatch.setenv("COMP_WORDS", words)
    monkeypatch.setenv("COMP_CWORD", str(len(words.split()) - (0 if words.endswith(" ") else 1)))
    result = cli()
    monkeypatch.delenv("_GPUVFIO_COMPLETE")
    return result.out.split()


def test_shell_completion_offers_commands_options_devices_and_domains(cli, monkeypatch, workstation, tmp_path):
    """typer's completion (bash, zsh, fish: --install-completion / --show-completion), with device
    addresses read from the host root and domain names from libvirt (issue 15 item 3)."""
    assert "bind" in _complete(cli, monkeypatch, "gpuvfio bi")
    assert {"--device-id", "--dry-run"} <= set(_complete(cli, monkeypatch, "gpuvfio bind --d"))
    root = workstation.root
    assert _complete(cli, monkeypatch, f"gpuvfio --root {root} bind 01:") == ["01:00.0", "01:00.1"]
    assert _complete(cli, monkeypatch, f"gpuvfio bind --root {root} 0000:04") == ["0000:04:00.0", "0000:04:00.1"]
    assert _complete(cli, monkeypatch, f"gpuvfio list --root {root} pci_0000_04") == ["pci_0000_04_00_0",
                                                                                    "pci_0000_04_00_1"]
    assert _complete(cli, monkeypatch, f"gpuvfio list --root {root} 03") == []  # the chipset's NIC: no candidate
    assert _complete(cli, monkeypatch, f"gpuvfio bind --root {tmp_path}/nowhere 0") == []  # no host: nothing
    node = tmp_path / "testdriver.xml"
    node.write_text("<node><domain type='test'><name>train-7</name><memory>1024</memory><os><type>hvm</type>"
                    "</os></domain></node>")
    assert _complete(cli, monkeypatch, f"gpuvfio detach --connect test://{node} tr") == ["train-7"]
    assert _complete(cli, monkeypatch, "gpuvfio detach --connect test:///nowhere/x tr") == []
    for shell in ("bash", "zsh", "fish"):  # printed, never written into the user's rc files
        script = cli("completion", shell)
        assert script.code == 0 and "_GPUVFIO_COMPLETE" in script.out, shell
    assert cli("completion", "tcsh").code == 2
    assert cli("--install-completion").code == 2  # typer's installer (writes ~/.bashrc) is not offered


def test_bash_answers_a_command_name_as_gpuvfio_would(cli, monkeypatch, tmp_path):
    """The bash script answers the first word itself (no process per Tab): bash runs the printed
    function for the empty word, every prefix of every command name, a word no name starts with
    and an option; what it offers is what gpuvfio's own completion offers. A word no name fits,
    and any option, go to gpuvfio (here a stand-in program that says it was asked)."""
    from gpuvfio.cli.lazy import COMMANDS

    script = tmp_path / "gpuvfio.bash"
    script.write_text(cli("completion", "bash").out)
    asked = tmp_path / "gpuvfio"
    asked.write_text("#!/bin/sh\necho ASKED\n")
    asked.chmod(0o755)
    words = sorted({""} | {name[:end] for name in COMMANDS for end in range(1, len(name) + 1)}) + ["zz", "--r"]
    driver = ('source "$1"; shift; program=$1; shift\n'
              'for word in "$@"; do COMP_WORDS=(gpuvfio "$word"); COMP_CWORD=1; COMPREPLY=()\n'
              '  _gpuvfio_completion "$program"; echo "${COMPREPLY[*]}"; done\n')
    proc = subprocess.run(["bash", "-c", driver, "bash", str(script), str(asked), *words], capture_output=True,
                          text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    offered = dict(zip(words, proc.stdout.split("\n")))
    for word in words[:-2]:
        assert sorted(offered[word].split()) == sorted(_complete(cli, monkeypatch, f"gpuvfio {word}")), word
    assert offered["zz"] == "ASKED" and offered["--r"] == "ASKED"
