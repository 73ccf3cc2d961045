"""gpuvfio list: the host's PCI functions (a directory, or a recorded fixture); doctor and
dump-host are in gpuvfio.cli.readiness."""

from __future__ import annotations

from gpuvfio.cli.app import JsonOption, RootOption, emit_json, root_of
from gpuvfio.cli.lazy import command_typer
from gpuvfio.cli.tables import from_table, options
from gpuvfio.cli.devices import DeviceIds, Devices
from gpuvfio.cli.output import Cell, Column, FormatOption, Listing, chosen_format, print_listing
from gpuvfio.ops.context import open_context
from gpuvfio.ops.inventory import FunctionIndex, ListReport, list_report
from gpuvfio.ops.selection import check_devices, resolve
from gpuvfio.options import RUN

commands = command_typer()  # its commands, listed in gpuvfio.cli.lazy.COMMANDS


def size_text(n: int) -> str:
    if not n:
        return "-"
    for unit, factor in (("TiB", 1 << 40), ("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if n >= factor:
            value = n / factor
            return f"{value:.0f} {unit}" if value == int(value) else f"{value:.1f} {unit}"
    return f"{n} B"


def link_text(link) -> str:
    """A function's PCIe link (gpuvfio.host.model.Link): now, and its maximum when it runs below it."""
    if link is None:
        return "-"
    cur = f"Gen{link.current_gen or '?'} x{link.current_width or '?'}"
    top = f"Gen{link.max_gen or '?'} x{link.max_width or '?'}"
    return cur if cur == top else f"{cur} (max {top})"


def virtualization_text(fn) -> str:
    """SR-IOV, VF, mdev and vGPU facts of a function (gpuvfio.host.model.PciFunction), briefly."""
    bits = []
    if fn.sriov_total_vfs is not None:
        bits.append(f"SR-IOV {fn.sriov_num_vfs}/{fn.sriov_total_vfs} VFs")
    if fn.physfn is not None:
        bits.append(f"VF of {fn.physfn}")
    if fn.mdev_types:
        bits.append(f"mdev: {len(fn.mdev_types)} types")
    if fn.vgpu_creatable is not None or fn.vgpu_current is not None:
        cur = fn.vgpu_current
        # Once a VF has a type, creatable_vgpu_types lists nothing more for it.
        bits.append(f"vGPU type {cur} set" if cur else f"vGPU: {len(fn.vgpu_creatable or [])} types")
    return "; ".join(bits) or "-"


def list_listing(report: ListReport, title: str) -> Listing:
    """gpuvfio list: one row per function; the least needed columns go first on a narrow terminal."""
    listing = Listing(title, [Column("Address", keep=True), Column("Device", rank=2), Column("Driver", rank=1),
                              Column("Group", keep=True), Column("Viable"), Column("NUMA", rank=3),
                              Column("Link", rank=4, keep=True), Column("Largest BAR", rank=5, keep=True),
                              Column("Virtualization", rank=6)])
    groups = {g.group_id: g for g in report.groups or []}
    for fn in report.devices:
        gid = fn.iommu_group
        group = groups.get(gid)
        viable = Cell("-") if group is None else (Cell("yes", "green") if group.viable else Cell("no", "red"))
        listing.add(str(fn.address), f"{fn.display_name} [{fn.vendor_id}:{fn.device_id}]", fn.driver or "none",
                    "-" if gid is None else str(gid), viable,
                    "-" if fn.numa_node is None else str(fn.numa_node), link_text(fn.link),
                    size_text(fn.largest_bar), virtualization_text(fn))
    if report.groups is None:
        listing.notes.append("No IOMMU groups: the IOMMU is off (see gpuvfio doctor).")
    for group in report.groups or []:
        listing.notes += [f"group {group.group_id} not viable: {problem}" for problem in group.problems]
    return listing


@commands.command("list")
@from_table
def list_cmd(
    addresses: Devices = None,
    device_ids: DeviceIds = None,
    run: dict = options(RUN, "list"),
    output_format: FormatOption = None,
    as_json: JsonOption = False,
    root: RootOption = None,
) -> None:
    """Inventory: NVIDIA devices (or --all) with IOMMU group, viability, driver, NUMA node, PCIe link
    and largest BAR."""
    check_devices(addresses, device_ids, required=False)
    show_all = run["all"]
    fmt = chosen_format(output_format, as_json)
    with open_context(root_of(root)) as (ctx, label):
        index = FunctionIndex(ctx.host)  # ids and groups of every function, read once for both
        report = list_report(ctx, show_all=show_all, only=resolve(ctx, addresses, device_ids, index=index),
                             index=index)
    if fmt == "json":
        emit_json(report.to_json())
        return
    listing = list_listing(report, f"PCI functions on {label}" if show_all else f"NVIDIA devices on {label}")
    listing.empty = ("no PCI function on this host" if show_all or addresses or device_ids else
                     "no NVIDIA device on this host (gpuvfio list --all lists every PCI function)")
    print_listing(listing, fmt)
