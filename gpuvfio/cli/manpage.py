"""The command reference (docs/reference.md) and the man page (docs/gpuvfio.1), both written from
the command tree itself, so they say what the parser takes:

    python -m gpuvfio.cli.manpage docs          (make docs)

tests/unit/test_docs.py fails when the committed files are not what this writes; the wheel installs
the man page as share/man/man1/gpuvfio.1.
"""

from __future__ import annotations

import re
import sys

import typer.main

from gpuvfio import __version__
from gpuvfio.cli.app import SUMMARY, app
from gpuvfio.user_files import user_dir

# Every environment variable gpuvfio reads (tests/unit/test_docs.py checks each is in the source).
ENVIRONMENT = (
    ("GPUVFIO_ROOT", "Host root when --root is not given (a directory, or a host fixture file). Default /."),
    ("GPUVFIO_STATE_DIR", "Where the journal, the lock and guests' known_hosts live. Default <root>/var/lib/gpuvfio."),
    ("GPUVFIO_RESET_VERDICTS", "The reset verdicts file gpuvfio qualify adds to and health, doctor and the plans "
                               "read, where a fleet shares one. Default reset-verdicts.json in the state directory."),
    ("GPUVFIO_PCI_IDS", "A pci.ids file to name devices with, before <root>/usr/share/misc/pci.ids and the "
                        "system's."),
    ("GPUVFIO_LIBVIRT_SCHEMAS", "Where libvirt's RelaxNG schemas are (domain.rng), to validate generated XML."),
    ("LIBVIRT_DEFAULT_URI", "libvirt's default connection, as for virsh (default qemu:///system); checked as "
                            "--connect is."),
    ("GPUVFIO_ALLOW_UNSAFE_URI", "1: hand libvirt a URI gpuvfio refuses anyway, with a warning: the ext and SSH "
                                 "transports, parameters such as command=, netcat= or no_verify=, drivers other "
                                 "than qemu and test. libvirt runs the programs such a URI names, even for a dry "
                                 "run or a plan."),
    ("SSH_AUTH_SOCK", "An ssh-agent whose keys SSH to guests and remote hypervisors may use (~/.ssh/config, or "
                      "--ssh-config, applies as for ssh)."),
)
DESCRIPTION = (
    "gpuvfio hands NVIDIA GPUs on a KVM host to guests at bare-metal speed (vfio-pci passthrough) or "
    "shares them (mdev and SR-IOV vGPU), and checks inside the guest that it worked. It reads the host "
    "through one root (--root: / or a recording made by dump-host), so every read-only command also "
    "runs on a copy of another machine.",
    "Commands that change the host plan first: the plan lists each check with its verdict and each "
    "step, --dry-run prints it and exits as the run would, and the run carries out that plan under "
    "one lock. A bind moves whole IOMMU groups, is journaled, and is undone on failure; restore "
    "returns each device to exactly the driver it had.",
)
EXAMPLES = (
    ("gpuvfio list", "The NVIDIA devices with IOMMU group, viability, driver, NUMA node, link and BAR."),
    ("gpuvfio doctor", "Readiness checks for passthrough, each with the fix to copy."),
    ("gpuvfio bind 01:00 --dry-run", "The plan of moving slot 01:00 (all its functions and its IOMMU "
                                     "group) to vfio-pci, changing nothing."),
    ("gpuvfio attach 01:00 --name train --disk /var/lib/libvirt/images/train.qcow2 --dry-run",
     "What an attach would check, define and start, and how it would verify the guest."),
    ("gpuvfio verify train", "Check a running guest over SSH: devices, driver, CUDA, link, bandwidth."),
    ("gpuvfio detach train", "Stop the guest, undefine it if gpuvfio defined it, give its devices back."),
    ("gpuvfio export kubevirt -d 10de: > patch.yaml",
     "KubeVirt's permittedHostDevices as a JSON patch, with the names NVIDIA's device plugin registers."),
)
# What gpuvfio writes on a host (the state dir moves with GPUVFIO_STATE_DIR).
FILES = (
    ("/var/lib/gpuvfio/journal.json", "What gpuvfio changed and how to undo it: each device's original "
                                      "driver, stopped services, vGPU instances, an unfinished operation."),
    ("/var/lib/gpuvfio/lock", "The run lock (flock), held for a whole operation; it names its holder."),
    ("/var/lib/gpuvfio/known_hosts", "Guests' SSH host keys, pinned or trusted on first use."),
    ("/etc/driverctl.d/", "persist with driverctl: one override per device."),
    ("/etc/udev/rules.d/61-gpuvfio-vfio-pci.rules", "persist without driverctl: the devices' driver_override "
                                                    "at boot."),
    ("/etc/modprobe.d/gpuvfio-vfio.conf", "persist: vfio-pci loads before the GPU drivers (softdep)."),
    ("/etc/modules-load.d/gpuvfio-vfio.conf", "persist: the vfio modules loaded at boot."),
    ("/etc/systemd/system/gpuvfio-vfio-pci.service", "persist without driverctl: binds the devices at boot."),
    ("/etc/gpuvfio/nccl-topo.xml", "In a guest: the NCCL topology file attach writes (the host's PCIe tree and "
                                   "links as NCCL reads them)."),
    ("/etc/nccl.conf", "In a guest: attach adds NCCL_TOPO_FILE=/etc/gpuvfio/nccl-topo.xml, merged into an admin's "
                       "file (every other line kept); a symbolic link there is left alone."),
)
EXIT_STATUS = (("0", "done"), ("1", "refused (the host's state does not allow it; a dry run the real run would "
                                     "refuse) or a check or step failed"),
               ("2", "bad input: a malformed device, option or spec; an unusable root; unreadable host files"))


