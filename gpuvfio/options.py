"""The option sets, each declared once: the domain request, the SSH target, the verify gates and
measurement options, the testbed run.

Every option has one snake_case name; the interfaces derive theirs from it: the command's
flag (``user_net_ssh_port`` is ``--user-net-ssh-port``; a switch on by default is ``--no-X``),
the Ansible option (the name itself), the testbed spec key (``key``: the name inside its
section, ``[guest.ssh] port`` for ``ssh_port``). ``cli``, ``ansible`` and ``spec`` say which
commands, modules and spec sections carry it. What is generated from here: the command's
options (gpuvfio.cli.tables), the Ansible argument specs and the options part of the modules'
DOCUMENTATION (``python -m gpuvfio.cli.generate``, held by tests/unit/test_option_table.py),
the testbed spec's key sets and value shapes (gpuvfio.testbed.spec) and its JSON Schema
(gpuvfio.testbed.schema). The table declares; the services validate the values
(gpuvfio.domain.request.domain_request, gpuvfio.ops.targets.ssh_options,
gpuvfio.ops.verify_options.verify_options), taking their bounds from here.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass

from gpuvfio.errors import InputError
from gpuvfio.numbers import finite, shown

__all__ = ["Option", "OptionSet", "OptionError", "DOMAIN", "SSH", "VERIFY", "RUN", "SETS", "USER_PATTERN", "USER",
           "ANSIBLE_MODULES", "CLI_COMMANDS", "checked", "cli_flag", "value_shown"]

KINDS = ("str", "int", "float", "bool", "path", "list")
# A login name as useradd(8) takes it (shadow-utils, NAME_REGEX relaxed to upper case as
# sshd and most directories allow), at most 32 characters: guests and a testbed's hypervisor.
USER_PATTERN = r"[A-Za-z_][A-Za-z0-9_.-]{0,31}"
USER = re.compile(USER_PATTERN)
CLI_DOMAIN_COMMANDS = ("xml", "attach", "verify", "detach")
# Every command that takes options from this table ("vgpu list": a subcommand by its words).
CLI_COMMANDS = CLI_DOMAIN_COMMANDS + ("bind", "unbind", "restore", "reset", "qualify", "persist", "unpersist",
                                      "vgpu list",
                                      "vgpu create", "testbed plan", "testbed run")
# The Ansible modules that take the table's options, by their FQCN (the gpuvfio.gpuvfio collection in
# playbooks/collections/): the name also keeps them apart from the commands of the same word.
ANSIBLE_MODULES = ("gpuvfio.gpuvfio.domain", "gpuvfio.gpuvfio.verify", "gpuvfio.gpuvfio.device")


@dataclass(frozen=True)
class Option:
    name: str
    kind: str  # one of KINDS; "path": a file path (absolute where the spec takes it)
    help: str  # {other_option} is written as each interface names that option
    default: object = None
    required: bool = False
    choices: tuple[str, ...] = ()
    minimum: float | None = None
    maximum: float | None = None
    above: float | None = None  # exclusive minimum
    pattern: str | None = None  # what the whole value matches (JSON Schema, the spec)
    shape: str | None = None  # the pattern in words, for the message when a value does not match it
    absolute: bool = False  # a path that must be absolute (one libvirt and QEMU open for the domain)
    metavar: str | None = None
    cli: tuple[str, ...] = ()  # the commands that take it
    ansible: tuple[str, ...] = ()  # the modules that take it
    spec: tuple[str, ...] = ()  # the testbed spec sections that take it
    key: str | None = None  # its name inside the SSH target and [guest.ssh] (default: name)
    aliases: tuple[str, ...] = ()  # Ansible aliases: older names playbooks may still use
    no_log: bool = False
    off_help: str | None = None  # a switch on by default: the help of its --no-X flag
    old_flags: tuple[str, ...] = ()  # command flags it had before (still taken, shown after the flag)

    def __post_init__(self) -> None:
        assert self.kind in KINDS and re.fullmatch(r"[a-z][a-z0-9_]*", self.name), self.name

    @property
    def spec_key(self) -> str:
        return self.key or self.name

    @property
    def negated(self) -> bool:
        """A switch on by default: the command offers only its --no-X flag."""
        return self.kind == "bool" and self.default is True

    @property
    def flag(self) -> str:
        word = self.name.replace("_", "-")
        return f"--no-{word}" if self.negated else f"--{word}"

    @property
    def flags(self) -> tuple[str, ...]:
        """Every flag the command takes for it: its own first, then the older ones."""
        return (self.flag,) + self.old_flags

    @property
    def parameter(self) -> str:
        """The command function's parameter (no_X for a switch on by default)."""
        return f"no_{self.name}" if self.negated else self.name

    def text(self, spell) -> str:
        """The help with each {option} named as ``spell(option_name)`` says."""
        return re.sub(r"\{([a-z_]+)\}", lambda m: spell(m.group(1)), self.help)


