"""Console entry point. Starts light; hands anything non-trivial to the typer layer.

Importing typer costs ~75 ms (more than the whole inventory of a large host), so the
two invocations that are run most often by machines and people -- ``gpuvfio --help``
and ``gpuvfio [--root R] list [--all] --json [ADDR...]`` -- are served here without
it. Everything else (including ``COMMAND --help`` and any option not listed below)
goes to ``gpuvfio.cli``. tests/test_fast_path.py checks both paths print the same.
"""

from __future__ import annotations

import os
import sys

SUMMARY = "GPU passthrough provisioning for KVM hosts: inventory, doctor, binding, domains, verification."

# One line per command: the typer commands take their help from here, so the light
# top-level help cannot drift from the real command set.
COMMANDS = {
    "list": "Inventory: NVIDIA devices (or --all) with IOMMU group, viability, driver, NUMA node, "
            "PCIe link and largest BAR.",
    "doctor": "Host readiness checks for passthrough, each with a fix. Exit 1 when one fails.",
    "dump-host": "Record what gpuvfio reads from this host into a text fixture (bug reports, tests).",
    "bind": "Move devices (their whole IOMMU group) to vfio-pci: planned, checked, journaled, rolled back "
            "on failure.",
    "unbind": "Give devices back to the host: clear driver_override, leave vfio-pci, reprobe (no journal).",
    "restore": "Return devices gpuvfio bound to exactly their recorded drivers; works after a crash.",
    "status": "Show the devices gpuvfio holds, their original drivers and any unfinished operation.",
    "persist": "Keep devices on vfio-pci across reboots, by address (driverctl, or a udev rule + softdep).",
    "unpersist": "Stop keeping devices on vfio-pci across reboots.",
    "xml": "Libvirt domain XML for passing GPUs through (q35, OVMF, NUMA pinning, hugepages, MMIO "
           "window sized from the BARs), or a vGPU; --define defines it idempotently.",
    "vgpu": "vGPU profiles: list the types a GPU offers, create and remove instances, set the scheduler (journaled).",
    "verify": "Check a guest over SSH: the assigned devices are there, driver, CUDA, PCIe link, bandwidth.",
    "attach": "Bind, define, start, wait and verify a guest with GPUs passed through; undone on failure.",
    "detach": "Stop a guest, undefine it if gpuvfio defined it, and give its devices back.",
    "testbed": "Comparison testbeds: passthrough vs vGPU vs bare metal, measured and reported side by side.",
}


def fail(message: str, code: int) -> None:
    sys.stderr.write(f"gpuvfio: error: {message}\n")
    sys.exit(code)


def emit_json(data: dict) -> None:
    import json

    # No indent: json's C encoder only runs without it (3x faster on a large host).
    sys.stdout.write(json.dumps(data) + "\n")


def top_help() -> str:
    width = max(len(name) for name in COMMANDS)
    lines = ["Usage: gpuvfio [--root DIR] COMMAND [ARGS]...", "", SUMMARY, "", "Options:",
             "  --root DIR  Host root to inspect (a directory like /, or a host fixture file).",
             "              Default: $GPUVFIO_ROOT or /.",
             "  --help      Show this message and exit.", "", "Commands:"]
    lines += [f"  {name.ljust(width)}  {text}" for name, text in COMMANDS.items()]
    lines += ["", "Run 'gpuvfio COMMAND --help' for the options of a command."]
    return "\n".join(lines) + "\n"


def _fast_list(argv: list[str]) -> dict | None:
    """Parse ``[--root R] list [--root R] [--all] --json [ADDR...]``; None when it is anything else."""
    root = None
    seen_list = show_all = as_json = False
    addresses: list[str] = []
    args = iter(argv)
    for arg in args:
        if arg == "--root":
            root = next(args, None)
            if root is None:
                return None
        elif arg.startswith("--root="):
            root = arg[len("--root="):]
        elif arg == "list" and not seen_list:
            seen_list = True
        elif seen_list and arg == "--all":
            show_all = True
        elif seen_list and arg == "--json":
            as_json = True
        elif seen_list and arg and not arg.startswith("-"):
            addresses.append(arg)
        else:
            return None
    if not (seen_list and as_json):
        return None
    return {"root": root, "show_all": show_all, "addresses": addresses}


def main(argv: list[str] | None = None) -> None:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv in (["--help"], ["-h"]):
        sys.stdout.write(top_help())
        return
    fast = _fast_list(argv)
    if fast is None:
        from gpuvfio.cli import typer_main

        typer_main(argv)
        return
    from gpuvfio.address import PciAddress
    from gpuvfio.commands import list_report, open_host
    from gpuvfio.errors import GpuvfioError

    try:
        only = [PciAddress.parse(a) for a in fast["addresses"]]
        with open_host(fast["root"]) as (host, _label):
            report = list_report(host, show_all=fast["show_all"], only=only)
    except GpuvfioError as exc:
        fail(str(exc), exc.exit_code)
    try:
        emit_json(report)
    except BrokenPipeError:
        sys.exit(1)


def run() -> None:
    """The console script and ``python -m gpuvfio``: main(), then leave without the
    interpreter's teardown. Everything gpuvfio changes is written, and the journal and
    persistence files fsynced, before main returns, and temporary directories are removed by
    their with-blocks; unloading lxml, libvirt, paramiko and the other modules took about
    0.1 s per command (a fifth of what attach adds to a guest's boot). In-process callers
    (the tests, the Ansible modules) use main() and keep the normal exit."""
    code = 0
    try:
        main()
    except SystemExit as exc:
        if isinstance(exc.code, int):
            code = exc.code
        elif exc.code is not None:
            sys.stderr.write(f"{exc.code}\n")
            code = 1
    try:
        sys.stdout.flush()
        sys.stderr.flush()
    except OSError:  # a closed pipe: let the interpreter end the way it always did
        sys.exit(code)
    os._exit(code)

