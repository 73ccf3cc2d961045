"""The testbed spec: one TOML file, validated with line-precise errors.

    [guest]                      # the guest template every variant shares
    kernel = "/var/lib/gpuvfio/vmlinux"   # or disk = "/var/lib/libvirt/images/g.qcow2"
    initrd = "/var/lib/gpuvfio/initrd.img"
    cmdline = "console=ttyS0"
    vcpus = 8
    memory = "32G"
    virt_type = "kvm"            # qemu for hosts without KVM
    firmware = "efi"             # libvirt picks the UEFI build (or loader + nvram_template by path)
    rom_bar = "off"              # optional: on | off, the GPUs' ROM BAR (or rom_file = "/path/clean.rom")
    topology = "auto"            # auto | mirror | flat; p2p = "auto" | "off"; hide_kvm = false
    console_log = "/var/log/gpuvfio-guest.log"   # optional: the serial console, also on the host
    [guest.ssh]
    user = "root"
    key = "/root/.ssh/testbed"
    known_hosts = "/root/.ssh/known_hosts"   # or trust_on_first_use = true
    port = 2222                  # QEMU user-net forward (127.0.0.1:port -> guest:22)
    boot_timeout = 300           # seconds from start until the guest must answer SSH

    [host]                       # optional: a remote hypervisor, driven over SSH
    address = "hv1.example.org"
    port = 22
    user = "root"
    key = "/root/.ssh/hv1"
    known_hosts = "/root/.ssh/known_hosts"   # or trust_on_first_use = true
    gpuvfio = ["gpuvfio"]        # how to run gpuvfio there (an argument list)
    root = "/"                   # --root for the remote gpuvfio (a fixture file for dry plans)
    ssh_config = "/root/.ssh/config"  # optional: an ssh_config instead of ~/.ssh/config (aliases, ProxyJump)
    workdir = "/var/tmp"         # where the run's scratch directory is made

    [run]
    repetitions = 3
    gpus = ["0000:1b:00.0"]      # device arguments: 1b:00 (every function), pci_0000_1b_00_0
    gpu_ids = ["10de:2330"]      # lspci -d ids (with gpus: what both select); beyond one device: run --yes
    connect = "qemu:///system"
    stop_services = false        # stop nvidia-persistenced/fabricmanager/DCGM for the binds (restore
                                 # restarts them); a Fabric Manager in shared-NVSwitch mode keeps running
    force = false                # bind groups with a foreign device / the console GPU anyway
    size_mib = 512               # the verifier's copy buffer, copies per sample, samples (nvbandwidth's)
    copies = 16
    samples = 3
    # min_gbps = 40.0            # bandwidth gate per direction (or link_efficiency = 0.75, a share of
                                 # the raw rate); default: 90% of what healthy cards of the slot's
                                 # generation measure

    [[variant]]
    name = "passthrough-1g"
    kind = "passthrough"         # passthrough | vgpu | baremetal
    hugepages = "1G"             # auto | 1G | 2M | none
    numa = "auto"                # auto | none | remote | N
    stop_services = true         # per variant, overrides [run]

    [[variant]]
    name = "vgpu-a10-4q"
    kind = "vgpu"
    profile = "NVIDIA A10-4Q"    # an mdev type, or an SR-IOV vGPU type (MIG-backed: "NVIDIA A100-3-20C")
    scheduler = "equal-share"    # best-effort | equal-share | fixed-share: set for the variant, put back after
"""

from __future__ import annotations

import dataclasses
import re
from dataclasses import dataclass, field

try:
    import tomllib
except ImportError:  # Python 3.10
    import tomli as tomllib

from gpuvfio.errors import InputError
from gpuvfio.numbers import shown
from gpuvfio.user_files import read_regular
from gpuvfio.guest.ssh import SshTarget  # paramiko itself is imported only when a session connects
from gpuvfio.ops.uris import check_uri
from gpuvfio.ops.domains import domain_request, parse_hugepages, parse_numa
from gpuvfio.ops.targets import valid_host
from gpuvfio.ops.vgpu import POLICIES
from gpuvfio.options import DOMAIN, RUN, SSH, USER, VERIFY, Option, OptionError, checked
from gpuvfio.selector import IdFilter, Selector
from gpuvfio.sizes import parse_size_kib

