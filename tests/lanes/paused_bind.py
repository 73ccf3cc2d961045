"""``python -m tests.lanes.paused_bind ADDRESS N``: ``gpuvfio bind ADDRESS --connect none`` on
this machine, stopped after step N until it is killed: the kernel lane's crash half-way.

The stop enters through the Context (``Context.after_step``), as every test double does; the
package reads no test hook of its own.
"""

from __future__ import annotations

import sys
import time

from gpuvfio.address import PciAddress
from gpuvfio.ops import binding
from gpuvfio.ops.binding import BindPolicy
from gpuvfio.ops.context import live_context


def main(argv: list[str]) -> int:
    address, stop = PciAddress.parse(argv[0]), int(argv[1])

    def say(line: str) -> None:
        print(line, file=sys.stderr, flush=True)

    def after(number: int) -> None:
        if number == stop:
            say(f"stopped after step {number}; waiting to be killed")
            time.sleep(3600)

    with live_context("/", progress=say, writable=True) as ctx:
        ctx.after_step = after
        report = binding.bind(ctx, [address], BindPolicy(), uri="none")
    print(report.status.value)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
