"""The typer layer: parse arguments, call command functions, print. Errors become one line.

Exit status: 0 success; 1 a check failed or a request was refused; 2 bad input
(malformed address, unusable root, unreadable host files, unknown option).
"""

from __future__ import annotations

import sys
from typing import Annotated, Optional

import typer

from gpuvfio.commands import open_host
from gpuvfio.errors import GpuvfioError
from gpuvfio.hostroot import ROOT_ENV
from gpuvfio.main import COMMANDS, SUMMARY, emit_json, fail

app = typer.Typer(
    name="gpuvfio",
    help=SUMMARY,
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


def resolve_root(command_root: str | None) -> str | None:
    """The command's --root, else the global one (both also read GPUVFIO_ROOT)."""
    return command_root or _state["root"]


@app.command("list", help=COMMANDS["list"])
def list_cmd(
    addresses: Annotated[Optional[list[str]], typer.Argument(
        metavar="[ADDR]...", help="Only these PCI functions (DDDD:BB:SS.F).")] = None,
    show_all: Annotated[bool, typer.Option("--all", help="Every PCI function, not only NVIDIA.")] = False,
    as_json: JsonOption = False,
    root: RootOption = None,
) -> None:
    from gpuvfio.address import PciAddress
    from gpuvfio.commands import list_report

    wanted = [PciAddress.parse(a) for a in addresses or []]
    with open_host(resolve_root(root)) as (host, label):
        report = list_report(host, show_all=show_all, only=wanted)
    if as_json:
        emit_json(report)
        return
    from gpuvfio.render import print_list

    print_list(report, f"PCI functions on {label}" if show_all else f"NVIDIA devices on {label}")


@app.command("doctor", help=COMMANDS["doctor"])
def doctor_cmd(as_json: JsonOption = False, root: RootOption = None) -> None:
    from gpuvfio.commands import doctor_report

    with open_host(resolve_root(root)) as (host, label):
        report = doctor_report(host)
    if as_json:
        emit_json({"checks": report["checks"]})
    else:
        from gpuvfio.render import print_doctor

        print_doctor(report, f"Readiness of {label}")
    if any(c["status"] == "fail" for c in report["checks"]):
        raise typer.Exit(1)


@app.command("dump-host", help=COMMANDS["dump-host"])
def dump_host_cmd(
    out: Annotated[str, typer.Argument(metavar="OUT", help="Fixture file to write ('-' for stdout).")],
    root: RootOption = None,
) -> None:
    from gpuvfio.commands import dump_host

    with open_host(resolve_root(root)) as (host, _label):
        text = dump_host(host, out)
    if out == "-":
        sys.stdout.write(text)
    else:
        records = text.count("\n") - 1
        sys.stderr.write(f"wrote {records} records to {out}\n")


def typer_main(argv: list[str] | None = None) -> None:
    try:
        # Without standalone mode click returns the code of a typer.Exit instead of exiting.
        code = app(args=argv, standalone_mode=False, prog_name="gpuvfio")
        if isinstance(code, int) and code:
            sys.exit(code)
    except GpuvfioError as exc:
        fail(str(exc), exc.exit_code)
    except typer.Exit as exc:
        sys.exit(getattr(exc, "exit_code", 0))
    except typer.Abort:
        fail("aborted", 130)
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
        fail(message.splitlines()[0] + (" (see gpuvfio --help)" if code == 2 else ""), code)



# Commands defined in their own modules register themselves on ``app``.
from gpuvfio import cli_bind, cli_domain, cli_guest, cli_testbed  # noqa: E402,F401