class OptionSet:
    """Options by name, in the order the interfaces list them."""

    def __init__(self, name: str, *options: Option) -> None:
        self.name = name
        self.options = options
        self.by_name = {o.name: o for o in options}
        assert len(self.by_name) == len(options), name

    def __getitem__(self, name: str) -> Option:
        return self.by_name[name]

    def __iter__(self):
        return iter(self.options)

    def names(self) -> tuple[str, ...]:
        return tuple(self.by_name)

    def for_command(self, command: str) -> tuple[Option, ...]:
        return tuple(o for o in self.options if command in o.cli)

    def for_module(self, module: str) -> tuple[Option, ...]:
        return tuple(o for o in self.options if module in o.ansible)

    def in_section(self, section: str) -> tuple[Option, ...]:
        return tuple(o for o in self.options if section in o.spec)


BOTH = ("xml", "attach")
GUEST_CMDS = ("verify", "attach")
DOM = ("gpuvfio.gpuvfio.domain",)
MODULES = ("gpuvfio.gpuvfio.domain", "gpuvfio.gpuvfio.verify")  # the guest-facing modules
GUEST = ("guest",)
MAX_VCPUS = 4096  # gpuvfio.domain.request takes its bound from here

DOMAIN = OptionSet(
    "domain",
    Option("name", "str", "Domain name.", required=True, metavar="NAME", cli=BOTH, ansible=DOM),
    Option("vcpus", "int", "Guest vCPUs.", 4, minimum=1, maximum=MAX_VCPUS,
           metavar="N", cli=BOTH, ansible=DOM, spec=GUEST),
    Option("memory", "str", "Guest memory: 64G, 64GiB, 65536M (a bare number in the spec: MiB).", "8G",
           metavar="SIZE", cli=BOTH,
           ansible=DOM, spec=GUEST),
    Option("hugepages", "str", "Backing pages: auto | none | 4K | 2M | 1G (also spelled 1g, 2MiB).", "auto",
           metavar="SIZE", cli=BOTH, ansible=DOM, spec=("variant",)),
    Option("numa", "str", "auto | none | remote (a node without the devices) | a host NUMA node number.", "auto",
           metavar="NODE", cli=BOTH, ansible=DOM, spec=("variant",)),
    Option("firmware", "str", "efi (UEFI: libvirt picks it from QEMU's firmware descriptors) | bios", "efi",
           choices=("efi", "bios"), metavar="efi|bios", cli=BOTH, ansible=DOM, spec=GUEST),
    Option("virt_type", "str", "kvm | qemu (TCG, for hosts without KVM)", "kvm", choices=("kvm", "qemu"),
           metavar="kvm|qemu", cli=BOTH,
           ansible=DOM, spec=GUEST),
    Option("loader", "path", "UEFI code image by path instead of libvirt's choice (with {nvram_template}).",
           metavar="PATH", cli=BOTH, ansible=DOM, spec=GUEST, absolute=True),
    Option("nvram_template", "path", "UEFI variables template (with {loader}).", metavar="PATH", cli=BOTH,
           ansible=DOM, spec=GUEST, absolute=True),
    Option("rom_bar", "str", "Show the GPUs' ROM BAR to the guest or hide it (off: the usual fix for a GPU that "
           "drove the host console); default libvirt's (shown).", choices=("on", "off"), metavar="on|off",
           cli=BOTH, ansible=DOM, spec=GUEST),
    Option("rom_file", "path", "A ROM image (a dumped, clean VBIOS) the guest sees instead of the GPU's own.",
           metavar="PATH", cli=BOTH, ansible=DOM, spec=GUEST, absolute=True),
    Option("hide_kvm", "bool", "Hide the hypervisor from the guest driver.", False, cli=BOTH, ansible=DOM,
           spec=GUEST),
    Option("mdev", "str", "Legacy mdev vGPU type instead of the whole GPU.", metavar="TYPE", cli=("xml",),
           ansible=DOM),
    Option("vgpu", "str", "SR-IOV vGPU type instead of the whole GPU.", metavar="TYPE", cli=("xml",), ansible=DOM),
    Option("uuid", "str", "mdev UUID (default: xml derives it from the domain name, GPU and type; vgpu create "
           "takes a random one).", metavar="UUID", cli=("xml", "vgpu create"), ansible=DOM),
    Option("disk", "path", "Boot disk image (absolute path).", metavar="PATH", cli=BOTH, ansible=DOM, spec=GUEST,
           absolute=True),
    Option("kernel", "path", "Direct kernel boot (absolute path).", metavar="PATH", cli=BOTH, ansible=DOM,
           spec=GUEST, absolute=True),
    Option("initrd", "path", "initrd for direct kernel boot (with {kernel}).", metavar="PATH", cli=BOTH,
           ansible=DOM, spec=GUEST, absolute=True),
    Option("cmdline", "str", "Kernel command line for direct kernel boot (one line).", pattern=r"[^\x00-\x1f\x7f]*",
           shape="one line without control characters", metavar="STR", cli=BOTH, ansible=DOM, spec=GUEST),
    Option("network", "str", "libvirt network to attach.", pattern=r"[^/\x00-\x1f\x7f]+",
           shape="a libvirt network name (no '/', no control character)", metavar="NAME", cli=BOTH,
           ansible=DOM, spec=GUEST),
    # The testbed forwards its [guest.ssh] port: that key is the spec's spelling of this one.
    Option("user_net_ssh_port", "int", "QEMU user networking, 127.0.0.1:PORT -> guest:22.", minimum=1,
           maximum=65535, metavar="PORT", cli=BOTH, ansible=DOM, aliases=("ssh_forward_port",)),
    Option("console_log", "path", "Also write the guest's serial console to this host file.", metavar="FILE",
           cli=BOTH, ansible=DOM, spec=GUEST, absolute=True),
    Option("force", "bool", "Share cores / accept short hugepages; an attach also overrides the overridable bind "
           "checks.", False, cli=BOTH, ansible=DOM),
    Option("topology", "str", "auto | mirror | flat: mirror the host's PCIe switches and root complexes in the "
           "guest (auto: for two or more devices).", "auto", choices=("auto", "mirror", "flat"),
           metavar="auto|mirror|flat", cli=BOTH,
           ansible=DOM, spec=GUEST),
    Option("p2p", "str", "auto | off | force: P2P cliques (x-nv-gpudirect-clique) for GPUs in IOMMU groups of "
           "their own, as far apart as NCCL's default P2P level allows on this CPU, of one architecture, never for "
           "GeForce or TITAN cards or device ids gpuvfio does not know; force: as far as the IOMMU groups allow, "
           "those cards too (the plan warns).", "auto",
           choices=("auto", "off", "force"), metavar="auto|off|force", cli=BOTH, ansible=DOM, spec=GUEST),
    Option("qemu_version", "str", "QEMU version the domain will run on (default: asked from libvirt when a "
           "connection is used).", metavar="X.Y", cli=BOTH, ansible=DOM),
    # NCCL takes the first NCCL_TOPO_FILE of /etc/nccl.conf: an admin's own is kept unless asked.
    Option("replace_nccl_topo_file", "bool", "Let the guest's /etc/nccl.conf name gpuvfio's NCCL topology file "
           "where the admin's names another (which is kept and reported otherwise).", False, cli=("attach",),
           ansible=DOM),
)

