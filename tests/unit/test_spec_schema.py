"""The published JSON Schema of the testbed spec (docs/testbed-spec.schema.json) and gpuvfio's own
validator (gpuvfio/testbed/spec.py) give the same answer on every spec here: the base one, and
one mutation per rule (issue 15 item 3). What a schema cannot say (unique variant names, a size
that is no whole number of KiB) is listed apart, validator-only."""

from __future__ import annotations

import json
import os

import pytest

from gpuvfio.errors import InputError
from gpuvfio.testbed.spec import load_spec

try:
    import tomllib
except ImportError:  # Python 3.10
    import tomli as tomllib

jsonschema = pytest.importorskip("jsonschema")

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
with open(os.path.join(REPO, "docs", "testbed-spec.schema.json"), encoding="utf-8") as _handle:
    SCHEMA = json.load(_handle)

BASE = """
[guest]
kernel = "/var/lib/gpuvfio/vmlinux"
initrd = "/var/lib/gpuvfio/initrd.img"
cmdline = "console=ttyS0"
vcpus = 8
memory = "32G"
[guest.ssh]
user = "root"
key = "/root/.ssh/testbed"
known_hosts = "/root/.ssh/known_hosts"
port = 2222
boot_timeout = 300

[run]
repetitions = 3
gpus = ["0000:1b:00.0"]
connect = "qemu:///system"
size_mib = 512
link_efficiency = 0.762

[[variant]]
name = "passthrough-1g"
kind = "passthrough"
hugepages = "1G"
numa = "auto"

[[variant]]
name = "vgpu-a10-4q"
kind = "vgpu"
profile = "NVIDIA A10-4Q"
scheduler = "equal-share"
"""

HOST = """
[host]
address = "hv1.example.org"
user = "root"
known_hosts = "/root/.ssh/known_hosts"
gpuvfio = ["gpuvfio"]
"""

