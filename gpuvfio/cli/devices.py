"""Device arguments as every command takes them: addresses, lspci slots (``01:00``: all its
functions), libvirt node-device names and ``-d VENDOR:[DEVICE][:CLASS]`` (gpuvfio.selector);
a command that changes the host says what a selector expanded to and wants ``--yes`` before it
acts on more than one physical device."""

from __future__ import annotations

from typing import Annotated, Callable, Optional

import typer

from gpuvfio.address import PciAddress
from gpuvfio.errors import InputError
from gpuvfio.ops.selection import complete_devices, parse_selectors, select
from gpuvfio.selector import SELECTOR_HELP

def _root_for_completion(ctx: typer.Context) -> str | None:
    """The --root given so far (the command's, else the global one); None: $GPUVFIO_ROOT or /."""
    while ctx is not None:
        if ctx.params.get("root"):
            return ctx.params["root"]
        ctx = ctx.parent
    return None


def complete_device(ctx: typer.Context, incomplete: str) -> list[str]:
    return complete_devices(_root_for_completion(ctx), incomplete)


Devices = Annotated[Optional[list[str]], typer.Argument(metavar="DEVICE", help=f"PCI devices: {SELECTOR_HELP}.",
                                                        show_default=False, autocompletion=complete_device)]
DeviceIds = Annotated[Optional[list[str]], typer.Option(
    "--device-id", "-d", metavar="VENDOR:[DEVICE][:CLASS]",
    help="Devices by PCI ids, as lspci -d (hex, x a wildcard digit; repeatable; 10de: is every NVIDIA function, "
         "NVSwitches too; 10de::03xx every NVIDIA display function).",
    show_default=False)]
Yes = Annotated[bool, typer.Option("--yes", "-y", help="Act on every device a slot or -d matched (needed when "
                                                       "they are more than one).")]


def check_devices(texts: list[str] | None, ids: list[str] | None, *, required: bool) -> None:
    """Validate at the edge, before anything is read or changed."""
    parse_selectors(texts, ids)
    if required and not texts and not ids:
        raise InputError(f"no device given ({SELECTOR_HELP}, or -d VENDOR:[DEVICE])")


def resolve(host, texts: list[str] | None, ids: list[str] | None, *, changes: bool = False, yes: bool = False,
            tell: Callable[[str], None] = lambda line: None) -> list[PciAddress]:
    """The addresses the arguments mean on ``host``; for a host change, what a selector expanded
    to is told, and more than one device needs ``yes``."""
    if not texts and not ids:
        return []
    selection = select(host, texts, ids)
    if selection.expanded and changes:
        tell(f"selected {selection.describe()}")
        selection.confirm(yes)
    return selection.addresses


def resolve_one(host, text: str) -> PciAddress:
    """The one function ``text`` names (vgpu commands act on one GPU)."""
    found = resolve(host, [text], None)
    if len(found) != 1:
        raise InputError(f"{text} matches {len(found)} functions ({', '.join(map(str, found))}); name one, "
                         "e.g. with its .FUNC")
    return found[0]