GUEST_SSH = ("guest.ssh",)
SECONDS = 24 * 3600.0  # the longest wait any timeout takes

SSH = OptionSet(
    "ssh",
    Option("ssh_host", "str", "Guest address (default: discovered through libvirt).", metavar="HOST", cli=GUEST_CMDS,
           ansible=MODULES, spec=GUEST_SSH, key="host"),
    Option("ssh_port", "int", "Guest SSH port (default: discovered, else 22).", minimum=1, maximum=65535,
           metavar="PORT", cli=GUEST_CMDS, ansible=MODULES, spec=GUEST_SSH, key="port"),
    Option("ssh_user", "str", "Guest user (default: the SSH config's User, else root).", pattern=USER_PATTERN,
           shape="a login name", metavar="USER", cli=GUEST_CMDS + ("xml",), ansible=MODULES, spec=GUEST_SSH,
           key="user"),
    Option("ssh_key", "path", "Private key file.", metavar="FILE", cli=GUEST_CMDS + ("xml",), ansible=MODULES,
           spec=GUEST_SSH, key="key"),
    Option("ssh_private_key", "str", "Private key content (kept out of logs); written to a mode 0600 temp file "
           "for the task.", ansible=MODULES, no_log=True),
    Option("ssh_config", "path", "An ssh_config file instead of ~/.ssh/config (Host aliases, HostName, User, "
           "Port, IdentityFile, UserKnownHostsFile, ProxyJump).", metavar="FILE", cli=GUEST_CMDS, ansible=MODULES),
    # How verify gets into a stock cloud image (gpuvfio.ops.cloud_init): the commands only, not the
    # Ansible modules or the testbed spec (yet).
    Option("cloud_init", "path", "Write a cloud-init NoCloud seed image here (mode 0600; a place QEMU can reach, "
           "e.g. /var/lib/libvirt/boot) and attach it as a read-only cdrom: the guest user ({ssh_user}) takes the "
           "public half of {ssh_key}, and a fresh SSH host key is pinned for the guest's address before it boots, "
           "so a stock cloud image verifies unprepared.", metavar="ISO", cli=("xml", "attach")),
    Option("known_hosts", "path", "Pinned host keys.", metavar="FILE", cli=GUEST_CMDS, ansible=MODULES,
           spec=GUEST_SSH),
    Option("trust_on_first_use", "bool", "Accept and record an unknown host key.", False, cli=GUEST_CMDS,
           ansible=MODULES, spec=GUEST_SSH),
    # --timeout meant this wait here, the sysfs write limit on bind and the shutdown wait on
    # detach: each has its own name now, the old flag and Ansible name still taken.
    Option("ssh_timeout", "float", "Seconds to wait for SSH.", 60.0, above=0, maximum=SECONDS,
           metavar="SECONDS", cli=("verify",), ansible=("gpuvfio.gpuvfio.verify",), key="timeout",
           old_flags=("--timeout",), aliases=("timeout",)),
    Option("boot_timeout", "float", "Seconds from start until SSH answers.", 300.0, above=0, maximum=SECONDS,
           metavar="SECONDS", cli=("attach",), ansible=DOM, spec=GUEST_SSH),
)