# (name, old text, new text): one rule each.
MUTATIONS = [
    ("unknown section", "[run]", "[runs]"),
    ("unknown guest key", 'cmdline = "console=ttyS0"', 'cmdline = "console=ttyS0"\ncolor = "blue"'),
    ("no kernel or disk", 'kernel = "/var/lib/gpuvfio/vmlinux"\n', ""),
    ("disk instead of kernel", 'kernel = "/var/lib/gpuvfio/vmlinux"', 'disk = "/var/lib/libvirt/images/g.qcow2"'),
    ("relative kernel", '"/var/lib/gpuvfio/vmlinux"', '"vmlinux"'),
    ("vcpus zero", "vcpus = 8", "vcpus = 0"),
    ("vcpus huge", "vcpus = 8", "vcpus = 5000"),
    ("vcpus a string", "vcpus = 8", 'vcpus = "8"'),
    ("memory a word", 'memory = "32G"', 'memory = "lots"'),
    ("memory in MiB", 'memory = "32G"', 'memory = "32768M"'),
    ("memory a bare number", 'memory = "32G"', "memory = 32768"),
    ("no ssh port or host", "port = 2222\n", ""),
    ("ssh host instead", "port = 2222", 'host = "10.0.0.5"'),
    ("ssh port 0", "port = 2222", "port = 0"),
    ("ssh port a bool", "port = 2222", "port = true"),
    ("unknown ssh key", "boot_timeout = 300", "boot_timeout = 300\npassword = \"x\""),
    ("relative known_hosts", 'known_hosts = "/root/.ssh/known_hosts"\nport', 'known_hosts = "known_hosts"\nport'),
    ("boot timeout zero", "boot_timeout = 300", "boot_timeout = 0"),
    ("boot timeout a float", "boot_timeout = 300", "boot_timeout = 12.5"),
    ("tofu not a bool", "boot_timeout = 300", "boot_timeout = 300\ntrust_on_first_use = \"yes\""),
    ("repetitions zero", "repetitions = 3", "repetitions = 0"),
    ("gpus not a list", 'gpus = ["0000:1b:00.0"]', 'gpus = "0000:1b:00.0"'),
    ("gpu a slot", 'gpus = ["0000:1b:00.0"]', 'gpus = ["1b:00"]'),
    ("gpu short address", 'gpus = ["0000:1b:00.0"]', 'gpus = ["1b:00.0"]'),
    ("gpu a node-device name", 'gpus = ["0000:1b:00.0"]', 'gpus = ["pci_0000_1b_00_0"]'),
    ("gpu a node-device name without function", 'gpus = ["0000:1b:00.0"]', 'gpus = ["pci_0000_1b_00"]'),
    ("gpu function out of range", 'gpus = ["0000:1b:00.0"]', 'gpus = ["1b:00.8"]'),
    ("gpu not an address", 'gpus = ["0000:1b:00.0"]', 'gpus = ["gpu0"]'),
    ("gpu slot out of range", 'gpus = ["0000:1b:00.0"]', 'gpus = ["0000:1b:20.0"]'),
    ("gpu_ids", 'gpus = ["0000:1b:00.0"]', 'gpu_ids = ["10de:2330"]'),
    ("gpu_ids with wildcards and class", 'gpus = ["0000:1b:00.0"]', 'gpu_ids = ["10de::03xx"]'),
    ("gpu_ids a bare colon", 'gpus = ["0000:1b:00.0"]', 'gpu_ids = [":"]'),
    ("gpu_ids five digits", 'gpus = ["0000:1b:00.0"]', 'gpu_ids = ["10de0:"]'),
    ("gpu_ids without a colon", 'gpus = ["0000:1b:00.0"]', 'gpu_ids = ["10de"]'),
    ("gpu_ids empty with vgpu", 'gpus = ["0000:1b:00.0"]', 'gpu_ids = []'),
    ("rom_bar off", 'memory = "32G"', 'memory = "32G"\nrom_bar = "off"'),
    ("rom_bar yes", 'memory = "32G"', 'memory = "32G"\nrom_bar = "yes"'),
    ("rom_file relative", 'memory = "32G"', 'memory = "32G"\nrom_file = "clean.rom"'),
    ("loader with nvram template", 'memory = "32G"', 'memory = "32G"\nloader = "/usr/share/OVMF/OVMF_CODE.fd"\n'
                                                      'nvram_template = "/usr/share/OVMF/OVMF_VARS.fd"'),
    ("rom_bar off with rom_file", 'memory = "32G"', 'memory = "32G"\nrom_bar = "off"\nrom_file = "/var/lib/clean.rom"'),
    ("rom_bar on with rom_file", 'memory = "32G"', 'memory = "32G"\nrom_bar = "on"\nrom_file = "/var/lib/clean.rom"'),
    ("loader with bios", 'memory = "32G"', 'memory = "32G"\nfirmware = "bios"\nloader = "/a.fd"\nnvram_template = "/b.fd"'),
    ("firmware uefi", 'memory = "32G"', 'memory = "32G"\nfirmware = "uefi"'),
    ("virt_type xen", 'memory = "32G"', 'memory = "32G"\nvirt_type = "xen"'),
    ("network with a slash", 'memory = "32G"', 'memory = "32G"\nnetwork = "a/b"'),
    ("network empty", 'memory = "32G"', 'memory = "32G"\nnetwork = ""'),
    ("cmdline two lines", 'cmdline = "console=ttyS0"', 'cmdline = "console=ttyS0\\nquiet"'),
    ("disk and kernel", 'memory = "32G"', 'memory = "32G"\ndisk = "/var/lib/g.qcow2"'),
    ("disk with initrd", 'kernel = "/var/lib/gpuvfio/vmlinux"\ninitrd', 'disk = "/g.qcow2"\ninitrd'),
    ("loader alone", 'memory = "32G"', 'memory = "32G"\nloader = "/usr/share/OVMF/OVMF_CODE.fd"'),
    ("connect empty", 'connect = "qemu:///system"', 'connect = ""'),
    ("size_mib too big", "size_mib = 512", "size_mib = 70000"),
    ("link efficiency above 1", "link_efficiency = 0.762", "link_efficiency = 1.5"),
    ("min_gbps", "link_efficiency = 0.762", "min_gbps = 40.0"),
    ("unknown run key", "size_mib = 512", "size_mib = 512\nwarmup = 3"),
    ("stop_services not a bool", "size_mib = 512", "size_mib = 512\nstop_services = 1"),
    ("variant name with a slash", 'name = "passthrough-1g"', 'name = "pass/through"'),
    ("variant name too long", 'name = "passthrough-1g"', 'name = "' + "p" * 42 + '"'),
    ("unknown kind", 'kind = "passthrough"', 'kind = "sriov"'),
    ("hugepages 2MiB", 'hugepages = "1G"', 'hugepages = "2MiB"'),
    ("hugepages 3M", 'hugepages = "1G"', 'hugepages = "3M"'),
    ("hugepages a number", 'hugepages = "1G"', "hugepages = 2"),
    ("numa a node number", 'numa = "auto"', "numa = 1"),
    ("numa a node string", 'numa = "auto"', 'numa = "3"'),
    ("numa REMOTE", 'numa = "auto"', 'numa = "REMOTE"'),
    ("numa too high", 'numa = "auto"', "numa = 5000"),
    ("numa a word", 'numa = "auto"', 'numa = "near"'),
    ("profile on passthrough", 'numa = "auto"', 'numa = "auto"\nprofile = "x"'),
    ("scheduler on passthrough", 'numa = "auto"', 'numa = "auto"\nscheduler = "equal-share"'),
    ("vgpu without profile", 'profile = "NVIDIA A10-4Q"\n', ""),
    ("blank profile", 'profile = "NVIDIA A10-4Q"', 'profile = "   "'),
    ("unknown scheduler", 'scheduler = "equal-share"', 'scheduler = "round-robin"'),
    ("scheduler a table", 'scheduler = "equal-share"', "scheduler = {}"),  # was a TypeError traceback
    ("scheduler a list", 'scheduler = "equal-share"', 'scheduler = ["equal-share"]'),
    ("unknown variant key", 'scheduler = "equal-share"', 'scheduler = "equal-share"\nmig = true'),
    ("vgpu without run gpus", 'gpus = ["0000:1b:00.0"]\n', ""),
    ("no variants", BASE[BASE.index("[[variant]]"):], ""),
]
HOST_MUTATIONS = [
    ("host as given", "", ""),
    ("host without known_hosts or tofu", 'known_hosts = "/root/.ssh/known_hosts"\ngpuvfio', "gpuvfio"),
    ("host with tofu", 'known_hosts = "/root/.ssh/known_hosts"\ngpuvfio', "trust_on_first_use = true\ngpuvfio"),
    ("host tofu false", 'known_hosts = "/root/.ssh/known_hosts"\ngpuvfio', "trust_on_first_use = false\ngpuvfio"),
    ("host address bad", 'address = "hv1.example.org"', 'address = "hv1 example"'),
    ("host address IPv6 in brackets", 'address = "hv1.example.org"', 'address = "[::1]"'),
    ("host user bad", 'user = "root"', 'user = "Root"'),
    ("host gpuvfio empty", 'gpuvfio = ["gpuvfio"]', "gpuvfio = []"),
    ("host gpuvfio a string", 'gpuvfio = ["gpuvfio"]', 'gpuvfio = "gpuvfio"'),
    ("host port out of range", 'user = "root"', 'user = "root"\nport = 70000'),
    ("host relative workdir", 'user = "root"', 'user = "root"\nworkdir = "tmp"'),
    ("host ssh_config", 'user = "root"', 'user = "root"\nssh_config = "/root/.ssh/config"'),
    ("host relative ssh_config", 'user = "root"', 'user = "root"\nssh_config = "config"'),
]
VALIDATOR_ONLY = [
    ("duplicate variant names", 'name = "vgpu-a10-4q"', 'name = "passthrough-1g"'),
    ("memory not whole KiB", 'memory = "32G"', 'memory = "0.1K"'),
]


