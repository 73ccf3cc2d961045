"""Numbers from hosts, guests, users and files: ASCII digits only, bounded (gpuvfio.numbers), and
through the entry points that read them: a bad number is one line or a handled value, never a
traceback, and never a value Python's int() made up from '١' or '²'."""

import os

import pytest

from gpuvfio import numbers
from gpuvfio.address import PciAddress
from gpuvfio.errors import HostReadError, InputError
from gpuvfio.guest.expect import gates, parse_expect
from gpuvfio.guest.verify import VerifyError, parse_verifier
from gpuvfio.host.inventory import read_inventory
from gpuvfio.host.model import parse_cpulist
from gpuvfio.host.numa import read_numa
from gpuvfio.host.nvidia import nvidia_holders, running_services
from gpuvfio.host.root import HostRoot
from gpuvfio.sizes import parse_size_kib
from gpuvfio.strictjson import JsonRejected, strict_loads
from gpuvfio.testbed.stats import metric_problem, ratio_ci, summarize, welch_test
from tests.make_samples import sample_path
from tests.unit.test_verify import verifier_json

SUPERSCRIPT_TWO, ARABIC_ONE = "\u00b2", "\u0661"  # '²': isdigit() but int() fails; '١': int() takes it
NOT_NUMBERS = ["", " 1", "1 ", "+1", "-1", "1_000", "0x10", "1.0", SUPERSCRIPT_TWO, ARABIC_ONE, "1" + ARABIC_ONE,
               "\uff11",  # fullwidth '１': int() takes it too
               "9" * 400, "9" * 4300, "9" * 5000, "18446744073709551616"]  # 2**64: one past the u64 range


# --- the helper ------------------------------------------------------------------------------

@pytest.mark.parametrize("text", NOT_NUMBERS)
def test_uint_takes_ascii_digits_only(text):
    assert numbers.uint(text) is None
    with pytest.raises(InputError) as caught:
        numbers.parse_uint(text, "count")
    assert "\n" not in str(caught.value) and len(str(caught.value)) < 120


@pytest.mark.parametrize("text, value", [("0", 0), ("7", 7), ("007", 7), ("65535", 65535),
                                         ("18446744073709551615", 2**64 - 1)])
def test_uint_reads_plain_numbers(text, value):
    assert numbers.uint(text) == value == numbers.parse_uint(text, "count")


def test_uint_bounds():
    assert numbers.uint("255", 255) == 255 and numbers.uint("256", 255) is None
    assert numbers.uint("1234", digits=3) is None
    assert numbers.uint(7) is None and numbers.uint(None) is None  # text only
    with pytest.raises(InputError, match="from 1 to 65535"):
        numbers.parse_uint("0", "port", 65535, lower=1)
    with pytest.raises(HostReadError):
        numbers.parse_uint(SUPERSCRIPT_TWO, "cpu", error=HostReadError)


@pytest.mark.parametrize("text, value", [("10de", 0x10DE), ("0x10de", 0x10DE), ("0X030200", 0x030200),
                                         ("0x" + "f" * 16, 2**64 - 1), ("F", 15)])
def test_hex_uint(text, value):
    assert numbers.hex_uint(text) == value


@pytest.mark.parametrize("text", ["", "0x", "-1", "+f", " f", "f_f", "g", ARABIC_ONE + "0de",
                                  "0x" + "f" * 17, "f" * 400])
def test_hex_uint_refuses(text):
    assert numbers.hex_uint(text) is None


def test_decimal_and_finite():
    assert numbers.decimal("16.0", 1024) == 16.0 and numbers.decimal("2.5", 1024) == 2.5
    for text in ("nan", "inf", "1e3", "-1", "16.", ".5", ARABIC_ONE + "6", "9" * 400, "2000", ""):
        assert numbers.decimal(text, 1024) is None, text
    assert numbers.finite(1) and numbers.finite(-2.5) and numbers.finite(2**1000)
    for value in (10**400, -(10**400), float("nan"), float("inf"), True, "1", None):
        assert not numbers.finite(value), value


def test_shown_is_short():
    assert numbers.shown("9" * 400).startswith("'999") and len(numbers.shown("9" * 400)) <= 40
    assert numbers.shown(10**5000) == "an integer of more than 20 digits"  # repr() would raise


# --- host files ------------------------------------------------------------------------------

def _node_file(builder, name: str, text: str) -> None:
    path = builder.sys_path("devices", "system", "node", "node0", name)
    with open(path, "w", encoding="utf-8") as handle:
        handle.write(text + "\n")


