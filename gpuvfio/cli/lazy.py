"""The root command's index: each command's name, its module and its one-line help, so that
``gpuvfio --help`` and the completion of a command name import no command module, and a
command's module (with what it imports: gpuvfio.ops, libvirt, jinja2, lxml) loads when that
command runs.

This is click's documented lazy-loading pattern ("Lazily Loading Subcommands", click 8.1
docs/complex.rst: a Group whose ``list_commands`` names the commands and whose
``get_command`` imports one), on typer's group class: typer (0.27 and later, our floor) builds
the root group from ``typer.Typer(cls=...)``. The index is held to the commands it names by a test
(tests/unit/test_lazy_commands.py): the same names, the same one-line help.
"""

from __future__ import annotations

import importlib
from collections.abc import Iterator, MutableMapping
from dataclasses import dataclass

import typer
import typer.main
from typer.core import TyperArgument, TyperCommand, TyperGroup


@dataclass(frozen=True)
class Entry:
    module: str  # the module that declares the command (gpuvfio.cli.<module>)
    attribute: str  # the typer.Typer in it that holds the command (or is the group)
    help: str  # the one-line help, as ``gpuvfio --help`` lists it


# In the order ``gpuvfio --help`` lists them.
COMMANDS: dict[str, Entry] = {
    "bind": Entry("gpuvfio.cli.binding", "commands", "Move devices (their whole IOMMU group) to vfio-pci: planned, "
                  "checked, journaled, rolled back on failure."),
    "unbind": Entry("gpuvfio.cli.binding", "commands", "Give devices back to the host: clear driver_override, leave "
                    "vfio-pci, reprobe (no journal)."),
    "restore": Entry("gpuvfio.cli.binding", "commands", "Return devices gpuvfio bound to exactly their recorded "
                     "drivers (all, when none is named); works after a crash."),
    "reset": Entry("gpuvfio.cli.binding", "commands", "Reset devices gpuvfio holds through the kernel (a device that "
                   "came back broken from a guest); one that answers again may be bound or restored."),
    "status": Entry("gpuvfio.cli.binding", "commands", "Show the devices gpuvfio holds, their original drivers and "
                    "any unfinished operation."),
    "persist": Entry("gpuvfio.cli.binding", "commands", "Keep devices on vfio-pci across reboots, by address "
                     "(driverctl, or a udev rule + softdep)."),
    "unpersist": Entry("gpuvfio.cli.binding", "commands", "Stop keeping devices on vfio-pci across reboots."),
    "completion": Entry("gpuvfio.cli.completion", "commands", "Print the shell completion script (put it where "
                        "your shell reads completions)."),
    "xml": Entry("gpuvfio.cli.domain", "commands", "Libvirt domain XML for passing GPUs through (q35, OVMF, NUMA "
                 "pinning, hugepages, MMIO window sized from the BARs), or a vGPU; --define defines it "
                 "idempotently."),
    "verify": Entry("gpuvfio.cli.guest", "commands", "Check a guest over SSH: the assigned devices are there, "
                    "driver, CUDA, PCIe link, bandwidth."),
    "attach": Entry("gpuvfio.cli.guest", "commands", "Bind, define, start, wait and verify a guest with GPUs passed "
                    "through; undone on failure."),
    "detach": Entry("gpuvfio.cli.guest", "commands", "Stop a guest, undefine it if gpuvfio defined it, and give its "
                    "devices back."),
    "list": Entry("gpuvfio.cli.inventory", "commands", "Inventory: NVIDIA devices (or --all) with IOMMU group, "
                  "viability, driver, NUMA node, PCIe link and largest BAR."),
    "doctor": Entry("gpuvfio.cli.readiness", "commands", "Host readiness checks for passthrough, each with a fix."),
    "health": Entry("gpuvfio.cli.health", "commands", "PCIe health of the GPUs (and what is on vfio-pci, with --all) "
                    "and the ports above them: AER errors, the link, config space, a broken return, the domain "
                    "that holds each; exit 1 when one is degraded or failed."),
    "qualify": Entry("gpuvfio.cli.health", "commands", "Before a device's first tenant: reset it by each method "
                     "the kernel offers, checking config space, BARs and link each time; record the verdicts per "
                     "model and method; exit 1 when one failed."),
    "dump-host": Entry("gpuvfio.cli.readiness", "commands", "Record what gpuvfio reads from this host into a text "
                       "fixture (bug reports, tests)."),
    "topo": Entry("gpuvfio.cli.topology", "commands", "GPU/NIC matrix like nvidia-smi topo -m (X, PIX, PXB, PHB, "
                  "NODE, SYS, NV#), CPU and NUMA affinity, NUMA distances and each device's place in the PCIe tree."),
    "export": Entry("gpuvfio.cli.export", "export_app", "What gpuvfio knows about the host's GPUs, for KubeVirt and "
                    "DRA drivers."),
    "testbed": Entry("gpuvfio.cli.testbed", "testbed_app", "Comparison testbeds: passthrough vs vGPU vs bare metal, "
                     "measured and reported side by side."),
    "vgpu": Entry("gpuvfio.cli.vgpu", "vgpu_app", "vGPU profiles: list the types a GPU offers, create and remove "
                  "instances, set the scheduler (journaled)."),
}


