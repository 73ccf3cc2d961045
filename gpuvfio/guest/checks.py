"""Checks from what the guest reported against what the host assigned. Fail closed.

Every expected function gets a verdict. An expected NVIDIA GPU that is absent, lacks the
nvidia driver, or that NVML or CUDA cannot bring up fails, with the guest's own words (the
CUDA error name, the NVRM lines of its kernel log); a check that could not run because
something expected is missing (no python3, no libcuda) fails too. Skip is only for what
was not expected (no NVIDIA GPU assigned, --no-bandwidth, a link the host cannot see).
"expected" marks outcomes that are right for the setup although they look like failures:
an A/B-series vGPU without CUDA, a MIG-enabled GPU without instances.

N identical GPUs need N functions and N CUDA devices: the host cannot know the guest's bus
numbers (libvirt's bus= is a controller index, and pxb-pcie renumbers), so functions are
matched slot by slot (a GPU with its audio function must appear as one slot with the same
functions), then by vendor:device, each guest function used once.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass, field

from gpuvfio.guest.expect import LANE_GBPS, Expected, Gates, cuda_not_expected
from gpuvfio.guest.nccl_checks import check_nccl, check_nccl_paths
from gpuvfio.guest.verdicts import (EXPECTED, FAIL, MOST_GBPS, MOST_MS, PASS, SKIP, WARN, WIDTHS, CheckResult,
                                    CheckStatus, Outcome, bus_key, check, shown)
from gpuvfio.numbers import finite

__all__ = ["CheckStatus", "Outcome", "CheckResult", "VerifyReport", "check", "judge", "evaluate", "report", "match",
           "bus_key", "shown", "MOST_GBPS", "MIG_WITHOUT_INSTANCES"]

MIG_WITHOUT_INSTANCES = ("MIG mode is on and CUDA sees no MIG device: none exists until a GPU instance and a "
                         "compute instance are created (nvidia-smi mig -cgi PROFILE -C)")


def _error_of(errors: dict, stage: str, address: str) -> str | None:
    """The verifier's error for ``stage`` ("bandwidth", "compute") of one GPU: keyed "STAGE BUS"."""
    key = bus_key(address)
    return next((v for k, v in errors.items() if k.split(" ", 1)[0] == stage and key is not None
                 and bus_key(k.partition(" ")[2]) == key), None)


@dataclass
class VerifyReport:
    """The checks, the guest's facts (the probe's and the verifier's answers as the guest gave
    them: JSON already), the measured bandwidths by bus id; set by the caller: what was expected,
    the SSH target's notes (verify) and the host root (verify on the host itself)."""

    checks: list[CheckResult]
    facts: dict
    bandwidth_gbps: dict[str, dict[str, float]] = field(default_factory=dict)
    expected: list[Expected] | None = None
    ssh_notes: list[str] | None = None
    host_root: str | None = None

    @property
    def failed(self) -> list[CheckResult]:
        return [c for c in self.checks if c.status is CheckStatus.FAIL]

    @property
    def outcome(self) -> Outcome:
        return Outcome.FAIL if self.failed else Outcome.PASS

    @property
    def ok(self) -> bool:
        return self.outcome is Outcome.PASS

    def to_json(self) -> dict:
        out = {"checks": [c.to_json() for c in self.checks], "facts": self.facts,
               "bandwidth_gbps": self.bandwidth_gbps, "ok": self.ok}
        if self.expected is not None:
            out["expected"] = [e.to_json() for e in self.expected]
        if self.ssh_notes is not None:
            out["ssh_notes"] = list(self.ssh_notes)
        if self.host_root is not None:
            out["host_root"] = self.host_root
        return out


def _slot(address: str) -> str:
    return address.rsplit(".", 1)[0]


