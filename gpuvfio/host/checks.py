"""A doctor check's result: one line of status, what was found, and the fix to copy."""

from __future__ import annotations

from dataclasses import dataclass

OK, WARN, FAIL, SKIP = "ok", "warn", "fail", "skip"


@dataclass(slots=True)
class Check:
    check_id: str
    status: str
    summary: str
    fix: str | None = None

    def to_json(self) -> dict:
        return {"id": self.check_id, "status": self.status, "summary": self.summary, "fix": self.fix}
