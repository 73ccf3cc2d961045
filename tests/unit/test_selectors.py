"""Device selectors as lspci and virsh take them (issue 15 item 2): parsing at the edge, matching
on a host, and the confirmation a host change wants when a selector reaches further than one
physical device."""

from __future__ import annotations

import pytest

from gpuvfio.address import PciAddress
from gpuvfio.errors import InputError
from gpuvfio.selector import IdFilter, Selector
from tests.conftest import gpu_workstation

A = PciAddress.parse


@pytest.mark.parametrize("text, parts", [
    ("01:00", (0, 1, 0, None)),
    ("01:00.1", (0, 1, 0, 1)),
    ("0000:01:00.0", (0, 1, 0, 0)),
    ("10000:e1:1f.7", (0x10000, 0xE1, 0x1F, 7)),  # a VMD domain
    ("pci_0000_01_00_1", (0, 1, 0, 1)),  # virsh nodedev-list
    ("1c", (0, None, 0x1C, None)),  # a slot on any bus, as lspci -s 1c
    ("1c.4", (0, None, 0x1C, 4)),
    (" 01:00.0 ", (0, 1, 0, 0)),
])
def test_selectors_parse(text, parts):
    s = Selector.parse(text)
    assert (s.domain, s.bus, s.slot, s.function) == parts
    assert (s.address is not None) == (parts[1] is not None and parts[3] is not None)


@pytest.mark.parametrize("text", ["", " ", "01:00.8", "01:20", "01:20.0", "pci_0000_01_00", "pci_0000_1_00_0",
                                  "g0:00", "0000:01:00.0.0", "01:00:00", "nan", "01:00.", "-1:00", "١:00",
                                  "0" * 200, "pci_0000_01_00_0/../x", "01:00\n00"])
def test_bad_selectors_are_input_errors_in_one_short_line(text):
    with pytest.raises(InputError) as info:
        Selector.parse(text)
    message = str(info.value)
    assert "\n" not in message.rstrip("'") and len(message) < 200


def test_selectors_match_all_functions_of_a_slot():
    slot = Selector.parse("01:00")
    assert slot.matches(A("0000:01:00.0")) and slot.matches(A("0000:01:00.1"))
    assert not slot.matches(A("0000:01:01.0")) and not slot.matches(A("0001:01:00.0"))
    assert Selector.parse("1c").matches(A("0000:00:1c.4")) and Selector.parse("1c").matches(A("0000:80:1c.0"))


@pytest.mark.parametrize("text, parts", [
    ("10de:", ((0x10DE, 0xFFFFFFFF), None, None)),
    ("10de:2330", ((0x10DE, 0xFFFFFFFF), (0x2330, 0xFFFFFFFF), None)),
    (":2330", (None, (0x2330, 0xFFFFFFFF), None)),
    ("10DE::0302", ((0x10DE, 0xFFFFFFFF), None, (0x0302, 0xFFFFFFFF))),
    ("10de::03xx", ((0x10DE, 0xFFFFFFFF), None, (0x0300, 0xFFFFFF00))),
    ("10de:23x0", ((0x10DE, 0xFFFFFFFF), (0x2300, 0xFFFFFF0F), None)),
])
def test_id_filters_parse(text, parts):
    f = IdFilter.parse(text)
    assert (f.vendor, f.device, f.klass) == parts


@pytest.mark.parametrize("text", ["", ":", "10de", "10deg:", "10de:23301", "10de:2330:03021",
                                  "::", "10de:2330:0302:00", "NaN:"])
def test_bad_id_filters(text):
    with pytest.raises(InputError):
        IdFilter.parse(text)


def test_id_filters_match_like_lspci():
    """As pciutils' parse_hex_field: the digits given are the whole value, x a wildcard digit."""
    gpu = ("10de", "2330", "030200")
    nvswitch = ("10de", "22a3", "068000")
    assert IdFilter.parse("10de:").matches(*gpu) and IdFilter.parse("10de:").matches(*nvswitch)
    assert IdFilter.parse("10de::03xx").matches(*gpu) and not IdFilter.parse("10de::03xx").matches(*nvswitch)
    assert not IdFilter.parse("10de::03").matches(*gpu)  # class 0x0003, as lspci -d 10de::03 reads it
    assert IdFilter.parse("10de::0302").matches(*gpu) and IdFilter.parse(":22ax").matches(*nvswitch)
    assert not IdFilter.parse("10de:2331").matches(*gpu)


# -- on a host, through the CLI ------------------------------------------------------------------

@pytest.fixture
def ws(tmp_path):
    b = gpu_workstation(tmp_path / "host")
    b.driver("vfio-pci")
    return b


def test_a_slot_binds_all_its_functions_without_asking(cli, ws):
    result = cli("--root", ws.root, "bind", "01:00", "--dry-run", "--connect", "none", "--json")
    assert result.code == 0, result.err
    assert result.json()["devices"] == ["0000:01:00.0", "0000:01:00.1"]
    same = cli("--root", ws.root, "bind", "pci_0000_01_00_0", "--dry-run", "--connect", "none", "--json")
    assert same.code == 0 and same.json()["devices"] == ["0000:01:00.0", "0000:01:00.1"]