def answers(text: str, tmp_path) -> tuple[bool, bool]:
    """(gpuvfio's validator accepts it, the schema accepts it)."""
    path = tmp_path / "spec.toml"
    path.write_text(text)
    try:
        load_spec(str(path))
        ours = True
    except InputError:
        ours = False
    try:
        data = tomllib.loads(text)
    except tomllib.TOMLDecodeError:
        return ours, False
    return ours, jsonschema.Draft202012Validator(SCHEMA).is_valid(data)


def test_the_schema_is_a_valid_draft_2020_12_schema():
    jsonschema.Draft202012Validator.check_schema(SCHEMA)


@pytest.mark.parametrize("name, old, new", [("base", "", "")] + MUTATIONS, ids=lambda v: v if isinstance(v, str)
                         and len(v) < 40 and "\n" not in v else None)
def test_the_schema_and_the_validator_agree(tmp_path, name, old, new):
    assert old in BASE
    ours, schema = answers(BASE.replace(old, new, 1) if old else BASE, tmp_path)
    assert ours == schema, (name, ours, schema)


@pytest.mark.parametrize("name, old, new", HOST_MUTATIONS, ids=[m[0] for m in HOST_MUTATIONS])
def test_the_schema_and_the_validator_agree_on_the_host_section(tmp_path, name, old, new):
    host = HOST.replace(old, new, 1) if old else HOST
    ours, schema = answers(BASE + host, tmp_path)
    assert ours == schema, (name, ours, schema)


def test_the_corpus_holds_both_answers(tmp_path):
    """A corpus where everything passes (or fails) would prove nothing."""
    results = [answers(BASE.replace(old, new, 1), tmp_path)[0] for _n, old, new in MUTATIONS]
    assert 10 <= results.count(True) and 30 <= results.count(False)


@pytest.mark.parametrize("name, old, new", VALIDATOR_ONLY, ids=[m[0] for m in VALIDATOR_ONLY])
def test_what_only_the_validator_can_say(tmp_path, name, old, new):
    ours, schema = answers(BASE.replace(old, new, 1), tmp_path)
    assert ours is False and schema is True, name
