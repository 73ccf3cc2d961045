"""XML options admins reach for (issue 15 item 6): UEFI through libvirt's firmware auto-selection
(QEMU's firmware descriptors, as virt-install does) instead of OVMF paths under the root; by path
only when asked or where a host has no descriptors; --rom-bar and --rom-file, checked."""

from __future__ import annotations

import os

import pytest
from lxml import etree

from gpuvfio.errors import InputError
from gpuvfio.host.firmware import uefi_descriptors
from gpuvfio.host.root import HostRoot
from tests.conftest import gpu_workstation

DESCRIPTOR = os.path.join("usr", "share", "qemu", "firmware", "60-edk2-x86_64.json")


def xml_of(cli, root, *extra):
    result = cli("--root", root, "xml", "01:00", "--name", "fw", "--memory", "8G", "--hugepages", "none", "--json",
                 *extra)
    return result, (etree.fromstring(result.json()["xml"].encode()) if result.code == 0 else None)


@pytest.fixture
def ws(tmp_path):
    b = gpu_workstation(tmp_path / "host")
    b.firmware()
    return b


def test_uefi_is_libvirts_choice_where_descriptors_are(cli, ws):
    result, doc = xml_of(cli, ws.root)
    assert result.code == 0, result.err
    os_element = doc.find("os")
    assert os_element.get("firmware") == "efi" and os_element.find("loader") is None
    assert [(f.get("name"), f.get("enabled")) for f in os_element.iterfind("firmware/feature")] == [
        ("secure-boot", "no")]
    assert uefi_descriptors(HostRoot(ws.root)) == ["/" + DESCRIPTOR]


def test_without_descriptors_ovmf_by_path_and_without_either_a_refusal(cli, ws):
    os.unlink(os.path.join(ws.root, DESCRIPTOR))
    result, doc = xml_of(cli, ws.root)
    assert result.code == 0 and doc.find("os").get("firmware") is None
    assert doc.findtext("os/loader") == "/usr/share/OVMF/OVMF_CODE_4M.fd"
    assert "no QEMU firmware descriptors here" in result.err
    for rel in ("usr/share/OVMF/OVMF_CODE_4M.fd", "usr/share/OVMF/OVMF_VARS_4M.fd"):
        os.unlink(os.path.join(ws.root, rel))
    refused, _doc = xml_of(cli, ws.root)
    assert refused.code == 1 and "install ovmf" in refused.err and "--firmware bios" in refused.err
    bios, doc = xml_of(cli, ws.root, "--firmware", "bios")
    assert bios.code == 0 and doc.find("os/loader") is None and doc.find("os").get("firmware") is None


def test_masks_and_overrides_as_libvirt_has_them(ws):
    """/etc/qemu/firmware hides the same name in /usr/share; an empty file or a link to /dev/null
    masks it; a secure-boot-only descriptor is no choice with secure boot off."""
    host = HostRoot(ws.root)
    etc = os.path.join(ws.root, "etc", "qemu", "firmware")
    os.makedirs(etc)
    os.symlink("/dev/null", os.path.join(etc, "60-edk2-x86_64.json"))
    assert uefi_descriptors(host) == []
    os.unlink(os.path.join(etc, "60-edk2-x86_64.json"))
    open(os.path.join(etc, "60-edk2-x86_64.json"), "w").close()
    assert uefi_descriptors(host) == []
    with open(os.path.join(ws.root, DESCRIPTOR)) as handle:
        text = handle.read()
    with open(os.path.join(etc, "60-edk2-x86_64.json"), "w") as handle:
        handle.write(text.replace('"acpi-s3"', '"secure-boot", "acpi-s3"'))
    assert uefi_descriptors(host) == []  # the /etc one wins, and it needs secure boot
    with open(os.path.join(etc, "60-edk2-x86_64.json"), "w") as handle:
        handle.write(text)
    assert uefi_descriptors(host) == ["/etc/qemu/firmware/60-edk2-x86_64.json"]