KINDS = ("passthrough", "vgpu", "baremetal")
_TABLE = re.compile(r"^\s*(\[\[?)\s*([A-Za-z0-9_.\-]+)\s*\]\]?\s*(#.*)?$")
_KEY = re.compile(r"^\s*([A-Za-z0-9_\-]+)\s*=")
NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]{0,40}")  # variant names: also directory names


@dataclass
class Variant:
    name: str
    kind: str
    hugepages: str = "auto"
    numa: str = "auto"
    profile: str | None = None
    scheduler: str | None = None
    stop_services: bool = False
    force: bool = False
    take_host_devices: bool = False


@dataclass
class Spec:
    path: str
    guest: dict
    ssh: dict
    repetitions: int
    gpus: list[str]  # device selectors (gpuvfio.selector), expanded on the hypervisor
    connect: str | None
    variants: list[Variant] = field(default_factory=list)
    gpu_ids: list[str] = field(default_factory=list)  # lspci -d filters
    host: RemoteHost | None = None
    verify: dict = field(default_factory=dict)  # [run] size_mib, copies, samples, link_efficiency, min_gbps
    stop_timeout: float = RUN["stop_timeout"].default  # [run]: each guest's ACPI shutdown, then destroyed


@dataclass
class RemoteHost:
    """The [host] section: a hypervisor reached over SSH where gpuvfio itself runs."""

    ssh: SshTarget
    gpuvfio: list[str] = field(default_factory=lambda: ["gpuvfio"])
    root: str | None = None
    workdir: str = "/var/tmp"
    ssh_config: str | None = None  # an ssh_config file instead of ~/.ssh/config
    given: frozenset = frozenset()  # "port", "user": set in the spec, so the SSH config does not change them

    def label(self) -> str:
        return f"{self.ssh.user}@{self.ssh.host}" + (f":{self.ssh.port}" if self.ssh.port != 22 else "")


class _Lines:
    """Where each (table, index, key) sits in the file, for error messages."""

    def __init__(self, text: str) -> None:
        self.where: dict[tuple[str, int, str | None], int] = {}
        counts: dict[str, int] = {}
        table, index = "", 0
        for number, line in enumerate(text.splitlines(), start=1):
            match = _TABLE.match(line)
            if match:
                table = match.group(2)
                if match.group(1) == "[[":
                    index = counts.get(table, 0)
                    counts[table] = index + 1
                else:
                    index = 0
                self.where.setdefault((table, index, None), number)
                continue
            match = _KEY.match(line)
            if match:
                self.where.setdefault((table, index, match.group(1)), number)

    def line(self, table: str, index: int = 0, key: str | None = None) -> int | None:
        return self.where.get((table, index, key)) or self.where.get((table, index, None))


SPEC_LIMIT = 1 << 20  # a spec of hundreds of variants is a few dozen KiB
MAX_VARIANTS = 256  # a plan per variant: 10,000 took 15 minutes to plan; past this, split the comparison


def load_spec(path: str) -> Spec:
    text = _spec_text(path)
    data = _parse_toml(path, text)
    reader = _SpecReader(path, _Lines(text))
    unknown = set(data) - {"guest", "run", "variant", "host"}
    if unknown:
        reader.fail(f"unknown section(s): {', '.join(sorted(unknown))}", sorted(unknown)[0])
    guest, ssh = reader.guest(data.get("guest"))
    run = reader.run(data.get("run", {}))
    gpus, gpu_ids = run.get("gpus", RUN["gpus"].default), run.get("gpu_ids", RUN["gpu_ids"].default)
    variants = reader.variants(data.get("variant"), run, bool(gpus or gpu_ids))
    verify = {o.name: run[o.name] for o in VERIFY.in_section("run") if o.name in run}
    return Spec(path=path, guest=guest, ssh=ssh, repetitions=run.get("repetitions", RUN["repetitions"].default),
                gpus=gpus, connect=run.get("connect"), variants=variants,
                host=_remote_host(data.get("host"), reader.fail), verify=verify, gpu_ids=gpu_ids,
                stop_timeout=float(run.get("stop_timeout", RUN["stop_timeout"].default)))


