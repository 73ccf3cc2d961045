"""Readiness services: the doctor report (every check, with the facts it was judged on) and a
host recorded as a fixture (gpuvfio doctor, gpuvfio dump-host, the Ansible facts module)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from dataclasses import dataclass

from gpuvfio.bind.journal import journal_check
from gpuvfio.user_files import check_output_path, write_output
from gpuvfio.host.doctor import FAIL, WARN, Check, run_doctor
from gpuvfio.host.recording import dump_host as record
from gpuvfio.host.inventory import read_inventory
from gpuvfio.host.kernel import KernelInfo, read_kernel
from gpuvfio.host.model import NumaNode
from gpuvfio.host.numa import read_numa
from gpuvfio.host.pciids import PciIds

if TYPE_CHECKING:  # the annotation only: a Context is passed in, never made here
    from gpuvfio.ops.context import Context

__all__ = ["DoctorReport", "doctor_report", "dump_host"]


@dataclass
class DoctorReport:
    """gpuvfio doctor: every readiness check (in the order they run), with the kernel and NUMA
    facts they were judged on."""

    checks: list[Check]
    kernel: KernelInfo
    numa_nodes: list[NumaNode]

    @property
    def failed(self) -> list[Check]:
        return [c for c in self.checks if c.status == FAIL]

    @property
    def warned(self) -> list[Check]:
        return [c for c in self.checks if c.status == WARN]

    def to_json(self) -> dict:
        return {"checks": [c.to_json() for c in self.checks],
                "kernel": self.kernel.to_json(),
                "numa_nodes": [n.to_json() for n in self.numa_nodes]}


def doctor_report(ctx: Context) -> DoctorReport:
    host = ctx.host
    inventory = read_inventory(host, names=PciIds.load(host))
    kernel = read_kernel(host)
    nodes = read_numa(host)
    return DoctorReport(run_doctor(host, inventory, kernel, nodes) + [journal_check(host)], kernel, nodes)


def dump_host(ctx: Context, out: str) -> str:
    """Record the host as a fixture; write it atomically to ``out`` unless ``out`` is '-'.

    ``out`` is a new name in an existing directory, or a regular file (replaced): never a
    device, a directory or a link (gpuvfio runs as root; a rename over /dev/null is a mistake)."""
    host = ctx.host
    if out != "-":
        check_output_path(out)
    text = record(host)
    if out != "-":
        write_output(out, text)
    return text