RUN_SPEC = ("run",)

VERIFY = OptionSet(
    "verify",
    Option("bandwidth", "bool", "Measure the copies (host to device, device to host, device to device).", True,
           off_help="Skip the copy measurements.", cli=GUEST_CMDS, ansible=MODULES),
    # The default gates are gpuvfio.guest.expect.HEALTHY (the test holds the help to them).
    Option("link_efficiency", "float", "Share of the slot's raw link rate each copy must reach, instead of the "
           "default floors: 90% of what healthy cards of the slot's generation measure (Gen3 x16 10.8, Gen4 "
           "21.5, Gen5 47.7 GB/s).", minimum=0.01, maximum=1.0, metavar="FRACTION",
           cli=GUEST_CMDS, ansible=MODULES, spec=RUN_SPEC),
    Option("min_gbps", "float", "Absolute bandwidth floor per direction in GB/s, instead of {link_efficiency}.",
           minimum=0.001, maximum=10000.0, metavar="GBPS", cli=GUEST_CMDS, ansible=MODULES, spec=RUN_SPEC),
    Option("size_mib", "int", "Copy buffer in MiB (default 512, as nvbandwidth).", minimum=1, maximum=64 * 1024,
           metavar="MIB", cli=GUEST_CMDS, ansible=MODULES, spec=RUN_SPEC),
    Option("copies", "int", "Copies per sample (default 16).", minimum=1, maximum=1000, metavar="N", cli=GUEST_CMDS,
           ansible=MODULES, spec=RUN_SPEC),
    Option("samples", "int", "Samples, median reported (default 3).", minimum=1, maximum=1000,
           metavar="N", cli=GUEST_CMDS,
           ansible=MODULES, spec=RUN_SPEC),
    Option("probe_timeout", "float", "Allow the in-guest probe this long (slow, emulated guests).", 120.0, above=0,
           maximum=SECONDS, metavar="SECONDS", cli=GUEST_CMDS, ansible=MODULES),
    Option("verify_timeout", "float", "Allow the in-guest verifier (bandwidth runs) this long.", 600.0, above=0,
           maximum=SECONDS, metavar="SECONDS", cli=GUEST_CMDS, ansible=MODULES),
)