@pytest.mark.parametrize("cpulist", ["0-" + SUPERSCRIPT_TWO, SUPERSCRIPT_TWO, "0-" + ARABIC_ONE, ARABIC_ONE + "-3",
                                     "0-\uff13", "0-" + "9" * 5000])
def test_a_damaged_cpulist_is_a_host_read_error(cpulist):
    with pytest.raises(HostReadError, match="malformed CPU list"):
        parse_cpulist(cpulist)


@pytest.mark.parametrize("command", ["topo", "doctor"])
def test_a_cpulist_of_superscripts_is_one_line_not_a_traceback(cli, workstation, command):
    _node_file(workstation, "cpulist", "0-" + SUPERSCRIPT_TWO)
    result = cli("--root", workstation.root, command)
    assert "Traceback" not in result.err
    if result.code == 2:  # the host tree is damaged: one line
        lines = result.err.strip().splitlines()
        assert len(lines) == 1 and lines[0].startswith("gpuvfio: error: ") and "malformed CPU list" in lines[0]
    else:  # or a check that says so
        assert result.code in (0, 1) and "malformed CPU list" in result.out + result.err


def test_hugepage_and_meminfo_numbers_are_ascii(workstation):
    _node_file(workstation, "meminfo", f"Node 0 MemTotal: {ARABIC_ONE * 3} kB\nNode 0 MemFree: {'9' * 400} kB")
    hp = workstation.sys_path("devices", "system", "node", "node0", "hugepages", "hugepages-2048kB")
    for name, text in (("nr_hugepages", ARABIC_ONE + "2"), ("free_hugepages", SUPERSCRIPT_TWO)):
        with open(os.path.join(hp, name), "w", encoding="utf-8") as handle:
            handle.write(text + "\n")
    os.mkdir(workstation.sys_path("devices", "system", "node", "node0", "hugepages", f"hugepages-{ARABIC_ONE}kB"))
    os.mkdir(workstation.sys_path("devices", "system", "node", f"node{ARABIC_ONE}"))
    (node,) = read_numa(HostRoot(workstation.root))
    assert node.node_id == 0
    assert node.mem_total_kb is None and node.mem_free_kb is None
    assert node.hugepages[2048] == (0, 0) and set(node.hugepages) == {2048, 1048576}


def test_pci_attributes_are_ascii(workstation):
    gpu = workstation.functions[PciAddress.parse("0000:01:00.0")]
    for name, text in (("numa_node", ARABIC_ONE), ("current_link_speed", "nan GT/s PCIe"),
                       ("current_link_width", SUPERSCRIPT_TWO), ("max_link_width", "9" * 4300)):
        with open(os.path.join(gpu.path, name), "w", encoding="utf-8") as handle:
            handle.write(text + "\n")
    fn = read_inventory(HostRoot(workstation.root)).functions[gpu.address]
    assert fn.numa_node is None
    assert fn.link.current_speed_gts is None and fn.link.current_width is None and fn.link.max_width is None
    with open(os.path.join(gpu.path, "uevent"), encoding="utf-8") as handle:
        uevent = handle.read()
    with open(os.path.join(gpu.path, "uevent"), "w", encoding="utf-8") as handle:
        handle.write(uevent.replace("PCI_ID=10DE", f"PCI_ID={ARABIC_ONE}0DE"))  # not used: the vendor is read
    with open(os.path.join(gpu.path, "vendor"), "w", encoding="utf-8") as handle:
        handle.write(f"0x{ARABIC_ONE}0de\n")  # int(..., 16) takes it
    with pytest.raises(HostReadError, match="malformed vendor"):
        read_inventory(HostRoot(workstation.root))


def test_a_proc_entry_of_superscripts_is_not_a_process(workstation):
    workstation.holder(1234, "nv-hostengine", ["/dev/nvidia0"])
    os.rename(workstation.proc("1234"), workstation.proc(SUPERSCRIPT_TWO))
    workstation.holder(77, "nv-hostengine", ["/dev/nvidia0"])
    host = HostRoot(workstation.root)
    assert [h.pid for h in nvidia_holders(host)] == [77]
    assert running_services(host) == {"nvidia-dcgm": [77]}


# --- user input ------------------------------------------------------------------------------

@pytest.mark.parametrize("memory", ["9" * 400, "9" * 400 + "G", "9" * 4300 + "K", "1." + "9" * 400 + "G",
                                    "9" * 5000, ARABIC_ONE + "6G", "\uff11\uff16G", "5000T"])
def test_xml_memory_of_400_digits_is_one_line(cli, memory):
    result = cli("--root", sample_path("workstation"), "xml", "0000:01:00.0", "--name", "x", "--memory", memory)
    assert result.code == 2, result.err
    lines = result.err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("gpuvfio: error: ") and len(lines[0]) < 200, result.err
    assert result.out == ""


