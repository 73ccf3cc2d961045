"""A doctor check's result: one line of status, what was found, and the fix to copy."""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum


class CheckStatus(str, Enum):
    """A readiness check's verdict (its JSON word is the value)."""

    OK = "ok"
    WARN = "warn"
    FAIL = "fail"
    SKIP = "skip"

    def __str__(self) -> str:
        return self.value


OK, WARN, FAIL, SKIP = CheckStatus.OK, CheckStatus.WARN, CheckStatus.FAIL, CheckStatus.SKIP


@dataclass(slots=True)
class Check:
    check_id: str
    status: CheckStatus
    summary: str
    fix: str | None = None

    def __post_init__(self) -> None:
        self.status = CheckStatus(self.status)  # a plain word from a caller becomes the enum

    def to_json(self) -> dict:
        return {"id": self.check_id, "status": self.status.value, "summary": self.summary, "fix": self.fix}
