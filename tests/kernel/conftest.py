"""The kernel lane's shared boot: the modules that need the GPU-host topology (kl.GPU_HOST_DEVICES)
declare a ``GPU_HOST_PART`` (kl.Part) and get its result from one boot for all of them.

Under TCG a boot costs 15-45 s before any script runs, and each Python script imports gpuvfio
again over 9p; three boots of the same devices were paid three times.  Only the parts of the
modules pytest collected run, so one module on its own still boots for itself only.
"""

from __future__ import annotations

import pytest

from tests.lanes import kernel as kl


def _collected_parts(session: pytest.Session) -> list[kl.Part]:
    parts: dict[str, kl.Part] = {}
    for item in session.items:
        part = getattr(getattr(item, "module", None), "GPU_HOST_PART", None)
        if isinstance(part, kl.Part):
            parts.setdefault(part.name, part)
    return list(parts.values())


@pytest.fixture(scope="session")
def gpu_host_boot(request: pytest.FixtureRequest) -> dict[str, kl.GuestResult]:
    """Each collected part's GuestResult, from one boot (read-only parts before binding)."""
    parts = _collected_parts(request.session)
    results = kl.run_parts_in_guest(parts, devices=kl.GPU_HOST_DEVICES)
    whole = next(iter(results.values()))
    print(f"kernel lane shared boot ({', '.join(results)}): started after {whole.boot_seconds or 0:.1f}s; "
          + ", ".join(f"{name} {r.seconds:.1f}s" for name, r in results.items()))
    return results
