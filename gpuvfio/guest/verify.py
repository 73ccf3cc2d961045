"""Verify a guest over SSH: run the probe and verifier there, gather facts, turn them into checks.

The guest side only reports facts (gpuvfio/guest/); the expectations come from this
host: which devices were assigned (vendor:device must appear in the guest), the host's
PCIe link for each (the guest's link under load must match: QEMU's pcie-root-port
advertises its own speed, so the GPU's link status is what counts), and a bandwidth
floor derived from that link.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass

from gpuvfio.address import PciAddress
from gpuvfio.errors import GpuvfioError, InputError
from gpuvfio.guest.payload import PROBE, VERIFIER
from gpuvfio.host.inventory import Inventory

PROBE_NAME = "gpuvfio-probe"  # $0 of the probe shell, how a harness recognises the command
# Usable GB/s per lane and direction after line coding (PCIe base spec: 8b/10b to Gen2,
# 128b/130b from Gen3; Gen6 FLIT ~242/256).
LANE_GBPS = {1: 0.25, 2: 0.5, 3: 0.985, 4: 1.969, 5: 3.938, 6: 7.563}
FLOOR = 0.6  # pinned copies typically reach 75-85% of the link; below 60% something is wrong


class VerifyError(GpuvfioError):
    """The guest's answer cannot be used (garbage, truncated, the probe did not run)."""


@dataclass
class Expected:
    address: str
    vendor_id: str
    device_id: str
    is_nvidia: bool
    link_gen: int | None
    link_width: int | None

    def to_json(self) -> dict:
        return dict(self.__dict__)


def expectations(inventory: Inventory, addresses: list[PciAddress]) -> list[Expected]:
    out = []
    for address in addresses:
        fn = inventory.functions.get(address)
        if fn is None:
            raise InputError(f"no such PCI function on this host: {address}")
        link = fn.link
        out.append(Expected(str(address), fn.vendor_id, fn.device_id, fn.is_nvidia,
                            link.max_gen if link else None, link.max_width if link else None))
    return out


def parse_probe(text: str) -> dict:
    lines = text.splitlines()
    if not lines or lines[0].strip() != "GPUVFIO-PROBE 1":
        raise VerifyError("the guest probe's output is not recognisable (no GPUVFIO-PROBE header)")
    if "END" not in (line.strip() for line in lines):
        raise VerifyError("the guest probe's output is truncated (no END line)")
    facts = {"kernel": None, "python3": None, "pci": [], "modules": [], "nvidia_version": None, "nvidia_smi": None}
    nvsmi: list[str] | None = None
    for line in lines[1:]:
        if nvsmi is not None:
            if line == "NVSMI-END":
                facts["nvidia_smi"] = "\n".join(nvsmi)
                nvsmi = None
            else:
                nvsmi.append(line)
            continue
        kind, _, rest = line.partition(" ")
        if kind == "KERNEL":
            facts["kernel"] = rest
        elif kind == "PYTHON3":
            facts["python3"] = None if rest == "none" else rest
        elif kind.startswith("PCI"):
            # "PCI|a|b|..." (values may hold spaces, e.g. "16.0 GT/s PCIe"); older probes: spaces
            parts = line.split("|")[1:] if line.startswith("PCI|") else rest.split()
            if len(parts) != 9:
                raise VerifyError(f"malformed PCI line from the guest probe: {line[:80]!r}")
            addr, vendor, device, klass, driver, cur_s, cur_w, max_s, max_w = parts
            facts["pci"].append({"address": addr, "vendor_id": vendor.lower().removeprefix("0x"),
                                 "device_id": device.lower().removeprefix("0x"),
                                 "class_id": klass.lower().removeprefix("0x"),
                                 "driver": None if driver == "-" else driver,
                                 "link": {"current_speed": cur_s, "current_width": cur_w,
                                          "max_speed": max_s, "max_width": max_w}})
        elif kind == "MODULE":
            facts["modules"].append(rest)
        elif kind == "NVIDIA-VERSION":
            facts["nvidia_version"] = rest
        elif kind == "NVSMI-BEGIN":
            nvsmi = []
    return facts