def match(expected: list[Expected], pci: list[dict]) -> list[dict | None]:
    """The guest function each expected one is, or None."""
    found: list[dict | None] = [None] * len(expected)
    used: set[str] = set()
    guest_slots: dict[str, list[dict]] = {}
    for fn in pci:
        guest_slots.setdefault(_slot(fn["address"]), []).append(fn)
    host_slots: dict[str, list[int]] = {}
    for index, exp in enumerate(expected):
        if exp.slot:
            host_slots.setdefault(exp.slot, []).append(index)
    for indices in host_slots.values():
        want = sorted((expected[i].function, expected[i].vendor_id, expected[i].device_id) for i in indices)
        for functions in guest_slots.values():
            have = sorted((f["address"].rsplit(".", 1)[1], f["vendor_id"], f["device_id"]) for f in functions)
            if have == want and not any(f["address"] in used for f in functions):
                by_function = {f["address"].rsplit(".", 1)[1]: f for f in functions}
                for i in indices:
                    found[i] = by_function[expected[i].function]
                    used.add(found[i]["address"])
                break
    for index, exp in enumerate(expected):
        if found[index] is None:
            fn = next((f for f in pci if f["address"] not in used
                       and (f["vendor_id"], f["device_id"]) == (exp.vendor_id, exp.device_id)), None)
            if fn is not None:
                found[index] = fn
                used.add(fn["address"])
    return found


def _by_bus(table: dict, address: str | None):
    """The entry of a verifier table (keyed by CUDA's or NVML's bus id) for a guest address."""
    key = bus_key(address)
    return next((v for k, v in table.items() if key is not None and bus_key(k) == key), None)


def _nvml_device(verifier: dict, address: str | None) -> dict | None:
    devices = (verifier.get("nvml") or {}).get("devices") or []
    key = bus_key(address)
    return next((d for d in devices if key is not None and bus_key(d.get("bus_id")) == key), None)


def _kernel_words(probe: dict) -> str:
    lines = [line for line in probe.get("dmesg") or [] if "NVRM" in line or "nvidia" in line]
    return f"; guest kernel log: {' | '.join(lines[-3:])}" if lines else ""


def evaluate(probe: dict, verifier: dict | None, expected: list[Expected], *, gates: Gates = Gates(),
             bandwidth: bool = True, verifier_problem: str | None = None,
             nccl_paths: Mapping[tuple[str, str], str] | None = None) -> dict:
    """judge's report as JSON: the form a recorded run keeps."""
    return judge(probe, verifier, expected, gates=gates, bandwidth=bandwidth,
                 verifier_problem=verifier_problem, nccl_paths=nccl_paths).to_json()


def judge(probe: dict, verifier: dict | None, expected: list[Expected], *, gates: Gates = Gates(),
          bandwidth: bool = True, verifier_problem: str | None = None,
          nccl_paths: Mapping[tuple[str, str], str] | None = None) -> VerifyReport:
    """Checks, facts and bandwidth from what the guest reported and what the host assigned.
    ``verifier`` None: it did not run (no python3) or ``verifier_problem`` says why it failed.
    ``nccl_paths``: NCCL's path type between pairs of the expected GPUs on the host (host
    addresses, the smaller first), which NCCL's view in the guest must equal."""
    checks: list[CheckResult] = []
    pci = probe.get("pci") or []
    found = match(expected, pci)
    if not expected:
        checks.append(check("pci_present", SKIP, reason="no devices assigned (nothing to look for)"))
    for exp, fn in zip(expected, found):
        where = fn and (fn["address"] + (f" (under {fn['upstream']})" if fn.get("upstream") else ""))
        checks.append(check("pci_present", PASS if fn else FAIL, f"{exp.vendor_id}:{exp.device_id}", where,
                            None if fn else "not visible in the guest (with N identical devices, N must be)",
                            exp.address))
    gpus = [(exp, fn) for exp, fn in zip(expected, found) if exp.kind == "gpu"]
    if not gpus:
        why = "no devices assigned" if not expected else "no NVIDIA GPU assigned"
        checks.append(check("driver", SKIP, reason=why))
        return report(checks, probe, verifier, verifier_problem)
    words = _kernel_words(probe)
    for exp, fn in gpus:
        driver = fn["driver"] if fn else None
        ok = driver == "nvidia"
        checks.append(check("driver", PASS if ok else FAIL, "nvidia", driver, None if ok else (
            ("not in the guest" if fn is None else "the NVIDIA driver is not bound to it") + words), exp.address))
    _check_driver_version(checks, probe, {exp.driver_version for exp, _fn in gpus if exp.driver_version})
    if verifier is None:
        reason = verifier_problem or "the guest has no python3: NVML, CUDA and the link could not be checked"
        checks.append(check("cuda", FAIL, f"{len(gpus)} device(s)", None, reason))
        return report(checks, probe, verifier, verifier_problem)
    errors = verifier.get("errors") or {}
    if "verifier" in errors:
        checks.append(check("verifier", FAIL, reason=f"the in-guest verifier failed: {errors['verifier']}"))
    _check_nvml_and_cuda(checks, verifier, gpus, words)
    for exp, fn in gpus:
        _check_one_gpu(checks, verifier, exp, fn, gates, bandwidth)
    if len(gpus) >= 2 and bandwidth:
        _check_peers(checks, verifier, len(gpus))
    if len(gpus) >= 2 and bandwidth and any(exp.clique is not None for exp, _fn in gpus):
        _check_cliques(checks, verifier, gpus)
    if nccl_paths and bandwidth:
        check_nccl_paths(checks, verifier, gpus, nccl_paths)
    return report(checks, probe, verifier, verifier_problem)


