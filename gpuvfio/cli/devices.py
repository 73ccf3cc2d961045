"""Device arguments as every command takes them: addresses, lspci slots (``01:00``: all its
functions), libvirt node-device names and ``-d VENDOR:[DEVICE][:CLASS]`` (gpuvfio.selector);
a command that changes the host says what a selector expanded to and wants ``--yes`` before it
acts on more than one physical device."""

from __future__ import annotations

from typing import Annotated, Optional

import typer

from gpuvfio.ops.completion import device_candidates
from gpuvfio.selector import SELECTOR_HELP

__all__ = ["DeviceIds", "Devices", "Yes", "complete_device"]


def _root_for_completion(ctx: typer.Context) -> str | None:
    """The --root given so far (the command's, else the global one); None: $GPUVFIO_ROOT or /."""
    while ctx is not None:
        if ctx.params.get("root"):
            return ctx.params["root"]
        ctx = ctx.parent
    return None


def complete_device(ctx: typer.Context, incomplete: str) -> list[str]:
    return device_candidates(_root_for_completion(ctx), incomplete)


Devices = Annotated[Optional[list[str]], typer.Argument(metavar="DEVICE", help=f"PCI devices: {SELECTOR_HELP}.",
                                                        show_default=False, autocompletion=complete_device)]
DeviceIds = Annotated[Optional[list[str]], typer.Option(
    "--device-id", "-d", metavar="VENDOR:[DEVICE][:CLASS]",
    help="Devices by PCI ids, as lspci -d (hex, x a wildcard digit; repeatable; 10de: is every NVIDIA function, "
         "NVSwitches too; 10de::03xx every NVIDIA display function).",
    show_default=False)]
Yes = Annotated[bool, typer.Option("--yes", "-y", help="Act on every device a slot or -d matched (needed when "
                                                       "they are more than one).")]