RUN_VARIANT = ("run", "variant")  # a [[variant]] overrides [run]'s
# The commands that move devices between drivers, and those that take the host's lock.
BINDING = ("bind", "unbind", "restore", "reset")
LOCKING = BINDING + ("qualify", "persist", "unpersist", "health")
DEVICE = ("gpuvfio.gpuvfio.device",)

RUN = OptionSet(
    "run",
    Option("repetitions", "int", "Measurements of each variant.", 3, minimum=1, maximum=1000, spec=RUN_SPEC),
    Option("gpus", "list", "Device arguments (01:00 is every function of the slot), expanded on the hypervisor.",
           [], spec=RUN_SPEC),
    Option("gpu_ids", "list", "lspci -d VENDOR:[DEVICE][:CLASS]; with {gpus}, what both select.", [],
           spec=RUN_SPEC),
    # One name everywhere: --connect, the modules' connect (uri and libvirt_uri, the names they
    # had, kept as aliases), [run] connect.
    Option("connect", "str", "The libvirt URI (default: libvirt's own, LIBVIRT_DEFAULT_URI or qemu:///system; "
           "for a testbed, its spec's [run] connect); one that would make libvirt run a program or skip a check "
           "(the ext and SSH transports, command=, netcat=, no_verify= and the like) is refused unless "
           "GPUVFIO_ALLOW_UNSAFE_URI=1. none asks no libvirt: what can do without it goes on without (bind, "
           "unbind, reset, vgpu list and the device module do not ask which domains use the devices; xml "
           "without --define, verify with --ssh-host), what needs it refuses none.",
           metavar="URI", cli=CLI_DOMAIN_COMMANDS + ("bind", "unbind", "reset", "qualify", "health", "vgpu list",
                                                     "testbed plan", "testbed run"),
           ansible=MODULES + DEVICE, spec=RUN_SPEC, aliases=("uri", "libvirt_uri")),
    Option("stop_services", "bool", "Stop NVIDIA services that hold the GPU while binding (nvidia-persistenced, "
           "fabricmanager, DCGM); restore restarts them.", False, cli=("attach", "bind"), ansible=DOM + DEVICE,
           spec=RUN_VARIANT),
    Option("force", "bool", "Override the checks marked overridable: a foreign device in the group, the console "
           "GPU (boot VGA).", False, cli=("bind", "persist"), ansible=DEVICE, spec=RUN_VARIANT),
    Option("allow_unsafe_host", "bool", "DANGEROUS: bind even with ACS override, unsafe interrupts or no-IOMMU "
           "mode.", False, cli=("bind",), ansible=DEVICE),
    Option("here", "bool", "Use this machine even when the spec names a remote [host] (how gpuvfio runs itself "
           "there).", False, cli=("testbed plan", "testbed run")),
    Option("take_host_devices", "bool", "DANGEROUS: take from the host what it runs on (a mounted disk, swap, an "
           "interface with its routes or addresses, its console) when binding; the host loses it.", False,
           cli=("attach", "bind", "persist"), ansible=DOM + DEVICE, spec=RUN_VARIANT),
    Option("write_timeout", "float", "Give up on a sysfs write the kernel does not return from after this many "
           "seconds.", 10.0, above=0, maximum=3600.0, metavar="SECONDS", cli=BINDING + ("qualify",), ansible=DEVICE,
           old_flags=("--timeout",)),
    Option("lock_timeout", "float", "Wait this long for another gpuvfio run to finish.", 30.0, above=0,
           maximum=SECONDS, metavar="SECONDS", cli=LOCKING, ansible=DEVICE),
    Option("stop_timeout", "float", "Seconds for the guest's ACPI shutdown before it is destroyed (0: destroyed "
           "at once).", 60.0, minimum=0, maximum=SECONDS, metavar="SECONDS", cli=("detach",), ansible=DOM,
           spec=RUN_SPEC, old_flags=("--timeout",)),
    Option("all", "bool", "Not only NVIDIA's functions: list shows every PCI function, health also every function "
           "on vfio-pci.", False, cli=("list", "health")),
    Option("cycles", "int", "Resets by each method the kernel offers (reset_method), each checked: config space, "
           "BARs, link.", 3, minimum=1, maximum=100, metavar="N", cli=("qualify",)),
    Option("record", "bool", "Keep each device's AER counts as the last sample in the state dir: correctable "
           "errors above it are rising, and degrade the device (the health timer records every run).", False,
           cli=("health",)),
    Option("acknowledge", "bool", "Take the named devices' AER errors so far as known (after a reset mended "
           "them): only errors after this count, until the next boot.", False, cli=("health",)),
    Option("textfile", "path", "Also write the report as Prometheus metrics to this file, atomically, for "
           "node_exporter's textfile collector (a .prom file in its --collector.textfile.directory).",
           metavar="FILE", cli=("health",)),
)