def _check_cliques(checks, verifier: dict, gpus) -> None:
    """The plan's P2P cliques against the guest's peer matrix (cuDeviceCanAccessPeer): two GPUs
    the plan put in one clique must reach each other; a matrix that is missing fails (closed)."""
    p2p = verifier.get("p2p") or {}
    index = {bus_key(bus): i for i, bus in enumerate(p2p.get("bus_ids") or [])}
    access = p2p.get("access") or []
    missing, seen = [], 0
    for n, (a, fa) in enumerate(gpus):
        for b, fb in gpus[n + 1:]:
            if a.clique is None or a.clique != b.clique:
                continue
            seen += 1
            i = index.get(bus_key(fa["address"])) if fa else None
            j = index.get(bus_key(fb["address"])) if fb else None
            ok = (i is not None and j is not None and i < len(access) and j < len(access[i])
                  and access[i][j] is True and access[j][i] is True)
            if not ok:
                missing.append(f"{a.address} <-> {b.address}")
    if not seen:
        return
    checks.append(check("p2p_cliques", PASS if not missing else FAIL, f"{seen} planned pair(s) with peer access",
                        f"{seen - len(missing)} with access", None if not missing else (
                            "the plan put these in one P2P clique but the guest reports no peer access between "
                            "them: " + "; ".join(missing))))


def _check_driver_version(checks, probe: dict, wanted: set[str]) -> None:
    """On an HGX shared-NVSwitch host the guest's driver must be the host Fabric Manager's
    version (FM user guide, shared NVSwitch model): anything else, or no version to read, fails."""
    for version in sorted(wanted):
        line = probe.get("nvidia_version") or ""
        found = re.search(r"\b([0-9]+\.[0-9]+(?:\.[0-9]+)?)\b", line.split("Kernel Module", 1)[-1], re.ASCII)
        have = found.group(1) if found else None
        checks.append(check("driver_version", PASS if have == version else FAIL, version, have,
                            None if have == version else (
                                "the guest's NVIDIA driver must match the host's Fabric Manager" if have
                                else "the guest shows no NVIDIA driver version (/proc/driver/nvidia/version)")))