class GlobalOptions:
    """What the global options set for the command that follows (one process, one command):
    given before the command (gpuvfio -v list) or, for -v, after it (gpuvfio list -v)."""

    root: str | None = None
    verbose: bool = False


VERBOSE_HELP = "Progress lines on stderr, also with --json."


def _set_verbose(ctx, param, value: bool) -> None:
    if value:
        GlobalOptions.verbose = True


class WordArgument(TyperArgument):
    """An argument shown by its metavar in words (DEVICE, NAME), without typer's type suffix
    (``DEVICE <list[str]>``): the help says what to give, the metavar names it."""

    def display_type_rich(self, ctx) -> None:
        return None


class GpuvfioCommand(TyperCommand):
    """A command as gpuvfio shows it: arguments in words, and -v/--verbose taken after the
    command as before it."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        for param in self.params:
            if type(param) is TyperArgument:
                param.__class__ = WordArgument  # the same parameter, shown without the type
        if not any("--verbose" in getattr(p, "opts", ()) for p in self.params):
            self.params.append(verbose_option())


def verbose_option():
    """-v/--verbose as a command's own option: it sets GlobalOptions.verbose and is not handed
    to the command's function (typer builds the parameter; only its use differs)."""
    holder = typer.Typer(add_completion=False)

    @holder.command()
    def verbose_holder(verbose: bool = typer.Option(False, "--verbose", "-v", help=VERBOSE_HELP,
                                                    callback=_set_verbose)) -> None:
        """Only its parameter is taken."""

    option = typer.main.get_command(holder).params[0]
    option.expose_value = False
    return option


class CommandTyper(typer.Typer):
    """typer.Typer whose commands are GpuvfioCommands."""

    def command(self, *args, cls=None, **kwargs):
        return super().command(*args, cls=cls or GpuvfioCommand, **kwargs)


def command_typer(**settings) -> typer.Typer:
    """The typer.Typer a command module declares its commands on: help as plain text (no rich
    markup, as the root's), no completion options of its own (the root's ``completion``)."""
    return CommandTyper(rich_markup_mode=None, add_completion=False, pretty_exceptions_enable=False, **settings)


def load(name: str):
    """The click command ``name`` (importing its module): from the module's typer.Typer."""
    entry = COMMANDS[name]
    built = typer.main.get_command(getattr(importlib.import_module(entry.module), entry.attribute))
    if entry.attribute == "commands":
        # A module's Typer with several commands is a group of them; with one, that command.
        built = built.commands[name] if isinstance(built, TyperGroup) else built
    built.name = name
    return built


class LazyCommands(MutableMapping):
    """The root group's commands: every name in COMMANDS, each loaded when first looked up."""

    def __init__(self, added: dict) -> None:
        self.loaded = dict(added)

    def __getitem__(self, name: str):
        if name not in self.loaded:
            if name not in COMMANDS:
                raise KeyError(name)
            self.loaded[name] = load(name)
        return self.loaded[name]

    def __setitem__(self, name: str, command) -> None:
        self.loaded[name] = command

    def __delitem__(self, name: str) -> None:
        raise TypeError("the command index is fixed")

    def __iter__(self) -> Iterator[str]:
        yield from COMMANDS
        yield from (n for n in self.loaded if n not in COMMANDS)

    def __len__(self) -> int:
        return len(set(COMMANDS) | set(self.loaded))

    def __contains__(self, name: object) -> bool:
        return name in COMMANDS or name in self.loaded


class LazyGroup(TyperGroup):
    """The root group: lists, shows and completes command names from the index; imports a
    command's module when the command is resolved (it runs, or its own help or arguments are
    asked for)."""

    def __init__(self, **attrs) -> None:
        super().__init__(**attrs)
        self.commands = LazyCommands(dict(self.commands))
        self.standing_in = False

    def stand_in(self, name: str):
        """The command if loaded, else a command that only carries its index help: what the
        help listing and name completion read from it (click's own shortening applies)."""
        if name in self.commands.loaded or name not in COMMANDS:
            return self.commands.get(name)
        return TyperCommand(name=name, help=COMMANDS[name].help)

    def list_commands(self, ctx) -> list[str]:
        return list(self.commands)  # names only (typer's own reads items(): every command loaded)

    def get_command(self, ctx, cmd_name: str):
        if self.standing_in:
            return self.stand_in(cmd_name)
        return super().get_command(ctx, cmd_name)

    def format_commands(self, ctx, formatter) -> None:
        self.standing_in = True
        try:
            super().format_commands(ctx, formatter)
        finally:
            self.standing_in = False

    def shell_complete(self, ctx, incomplete: str) -> list:
        self.standing_in = True
        try:
            return super().shell_complete(ctx, incomplete)
        finally:
            self.standing_in = False