SETS = (DOMAIN, SSH, VERIFY, RUN)


def cli_flag(name: str) -> str:
    """How the commands spell a declared option (``--no-X`` for a switch on by default)."""
    for option_set in SETS:
        if name in option_set.by_name:
            return option_set[name].flag
    return "--" + name.replace("_", "-")


class OptionError(InputError):
    """Bad input that names declared options. The message is kept with ``{option_name}`` in
    place of each name, so that each interface says it its own way (``spelled``): ``--rom-bar``
    for the commands (``str()``), ``rom_bar`` for the Ansible modules, the spec's key in a
    testbed spec."""

    def __init__(self, template: str) -> None:
        self.template = template
        super().__init__(self.spelled(cli_flag))

    def spelled(self, spell) -> str:
        named = re.sub(r"\{([a-z_]+)\}", lambda m: spell(m.group(1)), self.template)
        return named.replace(_OPEN, "{").replace(_CLOSE, "}")


# A value's braces in a message, kept apart from the {option} marks until the message is spelled
# (repr() escapes these two characters in any value, so they stand for braces only).
_OPEN, _CLOSE = "\x01", "\x02"


def value_shown(value) -> str:
    """``value`` for an OptionError's message: cut as numbers.shown cuts it, its braces kept
    from being taken for an option's name."""
    return shown(value).replace("{", _OPEN).replace("}", _CLOSE)