def _spec_text(path: str) -> str:
    raw = read_regular(path, SPEC_LIMIT)  # a regular file: no FIFO waited on, no /dev/zero read whole
    if raw is None:
        raise InputError(f"cannot read testbed spec {path}: no such file")
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError:
        raise InputError(f"{path}: not UTF-8 text (TOML is UTF-8)") from None


def _parse_toml(path: str, text: str) -> dict:
    try:
        return tomllib.loads(text)
    except tomllib.TOMLDecodeError as exc:
        raise InputError(f"{path}: not valid TOML: {exc}") from None
    except RecursionError:  # tomllib recurses per nested array or inline table
        raise InputError(f"{path}: nested too deeply") from None
    except ValueError:  # int() past Python's digit limit (sys.int_info.default_max_str_digits)
        raise InputError(f"{path}: a number with more digits than any setting takes") from None


class _SpecReader:
    """A spec's tables checked one by one; every refusal names the file and the line."""

    def __init__(self, path: str, lines: "_Lines") -> None:
        self.path, self.lines = path, lines

    def fail(self, message: str, table: str = "", index: int = 0, key: str | None = None):
        number = self.lines.line(table, index, key)
        raise InputError(f"{self.path}:{number}: {message}" if number else f"{self.path}: {message}")

    def boolean(self, table: str, index: int, raw: dict, key: str, default: bool) -> bool:
        value = raw.get(key, default)
        if not isinstance(value, bool):
            self.fail(f"{key} must be true or false, not {shown(value)}", table, index, key)
        return value

    def section(self, table: str, raw: dict, declared: tuple[Option, ...], extra: set[str], label: str = "") -> None:
        """Only the keys gpuvfio.options declares for ``table`` (and ``extra``), each of its shape."""
        allowed = {o.spec_key for o in declared} | extra
        for key in raw:
            if key not in allowed:
                self.fail(f"unknown key {shown(key)} in [{table}] (allowed: {', '.join(sorted(allowed))})", table, 0,
                          key)
        for option in declared:
            if option.spec_key in raw and option.name != "memory":  # memory: a size, parsed below
                try:
                    checked(in_a_spec(option), raw[option.spec_key])
                except OptionError as exc:
                    self.fail(exc.spelled(lambda _name, key=option.spec_key: label + key), table, 0, option.spec_key)

    def guest(self, guest) -> tuple[dict, dict]:
        """[guest] and [guest.ssh], checked as the run's domain request takes them."""
        if not isinstance(guest, dict):
            self.fail("missing [guest] section")
        self.section("guest", guest, DOMAIN.in_section("guest"), {"ssh"})
        if not guest.get("kernel") and not guest.get("disk"):
            self.fail("[guest] needs kernel (+ initrd) or disk", "guest")
        if "memory" in guest:
            try:
                parse_size_kib(str(guest["memory"]) if not isinstance(guest["memory"], bool) else "")
            except InputError as exc:
                self.fail(str(exc), "guest", 0, "memory")
        ssh = guest.get("ssh", {})
        if not isinstance(ssh, dict) or "port" not in ssh and "host" not in ssh:
            self.fail("[guest.ssh] needs port (user-net forward) or host", "guest.ssh")
        self.section("guest.ssh", ssh, SSH.in_section("guest.ssh"), set(), "ssh ")
        try:  # what the run asks libvirt for, validated now (not after the first variant ran)
            domain_request("gpuvfio-tb-spec", **guest_request_args(guest, ssh))
        except InputError as exc:
            self.fail(f"[guest]: {in_spec_words(exc)}", "guest")
        return guest, ssh

    def run(self, run) -> dict:
        """[run]: its keys, its device selectors and its libvirt URI."""
        if not isinstance(run, dict):
            self.fail("[run] must be a table", "run")
        self.section("run", run, RUN.in_section("run") + VERIFY.in_section("run"), set())
        gpus, gpu_ids = run.get("gpus", RUN["gpus"].default), run.get("gpu_ids", RUN["gpu_ids"].default)
        for key, values, parse in (("gpus", gpus, Selector.parse), ("gpu_ids", gpu_ids, IdFilter.parse)):
            for value in values:
                try:
                    parse(value)
                except InputError as exc:
                    self.fail(str(exc), "run", 0, key)
        if "connect" in run:  # even a plan opens it, and libvirt may run programs a URI names
            try:
                check_uri(run["connect"], source="connect")
            except InputError as exc:
                self.fail(str(exc), "run", 0, "connect")
        return run

    def variants(self, variants_raw, run: dict, devices_chosen: bool) -> list["Variant"]:
        if not isinstance(variants_raw, list) or not variants_raw:
            self.fail("no [[variant]] tables: a testbed compares at least one variant")
        if len(variants_raw) > MAX_VARIANTS:
            self.fail(f"{len(variants_raw)} [[variant]] tables: a testbed compares at most {MAX_VARIANTS} (each is a "
                      "guest provisioned, measured and torn down; split the comparison into several specs)")
        names: set[str] = set()
        return [self.variant(index, raw, run, devices_chosen, names) for index, raw in enumerate(variants_raw)]

    def variant(self, index: int, raw, run: dict, devices_chosen: bool, names: set[str]) -> "Variant":
        """One [[variant]]; its name joins ``names`` (the earlier variants')."""
        if not isinstance(raw, dict):
            self.fail("each [[variant]] must be a table", "variant", index)
        name = raw.get("name")
        if not isinstance(name, str) or not NAME.fullmatch(name):
            self.fail("variant name must be 1-41 letters, digits, '.', '_' or '-'", "variant", index, "name")
        if name in names:
            self.fail(f"duplicate variant name {name!r}", "variant", index, "name")
        names.add(name)
        kind = raw.get("kind")
        if kind not in KINDS:
            self.fail(f"variant kind must be one of {', '.join(KINDS)}, not {shown(kind)}", "variant", index, "kind")
        extra = set(raw) - {"name", "kind", "profile", "scheduler"} - VARIANT_KEYS
        if extra:
            keys = ", ".join(shown(k) for k in sorted(extra)[:8])
            self.fail(f"unknown key(s) {keys} in variant {name}", "variant", index, sorted(extra)[0])
        hugepages, numa = self.pages_and_numa(index, raw)
        profile, scheduler = self.vgpu_keys(index, raw, name, kind, devices_chosen)
        flags = [self.boolean("variant", index, raw, key, run.get(key, RUN[key].default))
                 for key in ("stop_services", "force", "take_host_devices")]
        return Variant(name, kind, hugepages, numa, profile, scheduler, *flags)

    def pages_and_numa(self, index: int, raw: dict):
        try:
            if not isinstance(raw.get("hugepages", DOMAIN["hugepages"].default), str):
                raise InputError(f"hugepages must be auto, none, 4K, 2M or 1G (a string), not {raw['hugepages']!r}")
            hugepages = parse_hugepages(raw.get("hugepages", DOMAIN["hugepages"].default))
        except InputError as exc:
            self.fail(in_spec_words(exc), "variant", index, "hugepages")
        try:
            numa = parse_numa(raw.get("numa", DOMAIN["numa"].default))
        except InputError as exc:
            self.fail(in_spec_words(exc), "variant", index, "numa")
        return hugepages, numa

    def vgpu_keys(self, index: int, raw: dict, name: str, kind: str, devices_chosen: bool):
        """A variant's profile and scheduler: for vgpu variants only, a profile each."""
        profile = raw.get("profile")
        if profile is not None and (not isinstance(profile, str) or not profile.strip()):
            self.fail("profile must be a vGPU type name or id", "variant", index, "profile")
        if kind == "vgpu" and not profile:
            self.fail(f"vgpu variant {name} needs a profile", "variant", index)
        if kind != "vgpu" and profile:
            self.fail(f"profile is for vgpu variants only ({name} is {kind})", "variant", index, "profile")
        if kind == "vgpu" and not devices_chosen:
            self.fail("vgpu variants need [run] gpus or gpu_ids", "run")
        scheduler = raw.get("scheduler")
        if scheduler is not None:
            if kind != "vgpu":
                self.fail(f"scheduler is for vgpu variants only ({name} is {kind})", "variant", index, "scheduler")
            if not isinstance(scheduler, str) or scheduler not in POLICIES:  # a table is unhashable
                self.fail(f"scheduler must be one of {', '.join(POLICIES)}, not {scheduler!r}", "variant", index,
                          "scheduler")
        return profile, scheduler


