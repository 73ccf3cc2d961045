"""gpuvfio topo: the GPU/NIC matrix as ``nvidia-smi topo -m`` prints it, with NUMA distances and
the PCIe tree. Plain aligned text, like nvidia-smi's, so it reads the same in a terminal, a pipe
or a bug report."""

from __future__ import annotations

import sys

from gpuvfio.cli.app import JsonOption, RootOption, app, emit_json, root_of
from gpuvfio.cli.devices import DeviceIds, Devices
from gpuvfio.cli.output import printable, printable_report
from gpuvfio.ops.inventory import open_host
from gpuvfio.ops.topology import LEGEND_ORDER, topology_report
from gpuvfio.ops.selection import check_devices, resolve

UNKNOWN_MARK = "?"


@app.command("topo")
def topo_cmd(
    addresses: Devices = None,
    device_ids: DeviceIds = None,
    as_json: JsonOption = False,
    root: RootOption = None,
) -> None:
    """GPU/NIC matrix like nvidia-smi topo -m (X, PIX, PXB, PHB, NODE, SYS, NV#), CPU and NUMA
    affinity, NUMA distances and each device's place in the PCIe tree."""
    check_devices(addresses, device_ids, required=False)
    with open_host(root_of(root)) as (host, label):
        report = topology_report(host, only=resolve(host, addresses, device_ids))
    if as_json:
        emit_json(report)
        return
    # Device and driver names, switch names and notes come from the host's tree and pci.ids:
    # escaped before the columns are measured, so the matrix stays aligned too.
    sys.stdout.write("\n".join(render(printable_report(report), printable(label))) + "\n")


def _table(rows: list[list[str]], indent: str = "") -> list[str]:
    widths = [max(len(row[i]) for row in rows if i < len(row)) for i in range(max(map(len, rows)))]
    return [(indent + "  ".join(cell.ljust(widths[i]) for i, cell in enumerate(row))).rstrip() for row in rows]


def render(report: dict, label: str) -> list[str]:
    devices = report["devices"]
    lines = [f"Topology of {label}", ""]
    if not devices:
        return lines + ["No NVIDIA GPU or NIC on this host."] + _numa(report)
    names = [d["name"] for d in devices]
    unknown = False
    rows = [[""] + names + ["CPU Affinity", "NUMA Affinity"]]
    for dev in devices:
        row = [dev["name"]]
        for other in names:
            cell = report["matrix"][dev["name"]][other]
            if report["nvlink_links"].get(dev["name"], {}).get(other, 0) is None:
                cell += UNKNOWN_MARK
                unknown = True
            row.append(cell)
        node = dev["numa_node"]
        row += [dev["local_cpulist"] or "N/A", "N/A" if node is None else str(node)]
        rows.append(row)
    lines += _table(rows)
    lines += ["", "Legend:", ""]
    lines += [f"  {word:<4} = {report['legend'][word]}" for word in LEGEND_ORDER]
    if unknown:
        lines.append(f"  {UNKNOWN_MARK:<4} = NVLink not read for this GPU pair: its PCIe path only (NVLink below)")
    lines += ["", "Devices:", ""]
    lines += _table([[f"{d['name']}:", d["address"], _describe(d)] for d in devices], "  ")
    lines += ["", f"NVLink: {report['nvlink']['summary']}"]
    lines += [f"  {address}: not read: {why}" for address, why in report["nvlink"]["unread"].items()
              if report["nvlink"]["read"]]
    lines += _fabric(report["fabric"])
    lines += _numa(report)
    lines += ["", "PCIe tree:", ""]
    tree = [["", "Address", "Root complex", "Root port", "Switch upstream ports (root first)"]]
    for dev in devices:
        switches = ", ".join(s["address"] + (f" ({s['name']})" if s["name"] else "") for s in dev["switches"])
        tree.append([dev["name"], dev["address"], dev["root_complex"], dev["root_port"] or "-", switches or "-"])
    lines += _table(tree, "  ")
    lines += [f"Note: {note}" for note in report["notes"]]
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


def _describe(dev: dict) -> str:
    name = dev["device_name"] or "device"
    text = f"{name} [{dev['vendor_id']}:{dev['device_id']}] ({dev['driver'] or 'no driver'})"
    links = dev["nvlink"]
    if links and links["read"]:
        if links["links"]:
            parts = [f"{links[k]} to {what}" for k, what in (("to_switch", "NVSwitches"), ("to_gpu", "GPUs"),
                                                            ("other", "other devices")) if links[k]]
            text += f", {links['links']} NVLinks: {', '.join(parts)}"
        else:
            text += ", no active NVLink"
    return text


def _numa(report: dict) -> list[str]:
    nodes = report["numa"]["nodes"]
    if not nodes:
        return ["", "NUMA distances: no NUMA nodes in sysfs"]
    if not any(n["distances"] for n in nodes):
        return ["", "NUMA distances: unreadable (no ACPI SLIT row in nodeN/distance)"]
    ids = [str(n["id"]) for n in nodes]
    rows = [[""] + [f"node{i}" for i in ids]]
    rows += [[f"node{n['id']}"] + [str(n["distances"].get(i, "?")) for i in ids] for n in nodes]
    lines = ["", "NUMA distances (ACPI SLIT, 10 = local):", ""] + _table(rows, "  ")
    return lines + ["", "NUMA CPUs:", ""] + _table([[f"node{n['id']}:", n["cpulist"] or "-"] for n in nodes], "  ")