def _whole(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _kind_error(option: Option, value) -> str | None:
    """What ``value`` must be for ``option``'s kind, when it is not."""
    if option.kind == "bool":
        return None if isinstance(value, bool) else "true or false"
    if option.kind == "int":
        return None if _whole(value) else "a whole number"
    if option.kind == "float":
        return None if finite(value) else "a number"
    if option.kind == "list":
        return None if isinstance(value, list) and all(isinstance(v, str) for v in value) else "a list of strings"
    if not isinstance(value, str):
        return "a string"
    if option.kind == "path" and (not value or any(ord(c) < 0x20 or ord(c) == 0x7F for c in value)):
        return "a file path (no control character)"
    if option.absolute and not os.path.isabs(value):
        return "an absolute path"
    return None


def _range_error(option: Option, value) -> str | None:
    low, top, above = option.minimum, option.maximum, option.above
    if (low is not None and value < low) or (top is not None and value > top) or (above is not None
                                                                                   and value <= above):
        if above is not None:
            return f"above {above:g}" + (f" and at most {top:g}" if top is not None else "")
        if low is None:
            return f"at most {top:g}"
        return f"from {low:g} to {top:g}" if top is not None else f"at least {low:g}"
    return None


def checked(option: Option, value):
    """``value`` when it has ``option``'s kind and lies within the bounds, choices and pattern the
    table declares; OptionError naming the option otherwise (exit status 2)."""
    name = "{" + option.name + "}"
    wrong = _kind_error(option, value)
    if wrong is not None:
        raise OptionError(f"{name} must be {wrong}, not {value_shown(value)}")
    if option.choices and value not in option.choices:
        raise OptionError(f"{name} must be {' or '.join(option.choices)}, not {value_shown(value)}")
    if option.kind in ("int", "float"):
        span = _range_error(option, value)
        if span is not None:
            raise OptionError(f"{name} must be {span}, not {value_shown(value)}")
    if option.pattern is not None and isinstance(value, str) and not re.fullmatch(option.pattern, value):
        raise OptionError(f"{name} must be {option.shape or 'of the form ' + option.pattern}, not {value_shown(value)}")
    return value


# The Ansible side: argument specs and the DOCUMENTATION options, generated into the collection by
# python -m gpuvfio.cli.generate (modules are read by ansible-doc without being run, so the
# text is committed; tests/unit/test_option_table.py fails while it differs).
_ANSIBLE_TYPES = {"str": "str", "path": "path", "int": "int", "float": "float", "bool": "bool", "list": "list"}


def ansible_options(module: str) -> tuple[Option, ...]:
    return tuple(o for option_set in SETS for o in option_set.for_module(module))


def argument_spec(option: Option) -> dict:
    """``option``'s AnsibleModule argument_spec entry."""
    spec: dict = {"type": _ANSIBLE_TYPES[option.kind]}
    if option.kind == "list":
        spec["elements"] = "str"
    if option.required:
        spec["required"] = True
    if option.default is not None:
        spec["default"] = option.default
    if option.choices:
        spec["choices"] = list(option.choices)
    if option.aliases:
        spec["aliases"] = list(option.aliases)
    if option.no_log:
        spec["no_log"] = True
    return spec


def _ansible_name(name: str) -> str:
    return f"C({name})"


def _yaml_value(value) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, (list, tuple)):
        return "[" + ", ".join(_yaml_value(v) for v in value) + "]"
    if isinstance(value, str):
        return '"' + value.replace("\\", "\\\\").replace('"', '\\"') + '"'
    return repr(value)


def documentation_options(module: str) -> str:
    """The DOCUMENTATION ``options:`` entries of ``module``'s declared options (YAML, two-space
    indented under ``options:``), as ansible-doc reads them."""
    lines = []
    for option in ansible_options(module):
        spec = argument_spec(option)
        lines.append(f"  {option.name}:")
        words = option.text(_ansible_name).split()
        line = "      "
        lines.append("    description: >-")
        for word in words:  # folded: one paragraph, wrapped at 110 columns
            if len(line) + len(word) > 110 and line.strip():
                lines.append(line.rstrip())
                line = "      "
            line += word + " "
        lines.append(line.rstrip())
        for key in ("type", "elements", "required", "default", "choices", "aliases"):  # no_log: code only
            if key in spec:
                lines.append(f"    {key}: {spec[key] if key in ('type', 'elements') else _yaml_value(spec[key])}")
    return "\n".join(lines) + "\n"
