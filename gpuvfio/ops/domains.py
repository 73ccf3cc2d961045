"""Domain services: a validated request -> DomainSpec -> XML (checked against libvirt's schema),
and the idempotent define. gpuvfio xml, attach, the testbed and the Ansible domain module all
build their domains here.
"""

from __future__ import annotations

from dataclasses import dataclass

from gpuvfio.address import PciAddress
from gpuvfio.domain.render import domain_xml
from gpuvfio.domain.request import DomainRequest, domain_request, parse_hugepages, parse_numa, parse_uuid
from gpuvfio.domain.spec import DomainSpec, build_spec, mdev_uuid
from gpuvfio.host.inventory import Inventory, read_inventory
from gpuvfio.host.numa import read_numa
from gpuvfio.host.pciids import PciIds
from gpuvfio.ops.context import Context
from gpuvfio.errors import Refused
from gpuvfio.virt import lifecycle
from gpuvfio.virt.connection import libvirt_module
from gpuvfio.virt.define import DefineResult, define, difference

__all__ = ["Provisioned", "provision_xml", "define_domain", "Existing", "existing_domain", "differences",
           "DomainRequest", "domain_request", "parse_hugepages", "parse_numa", "parse_uuid", "mdev_uuid"]


@dataclass
class Provisioned:
    """A domain as gpuvfio would define it, with what it was built from."""

    spec: DomainSpec
    xml: str
    inventory: Inventory

    @property
    def assigned(self) -> list[PciAddress]:
        """The host PCI functions the guest gets (the slot's functions, or the vGPU's VF)."""
        return [PciAddress.parse(a) for a in self.spec.host_devices]


def provision_xml(ctx: Context, addresses: list[PciAddress], request: DomainRequest) -> Provisioned:
    inventory = read_inventory(ctx.host, names=PciIds.load(ctx.host.root))
    spec = build_spec(ctx.host, inventory, read_numa(ctx.host), addresses, request)
    return Provisioned(spec, domain_xml(spec), inventory)


def define_domain(ctx: Context, xml: str, *, uri: str | None = None, update: bool = False,
                  dry_run: bool = False) -> DefineResult:
    """Define ``xml`` on libvirt at ``uri`` (default: libvirt's default), idempotently."""
    return define(ctx.libvirt(uri), xml, update=update, dry_run=dry_run)


@dataclass
class Existing:
    """A domain libvirt has under the name: its stored definition, whether it runs, and (when
    gpuvfio defined it) the host devices gpuvfio recorded in it."""

    xml: str
    active: bool
    ours: bool
    devices: list[PciAddress]


def existing_domain(ctx: Context, name: str, *, uri: str | None = None, ours_only: bool = True) -> Existing | None:
    """The domain called ``name``, or None; with ``ours_only`` one gpuvfio did not define is refused."""
    dom = lifecycle.lookup(ctx.libvirt(uri), name)
    if dom is None:
        return None
    ours = lifecycle.made_by_gpuvfio(dom)
    if ours_only and not ours:
        raise Refused(f"domain {name} exists and was not created by gpuvfio; pick another name")
    libvirt = libvirt_module()
    return Existing(dom.XMLDesc(libvirt.VIR_DOMAIN_XML_INACTIVE), bool(dom.isActive()), ours,
                    lifecycle.recorded_devices(dom) if ours else [])


def differences(wanted_xml: str, current_xml: str) -> list[str]:
    """What defining ``wanted_xml`` would change in ``current_xml`` (see gpuvfio.virt.define)."""
    return difference(wanted_xml, current_xml)