@pytest.mark.parametrize("text", [
    "not json", "[1, 2]",
    '{"interface-types": ["bios"], "targets": [{"architecture": "x86_64", "machines": ["pc-q35-*"]}]}',
    '{"interface-types": ["bios"], "targets": [{"architecture": "x86_64"}]}',
    '{"interface-types": ["uefi"], "targets": [{"architecture": "x86_64", "machines": ["pc-i440fx-*"]}]}',
    '{"interface-types": ["uefi"], "targets": [{"architecture": "aarch64"}]}',
    '{"interface-types": "uefi", "targets": []}',
    '{"interface-types": ["uefi"], "targets": [{"architecture": "x86_64"}], "targets": []}',
])
def test_descriptors_that_are_not_uefi_for_x86_64_q35_do_not_count(ws, text):
    with open(os.path.join(ws.root, DESCRIPTOR), "w") as handle:
        handle.write(text)
    assert uefi_descriptors(HostRoot(ws.root)) == []


def test_loader_by_path_when_asked(cli, ws):
    result, doc = xml_of(cli, ws.root, "--loader", "/usr/share/OVMF/OVMF_CODE_4M.fd", "--nvram-template",
                         "/usr/share/OVMF/OVMF_VARS_4M.fd")
    assert result.code == 0 and doc.find("os").get("firmware") is None
    assert doc.findtext("os/loader") == "/usr/share/OVMF/OVMF_CODE_4M.fd"
    assert doc.find("os/nvram").get("template") == "/usr/share/OVMF/OVMF_VARS_4M.fd"
    missing, _ = xml_of(cli, ws.root, "--loader", "/nope/CODE.fd", "--nvram-template", "/nope/VARS.fd")
    assert missing.code == 2 and "--loader '/nope/CODE.fd': no such file on this host" in missing.err
    for args in (["--loader", "/usr/share/OVMF/OVMF_CODE_4M.fd"],
                 ["--loader", "relative.fd", "--nvram-template", "/x"],
                 ["--loader", "/a", "--nvram-template", "/b", "--firmware", "bios"]):
        bad, _ = xml_of(cli, ws.root, *args)
        assert bad.code == 2 and bad.err.count("\n") == 1, args


def rom(path, data: bytes):
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path, "wb") as handle:
        handle.write(data)


def test_rom_bar_and_rom_file_go_on_the_gpu_only(cli, ws):
    result, doc = xml_of(cli, ws.root, "--rom-bar", "off")
    assert result.code == 0
    roms = {h.find("source/address").get("function"): h.find("rom") for h in doc.iter("hostdev")}
    assert roms["0x0"].get("bar") == "off" and roms["0x1"] is None  # the GPU, not its audio function
    rom(os.path.join(ws.root, "usr/share/vbios/ad102.rom"), b"\x55\xaa" + b"\0" * 1022)
    result, doc = xml_of(cli, ws.root, "--rom-file", "/usr/share/vbios/ad102.rom")
    assert result.code == 0
    (element,) = [h.find("rom") for h in doc.iter("hostdev") if h.find("rom") is not None]
    assert element.get("file") == "/usr/share/vbios/ad102.rom" and element.get("bar") is None


@pytest.mark.parametrize("data, words", [(None, "no such file"), (b"\x55\xaa", "not a PCI option ROM"),
                                         (b"MZ" + b"\0" * 2000, "not a PCI option ROM")])
def test_bad_rom_files_are_bad_input(cli, ws, data, words):
    path = os.path.join(ws.root, "usr/share/vbios/bad.rom")
    if data is not None:
        rom(path, data)
    result, _ = xml_of(cli, ws.root, "--rom-file", "/usr/share/vbios/bad.rom")
    assert result.code == 2 and words in result.err and result.err.count("\n") == 1