def in_spec_words(exc: InputError) -> str:
    """``exc``'s message with the options it names as the spec's keys (the SSH forward as
    [guest.ssh] port): the spec's author never typed --rom-bar."""
    def key(name: str) -> str:
        if name == "user_net_ssh_port":
            return "[guest.ssh] " + SSH["ssh_port"].spec_key
        return next((s[name].spec_key for s in (DOMAIN, SSH, VERIFY, RUN) if name in s.by_name), name)

    return exc.spelled(key) if isinstance(exc, OptionError) else str(exc)


def guest_request_args(guest: dict, ssh: dict) -> dict:
    """The domain request's arguments from ``[guest]`` (testbed.plan adds each variant's pages,
    NUMA and profile): one mapping for the spec's validation and for the run. Every domain
    option the spec's [guest] declares (gpuvfio.options.DOMAIN), by the same name; the
    [guest.ssh] port is the user-net forward."""
    args = {o.name: guest.get(o.name, o.default) for o in DOMAIN.in_section("guest")}
    args["memory"] = str(args["memory"])
    args["user_net_ssh_port"] = ssh.get(SSH["ssh_port"].spec_key)
    return args


def boot_timeout(spec: Spec) -> float:
    """Seconds from the guest's start until SSH must answer: [guest.ssh] boot_timeout."""
    return spec.ssh.get("boot_timeout", SSH["boot_timeout"].default)