def _check_nvml_and_cuda(checks, verifier, gpus, words) -> None:
    errors = verifier.get("errors") or {}
    nvml = verifier.get("nvml")
    if nvml is None:
        checks.append(check("nvml", FAIL, "NVML up", None, f"{errors.get('nvml', 'NVML did not start')}{words}"))
    else:
        count = len(nvml.get("devices") or [])
        checks.append(check("nvml", PASS if count >= len(gpus) else FAIL, f">= {len(gpus)} device(s)", count,
                            None if count >= len(gpus) else f"NVML sees fewer GPUs than were assigned{words}"))
    exempt = [(exp, cuda_not_expected(exp)) for exp, _fn in gpus if cuda_not_expected(exp)]
    want = len(gpus) - len(exempt)
    cuda = verifier.get("cuda")
    count = len(cuda.get("devices") or []) if cuda else 0
    mig = [d for d in (nvml or {}).get("devices") or [] if d.get("mig") is True]
    for exp, why in exempt:
        checks.append(check("cuda", EXPECTED, "no CUDA device", None, why, exp.address))
    if want <= 0:
        return
    if count >= want:
        checks.append(check("cuda", PASS, f">= {want} device(s)", count))
    elif mig and count + len(mig) >= want:
        checks.append(check("cuda", EXPECTED, f">= {want} device(s)", count, MIG_WITHOUT_INSTANCES))
    else:
        reason = (errors.get("cuda") or "the verifier gave no CUDA result and no error") if cuda is None else \
            f"CUDA sees {count} of the {want} GPUs assigned"
        checks.append(check("cuda", FAIL, f">= {want} device(s)", count, f"{reason}{words}"))


def _plausible_link(link: dict) -> bool:
    gen, width = link.get("current_gen"), link.get("current_width")
    return isinstance(gen, int) and gen in LANE_GBPS and isinstance(width, int) and width in WIDTHS


def _ceiling(gen: int | None, width: int | None, key: str) -> float:
    """The most a copy can move over that link (both directions for bidir_total): the lane rate
    after line coding times the width; the widest, fastest link when the link is not known."""
    one_way = LANE_GBPS[gen] * width if gen in LANE_GBPS and width else MOST_GBPS
    return one_way * (2 if key == "bidir_total" else 1)


def _link_of(verifier, measured, address):
    link = (measured or {}).get("link_under_load")
    if isinstance(link, dict) and "error" not in link and link.get("current_gen"):
        return link, True
    link = (_nvml_device(verifier, address) or {}).get("link_idle")
    if isinstance(link, dict) and "error" not in link and link.get("current_gen"):
        return link, False
    return None, False


def _check_link(checks, exp: Expected, link, under_load: bool, bandwidth: bool, errors: dict, device):
    """pcie_link against the host slot; the link back, or None where it cannot be believed (a
    link no device has, or above its slot: the bandwidth is then judged without it)."""
    want = f"Gen{exp.link_gen} x{exp.link_width}" if exp.link_gen else None
    if link is None:
        checks.append(check("pcie_link", FAIL if bandwidth else SKIP, want, None,
                            errors.get("nvml", "NVML could not read the GPU's link"), device))
    elif not _plausible_link(link):
        checks.append(check("pcie_link", FAIL, want, None, "the guest reports a link no PCIe device has (Gen "
                            f"{shown(link.get('current_gen'))}, x{shown(link.get('current_width'))})", device))
        link = None
    elif want is None:
        checks.append(check("pcie_link", SKIP, None, f"Gen{link['current_gen']} x{link['current_width']}",
                            "not observable here: the host knows no slot capability for this device", device))
    elif link["current_gen"] > exp.link_gen or link["current_width"] > exp.link_width:
        checks.append(check("pcie_link", FAIL, want, f"Gen{link['current_gen']} x{link['current_width']}",
                            "above what the host slot allows (" + (exp.link_source or "the host") + "): no device "
                            "trains past its slot, so this is not the device's link", device))
        link = None
    else:
        seen = f"Gen{link['current_gen']} x{link['current_width']}"
        ok = link["current_gen"] >= exp.link_gen and link["current_width"] >= exp.link_width
        checks.append(check("pcie_link", PASS if ok else (FAIL if under_load else WARN), want, seen,
                            None if ok else "the GPU trained below what its host slot allows (" + exp.link_source
                            + ")" + ("" if under_load else "; read idle, links train down when idle"), device))
    return link


