"""gpuvfio list, doctor, dump-host: reading a host (a directory, or a recorded fixture)."""

from __future__ import annotations

import sys
from typing import Annotated

import typer

from gpuvfio.cli.app import JsonOption, RootOption, emit_json, root_of, say
from gpuvfio.cli.lazy import command_typer
from gpuvfio.cli.devices import DeviceIds, Devices
from gpuvfio.cli.output import Cell, Column, FormatOption, Listing, chosen_format, print_listing
from gpuvfio.ops.inventory import (DoctorReport, FunctionIndex, ListReport, doctor_report, dump_host, list_report,
                                   open_host)
from gpuvfio.ops.selection import check_devices, resolve

commands = command_typer()  # its commands, listed in gpuvfio.cli.lazy.COMMANDS

STATUS_STYLE = {"ok": "green", "warn": "yellow", "fail": "bold red", "skip": "dim"}


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
        # pci.ids calls an NVSwitch (class 0x0680) a bridge; it bridges NVLinks, not PCI buses.
        name = fn.device_name or ("NVSwitch" if fn.is_nvswitch else fn.class_name) or "device"
        listing.add(str(fn.address), f"{name} [{fn.vendor_id}:{fn.device_id}]", fn.driver or "none",
                    "-" if gid is None else str(gid), viable,
                    "-" if fn.numa_node is None else str(fn.numa_node), link_text(fn.link),
                    size_text(fn.largest_bar), virtualization_text(fn))
    if report.groups is None:
        listing.notes.append("No IOMMU groups: the IOMMU is off (see gpuvfio doctor).")
    for group in report.groups or []:
        listing.notes += [f"group {group.group_id} not viable: {problem}" for problem in group.problems]
    return listing


def doctor_listing(report: DoctorReport, title: str) -> Listing:
    """gpuvfio doctor: a row per check; the fixes under the table, whole, to copy."""
    listing = Listing(title, [Column("Check", keep=True), Column("Status", keep=True), Column("Summary"),
                              Column("Fix", below=True)])
    for check in report.checks:
        listing.add(check.check_id, Cell(check.status.value, STATUS_STYLE.get(check.status.value, "")), check.summary,
                    check.fix or "")
    return listing


@commands.command("list")
def list_cmd(
    addresses: Devices = None,
    device_ids: DeviceIds = None,
    show_all: Annotated[bool, typer.Option("--all", help="Every PCI function, not only NVIDIA.")] = False,
    output_format: FormatOption = None,
    as_json: JsonOption = False,
    root: RootOption = None,
) -> None:
    """Inventory: NVIDIA devices (or --all) with IOMMU group, viability, driver, NUMA node, PCIe link
    and largest BAR."""
    check_devices(addresses, device_ids, required=False)
    fmt = chosen_format(output_format, as_json)
    with open_host(root_of(root)) as (host, label):
        index = FunctionIndex(host)  # ids and groups of every function, read once for both
        report = list_report(host, show_all=show_all, only=resolve(host, addresses, device_ids, index=index),
                             index=index)
    if fmt == "json":
        emit_json(report.to_json())
        return
    print_listing(list_listing(report, f"PCI functions on {label}" if show_all else f"NVIDIA devices on {label}"),
                  fmt)


@commands.command("doctor")
def doctor_cmd(output_format: FormatOption = None, as_json: JsonOption = False, root: RootOption = None) -> None:
    """Host readiness checks for passthrough, each with a fix. Exit 1 when one fails."""
    fmt = chosen_format(output_format, as_json)
    with open_host(root_of(root)) as (host, label):
        report = doctor_report(host)
    if fmt == "json":
        emit_json({"checks": [c.to_json() for c in report.checks]})
    else:
        print_listing(doctor_listing(report, f"Readiness of {label}"), fmt)
    if report.failed:
        raise typer.Exit(1)


@commands.command("dump-host")
def dump_host_cmd(
    out: Annotated[str, typer.Argument(metavar="OUT", help="Fixture file to write ('-' for stdout).")],
    root: RootOption = None,
) -> None:
    """Record what gpuvfio reads from this host into a text fixture (bug reports, tests)."""
    with open_host(root_of(root)) as (host, _label):
        text = dump_host(host, out)
    if out == "-":
        sys.stdout.write(text)
    else:
        say(f"wrote {text.count(chr(10)) - 1} records to {out}")
