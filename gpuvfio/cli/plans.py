"""Dry runs as every command that changes the host takes them: the plan shown, then the exit
the run would have (gpuvfio.ops.plans)."""

from __future__ import annotations

import contextlib
from typing import Annotated

import typer

from gpuvfio.cli import render
from gpuvfio.cli.app import emit_json, progress_for, say
from gpuvfio.errors import Refused
from gpuvfio.ops.context import live_context, open_context
from gpuvfio.ops.plans import Check, CheckStatus, Plan
from gpuvfio.ops.selection import resolve, select

__all__ = ["DryRun", "command_context", "confirmation", "needs_yes", "show_plan", "preview"]

DryRun = Annotated[bool, typer.Option("--dry-run", help="Show the plan; change nothing (no --yes needed); exit as "
                                                        "the run would.")]


@contextlib.contextmanager
def command_context(root: str | None, read_only: bool, **kwargs):
    """The Context of a command: a read-only one (status, a dry run) takes a recording (.host)
    as it takes a directory and has no way to run modprobe or systemctl; a command that
    changes the host takes the host itself."""
    if read_only:
        with open_context(root, **kwargs) as (ctx, _label):
            yield ctx
    else:
        with live_context(root, writable=True, **kwargs) as ctx:
            yield ctx


def confirmation(ctx, addresses, device_ids, yes: bool) -> Check | None:
    """The plan's line for --yes: a selection that reaches more than one physical device is
    confirmed by it, or refused without it (None: one device needs no confirmation)."""
    if not addresses and not device_ids:
        return None
    return select(ctx, addresses, device_ids).confirmation(yes)


def needs_yes(ctx, addresses, device_ids) -> Refused | None:
    """The refusal a run without --yes meets (a selector that reached more than one device), for
    a dry run to show its plan first and then exit as that run would."""
    check = confirmation(ctx, addresses, device_ids, False)
    return Refused(check.message) if check is not None else None


def show_plan(plan: Plan, as_json: bool, *, confirm: Check | None = None, show_xml: bool = False) -> None:
    """Print ``plan`` (text, or JSON with --json) and exit as its run would: its --yes line
    first (``confirm``); a run without the --yes it needs is refused first, in its own words;
    a refused plan is refused with the plan's words; otherwise exit 0, nothing changed."""
    unconfirmed = Refused(confirm.message) if confirm is not None and confirm.status is CheckStatus.REFUSE else None
    if confirm is not None:
        plan.checks.insert(0, confirm)
    if as_json:
        emit_json(plan.to_json())
    else:
        render.print_operation_plan(plan.to_json(), show_xml=show_xml)
    if unconfirmed is not None:
        raise unconfirmed
    if plan.refused:
        raise plan.refusal()
    if not as_json:
        say(f"dry run: nothing changed; the run takes {len(plan.steps)} step{'s' if len(plan.steps) != 1 else ''}"
            if plan.steps else "dry run: nothing to do")


def preview(root: str | None, addresses, device_ids, yes: bool, as_json: bool, make_plan) -> None:
    """A command's --dry-run over device arguments: resolve them on a read-only Context (a
    recording too), make the plan with ``make_plan(ctx, addresses)``, show it, exit as the run."""
    tell = progress_for(as_json)
    with command_context(root, True, progress=tell) as ctx:
        wanted = resolve(ctx, addresses, device_ids, changes=True, yes=True, tell=tell)
        show_plan(make_plan(ctx, wanted), as_json, confirm=confirmation(ctx, addresses, device_ids, yes))
