"""verify's NCCL checks: the all-reduce, the topology file NCCL loaded beside its own view, and
NCCL's path type between each pair of GPUs in the guest against the host's."""

from __future__ import annotations

import re
from collections.abc import Mapping

from gpuvfio.guest.verdicts import FAIL, MOST_GBPS, PASS, SKIP, WARN, bus_key, check
from gpuvfio.numbers import finite, shown as text_shown

__all__ = ["check_nccl", "check_nccl_paths"]


def check_nccl(checks, verifier: dict, gpus: int) -> None:
    """The all-reduce over every GPU (sums exact, figures plausible) and the topology it ran on."""
    errors = verifier.get("errors") or {}
    nccl = verifier.get("nccl")
    if nccl is None:
        reason = errors.get("nccl", "NCCL did not run")
        not_there = "libnccl.so.2 not found" in reason
        checks.append(check("nccl_allreduce", SKIP if not_there else FAIL, reason=(
            "no NCCL in the guest (libnccl.so.2): install it to measure an all-reduce" if not_there else reason)))
    else:
        results = nccl.get("results") or []
        sane = all(finite(r.get("busbw_gbps", 0)) and 0 <= r.get("busbw_gbps", 0) <= MOST_GBPS * 64
                   and isinstance(r.get("bytes", 0), int) and 0 <= r.get("bytes", 0) < 1 << 50 for r in results)
        ok = bool(results) and sane and all(r.get("verified") is True for r in results)
        top = max(results, key=lambda r: r.get("bytes", 0)) if results and sane else {}
        checks.append(check("nccl_allreduce", PASS if ok else FAIL, f"sum over {gpus} GPUs exact",
                            f"busbw {top.get('busbw_gbps', 0):.1f} GB/s at {int(top.get('bytes', 0)) >> 20} MiB"
                            if top else None, None if ok else "the all-reduce gave wrong sums" if sane
                            else "implausible all-reduce figures"))
        if "topology" in nccl:
            _check_nccl_topology(checks, nccl["topology"])


def _links(table: dict) -> str:
    return ", ".join(f"{bus} {e.get('link_speed') or '?'} x{e.get('link_width') or '?'}"
                     + (f" +{e['nvlink']} NVLink" if e.get("nvlink") else "") for bus, e in sorted(table.items()))


def _check_nccl_topology(checks, topology: dict) -> None:
    """Which topology file NCCL loaded and NCCL's own view of the GPUs' links (its topology dump,
    NCCL_TOPO_DUMP_FILE) beside the file's. The verifier runs NCCL without the NCCL_* variables
    it was started with, so NCCL's own files decide ($HOME/.nccl.conf, then /etc/nccl.conf, where
    attach names gpuvfio's file): gpuvfio's file in the guest that NCCL does not load is a
    warning, and so is a file whose links NCCL did not take (NCCL keeps every attribute a loaded
    file gives, src/graph/xml.cc ncclTopoGetXmlFromSys: it did not load it, or the file names
    other bus ids than the guest's). Warnings, since NCCL still runs on what it detected."""
    planned, seen, problem = topology.get("planned"), topology.get("nccl"), topology.get("error")
    above = _settings_above(topology.get("above") or [])
    own, file = topology.get("gpuvfio_file"), topology.get("file")
    if file is None and own is None:
        checks.append(check("nccl_topology", SKIP, None, _links(seen) if seen else None,
                            _joined("no NCCL topology file in the guest (gpuvfio attach writes one for two or more "
                                    "GPUs)", above)))
        return
    if own is not None and file != own:
        named = (f"NCCL loads {text_shown(file, 120)} (named in {_plain(topology.get('source'))})" if file
                 else "nothing NCCL reads names it")
        checks.append(check("nccl_topology", WARN, text_shown(own, 120), text_shown(file, 120), _joined(
            f"gpuvfio's {text_shown(own, 120)} is in the guest, but {named}: a job gets another PCIe tree than "
            "the host's", above)))
        return
    if planned is None or seen is None:
        checks.append(check("nccl_topology", WARN, _links(planned) if planned else None,
                            _links(seen) if seen else None, _joined(problem or "no GPU to compare", above)))
        return
    differ = []
    for bus in sorted(set(planned) | set(seen)):
        want, got = planned.get(bus), seen.get(bus)
        if want is None:
            differ.append(f"{bus}: not in the file")
        elif got is None:
            differ.append(f"{bus}: not in NCCL's view")
        else:
            differ.extend(f"{bus} {key} {got.get(key)!r}, the file {want.get(key)!r}"
                          for key in ("link_speed", "link_width") if got.get(key) != want.get(key))
    reason = None
    if differ:
        reason = (f"NCCL's view differs from {file} ({'; '.join(differ)}): NCCL did not load the file, "
                  "or the file names other bus ids than the guest shows")
    checks.append(check("nccl_topology", WARN if differ else PASS, _links(planned), _links(seen),
                        _joined(reason, above)))