def _check_one_gpu(checks, verifier, exp: Expected, fn, gates: Gates, bandwidth: bool) -> None:
    """The link, bandwidth, data and compute checks of one expected GPU (``fn``: its function in
    the guest, None when absent); where nothing can be measured each is skipped (absent, or not
    asked for) or expected (no CUDA on its vGPU profile, MIG without instances)."""
    device = exp.address
    address = fn["address"] if fn else None
    ids = ("pcie_link", "h2d_bandwidth", "d2h_bandwidth", "bidir_bandwidth", "data_verified", "compute")
    if fn is None:
        for check_id in ids:
            checks.append(check(check_id, SKIP, reason="the device is not in the guest (see pci_present)",
                                device=device))
        return
    if cuda_not_expected(exp):
        for check_id in ids:
            checks.append(check(check_id, EXPECTED, reason="no CUDA on this vGPU profile: nothing to measure",
                                device=device))
        return
    errors = verifier.get("errors") or {}
    cuda_buses = {bus_key(d.get("bus_id")) for d in (verifier.get("cuda") or {}).get("devices") or []}
    if (_nvml_device(verifier, address) or {}).get("mig") is True and bus_key(address) not in cuda_buses:
        for check_id in ids:
            checks.append(check(check_id, EXPECTED, reason=MIG_WITHOUT_INSTANCES, device=device))
        return
    measured = _by_bus(verifier.get("bandwidth") or {}, address)
    link, under_load = _link_of(verifier, measured, address)
    link = _check_link(checks, exp, link, under_load, bandwidth, errors, device)
    if not bandwidth:
        for check_id in ids[1:]:
            checks.append(check(check_id, SKIP, reason="not asked (--no-bandwidth)", device=device))
        return
    problem = _error_of(errors, "bandwidth", address)
    if measured is None:
        reason = problem or "the verifier measured nothing for this GPU"
        for check_id in ids[1:5]:
            checks.append(check(check_id, FAIL, reason=reason, device=device))
    else:
        _check_bandwidth(checks, exp, link, measured, gates, device)
    compute_problem = _error_of(errors, "compute", address) or problem
    _check_compute(checks, _by_bus(verifier.get("compute") or {}, address), compute_problem, device)


def _check_bandwidth(checks, exp: Expected, link, measured: dict, gates: Gates, device) -> None:
    """The three copy bandwidths of one GPU against the floor of its link (the host slot's, else
    the link the GPU negotiated), and whether the copied data came back right."""
    gen, width = exp.link_gen, exp.link_width
    basis = exp.link_source
    if gen is None and link is not None:
        gen, width, basis = link["current_gen"], link["current_width"], "the link the GPU negotiated (NVML)"
    floor = gates.floor(gen, width)
    for check_id, key in (("h2d_bandwidth", "h2d"), ("d2h_bandwidth", "d2h"), ("bidir_bandwidth", "bidir_total")):
        gbps = (measured.get(key) or {}).get("median")
        ceiling = _ceiling(gen, width, key)
        if gbps is None:
            checks.append(check(check_id, FAIL, reason=f"no {key} figure in the verifier's answer", device=device))
        elif not finite(gbps) or not 0 <= gbps <= ceiling:
            checks.append(check(check_id, FAIL, None, shown(gbps), f"no copy moves that: the link carries at "
                                f"most {ceiling:.1f} GB/s" + (f" (Gen{gen} x{width})" if gen and width else ""),
                                device))
        elif floor is None:
            checks.append(check(check_id, SKIP, None, round(gbps, 2), "no link to derive a floor from "
                                "(give --min-gbps)", device))
        else:
            # Both directions at once must still beat one direction's floor: a weak gate that
            # catches a collapse (platforms differ in how far over it they get, 1.5-1.9x).
            ok = gbps >= floor
            checks.append(check(check_id, PASS if ok else FAIL, gates.describe(gen, width), round(gbps, 2),
                                None if ok else f"below the floor for {basis or 'this link'}", device))
    verified = measured.get("verified")
    checks.append(check("data_verified", PASS if verified is True else FAIL, True, verified,
                        None if verified is True else f"the copied data came back wrong: "
                        f"{measured.get('mismatches')} mismatching 64-bit words per copy stage", device))


