"""Plans as values: what an operation that changes the host will do, decided once.

Every operation that changes the host (attach, detach, unbind, restore, reset, vgpu
create/remove/scheduler, xml --define; bind and persist keep their own richer plans) is split
in two: ``plan_X(ctx, ...) -> Plan`` reads the host and libvirt and decides -- the steps, each
check with its verdict, the XML and its differences against what libvirt holds -- and the run
executes that plan object under the run lock. ``--dry-run``, Ansible check mode and ``testbed
plan`` print the same object and exit as the run would: a refusal in the plan is the run's
refusal, with the same words (Terraform's plan/apply, community.libvirt's check mode).

A plan is made without the run lock and writes nothing: not the tree, not libvirt, not the
journal, not the lock file.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import Enum

from gpuvfio.errors import Refused

__all__ = ["Verdict", "Check", "PlannedStep", "Plan"]


class Verdict(str, Enum):
    """A check's verdict, in the words of the bind plan (gpuvfio.bind.plan)."""

    OK = "ok"
    WARN = "warn"
    REFUSE = "refuse"


@dataclass(frozen=True)
class Check:
    check_id: str
    verdict: Verdict
    message: str

    def to_json(self) -> dict:
        return {"id": self.check_id, "status": self.verdict.value, "message": self.message}


@dataclass(frozen=True)
class PlannedStep:
    """One step of the run, by the name the run records it under (``action``)."""

    action: str
    detail: str = ""

    def to_json(self) -> dict:
        return {"step": self.action, "detail": self.detail}


@dataclass
class Plan:
    operation: str  # attach | detach | unbind | restore | reset | vgpu create | ...
    target: str  # what it acts on, as the user named it
    steps: list[PlannedStep] = field(default_factory=list)
    checks: list[Check] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    xml: str | None = None  # the domain XML the run defines
    changes: list[str] | None = None  # its differences against libvirt's definition (None: nothing defined)
    details: dict = field(default_factory=dict)  # operation-specific facts (JSON-ready), e.g. the bind plan

    def check(self, check_id: str, verdict: Verdict, message: str) -> None:
        self.checks.append(Check(check_id, verdict, message))

    def refuse(self, check_id: str, message: str) -> None:
        self.check(check_id, Verdict.REFUSE, message)

    def step(self, action: str, detail: str = "") -> None:
        self.steps.append(PlannedStep(action, detail))

    @property
    def refusals(self) -> list[Check]:
        return [c for c in self.checks if c.verdict is Verdict.REFUSE]

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
        return Refused("refused: " + "; ".join(dict.fromkeys(c.message for c in self.refusals)), self.to_json())

    def raise_if_refused(self) -> None:
        if self.refused:
            raise self.refusal()

    @property
    def step_names(self) -> list[str]:
        return [s.action for s in self.steps]

    def to_json(self) -> dict:
        out = {"operation": self.operation, "target": self.target, "result": self.result,
               "steps": [s.to_json() for s in self.steps], "checks": [c.to_json() for c in self.checks],
               "refused": [c.message for c in self.refusals], "notes": list(self.notes)}
        if self.xml is not None:
            out["xml"] = self.xml
        if self.changes is not None:
            out["changes"] = list(self.changes)
        out.update(self.details)
        return out
