"""The edges of the plugin's names (gpuvfio/ops/kubevirt_names.py) that mutation testing found
untested: bufio.Scanner's line ends, bytes that are not UTF-8, the bundled table's own reader,
the first header line winning, and Kubernetes' rule for an extended resource name
(apimachinery IsQualifiedName, v1.31)."""

from __future__ import annotations

import pytest

from gpuvfio.errors import InputError
from gpuvfio.ops.kubevirt_names import (PLUGIN, SCAN_TOKEN_LIMIT, PluginNames, device_name, from_pci_ids,
                                        nvidia_device_lines, parse_table, pci_ids_header, repaired, scan_lines,
                                        valid_resource_name, vgpu_key)


def test_scan_lines_splits_as_bufio_scanner_does():
    assert list(scan_lines(b"a\n")) == [b"a"]  # no empty token after the last newline
    assert list(scan_lines(b"a\nbc")) == [b"a", b"bc"]  # the last line without its newline, whole
    assert list(scan_lines(b"\nab")) == [b"", b"ab"]  # an empty first line
    assert list(scan_lines(b"a\r\nb\r")) == [b"a", b"b"]  # one CR dropped, at EOF too
    assert list(scan_lines(b"a\r\r\n")) == [b"a\r"]  # only one


def test_scan_stops_at_a_line_of_the_token_limit_not_one_byte_short():
    short = b"x" * (SCAN_TOKEN_LIMIT - 1)
    assert list(scan_lines(short + b"\nb")) == [short, b"b"]
    assert list(scan_lines(b"a\n" + b"x" * SCAN_TOKEN_LIMIT + b"\nb")) == [b"a"]  # ErrTooLong


def test_bytes_that_are_not_utf8_are_replaced_not_fatal():
    data = b"# Version: 2024.01.01\xff\n10de  NVIDIA\n\t2330  GH100 \xff[H100]\n"
    assert device_name(data, "2330") == "GH100_H100"  # U+FFFD is outside [a-zA-Z0-9_.]
    assert nvidia_device_lines(data) == {"2330": "GH100_H100"}
    assert pci_ids_header(data) == ("2024.01.01\ufffd", None)


def test_a_key_that_is_not_utf8_names_nothing():
    data = b"10de  NVIDIA\n\t2330  GH100\n"
    assert device_name(data, "\udcff23") == ""  # a sysfs name read with surrogateescape


def test_a_short_key_at_the_end_of_the_file_names_nothing():
    # the NVIDIA block is the file's last: no next vendor line ends the scan
    assert device_name(b"10de  NVIDIA\n\t2330  GH100\n", "99") == ""


def test_a_device_line_of_go_spaces_only_is_refused_but_python_spaces_are_a_name():
    with pytest.raises(InputError, match="not a pci.ids device line"):
        nvidia_device_lines(b"10de  NVIDIA\n\t2330  \xc2\x85\n")  # U+0085: unicode.IsSpace
    with pytest.raises(InputError, match="not a pci.ids device line"):
        nvidia_device_lines(b"10de  NVIDIA\n\t2330 X\n")  # one space
    # U+001C is space to Python's str.strip, not to Go's TrimSpace: the line has a name
    assert nvidia_device_lines(b"10de  NVIDIA\n\t2330  \x1c\n") == {"2330": ""}
    with pytest.raises(InputError, match="no NVIDIA"):
        nvidia_device_lines(b"8086  Intel\n")


def test_the_first_version_line_wins():
    assert pci_ids_header(b"# Version: 1\n# Version: 2\n# Date: d1\n# Date: d2\n10de  NVIDIA\n") == ("1", "d1")


TABLE = ("# a comment\n# plugin: P v9\n# pci.ids-version: 2024.01.01\n# pci.ids-date: 2024-01-01 03:15:02\n"
         "1db4\tGV100GL_TESLA_V100\n2330\tGH100_H100\n# trailing comment\n2331\t\n")


def test_the_bundled_table_is_read_whole():
    names = parse_table(TABLE)
    assert names.table == {"1db4": "GV100GL_TESLA_V100", "2330": "GH100_H100", "2331": ""}
    assert (names.source, names.version, names.date) == ("P v9's bundled pci.ids", "2024.01.01",
                                                         "2024-01-01 03:15:02")
    assert parse_table("2330\tX\n").source == f"{PLUGIN}'s bundled pci.ids"
    assert (parse_table("2330\tX\n").version, parse_table("2330\tX\n").date) == (None, None)


def test_a_short_key_is_named_as_the_scan_would():
    names = parse_table(TABLE)
    assert names.name("1") == "DB4_GV100GL_TESLA_V100"  # the rest of the id, upper-cased, then the name
    assert names.name("ff") == "" and names.name("2331") == ""


def test_from_pci_ids_keeps_the_header_and_names_a_missing_file(tmp_path):
    path = tmp_path / "pci.ids"
    path.write_bytes(b"# Version: 2025.02.02\n# Date: 2025-02-02\n10de  NVIDIA\n\t2330  GH100\n")
    names = from_pci_ids(str(path))
    assert (names.version, names.date, names.name("2330")) == ("2025.02.02", "2025-02-02", "GH100")
    with pytest.raises(InputError, match="no such file: .*absent"):
        from_pci_ids(str(tmp_path / "absent"))


def test_from_pci_ids_reads_a_file_of_more_than_a_mebibyte(tmp_path):
    path = tmp_path / "pci.ids"  # pci.ids was 1.4 MB in 2024
    path.write_bytes(b"# Version: 3\n" + b"# padding\n" * 200_000 + b"10de  NVIDIA\n\t2330  GH100\n")
    assert from_pci_ids(str(path)).name("2330") == "GH100"


def test_vgpu_key_trims_newlines_only():
    assert vgpu_key(" GRID A100-4C\n\n") == "_GRID_A100-4C"  # Go: strings.Trim(s, "\n"), then \s+ -> _
    assert vgpu_key("X-1Q\n") == "X-1Q"


@pytest.mark.parametrize("resource, valid", [
    ("nvidia.com/GRID_T4-1Q", True),
    ("nvidia.com/" + "A" * 63, True),
    ("nvidia.com/" + "A" * 64, False),
    ("nvidia.com/GRID_A100/4C", False),  # IsQualifiedName: one "/" at most
    ("GRID_T4-1Q", False),  # no "/": a native resource
    ("/GRID", False),  # an empty prefix
    ("NVIDIA.com/GRID", False),  # the prefix is a DNS-1123 subdomain: lower case
    ("kubernetes.io/gpu", False),
    ("requests.nvidia.com/gpu", False),
    ("nvidia.com/-GRID", False),
    # IsDNS1123Subdomain: "requests." + the prefix, 253 characters at most
    (".".join(["a" * 63, "b" * 63, "c" * 63, "d" * 52]) + "/gpu", True),
    (".".join(["a" * 63, "b" * 63, "c" * 63, "d" * 53]) + "/gpu", False),
])
def test_extended_resource_names_follow_kubernetes(resource, valid):
    assert valid_resource_name(resource) is valid


def test_repaired_keeps_what_kubernetes_takes():
    assert repaired("abc") == "abc"
    assert repaired("-a b.c_d-") == "ab.c_d"
    assert repaired("GRID A100/4C") == "GRIDA1004C"


def test_plugin_names_from_a_table_is_a_value():
    names = PluginNames(source="s", version=None, date=None, table={"2330": "X"})
    assert names.resource("2330") == "nvidia.com/X" and names.resource("2331") == "nvidia.com/2331"