def _check_compute(checks, compute: dict | None, problem: str | None, device) -> None:
    """The SAXPY check of one GPU: its result exact and its launch time plausible; ``problem``:
    the verifier's error for the GPU, the reason given when there is no result."""
    if compute is None:
        checks.append(check("compute", FAIL, reason=problem or "no SAXPY result", device=device))
    else:
        # a launch takes microseconds at least: no time, or none at all, was not measured
        launch = compute.get("launch_ms")
        plausible = finite(launch) and 0 < launch <= MOST_MS
        ok = compute.get("verified") is True and plausible
        checks.append(check("compute", PASS if ok else FAIL, "SAXPY result exact",
                            f"{launch:.3f} ms" if plausible else shown(launch),
                            None if ok else "the kernel computed wrong results" if compute.get("verified") is not True
                            else "no launch time" if launch is None else "an implausible launch time", device))


def _check_peers(checks, verifier, gpus: int) -> None:
    errors = verifier.get("errors") or {}
    p2p = verifier.get("p2p")
    if p2p is None:
        checks.append(check("p2p", FAIL, reason=errors.get("p2p", "no peer-to-peer result for several GPUs")))
    else:
        pairs = p2p.get("bandwidth") or {}
        bad = {k: v.get("error") or f"{v.get('mismatches')} wrong words" for k, v in pairs.items()
               if v.get("error") or v.get("verified") is not True}
        if bad:
            checks.append(check("p2p", FAIL, "peer copies move the right data", None,
                                "; ".join(f"{k}: {v}" for k, v in sorted(bad.items()))))
        elif not pairs:
            checks.append(check("p2p", SKIP, None, "no pair has peer access",
                                "no GPU pair reports peer access (cuDeviceCanAccessPeer): copies go through the "
                                "host; a clique (x-nv-gpudirect-clique) enables it where the host can route it"))
        else:
            medians = [v.get("median") for v in pairs.values()]
            wild = [m for m in medians if not (finite(m) and 0 <= m <= MOST_GBPS * 2)]
            if wild:  # shown: the implausible figures, not the first ones
                checks.append(check("p2p", FAIL, "peer copies move the right data", None,
                                    "an implausible peer bandwidth: " + ", ".join(shown(m) for m in wild[:4])))
            else:
                checks.append(check("p2p", PASS, "peer copies move the right data",
                                    f"{len(pairs)} pair(s), slowest {min(medians):.1f} GB/s"))
    check_nccl(checks, verifier, gpus)


def report(checks: list[CheckResult], probe: dict, verifier: dict | None, problem: str | None = None
           ) -> VerifyReport:
    if problem and not any(c.check_id == "verifier" for c in checks):
        checks.append(check("verifier", FAIL, reason=problem))
    bandwidth = {}
    for bus, measured in ((verifier or {}).get("bandwidth") or {}).items():
        bandwidth[bus] = {name: round(measured[key]["median"], 3) for name, key in
                          (("h2d", "h2d"), ("d2h", "d2h"), ("d2d", "d2d"), ("bidir", "bidir_total"))
                          if isinstance(measured.get(key), dict) and "median" in measured[key]}
    facts = {"guest_kernel": probe.get("kernel"), "python3": probe.get("python3"), "pci": probe.get("pci") or [],
             "nvidia_modules": [m for m in probe.get("modules") or [] if m.startswith(("nvidia", "vfio"))],
             "nvidia_version": probe.get("nvidia_version"), "kernel_log": probe.get("dmesg") or []}
    if verifier is not None:
        facts.update({key: verifier.get(key) for key in ("method", "nvml", "cuda", "latency", "copy_overhead",
                                                         "compute", "p2p", "nccl", "errors")})
    return VerifyReport(checks, facts, bandwidth)