def _text(value: str | None) -> str:
    return re.sub(r"\s+", " ", value or "").strip()


def commands() -> list[tuple[list[str], object]]:
    """(path, command) for every command and group, depth first, in name order (typer's click
    commands; typer vendors its click, so they are read by their interface)."""
    found: list[tuple[list[str], object]] = []

    def walk(command, path: list[str]) -> None:
        found.append((path, command))
        for name, sub in sorted(getattr(command, "commands", {}).items()):
            walk(sub, path + [name])

    walk(typer.main.get_command(app), [])
    return found


def _context(path: list[str], command):
    """The context the command's own help screen has: below the root's, whose settings (-h as
    well as --help) it inherits, as when gpuvfio runs it."""
    root = typer.main.get_command(app)
    parent = root.context_class(root, info_name="gpuvfio", **(root.context_settings or {}))
    if not path:
        return parent
    return command.context_class(command, info_name=" ".join(["gpuvfio"] + path), parent=parent)


def _usage(path: list[str], command) -> str:
    with _context(path, command) as ctx:
        return _text(command.get_usage(ctx).removeprefix("Usage:"))


def rows(path: list[str], command) -> list[tuple[str, str]]:
    """(names and metavar, help) of each parameter, as the command's own help screen shows them."""
    rows = []
    with _context(path, command) as ctx:
        for param in command.params:
            record = None if getattr(param, "hidden", False) else param.get_help_record(ctx)
            if record:
                rows.append((_text(record[0]), _text(record[1])))
    return rows


def markdown() -> str:
    lines = ["# gpuvfio command reference", "",
             f"Written from the command tree of gpuvfio {__version__} by `make docs` "
             "(`python -m gpuvfio.cli.manpage docs`); do not edit by hand.", "", _text(SUMMARY), ""]
    lines += [paragraph for text in DESCRIPTION for paragraph in (text, "")]
    for path, command in commands():
        lines += [f"## gpuvfio {' '.join(path)}".rstrip(), "", "```", _usage(path, command), "```", "",
                  _text(command.help), ""]
        params = rows(path, command)
        if params:
            lines += [f"- `{name}`: {help_}" if help_ else f"- `{name}`" for name, help_ in params] + [""]
    lines += ["## Examples", ""] + [f"- `{command}`: {text}" for command, text in EXAMPLES] + [""]
    lines += ["## Files", ""] + [f"- `{path}`: {text}" for path, text in FILES] + [""]
    lines += ["## Environment", ""] + [f"- `{name}`: {text}" for name, text in ENVIRONMENT] + [""]
    lines += ["## Exit status", ""] + [f"- `{code}`: {text}" for code, text in EXIT_STATUS]
    return "\n".join(lines) + "\n"


def _roff(value: str) -> str:
    """Text safe in a roff line: backslashes doubled, a leading . or ' escaped, dashes literal."""
    value = value.replace("\\", "\\e").replace("-", "\\-")
    return "\\&" + value if value.startswith((".", "'")) else value


def man() -> str:
    lines = [f'.TH GPUVFIO 1 "" "gpuvfio {__version__}" "gpuvfio manual"', ".SH NAME",
             "gpuvfio \\- " + _roff(_text(SUMMARY)), ".SH SYNOPSIS",
             ".B gpuvfio", "[\\fIOPTIONS\\fR] \\fICOMMAND\\fR [\\fIARGS\\fR]...", ".SH DESCRIPTION"]
    for paragraph in DESCRIPTION:
        lines += [_roff(paragraph), ".PP"]
    lines[-1:] = [".SH COMMANDS"]
    for path, command in commands():
        if not path:
            continue
        lines += [f".SS {_roff('gpuvfio ' + ' '.join(path))}", _roff(_usage(path, command)), ".PP",
                  _roff(_text(command.help))]
        for name, help_ in rows(path, command):
            lines += [".TP", f"\\fB{_roff(name)}\\fR", _roff(help_) if help_ else ""]
    lines += [".SH GLOBAL OPTIONS"]
    for name, help_ in rows([], typer.main.get_command(app)):
        lines += [".TP", f"\\fB{_roff(name)}\\fR", _roff(help_)]
    lines += [".SH EXAMPLES"]
    for command, text in EXAMPLES:
        lines += [".TP", f"\\fB{_roff(command)}\\fR", _roff(text)]
    lines += [".SH FILES"]
    for path, text in FILES:
        lines += [".TP", f"\\fI{_roff(path)}\\fR", _roff(text)]
    lines += [".SH ENVIRONMENT"]
    for name, text in ENVIRONMENT:
        lines += [".TP", f"\\fB{name}\\fR", _roff(text)]
    lines += [".SH EXIT STATUS"]
    for code, text in EXIT_STATUS:
        lines += [".TP", f"\\fB{code}\\fR", _roff(text)]
    lines += [".SH SEE ALSO", "lspci(8), virsh(1), virt\\-host\\-validate(1), driverctl(8), mdevctl(8), nvidia\\-smi(1)"]
    return "\n".join(line for line in lines if line != "") + "\n"


def write(directory: str) -> list[str]:
    written = []
    tree = user_dir(directory)
    for name, text in (("reference.md", markdown()), ("gpuvfio.1", man())):
        tree.write(name, text)
        written.append(tree.path(name))
    return written


if __name__ == "__main__":
    for written_path in write(sys.argv[1] if len(sys.argv) > 1 else "docs"):
        print(f"wrote {written_path}")