def test_rom_file_through_a_link_out_of_the_root_is_refused(cli, ws, tmp_path):
    outside = tmp_path / "outside.rom"
    outside.write_bytes(b"\x55\xaa" + b"\0" * 1022)
    os.makedirs(os.path.join(ws.root, "usr/share/vbios"), exist_ok=True)
    # An absolute link means a path of the host: taken under the root (as the host would follow it),
    # never this machine's file of that name.
    os.symlink(str(outside), os.path.join(ws.root, "usr/share/vbios/link.rom"))
    result, _ = xml_of(cli, ws.root, "--rom-file", "/usr/share/vbios/link.rom")
    assert result.code == 2 and "no such file on this host" in result.err
    escape = os.path.relpath(str(outside), os.path.join(ws.root, "usr/share/vbios"))  # ../../.. out of the root
    os.symlink(escape, os.path.join(ws.root, "usr/share/vbios/escape.rom"))
    result, _ = xml_of(cli, ws.root, "--rom-file", "/usr/share/vbios/escape.rom")
    assert result.code == 2 and "leads out of the host root" in result.err
    os.makedirs(os.path.join(ws.root, "opt"), exist_ok=True)
    # a linked directory that climbs out of the root, same
    os.symlink(os.path.relpath(str(tmp_path), os.path.join(ws.root, "opt")), os.path.join(ws.root, "opt", "dir"))
    result, _ = xml_of(cli, ws.root, "--rom-file", "/opt/dir/outside.rom")
    assert result.code == 2 and "leads out of the host root" in result.err
    os.mkfifo(os.path.join(ws.root, "usr/share/vbios/fifo.rom"))  # would hang a read
    result, _ = xml_of(cli, ws.root, "--rom-file", "/usr/share/vbios/fifo.rom")
    assert result.code == 2 and "no such file" in result.err
    inside = os.path.join(ws.root, "usr/share/vbios/real.rom")
    rom(inside, b"\x55\xaa" + b"\0" * 1022)
    os.symlink("real.rom", os.path.join(ws.root, "usr/share/vbios/current.rom"))  # a link inside the root
    result, _ = xml_of(cli, ws.root, "--rom-file", "/usr/share/vbios/current.rom")
    assert result.code == 0, result.err
    os.symlink("/usr/share/vbios/real.rom", os.path.join(ws.root, "usr/share/vbios/absolute.rom"))
    result, _ = xml_of(cli, ws.root, "--rom-file", "/usr/share/vbios/absolute.rom")  # absolute, inside the root
    assert result.code == 0, result.err


def test_rom_options_conflict_and_words(cli, ws):
    for args in (["--rom-bar", "maybe"], ["--rom-bar", "off", "--rom-file", "/x.rom"]):
        bad, _ = xml_of(cli, ws.root, *args)
        assert bad.code == 2 and bad.err.count("\n") == 1, args
    with pytest.raises(InputError):
        from gpuvfio.domain.request import domain_request

        domain_request("x", rom_bar="OFF")


def test_a_rom_file_a_recording_lacks_is_refused_and_nothing_is_defined(cli, tmp_path):
    """xml on a recording refuses a ROM or UEFI file the recording does not hold, --define too
    (nothing is defined with a file no one checked); one the recording holds is checked as a ROM."""
    from tests.make_samples import sample_path

    node = tmp_path / "testdriver.xml"
    node.write_text("<node/>")
    args = ("xml", "0000:01:00.0", "--name", "g", "--memory", "2G", "--hugepages", "none")
    for extra in (("--rom-file", "/usr/share/vbios/ad102.rom"),
                  ("--loader", "/opt/edk2/CODE.fd", "--nvram-template", "/opt/edk2/VARS.fd")):
        result = cli("--root", sample_path("workstation"), *args, *extra, "--define", "--connect", f"test://{node}")
        assert result.code == 2 and "no such file on this host" in result.err, result.err
        assert result.out == ""  # neither the XML nor a define result
    bad = cli("--root", sample_path("workstation"), *args, "--rom-file", "/proc/cpuinfo")  # recorded, not a ROM
    assert bad.code == 2 and "not a PCI option ROM" in bad.err
