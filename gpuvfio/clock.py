"""The clock: the one place gpuvfio reads the time or waits.

The Context owns a Clock (``Context.clock``) and hands it to whatever measures, waits or stamps
on gpuvfio's behalf: the run lock's wait, a stuck sysfs writer's reaping, the journal's times,
SSH's connection waits, a guest's shutdown, verify's timings. A test gives a fake one (a
``sleep`` that advances ``monotonic``) and a thirty-second wait passes at once. The default
below is the real clock, for a part built outside a Context (a test of the part itself).
tests/unit/test_structure.py allows the ``time`` module here only.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Callable

__all__ = ["Clock", "SYSTEM_CLOCK"]


@dataclass(frozen=True)
class Clock:
    monotonic: Callable[[], float] = time.monotonic  # for intervals and deadlines
    sleep: Callable[[float], None] = time.sleep
    time: Callable[[], float] = time.time  # the wall clock, for what a person reads later (the journal)

    def stamp(self) -> str:
        """The wall-clock time as ISO 8601 with the local offset (2026-12-05T11:22:46+0000)."""
        return time.strftime("%Y-%m-%dT%H:%M:%S%z", time.localtime(self.time()))

    def utc(self) -> str:
        """The wall-clock time as ISO 8601 in UTC (2026-12-05T11:22:46Z): records other hosts read."""
        return time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(self.time()))


SYSTEM_CLOCK = Clock()
