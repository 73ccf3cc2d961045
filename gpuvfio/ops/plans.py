"""Plans as values: what an operation that changes the host will do, decided once.

Every operation that changes the host is split in two: a plan function reads the host and
libvirt and decides -- the steps, each check with its verdict, the XML and its differences
against what libvirt holds -- and a run function carries out that plan object, step by step,
under the run lock, recording the steps it took in its result (gpuvfio.planning: one
vocabulary of checks and steps). Most pairs are ``plan_X(ctx, ...) -> XPlan`` and
``run_X(ctx, plan)``; a bind's are plan_operation and apply_operation (gpuvfio.ops.binding), a
cloud-init seed's plan_seed and write_seed. ``--dry-run``, Ansible check mode and ``testbed
plan`` print the same object and exit as the run would: a refusal in the plan is the run's
refusal, with the same words (Terraform's plan/apply, community.libvirt's check mode).

A plan is made without the run lock and writes nothing: not the tree, not libvirt, not the
journal, not the lock file. A dry run makes it on a Context that only reads, which refuses
those writes by construction (gpuvfio.ops.context). A run makes its plan again under the
lock, so it acts on the host as it is then, and executes that plan as it is.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from gpuvfio.errors import Refused
from gpuvfio.planning import FORCE_HINT, Check, CheckStatus, Step, StepKind

__all__ = ["Plan", "Check", "CheckStatus", "Step", "StepKind", "FORCE_HINT"]

REFUSED_PREFIX = "refused: "


@dataclass
class Plan:
    operation: str  # attach | detach | unbind | restore | reset | vgpu create | ...
    target: str  # what it acts on, as the user named it
    steps: list[Step] = field(default_factory=list)
    checks: list[Check] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    xml: str | None = None  # the domain XML the run defines
    changes: list[str] | None = None  # its differences against libvirt's definition (None: nothing defined)
    root: str | None = None  # step paths are shown as the host beneath this root names them

    def check(self, check_id: str, status: CheckStatus, message: str) -> None:
        self.checks.append(Check(check_id, status, message))

    def refuse(self, check_id: str, message: str) -> None:
        """A refusing check, in the words of its reason: a refusal raised below (its line begins
        "refused: ") loses that word here, as the plan's own refusal puts it in front of all."""
        self.check(check_id, CheckStatus.REFUSE, message.removeprefix(REFUSED_PREFIX))

    def step(self, kind: StepKind, detail: str = "", **what) -> Step:
        made = Step(kind, detail=detail, **what)
        self.steps.append(made)
        return made

    @property
    def refusals(self) -> list[Check]:
        return [c for c in self.checks if c.status is CheckStatus.REFUSE]

    @property
    def refused(self) -> bool:
        return bool(self.refusals)

    @property
    def nothing_to_do(self) -> bool:
        return not self.steps and not self.refused

    @property
    def exit_code(self) -> int:
        """The run's exit status: 1 when refused, else 0 (bad input never makes a plan: exit 2)."""
        return 1 if self.refused else 0

    @property
    def result(self) -> str:
        return "refused" if self.refused else ("nothing_to_do" if self.nothing_to_do else "planned")

    def refusal(self) -> Refused:
        """The error the run raises for this plan: its refusals, in order, in one line."""
        return Refused(REFUSED_PREFIX + "; ".join(dict.fromkeys(c.reason for c in self.refusals)), self.to_json())

    def raise_if_refused(self) -> None:
        if self.refused:
            raise self.refusal()

    def extra_json(self) -> dict:
        """What an operation's plan adds to its JSON (the bind, the placement, verify's gates)."""
        return {}

    def to_json(self) -> dict:
        out = {"operation": self.operation, "target": self.target, "result": self.result,
               "steps": [s.to_json(self.root) for s in self.steps], "checks": [c.to_json() for c in self.checks],
               "refused": [c.message for c in self.refusals], "notes": list(self.notes)}
        if self.xml is not None:
            out["xml"] = self.xml
        if self.changes is not None:
            out["changes"] = list(self.changes)
        out.update(self.extra_json())
        return out

