"""Command functions: dependencies in, data out. The typer layer only parses and prints."""

from __future__ import annotations

import contextlib
import os

from gpuvfio.address import PciAddress
from gpuvfio.errors import HostReadError, InputError
from gpuvfio.hostroot import ROOT_ENV, HostRoot
from gpuvfio.inventory import Inventory, read_inventory


@contextlib.contextmanager
def open_host(root: str | None):
    """The host behind ``--root``: a directory, or a fixture file loaded into a temp dir.

    Yields (HostRoot, label for titles). ``None`` means GPUVFIO_ROOT or ``/``.
    """
    root = root or os.environ.get(ROOT_ENV) or "/"
    if os.path.isfile(root):
        import tempfile

        from gpuvfio.fixture import load_fixture

        try:
            with open(root, encoding="utf-8") as handle:
                text = handle.read()
        except (OSError, UnicodeDecodeError) as exc:
            raise HostReadError(f"cannot read host fixture {root}: {exc}") from None
        # A recorded host is thousands of small files: memory-backed /dev/shm makes loading
        # it several times faster than a disk-backed /tmp.
        scratch = "/dev/shm" if os.access("/dev/shm", os.W_OK) and not os.environ.get("TMPDIR") else None
        with tempfile.TemporaryDirectory(prefix="gpuvfio-host-", dir=scratch) as tmp:
            load_fixture(text, tmp)
            yield HostRoot(tmp), os.path.basename(root)
        return
    yield HostRoot(root), root


def list_report(host: HostRoot, *, show_all: bool, only: list[PciAddress] = ()) -> dict:
    """The ``gpuvfio list --json`` object: devices and the groups that hold them."""
    from gpuvfio.pciids import PciIds

    inventory = read_inventory(host, names=PciIds.load(host.root))
    return inventory_report(inventory, show_all=show_all, only=only)


def inventory_report(inventory: Inventory, *, show_all: bool, only: list[PciAddress] = ()) -> dict:
    functions = list(inventory.functions.values())
    if only:
        unknown = [str(a) for a in only if a not in inventory.functions]
        if unknown:
            raise InputError(f"no such PCI function on this host: {', '.join(unknown)}")
        chosen = [inventory.functions[a] for a in sorted(set(only))]
    else:
        chosen = functions if show_all else [f for f in functions if f.is_nvidia]
    if inventory.groups is None:
        groups = None
    elif show_all and not only:
        groups = [g.to_json() for g in inventory.groups.values()]
    else:
        wanted = {f.iommu_group for f in chosen if f.iommu_group is not None}
        groups = [g.to_json() for gid, g in inventory.groups.items() if gid in wanted]
    return {"devices": [f.to_json() for f in chosen], "groups": groups}


def doctor_report(host: HostRoot) -> dict:
    from gpuvfio.doctor import run_doctor
    from gpuvfio.kernel import read_kernel
    from gpuvfio.numa import read_numa
    from gpuvfio.pciids import PciIds

    inventory = read_inventory(host, names=PciIds.load(host.root))
    kernel = read_kernel(host)
    nodes = read_numa(host)
    checks = run_doctor(host, inventory, kernel, nodes)
    return {"checks": [c.to_json() for c in checks],
            "kernel": kernel.to_json(),
            "numa_nodes": [n.to_json() for n in nodes]}


def dump_host(host: HostRoot, out: str) -> str:
    """Record the host as a fixture; write it atomically to ``out`` unless ``out`` is '-'."""
    from gpuvfio.fixture import dump_host as record

    text = record(host)
    if out == "-":
        return text
    from gpuvfio.journal import atomic_write

    directory = os.path.dirname(os.path.abspath(out))
    if not os.path.isdir(directory):
        raise HostReadError(f"cannot write {out}: {directory} is not a directory")
    atomic_write(os.path.abspath(out), text)
    return text