def parse_verifier(text: str) -> dict:
    for line in text.splitlines():
        if line.startswith("GPUVFIO-VERIFIER "):
            try:
                data = json.loads(line[len("GPUVFIO-VERIFIER "):])
            except ValueError:
                raise VerifyError("the in-guest verifier's JSON is garbled") from None
            if not isinstance(data, dict) or data.get("version") != 1:
                raise VerifyError("the in-guest verifier answered in an unknown format")
            return data
    raise VerifyError("the in-guest verifier printed no result (truncated output or a crash)")


def _check(check_id, status, expected=None, observed=None, reason=None) -> dict:
    return {"id": check_id, "status": status, "expected": expected, "observed": observed, "reason": reason}


def evaluate(probe: dict, verifier: dict | None, expected: list[Expected]) -> dict:
    """Checks, facts and bandwidth from what the guest reported and what the host assigned."""
    checks = []
    present = {(p["vendor_id"], p["device_id"]): p for p in probe["pci"]}
    if not expected:
        checks.append(_check("pci_present", "skip", reason="no devices assigned (nothing to look for)"))
    for exp in expected:
        found = present.get((exp.vendor_id, exp.device_id))
        checks.append(_check("pci_present", "pass" if found else "fail", f"{exp.vendor_id}:{exp.device_id}",
                             found["address"] if found else None,
                             None if found else f"host device {exp.address} is not visible in the guest"))
    nvidia_expected = [e for e in expected if e.is_nvidia]
    if not nvidia_expected:
        why = "no devices assigned" if not expected else "no NVIDIA device assigned"
        for check_id in ("driver", "cuda", "pcie_link", "h2d_bandwidth", "d2h_bandwidth"):
            checks.append(_check(check_id, "skip", reason=why))
        return _report(checks, probe, verifier)
    for exp in nvidia_expected:
        found = present.get((exp.vendor_id, exp.device_id))
        driver = found["driver"] if found else None
        checks.append(_check("driver", "pass" if driver == "nvidia" else "fail", "nvidia", driver,
                             None if driver == "nvidia" else "the NVIDIA driver is not bound in the guest"))
    if verifier is None:
        for check_id in ("cuda", "pcie_link", "h2d_bandwidth", "d2h_bandwidth"):
            checks.append(_check(check_id, "skip", reason="no python3 in the guest"))
        return _report(checks, probe, verifier)
    cuda = verifier.get("cuda")
    if cuda is None:
        checks.append(_check("cuda", "skip", reason=verifier.get("errors", {}).get("cuda", "libcuda not available")))
    else:
        count = len(cuda.get("devices", []))
        ok = count >= len(nvidia_expected)
        checks.append(_check("cuda", "pass" if ok else "fail", f">= {len(nvidia_expected)} device(s)", count))
    nvml_devices = (verifier.get("nvml") or {}).get("devices", [])
    bandwidth = verifier.get("bandwidth") or {}
    for index, exp in enumerate(nvidia_expected):
        dev = nvml_devices[index] if index < len(nvml_devices) else None
        bus = dev["bus_id"] if dev else None
        measured = next((v for k, v in bandwidth.items() if bus and k[-12:] == bus[-12:]), None)
        link = (measured or {}).get("link_under_load") or (dev or {}).get("link_idle")
        want = f"Gen{exp.link_gen} x{exp.link_width}" if exp.link_gen else None
        if not dev or not link or "error" in link:
            checks.append(_check("pcie_link", "skip", want, None, verifier.get("errors", {}).get("nvml", "NVML "
                                 "could not read the link")))
        elif want is None:
            checks.append(_check("pcie_link", "skip", None, f"Gen{link['current_gen']} x{link['current_width']}",
                                 "the host reports no link for this device"))
        else:
            seen = f"Gen{link['current_gen']} x{link['current_width']}"
            ok = link["current_gen"] >= exp.link_gen and link["current_width"] >= exp.link_width
            under_load = measured is not None and measured.get("link_under_load")
            status = "pass" if ok else ("fail" if under_load else "warn")
            checks.append(_check("pcie_link", status, want, seen, None if ok else (
                "the guest's link is slower than the host's" + ("" if under_load else " (read idle)"))))
        for direction in ("h2d", "d2h"):
            check_id = f"{direction}_bandwidth"
            if measured is None:
                reason = next((v for k, v in verifier.get("errors", {}).items() if k.startswith("bandwidth")),
                              "no bandwidth measured")
                checks.append(_check(check_id, "skip", reason=reason))
                continue
            gbps = measured[direction]["median"]
            if not exp.link_gen:
                checks.append(_check(check_id, "skip", None, round(gbps, 2), "no host link to derive a floor"))
                continue
            floor = FLOOR * LANE_GBPS[exp.link_gen] * exp.link_width
            checks.append(_check(check_id, "pass" if gbps >= floor else "fail", f">= {floor:.1f} GB/s",
                                 round(gbps, 2), None if gbps >= floor else "below the floor for this link"))
        if measured is not None:
            checks.append(_check("data_verified", "pass" if measured.get("verified") else "fail", True,
                                 measured.get("verified")))
    return _report(checks, probe, verifier)


