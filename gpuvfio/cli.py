"""The typer layer: parse arguments, call command functions, print. Errors become one line.

Exit status: 0 success; 1 a check failed or a request was refused; 2 bad input
(malformed address, unusable root, unreadable host files, unknown option).
"""

from __future__ import annotations

import contextlib
import json
import os
import sys
import tempfile
from typing import Annotated, Optional

import typer

from gpuvfio.errors import GpuvfioError, HostReadError
from gpuvfio.hostroot import ROOT_ENV, HostRoot

app = typer.Typer(
    name="gpuvfio",
    help="GPU passthrough provisioning for KVM hosts: inventory, doctor, binding, domains, verification.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
    rich_markup_mode=None,
)

RootOption = Annotated[
    Optional[str],
    typer.Option("--root", envvar=ROOT_ENV, metavar="DIR",
                 help="Host root to inspect (a directory like /, or a host fixture file). Default /."),
]
JsonOption = Annotated[bool, typer.Option("--json", help="Print one JSON object instead of a table.")]

_state: dict = {"root": None}


@app.callback()
def _global(root: RootOption = None) -> None:
    _state["root"] = root


@contextlib.contextmanager
def open_host(command_root: str | None):
    """The host behind ``--root``: a directory, or a fixture file loaded into a temp dir."""
    root = command_root or _state["root"] or "/"
    if os.path.isfile(root):
        from gpuvfio.fixture import load_fixture

        try:
            with open(root, encoding="utf-8") as handle:
                text = handle.read()
        except (OSError, UnicodeDecodeError) as exc:
            raise HostReadError(f"cannot read host fixture {root}: {exc}") from None
        with tempfile.TemporaryDirectory(prefix="gpuvfio-host-") as tmp:
            load_fixture(text, tmp)
            yield HostRoot(tmp), os.path.basename(root)
        return
    yield HostRoot(root), root


def _emit_json(data: dict) -> None:
    sys.stdout.write(json.dumps(data, indent=2) + "\n")


@app.command("list")
def list_cmd(
    addresses: Annotated[Optional[list[str]], typer.Argument(
        metavar="[ADDR]...", help="Only these PCI functions (DDDD:BB:SS.F).")] = None,
    show_all: Annotated[bool, typer.Option("--all", help="Every PCI function, not only NVIDIA.")] = False,
    as_json: JsonOption = False,
    root: RootOption = None,
) -> None:
    """Inventory: NVIDIA devices (or --all) with IOMMU group, viability, NUMA, link, BARs."""
    from gpuvfio.address import PciAddress
    from gpuvfio.commands import list_report

    wanted = [PciAddress.parse(a) for a in addresses or []]
    with open_host(root) as (host, label):
        report = list_report(host, show_all=show_all, only=wanted)
    if as_json:
        _emit_json(report)
        return
    from gpuvfio.render import print_list

    print_list(report, f"PCI functions on {label}" if show_all else f"NVIDIA devices on {label}")


@app.command("doctor")
def doctor_cmd(as_json: JsonOption = False, root: RootOption = None) -> None:
    """Host readiness checks for passthrough, each with a fix. Exit 1 when one fails."""
    from gpuvfio.commands import doctor_report

    with open_host(root) as (host, label):
        report = doctor_report(host)
    if as_json:
        _emit_json({"checks": report["checks"]})
    else:
        from gpuvfio.render import print_doctor

        print_doctor(report, f"Readiness of {label}")
    if any(c["status"] == "fail" for c in report["checks"]):
        raise typer.Exit(1)


@app.command("dump-host")
def dump_host_cmd(
    out: Annotated[str, typer.Argument(metavar="OUT", help="Fixture file to write ('-' for stdout).")],
    root: RootOption = None,
) -> None:
    """Record what gpuvfio reads from this host into a text fixture (for bug reports, tests)."""
    from gpuvfio.commands import dump_host

    with open_host(root) as (host, _label):
        text = dump_host(host, out)
    if out == "-":
        sys.stdout.write(text)
    else:
        records = text.count("\n") - 1
        sys.stderr.write(f"wrote {records} records to {out}\n")


def _fail(message: str, code: int) -> None:
    sys.stderr.write(f"gpuvfio: error: {message}\n")
    sys.exit(code)


def main(argv: list[str] | None = None) -> None:
    try:
        # Without standalone mode click returns the code of a typer.Exit instead of exiting.
        code = app(args=argv, standalone_mode=False, prog_name="gpuvfio")
        if isinstance(code, int) and code:
            sys.exit(code)
    except GpuvfioError as exc:
        _fail(str(exc), exc.exit_code)
    except typer.Exit as exc:
        sys.exit(getattr(exc, "exit_code", 0))
    except typer.Abort:
        _fail("aborted", 130)
    except BrokenPipeError:
        sys.exit(1)
    except Exception as exc:  # click's own usage errors (vendored or not): duck-typed
        if not hasattr(exc, "format_message"):
            raise
        message = exc.format_message()
        if type(exc).__name__ == "NoArgsIsHelpError":
            sys.stdout.write(message + "\n")
            sys.exit(2)
        code = getattr(exc, "exit_code", 2)
        _fail(message.splitlines()[0] + (" (see gpuvfio --help)" if code == 2 else ""), code)