def test_sizes_are_counted_exactly():
    """Whole KiB, counted exactly (a float rounded 1.0000000000000001G to 1G); what admins write
    reads as before."""
    with pytest.raises(InputError, match="not a whole number"):
        parse_size_kib("1.0000000000000001G")
    for text, kib in (("64G", 64 * 1024**2), ("64GiB", 64 * 1024**2), ("65536M", 65536 * 1024),
                      ("1.5G", 1536 * 1024), ("0.5", 512), ("4096T", 1 << 42), (" 2 m ", 2048)):
        assert parse_size_kib(text) == kib, text


def test_expect_counts_and_gates_are_ascii():
    with pytest.raises(InputError):
        parse_expect([f"10de:2330x{ARABIC_ONE}"])
    with pytest.raises(InputError, match="link efficiency"):
        gates(link_efficiency=10**400)
    with pytest.raises(InputError, match="minimum bandwidth"):
        gates(min_gbps=10**400)


# --- guests' and tools' JSON -----------------------------------------------------------------

@pytest.mark.parametrize("digits", [21, 400, 4300])
def test_strict_json_bounds_integers(digits):
    with pytest.raises(JsonRejected, match="digits"):
        strict_loads("1" * digits)
    with pytest.raises(JsonRejected, match="digits"):
        strict_loads('{"bytes": -' + "9" * digits + "}")
    assert strict_loads("[0, -0, 7, -12, 99999999999999999999, 1.5]") == [0, 0, 7, -12, 10**20 - 1, 1.5]


@pytest.mark.parametrize("digits", [400, 4300])
def test_a_huge_integer_from_the_verifier_is_a_verify_error(digits):
    text = verifier_json().replace('"median": 50.0', '"median": ' + "9" * digits, 1)
    assert text != verifier_json()
    with pytest.raises(VerifyError, match="digits"):
        parse_verifier(text)


# --- testbed results -------------------------------------------------------------------------

@pytest.mark.parametrize("value", [5e-324, 1e-320, 1e308 * 10, -1e308 * 10, float("nan"), 10**309, 10**400,
                                   -(10**400), 1e200, 1e80, 1e-300, True, "25"])
def test_stats_refuse_what_is_not_a_measurement(value):
    assert metric_problem(value)
    with pytest.raises(InputError) as caught:
        summarize([25.0, value, 26.0])
    assert "\n" not in str(caught.value) and len(str(caught.value)) < 200


def test_stats_take_measurements_and_stay_finite_at_the_bounds():
    """The extremes the rule lets through (and a mean that cancels to its last bit) give finite
    statistics or None, no OverflowError: the fourth powers stay inside the float range."""
    for value in (0, 0.0, 1e-12, 1e12, -3.5, 25, None):
        assert metric_problem(value) is None
        assert summarize([25.0, value, 26.0])["count"] == (2 if value is None else 3)
    samples = [[1e12, -1e12], [1e12, 1e12 * (1 - 2**-52)], [1e12, 1e-12], [1e-12, -1e-12 * (1 + 2**-52)],
               [1e12 * (1 - 2**-52), -1e12], [1e-12, 1e-12, -2e-12 * (1 + 2**-52)], [0.0, 1e-12, 1e12]]
    for a in samples:
        for b in samples:
            sa, sb = summarize(a), summarize(b)
            test, ratio = welch_test(sa, sb), ratio_ci(sa, sb)
            for value in [test["p"], test["t"], test["df"], *(ratio or []), *(sa["ci95"] or [])]:
                assert value is None or value == value and abs(value) < float("inf"), (a, b)


@pytest.mark.parametrize("value", ["5e-324", "1e-320", "1" + "0" * 400])
def test_testbed_report_refuses_a_denormal_or_huge_result_in_one_line(cli, tmp_path, value):
    out = tmp_path / "out"
    rep = out / "results" / "pt"
    rep.mkdir(parents=True)
    (rep / "rep-0.json").write_text('{"variant": "pt", "kind": "passthrough", "metrics": {"h2d_gbps": 25.0}}')
    (rep / "rep-1.json").write_text('{"variant": "pt", "kind": "passthrough", "metrics": {"h2d_gbps": %s}}' % value)
    result = cli("testbed", "report", str(out))
    assert result.code == 2, (result.code, result.err)
    lines = result.err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("gpuvfio: error: ") and "Traceback" not in result.err
    assert sorted(p.name for p in out.iterdir()) == ["results"]  # no report from a damaged result