def _report(checks: list[dict], probe: dict, verifier: dict | None) -> dict:
    bandwidth = {}
    for bus, measured in ((verifier or {}).get("bandwidth") or {}).items():
        bandwidth[bus] = {d: round(measured[d]["median"], 3) for d in ("h2d", "d2h", "d2d") if d in measured}
    facts = {"guest_kernel": probe["kernel"], "python3": probe["python3"], "pci": probe["pci"],
             "nvidia_modules": [m for m in probe["modules"] if m.startswith(("nvidia", "vfio"))],
             "nvidia_version": probe["nvidia_version"]}
    if verifier is not None:
        facts.update({"nvml": verifier.get("nvml"), "cuda": verifier.get("cuda"),
                      "latency": verifier.get("latency"), "compute": verifier.get("compute"),
                      "errors": verifier.get("errors")})
    return {"checks": checks, "facts": facts, "bandwidth_gbps": bandwidth,
            "ok": not any(c["status"] == "fail" for c in checks)}


def probe_argv(script: str) -> list[str]:
    """The probe as one command: its text is ``sh -c``'s argument (shlex-quoted by Session.run),
    so nothing is uploaded and nothing stays in the guest. It must stay well under dropbear's
    9000-byte command limit (MAX_CMD_LEN); tests/test_verify.py checks its size."""
    return ["sh", "-c", script, PROBE_NAME]


def verify_guest(session, expected: list[Expected], *, bandwidth: bool = True, timeout: float = 600.0,
                 probe_timeout: float = 120.0, progress=lambda line: None) -> dict:
    """Run the probe (and the verifier where the guest has python3) and evaluate.

    The probe travels as ``sh -c``'s argument, the verifier on ``python3 -``'s stdin: one SSH
    channel each, no SFTP subsystem to ask for (dropbear has none), no files left in the guest.
    ``probe_timeout`` bounds the probe (its forks take seconds under emulation, minutes under two
    layers of it), ``timeout`` the verifier (bandwidth runs included).
    """
    with open(PROBE, encoding="utf-8") as handle:
        probe_sh = handle.read()
    began = time.monotonic()
    status, out, err = session.run(probe_argv(probe_sh), timeout=probe_timeout)
    progress(f"  guest probe: exit {status} ({time.monotonic() - began:.1f}s)")
    if status:
        raise VerifyError(f"the guest probe failed (exit {status}): {err.strip()[:200]}")
    probe = parse_probe(out)
    verifier = None
    if probe["python3"]:
        with open(VERIFIER, "rb") as handle:
            code = handle.read()
        # Too long for a command line everywhere (dropbear refuses commands over 9000 bytes,
        # MAX_CMD_LEN): python3 reads the program from stdin, all of it before running it.
        argv = [probe["python3"], "-"] + ([] if bandwidth else ["--no-bandwidth"])
        began = time.monotonic()
        status, out, err = session.run(argv, timeout=timeout, stdin=code)
        progress(f"  in-guest verifier: exit {status} ({time.monotonic() - began:.1f}s)")
        if status:
            raise VerifyError(f"the in-guest verifier failed (exit {status}): {err.strip()[-200:]}")
        verifier = parse_verifier(out)
    report = evaluate(probe, verifier, expected)
    report["expected"] = [e.to_json() for e in expected]
    return report
