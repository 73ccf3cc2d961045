"""``gpuvfio attach`` and ``detach``: the whole path, transactional.

attach: readiness (the bind plan's checks) -> bind -> DomainSpec/XML -> define -> start ->
wait for SSH -> verify -> report. Every step that changes something registers its undo;
when a later step fails the undos run in reverse (domain destroyed and undefined, devices
restored) unless the caller keeps the wreck for inspection (--keep-on-failure).
detach: stop the guest (ACPI, then destroy after a timeout), undefine it if gpuvfio
defined it, give its devices back (gpuvfio restore of the devices in its metadata).
"""

from __future__ import annotations

import time
import xml.etree.ElementTree as ET
from dataclasses import dataclass, field
from typing import Callable

from gpuvfio import guests
from gpuvfio.address import PciAddress
from gpuvfio.errors import GpuvfioError, InputError
from gpuvfio.hostroot import HostRoot
from gpuvfio.ssh import Session, SshTarget


@dataclass
class AttachResult:
    name: str
    steps: list[dict] = field(default_factory=list)
    report: dict | None = None
    xml: str | None = None
    ssh: dict | None = None
    rolled_back: list[str] = field(default_factory=list)
    ok: bool = False

    def to_json(self) -> dict:
        return {"name": self.name, "ok": self.ok, "steps": self.steps, "verify": self.report, "ssh": self.ssh,
                "rolled_back": self.rolled_back, "xml": self.xml}


class AttachFailed(GpuvfioError):
    def __init__(self, message: str, result: AttachResult, exit_code: int = 1) -> None:
        super().__init__(message)
        self.result = result
        self.exit_code = exit_code


def attach(host: HostRoot, addresses: list[PciAddress], options, *, conn, ssh: SshTarget | None,
           bind_step: Callable | None, restore_step: Callable | None, verify: bool = True,
           keep_on_failure: bool = False, boot_timeout: float = 300.0, known_hosts_default: str | None = None,
           progress: Callable[[str], None] = lambda line: None) -> AttachResult:
    """``bind_step(addresses)`` binds (and returns the report), ``restore_step(addresses)`` undoes it:
    injected so the unit lane can use a simulated kernel and the live host the real one."""
    from gpuvfio.domainspec import build_spec
    from gpuvfio.domainxml import domain_xml
    from gpuvfio.inventory import read_inventory
    from gpuvfio.numa import read_numa
    from gpuvfio.pciids import PciIds
    from gpuvfio.verify import expectations, verify_guest

    result = AttachResult(options.name)
    undo: list[tuple[str, Callable[[], None]]] = []

    def step(name: str, func: Callable, *args):
        started = time.monotonic()
        progress(f"{name} ...")
        try:
            value = func(*args)
        except GpuvfioError as exc:
            result.steps.append({"step": name, "ok": False, "seconds": round(time.monotonic() - started, 3),
                                 "error": str(exc)})
            raise
        result.steps.append({"step": name, "ok": True, "seconds": round(time.monotonic() - started, 3)})
        progress(f"{name}: done ({time.monotonic() - started:.1f}s)")
        return value

    existing = guests.lookup(conn, options.name)
    if existing is not None and not guests.made_by_gpuvfio(existing):
        raise InputError(f"domain {options.name} exists and was not created by gpuvfio; pick another --name")
    if existing is not None and existing.isActive():
        raise InputError(f"domain {options.name} is running; gpuvfio detach {options.name} first")
    try:
        inventory = read_inventory(host, names=PciIds.load(host.root))
        spec = build_spec(host, inventory, read_numa(host), addresses, options)
        result.xml = domain_xml(spec)
        assigned = [PciAddress.parse(a) for a in spec.host_devices]
        if assigned and bind_step is not None:
            step("bind", bind_step, assigned)
            undo.append(("restore devices", lambda: restore_step(assigned)))
        dom = step("define", _define, conn, result.xml)
        undo.append(("undefine", lambda: guests.undefine(dom)))
        step("start", guests.start, dom)
        undo.append(("destroy", lambda: guests.stop(dom, timeout=0)))
        if ssh is None:
            host_port = step("find address", guests.ssh_address, conn, dom)
            ssh_target = SshTarget(host_port[0], host_port[1])
        else:
            ssh_target = ssh
        ssh_target.connect_timeout = boot_timeout
        result.ssh = {"host": ssh_target.host, "port": ssh_target.port, "user": ssh_target.user}
        session = step("wait for ssh", Session(ssh_target, known_hosts_default).connect)
        try:
            result.ssh["notes"] = list(ssh_target.notes)
            if verify:
                expected = expectations(inventory, assigned)
                result.report = step("verify", verify_guest, session, expected)
        finally:
            session.close()
    except GpuvfioError as exc:
        if not keep_on_failure:
            for what, action in reversed(undo):
                try:
                    action()
                    result.rolled_back.append(what)
                except GpuvfioError as undo_exc:
                    result.rolled_back.append(f"{what} FAILED: {undo_exc}")
        raise AttachFailed(f"attach {options.name} failed: {exc}"
                           + (f"; rolled back: {', '.join(result.rolled_back)}" if result.rolled_back else
                              ("; kept as it is (--keep-on-failure)" if keep_on_failure and undo else "")),
                           result, exit_code=getattr(exc, "exit_code", 1)) from None
    result.ok = result.report is None or result.report["ok"]
    return result


def _define(conn, xml: str):
    libvirt = guests._libvirt()
    try:
        return conn.defineXML(xml)
    except libvirt.libvirtError as exc:
        raise guests.LibvirtError(f"libvirt refused the domain: {exc.get_error_message()}") from None


def domain_devices(dom) -> list[PciAddress]:
    """The host devices gpuvfio recorded in the domain's metadata."""
    root = ET.fromstring(dom.XMLDesc(0))
    found = []
    for element in root.iter(f"{{{guests.METADATA_NS}}}device"):
        address = PciAddress.try_parse(element.get("address", ""))
        if address:
            found.append(address)
    return found


def detach(conn, name: str, *, restore_step: Callable | None, timeout: float = 60.0,
           progress: Callable[[str], None] = lambda line: None) -> dict:
    dom = guests.lookup(conn, name)
    if dom is None:
        raise InputError(f"no domain named {name}")
    ours = guests.made_by_gpuvfio(dom)
    devices = domain_devices(dom) if ours else []
    how = guests.stop(dom, timeout=timeout)
    progress(f"{name}: {how}")
    if ours:
        guests.undefine(dom)
        progress(f"{name}: undefined")
    restored = None
    if devices and restore_step is not None:
        restored = restore_step(devices)
    return {"name": name, "stopped": how, "undefined": ours, "devices": [str(d) for d in devices],
            "restored": restored}
