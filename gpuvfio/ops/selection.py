"""Which PCI functions a command's device arguments mean on this host: exact addresses, lspci
slots and ``-d`` id filters, libvirt node-device names (gpuvfio.selector parses them).

An exact address stands for itself and is checked by the command (so "no such function" and
"is a bridge" keep their own messages). A slot or an id filter expands to the matching
functions of the host, PCI bridges left out (no command acts on one). A command that changes
the host shows what a selector expanded to, and wants a confirmation when it matched more than
one physical device (``-d 10de:`` also matches NVSwitches).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Callable

from gpuvfio.address import PciAddress
from gpuvfio.errors import InputError, Refused
from gpuvfio.host.inventory import FunctionIndex, list_addresses, read_ids, require_present
from gpuvfio.host.model import DISPLAY_CLASS, PCI_BRIDGE_CLASS
from gpuvfio.planning import Check, CheckStatus
from gpuvfio.selector import SELECTOR_HELP, IdFilter, Selector

if TYPE_CHECKING:  # the annotation only: a Context is passed in, never made here
    from gpuvfio.ops.context import Context


@dataclass
class Selection:
    addresses: list[PciAddress]
    typed: list[str] = field(default_factory=list)  # the selectors and -d filters as given
    expanded: bool = False  # a slot or an id filter was expanded on the host

    @property
    def devices(self) -> list[tuple[int, int, int]]:
        """The physical devices (domain, bus, slot) selected."""
        return sorted({a.device for a in self.addresses})

    def describe(self) -> str:
        return f"{' '.join(self.typed)} -> {', '.join(map(str, self.addresses))}"

    def confirm(self, yes: bool, yes_hint: str = "--yes") -> None:
        """Refused when the selection reaches more than one physical device (slot) and ``yes`` was
        not given: a host change should not reach further than the admin looked. Counted in
        physical devices whatever the spelling: ``18:00 19:00`` and ``18:00.0 19:00.0`` both
        name two GPUs, ``01:00`` (a GPU and its audio) one. ``yes_hint``: how the interface says
        yes (the CLI's --yes, a module's parameter)."""
        check = self.confirmation(yes, yes_hint)
        if check is not None and check.status is CheckStatus.REFUSE:
            raise Refused(check.message)

    def confirmation(self, yes: bool, yes_hint: str = "--yes") -> Check | None:
        """The plan's line for the confirmation (None: one physical device needs none)."""
        if len(self.devices) <= 1:
            return None
        reach = (f"{' '.join(self.typed)} {'matches' if self.expanded else 'names'} {len(self.devices)} physical "
                 f"devices ({', '.join(map(str, self.addresses))})")
        if yes:
            return Check("confirm", CheckStatus.OK, f"{reach}: confirmed with {yes_hint}")
        return Check("confirm", CheckStatus.REFUSE, f"{reach}; add {yes_hint} to act on all of them")


def parse_selectors(texts: list[str] | None, ids: list[str] | None) -> tuple[list[Selector], list[IdFilter]]:
    """Parse at the edge (bad input before anything is read)."""
    return [Selector.parse(t) for t in texts or []], [IdFilter.parse(t) for t in ids or []]


def select(ctx: Context, texts: list[str] | None, ids: list[str] | None = None, *,
           index: FunctionIndex | None = None) -> Selection:
    """The functions ``texts`` (selectors) and ``ids`` (-d filters, any of which may match) mean
    on the Context's host; with only -d, every function they match. InputError when nothing matches.
    ``index``: the host's ids read once for the command (gpuvfio list reads them anyway)."""
    host = ctx.host
    selectors, filters = parse_selectors(texts, ids)
    typed = [s.text for s in selectors] + [f"-d {f.text}" for f in filters]
    exact = [s.address for s in selectors]
    if exact and all(a is not None for a in exact) and not filters:
        return Selection(sorted(set(exact)), typed)
    index = index or FunctionIndex(host)
    present = index.addresses
    chosen = []
    with host.sys_dirs() as dirs:
        for address in present:
            if selectors and not any(s.matches(address) for s in selectors):
                continue
            # A -d filter decides on the vendor alone for most functions: the rest of the ids
            # are read only where the vendor fits (lspci -d reads no more).
            if filters and not any(f.vendor_fits(index.vendor(address, dirs)) for f in filters):
                continue
            found = index.ids(address, dirs)
            named = any(s.address == address for s in selectors)
            if found.class_id.startswith(PCI_BRIDGE_CLASS) and not named:
                continue
            if filters and not any(f.matches(found.vendor_id, found.device_id, found.class_id) for f in filters):
                continue
            chosen.append(address)
    # An exact address that is not on the host stays, for the command's own message.
    chosen += [a for a in exact if a is not None and a not in index.present and not filters]
    if not chosen:
        raise InputError(f"no PCI function on this host matches {' '.join(typed)}")
    return Selection(sorted(set(chosen)), typed, expanded=True)


def check_devices(texts: list[str] | None, ids: list[str] | None, *, required: bool,
                  missing: str = f"no device given ({SELECTOR_HELP}, or -d VENDOR:[DEVICE])") -> None:
    """Validate at the edge, before anything is read or changed (``missing``: how the interface
    asks for a device, as ``yes_hint`` for a confirmation)."""
    parse_selectors(texts, ids)
    if required and not texts and not ids:
        raise InputError(missing)


def resolve(ctx: Context, texts: list[str] | None, ids: list[str] | None, *, changes: bool = False,
            yes: bool = False, yes_hint: str = "--yes", tell: Callable[[str], None] = lambda line: None,
            index: FunctionIndex | None = None) -> list[PciAddress]:
    """The addresses the arguments mean on the Context's host (every interface: the CLI, the Ansible
    modules, the testbed spec); for a host change, what a selector expanded to is told, and more
    than one physical device needs ``yes``."""
    if not texts and not ids:
        return []
    selection = select(ctx, texts, ids, index=index)
    if changes:
        if selection.expanded:
            tell(f"selected {selection.describe()}")
        selection.confirm(yes, yes_hint)
    return selection.addresses


def resolve_one(ctx: Context, text: str) -> PciAddress:
    """The one function ``text`` names (vgpu commands act on one GPU)."""
    found = resolve(ctx, [text], None)
    if len(found) != 1:
        raise InputError(f"{text} matches {len(found)} functions ({', '.join(map(str, found))}); name one, "
                         "e.g. with its .FUNC")
    return found[0]


def the_gpu(ctx: Context, addresses: list[PciAddress]) -> PciAddress:
    """The one GPU (display-class function) among ``addresses``, as a vGPU needs one parent: a
    slot's audio function is left out; none, more than one, or a function the host does not
    have is bad input."""
    host = ctx.host
    require_present(set(list_addresses(host)), addresses)
    gpus = [a for a in addresses if read_ids(host, a)[2].startswith(DISPLAY_CLASS)]
    if len(gpus) != 1:
        raise InputError(f"a vGPU takes one GPU, the selection holds {len(gpus)} "
                         f"({', '.join(map(str, gpus)) or 'no display function'})")
    return gpus[0]
