"""gpuvfio topo: the GPU/NIC matrix as ``nvidia-smi topo -m`` prints it, with NUMA distances and
the PCIe tree. Plain aligned text, like nvidia-smi's, so it reads the same in a terminal, a pipe
or a bug report."""

from __future__ import annotations

import sys

from gpuvfio.cli.app import JsonOption, RootOption, emit_json, root_of
from gpuvfio.cli.lazy import command_typer
from gpuvfio.cli.devices import DeviceIds, Devices
from gpuvfio.cli.output import printable, printable_report
from gpuvfio.ops.context import open_context
from gpuvfio.ops.topology import FULL_LEGEND, LEGEND_ORDER, TopoDevice, TopologyReport, topology_report
from gpuvfio.ops.selection import check_devices, resolve

commands = command_typer()  # its commands, listed in gpuvfio.cli.lazy.COMMANDS

UNKNOWN_MARK = "?"


@commands.command("topo")
def topo_cmd(
    addresses: Devices = None,
    device_ids: DeviceIds = None,
    as_json: JsonOption = False,
    root: RootOption = None,
) -> None:
    """GPU/NIC matrix like nvidia-smi topo -m (X, PIX, PXB, PHB, NODE, SYS, NV#), CPU and NUMA
    affinity, NUMA distances and each device's place in the PCIe tree."""
    check_devices(addresses, device_ids, required=False)
    with open_context(root_of(root)) as (ctx, label):
        report = topology_report(ctx, only=resolve(ctx, addresses, device_ids))
    if as_json:
        emit_json(report.to_json())
        return
    sys.stdout.write("\n".join(render(report, printable(label))) + "\n")


def _shown(value: str | None) -> str:
    """A string the host gave (a device or driver name, a cpulist, a note), escaped before the
    columns are measured, so the matrix stays aligned; "" for none."""
    return printable(value) if value else ""


def _table(rows: list[list[str]], indent: str = "") -> list[str]:
    widths = [max(len(row[i]) for row in rows if i < len(row)) for i in range(max(map(len, rows)))]
    return [(indent + "  ".join(cell.ljust(widths[i]) for i, cell in enumerate(row))).rstrip() for row in rows]


def render(report: TopologyReport, label: str) -> list[str]:
    devices = report.devices
    lines = [f"Topology of {label}", ""]
    if not devices:
        return lines + ["No NVIDIA GPU or NIC on this host."] + _numa(report)
    names = [d.name for d in devices]
    unknown = False
    rows = [[""] + names + ["CPU Affinity", "NUMA Affinity"]]
    for dev in devices:
        row = [dev.name]
        for other in names:
            cell = report.matrix[dev.name][other]
            if report.nvlink_links.get(dev.name, {}).get(other, 0) is None:
                cell += UNKNOWN_MARK
                unknown = True
            row.append(cell)
        node = dev.function.numa_node
        row += [_shown(dev.function.local_cpulist) or "N/A", "N/A" if node is None else str(node)]
        rows.append(row)
    lines += _table(rows)
    lines += ["", "Legend:", ""]
    lines += [f"  {word:<4} = {FULL_LEGEND[word]}" for word in LEGEND_ORDER]
    if unknown:
        lines.append(f"  {UNKNOWN_MARK:<4} = NVLink not read for this GPU pair: its PCIe path only (NVLink below)")
    lines += ["", "Devices:", ""]
    lines += _table([[f"{d.name}:", str(d.function.address), _describe(d)] for d in devices], "  ")
    lines += ["", f"NVLink: {_shown(report.nvlink.summary)}"]
    if report.nvlink.reading.read:
        lines += [f"  {address}: not read: {_shown(why)}" for address, why in report.nvlink.unread.items()]
    # The fabric's mode name is in its JSON form only: rendered from that, escaped whole.
    lines += _fabric(printable_report(report.fabric.to_json()))
    lines += _numa(report)
    lines += ["", "PCIe tree:", ""]
    tree = [["", "Address", "Root complex", "Root port", "Switch upstream ports (root first)"]]
    for dev in devices:
        switches = ", ".join(str(s.address) + (f" ({_shown(s.name)})" if s.name else "") for s in dev.switches)
        root_port = dev.position.root_port
        tree.append([dev.name, str(dev.function.address), str(dev.position.root_complex),
                     str(root_port) if root_port else "-", switches or "-"])
    lines += _table(tree, "  ")
    lines += [f"Note: {_shown(note)}" for note in report.notes]
    return lines


def _fabric(fabric: dict) -> list[str]:
    """The NVSwitch fabric, when the host has one (HGX baseboards)."""
    if not fabric["nvswitches"]:
        return []
    mode = fabric["fabric_mode"]
    fm = ("running" if fabric["fabric_manager_running"] else "not running") + (
        f", driver/FM version {fabric['fabric_manager_version']}" if fabric["fabric_manager_version"] else "")
    return ["", f"NVSwitch fabric: {len(fabric['nvswitches'])} NVSwitches ({', '.join(fabric['nvswitches'])}), "
                f"{len(fabric['gpus'])} baseboard GPUs; "
                f"FABRIC_MODE={mode if mode is not None else 'unset (0)'} ({fabric['mode_name']}); "
                f"Fabric Manager {fm}"] + [f"  {note}" for note in fabric["notes"]]


def _describe(dev: TopoDevice) -> str:
    fn = dev.function
    text = (f"{_shown(fn.display_name)} [{_shown(fn.vendor_id)}:{_shown(fn.device_id)}] "
            f"({_shown(fn.driver) or 'no driver'})")
    links = dev.nvlink
    if links is not None and links.read:
        if links.links:
            parts = [f"{count} to {what}" for count, what in ((links.to_switch, "NVSwitches"), (links.to_gpu, "GPUs"),
                                                             (links.other, "other devices")) if count]
            text += f", {len(links.links)} NVLinks: {', '.join(parts)}"
        else:
            text += ", no active NVLink"
    return text


def _numa(report: TopologyReport) -> list[str]:
    nodes = report.nodes
    if not nodes:
        return ["", "NUMA distances: no NUMA nodes in sysfs"]
    if not any(n.distances for n in nodes):
        return ["", "NUMA distances: unreadable (no ACPI SLIT row in nodeN/distance)"]
    rows = [[""] + [f"node{n.node_id}" for n in nodes]]
    rows += [[f"node{n.node_id}"] + [str(n.distances.get(other.node_id, "?")) for other in nodes] for n in nodes]
    lines = ["", "NUMA distances (ACPI SLIT, 10 = local):", ""] + _table(rows, "  ")
    return lines + ["", "NUMA CPUs:", ""] + _table([[f"node{n.node_id}:", _shown(n.cpulist) or "-"] for n in nodes],
                                                   "  ")