def _settings_above(above: list) -> str:
    """What the guest sets where NCCL ranks it above /etc/nccl.conf (the verifier's environment,
    the user's nccl.conf), for the check's reason: each bounded, the first ten."""
    if not above:
        return ""
    said = ", ".join(f"{_plain(entry.get('key'))}={text_shown(entry.get('value'), 60)} "
                     f"({_plain(entry.get('source'))})" for entry in above[:10])
    return f"NCCL settings ranked above /etc/nccl.conf: {said}" + (
        f" and {len(above) - 10} more" if len(above) > 10 else "")


_PLAIN = re.compile(r"[A-Za-z0-9_~./-]{1,64}")


def _plain(text) -> str:
    """A name from the guest as it is where it looks like one (NCCL_ALGO, ~/.nccl.conf), else bounded."""
    return text if isinstance(text, str) and _PLAIN.fullmatch(text) else text_shown(text, 60)


def _joined(*parts: str | None) -> str | None:
    return "; ".join(p for p in parts if p) or None


def check_nccl_paths(checks, verifier: dict, gpus, want: Mapping[tuple[str, str], str]) -> None:
    """NCCL's path type between each pair of GPUs as NCCL saw the guest (its dump, by NCCL's
    rules: gpuvfio_ncclpaths, v2.30.7-1) against the host's (the same rules on the tree NCCL's
    sysfs reader builds there). The host cannot tell which of N identical GPUs the guest shows
    where (``match`` pairs them in order), and NCCL plans alike whichever it is: the guest passes
    where some pairing of same-model GPUs gives every pair the host's type (``_pairing``). It
    fails otherwise, naming the pairs that differ as matched, and, closed, where NCCL ran but
    its dump gave no paths: nothing then shows that NCCL plans for the machine its GPUs are in."""
    nccl = verifier.get("nccl")
    if nccl is None:
        checks.append(check("nccl_paths", SKIP, reason="NCCL did not run in the guest (see nccl_allreduce)"))
        return
    topology = nccl.get("topology") or {}
    rows = topology.get("paths")
    if rows is None:
        checks.append(check("nccl_paths", FAIL, f"{len(want)} pair(s) as on the host", None,
                            f"no paths from NCCL's topology dump: {topology.get('error') or 'none reported'}"))
        return
    seen = {_pair(bus_key(a), bus_key(b)): kind for a, b, kind in rows}
    hosts = [(exp.address, (exp.vendor_id, exp.device_id), bus_key(fn["address"]) if fn else None)
             for exp, fn in gpus if exp.address]
    pairs = [(a, b) for n, (a, _k, _g) in enumerate(hosts) for b, _l, _h in hosts[n + 1:] if _pair(a, b) in want]
    if _pairing(hosts, want, seen) is not None:
        checks.append(check("nccl_paths", PASS, f"{len(pairs)} pair(s) as on the host", f"{len(pairs)} the same"))
        return
    guest_of = {address: guest for address, _kind, guest in hosts}
    differ = []
    for a, b in pairs:
        host, guest = want[_pair(a, b)], seen.get(_pair(guest_of[a], guest_of[b]))
        if guest != host:
            differ.append(f"{min(a, b)} <-> {max(a, b)}: host {host}, guest {guest or 'not in NCCL view'}")
    checks.append(check("nccl_paths", FAIL, f"{len(pairs)} pair(s) as on the host", f"{len(pairs) - len(differ)} "
                        "the same", "NCCL in the guest sees other PCIe paths between these GPUs than it would on "
                        "the host (no pairing of same-model GPUs gives the host's), so it plans rings, trees and "
                        "P2P for another machine: " + ("; ".join(differ) or "as matched, every pair is the same")))


def _pair(a, b) -> tuple:
    return (a, b) if (a or "") <= (b or "") else (b, a)


PAIRING_STEPS = 100_000  # a bound on the search: 8 identical GPUs in a symmetric tree take a few hundred


def _pairing(hosts: list, want: Mapping, seen: Mapping) -> dict | None:
    """A guest GPU for each host GPU (``hosts``: address, model, the matched guest address),
    of the same model, each used once, under which every host pair in ``want`` has its type in
    ``seen``; the matched one is tried first. None: none within PAIRING_STEPS."""
    guests = [(guest, kind) for _address, kind, guest in hosts if guest is not None]
    if len(guests) != len(hosts):
        return None
    chosen: dict = {}
    steps = [0]

    def fits(address, guest) -> bool:
        return all(want.get(_pair(address, other)) in (None, seen.get(_pair(guest, chosen[other])))
                   for other in chosen)

    def place(n: int) -> bool:
        if n == len(hosts):
            return True
        address, kind, matched = hosts[n]
        taken = set(chosen.values())
        for guest, guest_kind in sorted(guests, key=lambda g: g[0] != matched):
            steps[0] += 1
            if steps[0] > PAIRING_STEPS:
                return False
            if guest_kind == kind and guest not in taken and fits(address, guest):
                chosen[address] = guest
                if place(n + 1):
                    return True
                del chosen[address]
        return False

    return dict(chosen) if place(0) else None
