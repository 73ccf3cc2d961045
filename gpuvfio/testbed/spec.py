"""The testbed spec: one TOML file, validated with line-precise errors.

    [guest]                      # the guest template every variant shares
    kernel = "/var/lib/gpuvfio/vmlinux"   # or disk = "/var/lib/libvirt/images/g.qcow2"
    initrd = "/var/lib/gpuvfio/initrd.img"
    cmdline = "console=ttyS0"
    vcpus = 8
    memory = "32G"
    virt_type = "kvm"            # qemu for hosts without KVM
    firmware = "efi"
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
    workdir = "/var/tmp"         # where the run's scratch directory is made

    [run]
    repetitions = 3
    gpus = ["0000:1b:00.0"]
    connect = "qemu:///system"

    [[variant]]
    name = "passthrough-1g"
    kind = "passthrough"         # passthrough | vgpu | baremetal
    hugepages = "1G"             # auto | 1G | 2M | none
    numa = "auto"                # auto | none | remote | N

    [[variant]]
    name = "vgpu-a10-4q"
    kind = "vgpu"
    profile = "NVIDIA A10-4Q"    # an mdev type, or an SR-IOV vGPU type (MIG-backed: "NVIDIA A100-3-20C")
    scheduler = "equal-share"    # best-effort | equal-share | fixed-share: set for the variant, put back after
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field

from gpuvfio.errors import InputError
from gpuvfio.ssh import SshTarget  # paramiko itself is imported only when a session connects

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


@dataclass
class Spec:
    path: str
    guest: dict
    ssh: dict
    repetitions: int
    gpus: list[str]
    connect: str | None
    variants: list[Variant] = field(default_factory=list)
    host: RemoteHost | None = None


@dataclass
class RemoteHost:
    """The [host] section: a hypervisor reached over SSH where gpuvfio itself runs."""

    ssh: SshTarget
    gpuvfio: list[str] = field(default_factory=lambda: ["gpuvfio"])
    root: str | None = None
    workdir: str = "/var/tmp"

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


def load_spec(path: str) -> Spec:
    try:
        import tomllib
    except ImportError:  # Python 3.10
        import tomli as tomllib

    try:
        with open(path, "rb") as handle:
            raw = handle.read()
    except OSError as exc:
        raise InputError(f"cannot read testbed spec {path}: {exc.strerror}") from None
    text = raw.decode("utf-8", "replace")
    try:
        data = tomllib.loads(text)
    except tomllib.TOMLDecodeError as exc:
        raise InputError(f"{path}: not valid TOML: {exc}") from None
    lines = _Lines(text)

    def fail(message: str, table: str = "", index: int = 0, key: str | None = None):
        number = lines.line(table, index, key)
        raise InputError(f"{path}:{number}: {message}" if number else f"{path}: {message}")

    unknown = set(data) - {"guest", "run", "variant", "host"}
    if unknown:
        fail(f"unknown section(s): {', '.join(sorted(unknown))}", sorted(unknown)[0])
    guest = data.get("guest")
    if not isinstance(guest, dict):
        fail("missing [guest] section")
    allowed = {"kernel", "initrd", "cmdline", "disk", "vcpus", "memory", "virt_type", "firmware", "ssh", "network"}
    for key in guest:
        if key not in allowed:
            fail(f"unknown key {key!r} in [guest] (allowed: {', '.join(sorted(allowed))})", "guest", 0, key)
    if not guest.get("kernel") and not guest.get("disk"):
        fail("[guest] needs kernel (+ initrd) or disk", "guest")
    if not isinstance(guest.get("vcpus", 4), int) or not 1 <= guest.get("vcpus", 4) <= 4096:
        fail("vcpus must be an integer between 1 and 4096", "guest", 0, "vcpus")
    if "memory" in guest:
        from gpuvfio.sizes import parse_size_kib

        try:
            parse_size_kib(str(guest["memory"]))
        except InputError as exc:
            fail(str(exc), "guest", 0, "memory")
    ssh = guest.get("ssh", {})
    if not isinstance(ssh, dict) or "port" not in ssh and "host" not in ssh:
        fail("[guest.ssh] needs port (user-net forward) or host", "guest.ssh")
    ssh_keys = {"host", "port", "user", "key", "known_hosts", "trust_on_first_use", "boot_timeout"}
    for key in ssh:
        if key not in ssh_keys:
            fail(f"unknown key {key!r} in [guest.ssh] (allowed: {', '.join(sorted(ssh_keys))})", "guest.ssh", 0, key)
    if "port" in ssh and (not isinstance(ssh["port"], int) or not 0 < ssh["port"] < 65536):
        fail("ssh port must be an integer 1-65535", "guest.ssh", 0, "port")
    timeout = ssh.get("boot_timeout", 300)
    if not isinstance(timeout, (int, float)) or isinstance(timeout, bool) or not 0 < timeout <= 86400:
        fail("boot_timeout must be a number of seconds, 1-86400", "guest.ssh", 0, "boot_timeout")
    run = data.get("run", {})
    reps = run.get("repetitions", 3)
    if not isinstance(reps, int) or not 1 <= reps <= 1000:
        fail("repetitions must be an integer between 1 and 1000", "run", 0, "repetitions")
    gpus = run.get("gpus", [])
    if not isinstance(gpus, list) or not all(isinstance(g, str) for g in gpus):
        fail("gpus must be a list of PCI addresses", "run", 0, "gpus")
    from gpuvfio.address import PciAddress

    for gpu in gpus:
        try:
            PciAddress.parse(gpu)
        except InputError as exc:
            fail(str(exc), "run", 0, "gpus")
    variants_raw = data.get("variant")
    if not isinstance(variants_raw, list) or not variants_raw:
        fail("no [[variant]] tables: a testbed compares at least one variant")
    variants, names = [], set()
    for index, raw in enumerate(variants_raw):
        name = raw.get("name")
        if not isinstance(name, str) or not NAME.fullmatch(name):
            fail("variant name must be 1-41 letters, digits, '.', '_' or '-'", "variant", index, "name")
        if name in names:
            fail(f"duplicate variant name {name!r}", "variant", index, "name")
        names.add(name)
        kind = raw.get("kind")
        if kind not in KINDS:
            fail(f"variant kind must be one of {', '.join(KINDS)}, not {kind!r}", "variant", index, "kind")
        extra = set(raw) - {"name", "kind", "hugepages", "numa", "profile", "scheduler"}
        if extra:
            fail(f"unknown key(s) {', '.join(sorted(extra))} in variant {name}", "variant", index, sorted(extra)[0])
        hugepages = raw.get("hugepages", "auto")
        if hugepages not in ("auto", "1G", "2M", "none", "4K"):
            fail(f"hugepages must be auto, 1G, 2M, 4K or none, not {hugepages!r}", "variant", index, "hugepages")
        numa = str(raw.get("numa", "auto"))
        if numa not in ("auto", "none", "remote") and not numa.isdigit():
            fail(f"numa must be auto, none, remote or a node number, not {numa!r}", "variant", index, "numa")
        if kind == "vgpu" and not raw.get("profile"):
            fail(f"vgpu variant {name} needs a profile", "variant", index)
        if kind != "baremetal" and kind != "vgpu" and raw.get("profile"):
            fail(f"profile is for vgpu variants only ({name} is {kind})", "variant", index, "profile")
        if kind == "vgpu" and not gpus:
            fail("vgpu variants need [run] gpus", "run")
        scheduler = raw.get("scheduler")
        if scheduler is not None:
            from gpuvfio.vgpusched import POLICIES

            if kind != "vgpu":
                fail(f"scheduler is for vgpu variants only ({name} is {kind})", "variant", index, "scheduler")
            if scheduler not in POLICIES:
                fail(f"scheduler must be one of {', '.join(POLICIES)}, not {scheduler!r}", "variant", index,
                     "scheduler")
        variants.append(Variant(name, kind, "none" if hugepages == "4K" else hugepages, numa,
                                raw.get("profile"), raw.get("scheduler")))
    return Spec(path=path, guest=guest, ssh=ssh, repetitions=reps, gpus=gpus, connect=run.get("connect"),
                variants=variants, host=_remote_host(data.get("host"), fail))


_HOSTNAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9.\-]{0,252}|[0-9A-Fa-f:.]+|\[[0-9A-Fa-f:.]+\]")
_USER = re.compile(r"[a-z_][a-z0-9_.-]{0,31}")


def _remote_host(raw, fail) -> RemoteHost | None:
    if raw is None:
        return None
    if not isinstance(raw, dict):
        fail("[host] must be a table", "host")
    allowed = {"address", "port", "user", "key", "known_hosts", "trust_on_first_use", "gpuvfio", "root", "workdir"}
    for key in raw:
        if key not in allowed:
            fail(f"unknown key {key!r} in [host] (allowed: {', '.join(sorted(allowed))})", "host", 0, key)
    address = raw.get("address")
    if not isinstance(address, str) or not _HOSTNAME.fullmatch(address):
        fail("[host] address must be a host name or IP address", "host", 0, "address")
    port = raw.get("port", 22)
    if not isinstance(port, int) or isinstance(port, bool) or not 0 < port < 65536:
        fail("[host] port must be an integer 1-65535", "host", 0, "port")
    user = raw.get("user", "root")
    if not isinstance(user, str) or not _USER.fullmatch(user):
        fail("[host] user must be a user name", "host", 0, "user")
    for key in ("key", "known_hosts", "root", "workdir"):
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
                      gpuvfio=list(command), root=raw.get("root"), workdir=raw.get("workdir", "/var/tmp"))