VARIANT_KEYS = {o.name for o in DOMAIN.in_section("variant") + RUN.in_section("variant")}


def in_a_spec(option: Option) -> Option:
    """``option`` as a spec takes it: every path absolute (the spec is read where the run is, maybe
    on another host, so a path cannot be taken relative to a working directory)."""
    return dataclasses.replace(option, absolute=True) if option.kind == "path" else option


def _remote_host(raw, fail) -> RemoteHost | None:
    if raw is None:
        return None
    if not isinstance(raw, dict):
        fail("[host] must be a table", "host")
    allowed = {"address", "port", "user", "key", "known_hosts", "trust_on_first_use", "gpuvfio", "root", "workdir",
               "ssh_config"}
    for key in raw:
        if key not in allowed:
            fail(f"unknown key {shown(key)} in [host] (allowed: {', '.join(sorted(allowed))})", "host", 0, key)
    address = raw.get("address")
    if isinstance(address, str) and address.startswith("[") and address.endswith("]"):
        address = address[1:-1]  # [::1] as in URLs
    if not valid_host(address):
        fail("[host] address must be a host name or IP address", "host", 0, "address")
    port = raw.get("port", 22)
    if not isinstance(port, int) or isinstance(port, bool) or not 0 < port < 65536:
        fail("[host] port must be an integer 1-65535", "host", 0, "port")
    user = raw.get("user", "root")
    if not isinstance(user, str) or not USER.fullmatch(user):
        fail("[host] user must be a user name", "host", 0, "user")
    for key in ("key", "known_hosts", "root", "workdir", "ssh_config"):
        value = raw.get(key)
        if value is not None and (not isinstance(value, str) or not value.startswith("/") or "\0" in value):
            fail(f"[host] {key} must be an absolute path", "host", 0, key)
    tofu = raw.get("trust_on_first_use", False)
    if not isinstance(tofu, bool):
        fail("[host] trust_on_first_use must be true or false", "host", 0, "trust_on_first_use")
    if not raw.get("known_hosts") and not tofu:
        fail("[host] needs known_hosts (pinned host keys) or trust_on_first_use = true", "host")
    command = raw.get("gpuvfio", ["gpuvfio"])
    if (not isinstance(command, list) or not command or not all(isinstance(a, str) and a for a in command)):
        fail('[host] gpuvfio must be a non-empty list of strings, e.g. ["gpuvfio"]', "host", 0, "gpuvfio")
    return RemoteHost(SshTarget(address, port, user, raw.get("key"), raw.get("known_hosts"), tofu,
                                connect_timeout=30.0),
                      gpuvfio=list(command), root=raw.get("root"), workdir=raw.get("workdir", "/var/tmp"),
                      ssh_config=raw.get("ssh_config"), given=frozenset(k for k in ("port", "user") if k in raw))