def test_a_selector_reaching_two_devices_needs_yes(cli, ws):
    """-d 10de: matches both GPUs (and their audio): the bind says what it expanded to and wants
    --yes; a dry run exits as the real run would."""
    refused = cli("--root", ws.root, "bind", "-d", "10de:", "--dry-run", "--connect", "none")
    assert refused.code == 1
    assert "-d 10de: matches 2 physical devices (0000:01:00.0, 0000:01:00.1, 0000:04:00.0, 0000:04:00.1)" in refused.err
    assert "add --yes" in refused.err and "Traceback" not in refused.err
    assert "selected -d 10de: -> 0000:01:00.0, 0000:01:00.1, 0000:04:00.0, 0000:04:00.1" in refused.err
    # With --yes it goes on to the plan, which refuses the second GPU's group (it shares it with a NIC).
    confirmed = cli("--root", ws.root, "bind", "-d", "10de:", "--yes", "--dry-run", "--connect", "none", "--json")
    assert confirmed.code == 1 and "(igc)" in confirmed.err and "add --yes" not in confirmed.err
    # A slot and an id filter intersect.
    both = cli("--root", ws.root, "bind", "01:00", "-d", "10de:2684", "--dry-run", "--connect", "none", "--json")
    assert both.code == 0, both.err
    assert both.json()["devices"] == ["0000:01:00.0", "0000:01:00.1"]  # the group goes whole


def test_yes_is_counted_in_physical_devices_whatever_the_spelling(cli, ws):
    """Issue 33 item 6: two GPUs named by slot or by exact address both ask for --yes; a GPU and
    its audio (one slot) do not, however spelled."""
    for spelling in (["01:00", "04:00"], ["0000:01:00.0", "0000:04:00.0"], ["01:00.0", "pci_0000_04_00_0"]):
        for command in (["bind"], ["persist"], ["attach", "--name", "vm", "--memory", "1G", "--no-verify"]):
            refused = cli("--root", ws.root, *command, *spelling, "--dry-run")
            assert refused.code == 1, (command, spelling)
            assert "2 physical devices" in refused.err and "add --yes" in refused.err, refused.err
    for spelling in (["01:00"], ["0000:01:00.0", "0000:01:00.1"], ["01:00.0", "01:00.1"]):
        one = cli("--root", ws.root, "bind", *spelling, "--dry-run", "--connect", "none")
        assert one.code == 0 and "add --yes" not in one.err, (spelling, one.err)


def test_yes_is_a_line_of_the_plan(cli, ws):
    """With --yes the plan says what it confirmed (first among its checks), for bind, attach and
    restore alike; one physical device needs no confirmation and gets no line."""
    two = ["01:00.0", "04:00.0"]
    attach = cli("--root", ws.root, "attach", *two, "--name", "vm", "--memory", "1G", "--no-verify",
                 "--ssh-host", "192.0.2.7", "--kernel", "/boot/vmlinuz", "--yes", "--dry-run", "--json")
    bind = cli("--root", ws.root, "bind", *two, "--yes", "--dry-run", "--connect", "none", "--json")
    for shown in (attach, bind):
        first = (shown.json().get("checks") or shown.json()["report"]["checks"])[0]
        assert first["id"] == "confirm" and first["status"] == "ok", shown.out
        assert first["message"] == ("01:00.0 04:00.0 names 2 physical devices (0000:01:00.0, 0000:04:00.0): "
                                    "confirmed with --yes")
    text = cli("--root", ws.root, "attach", *two, "--name", "vm", "--memory", "1G", "--no-verify",
               "--ssh-host", "192.0.2.7", "--kernel", "/boot/vmlinuz", "--yes", "--dry-run")
    assert "ok     confirm: 01:00.0 04:00.0 names 2 physical devices" in text.out
    one = cli("--root", ws.root, "bind", "01:00", "--dry-run", "--connect", "none", "--json")
    assert [c for c in one.json()["checks"] if c["id"] == "confirm"] == []


def test_list_and_bad_selection(cli, ws):
    listed = cli("--root", ws.root, "list", "-d", "::02xx", "--json").json()
    assert [d["address"] for d in listed["devices"]] == ["0000:03:00.0"]
    listed = cli("--root", ws.root, "list", "04:00", "--json").json()
    assert [d["address"] for d in listed["devices"]] == ["0000:04:00.0", "0000:04:00.1"]
    for args, words in ((["bind", "--dry-run"], "no device given"),
                        (["bind", "-d", "dead:", "--dry-run"], "no PCI function on this host matches -d dead:"),
                        (["list", "07:00"], "no PCI function on this host matches 07:00"),
                        (["bind", "-d", "10de", "--dry-run"], "not a device id filter"),
                        (["vgpu", "types", "01:00"], "matches 2 functions"),
                        (["bind", "0000:01:00.7", "--dry-run"], "no such PCI function on this host: 0000:01:00.7")):
        result = cli("--root", ws.root, *args)
        assert result.code == 2, (args, result.err)
        assert words in result.err and result.err.count("\n") == 1, (args, result.err)


def test_nvswitches_show_as_nvswitches(cli):
    from tests.make_samples import sample_path

    out = cli("--root", sample_path("dgx-h100"), "list", "-d", "10de::0680").out
    assert out.count("NVSwitch") == 4 and "Bridge" not in out
    data = cli("--root", sample_path("dgx-h100"), "list", "-d", "10de::0680", "--json").json()
    assert {d["kind"] for d in data["devices"]} == {"nvswitch"}
