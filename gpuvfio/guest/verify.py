"""Verify a guest over SSH: run the probe and the verifier there, gather facts, judge them.

The guest side only reports facts (gpuvfio/guest/payload/); what was expected comes from this
host (gpuvfio/guest/expect.py) and the verdicts from gpuvfio/guest/checks.py. Whatever the
guest answers -- nothing, garbage, a crash -- there is a report: a failed "probe" or
"verifier" check with the reason, never a traceback and never a silent pass.
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Mapping

from gpuvfio.clock import SYSTEM_CLOCK, Clock
from gpuvfio.errors import GpuvfioError
from gpuvfio.user_files import read_regular
from gpuvfio.guest.checks import FAIL, VerifyReport, bus_key, check, judge, report
from gpuvfio.guest.expect import Expected, Gates
from gpuvfio.guest.payload import PROBE, verifier_program
from gpuvfio.guest.payload.gpuvfio_ncclpaths import PATH_NAMES
from gpuvfio.numbers import finite
from gpuvfio.strictjson import JsonRejected, strict_loads

# What a guest's sysfs can name (lib/vsprintf.c, drivers/pci/probe.c: "%04x:%02x:%02x.%d", a
# domain past 0xffff printed wider) and its ids ("0x%04x", class "0x%06x"): anything else from a
# guest is not a PCI function and is never compared or shown.
# the kernel prints the domain with %04x: four digits, or more with no leading zero
_GUEST_ADDRESS = re.compile(r"(?:[0-9a-f]{4}|[1-9a-f][0-9a-f]{4,7}):[0-9a-f]{2}:[0-1][0-9a-f]\.[0-7]", re.ASCII)
_HEX4 = re.compile(r"[0-9a-f]{4}", re.ASCII)
_HEX6 = re.compile(r"[0-9a-f]{6}", re.ASCII)
PROBE_NAME = "gpuvfio-probe"  # $0 of the probe shell, how a harness recognises the command
VERIFIER_VERSION = 2


class VerifyError(GpuvfioError):
    """The guest's answer cannot be used (garbage, truncated, the probe did not run)."""


def parse_probe(text: str) -> dict:
    lines = text.splitlines()
    if not lines or lines[0].strip() != "GPUVFIO-PROBE 1":
        raise VerifyError("the guest probe's output is not recognisable (no GPUVFIO-PROBE header)")
    if "END" not in (line.strip() for line in lines):
        raise VerifyError("the guest probe's output is truncated (no END line)")
    facts = {"kernel": None, "python3": None, "pci": [], "modules": [], "nvidia_version": None, "nvidia_smi": None,
             "dmesg": []}
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
            if len(parts) not in (9, 10):
                raise VerifyError(f"malformed PCI line from the guest probe: {line[:80]!r}")
            addr, vendor, device, klass, driver, cur_s, cur_w, max_s, max_w = parts[:9]
            upstream = parts[9] if len(parts) == 10 and parts[9] != "-" else None
            ids = [part.lower().removeprefix("0x") for part in (vendor, device, klass)]
            if not all(_GUEST_ADDRESS.fullmatch(a) for a in [addr.lower()] + ([upstream.lower()] if upstream else [])):
                raise VerifyError(f"malformed PCI address from the guest probe: {addr[:40]!r}")
            # the driver is only compared with "nvidia" and shown escaped; the ids and addresses
            # are matched against the plan, so they must be what a kernel prints
            if not (_HEX4.fullmatch(ids[0]) and _HEX4.fullmatch(ids[1]) and _HEX6.fullmatch(ids[2])):
                raise VerifyError(f"malformed PCI ids from the guest probe: {line[:80]!r}")
            facts["pci"].append({"address": addr.lower(), "upstream": upstream and upstream.lower(),
                                 "vendor_id": ids[0], "device_id": ids[1], "class_id": ids[2],
                                 "driver": None if driver == "-" else driver,
                                 "link": {"current_speed": cur_s, "current_width": cur_w,
                                          "max_speed": max_s, "max_width": max_w}})
        elif kind == "MODULE":
            facts["modules"].append(rest)
        elif kind == "NVIDIA-VERSION":
            facts["nvidia_version"] = rest
        elif kind == "DMESG":
            facts["dmesg"] = (facts["dmesg"] + [rest[:300]])[-50:]
        elif kind == "NVSMI-BEGIN":
            nvsmi = []
    return facts


def parse_verifier(text: str) -> dict:
    """The verifier's JSON, its shape checked where the checks read it (a guest is not trusted
    to answer well: a hostile or broken one gets a failed check, not a traceback here)."""
    for line in text.splitlines():
        if line.startswith("GPUVFIO-VERIFIER "):
            try:
                data = strict_loads(line[len("GPUVFIO-VERIFIER "):])
            except JsonRejected as exc:
                raise VerifyError(f"the in-guest verifier's JSON is garbled ({exc})") from None
            if not isinstance(data, dict) or data.get("version") != VERIFIER_VERSION:
                raise VerifyError("the in-guest verifier answered in an unknown format")
            problem = shape_problem(data)
            if problem:
                raise VerifyError(f"the in-guest verifier's answer is malformed: {problem}")
            return data
    raise VerifyError("the in-guest verifier printed no result (truncated output or a crash)")


def _number(value) -> bool:
    return finite(value)


def shape_problem(data: dict) -> str | None:
    """What in the verifier's answer does not have the shape gpuvfio reads (None: nothing)."""
    errors = data.get("errors")
    if not isinstance(errors, dict) or not all(isinstance(k, str) and isinstance(v, str) for k, v in errors.items()):
        return "errors is not a table of texts"
    for key in ("nvml", "cuda", "p2p", "nccl"):
        value = data.get(key)
        if value is not None and not isinstance(value, dict):
            return f"{key} is not an object"
        if key in ("nvml", "cuda") and value is not None:
            devices = value.get("devices")
            if not isinstance(devices, list) or not all(isinstance(d, dict) and isinstance(d.get("bus_id"), str)
                                                        for d in devices):
                return f"{key}.devices is not a list of devices"
    for key in ("bandwidth", "latency", "copy_overhead", "compute"):
        table = data.get(key)
        if not isinstance(table, dict) or not all(isinstance(k, str) and isinstance(v, dict) for k, v in table.items()):
            return f"{key} is not a table of devices"
    for bus, measured in data["bandwidth"].items():
        for direction in ("h2d", "d2h", "d2d", "bidir_total"):
            if direction in measured and not (isinstance(measured[direction], dict)
                                              and _number(measured[direction].get("median"))):
                return f"bandwidth {bus} {direction} has no finite median"
        link = measured.get("link_under_load")
        if link is not None and not (isinstance(link, dict) and ("error" in link or all(
                _number(link.get(k)) for k in ("current_gen", "current_width")))):
            return f"bandwidth {bus} link is malformed"
    for bus, compute in data["compute"].items():
        if not _number(compute.get("launch_ms", 0)):
            return f"compute {bus} has no finite time"
    for device in (data.get("nvml") or {}).get("devices", []):
        link = device.get("link_idle")
        if link is not None and not (isinstance(link, dict) and ("error" in link or all(
                _number(link.get(k)) for k in ("current_gen", "current_width")))):
            return "an NVML link is malformed"
    p2p = data.get("p2p")
    if p2p is not None:
        buses, access = p2p.get("bus_ids", []), p2p.get("access", [])
        if not isinstance(buses, list) or not all(isinstance(b, str) for b in buses):
            return "p2p.bus_ids is not a list of bus ids"
        if not isinstance(access, list) or not all(
                isinstance(row, list) and all(isinstance(a, bool) for a in row) for row in access):
            return "p2p.access is not a matrix of true and false"
        pairs = p2p.get("bandwidth")
        if not isinstance(pairs, dict) or not all(
                isinstance(v, dict) and ((isinstance(v.get("error"), str) and v["error"]) or _number(v.get("median")))
                for v in pairs.values()):
            return "p2p.bandwidth is malformed"
    nccl = data.get("nccl")
    if nccl is not None:
        results = nccl.get("results")
        if not isinstance(results, list) or not all(isinstance(r, dict) and _number(r.get("bytes"))
                                                    and _number(r.get("busbw_gbps")) for r in results):
            return "nccl.results is malformed"
        if "topology" in nccl and not _topology_shaped(nccl["topology"]):
            return "nccl.topology is malformed"
    return None


MAX_PATHS = 256 * 255 // 2  # pairs of NCCL_TOPO_XML_MAX_NODES nodes


def _topology_shaped(topology) -> bool:
    """The verifier's NCCL topology view: the file and NCCL's dump, each GPU's link attributes
    by bus id (texts), an NVLink count where NCCL found some (None: that side is unknown), and
    NCCL's path type between each pair of the dump's GPUs."""
    def text(value) -> bool:
        return value is None or isinstance(value, str)

    def links(table) -> bool:
        return table is None or (isinstance(table, dict) and all(
            isinstance(bus, str) and isinstance(entry, dict) and text(entry.get("link_speed"))
            and text(entry.get("link_width")) and (entry.get("nvlink") is None or _number(entry["nvlink"]))
            for bus, entry in table.items()))
    def paths(rows) -> bool:  # [bus id, bus id, NCCL path type], at most one per pair of 256 nodes
        return rows is None or (isinstance(rows, list) and len(rows) <= MAX_PATHS and all(
            isinstance(row, list) and len(row) == 3 and all(isinstance(v, str) for v in row)
            and bus_key(row[0]) is not None and bus_key(row[1]) is not None and row[2] in PATH_NAMES
            for row in rows))
    def settings(rows) -> bool:  # what NCCL ranks above /etc/nccl.conf: at most 64, each three texts
        return rows is None or (isinstance(rows, list) and len(rows) <= 64 and all(
            isinstance(row, dict) and all(isinstance(row.get(k), str) for k in ("source", "key", "value"))
            for row in rows))
    return (isinstance(topology, dict)
            and all(text(topology.get(k)) for k in ("file", "source", "error", "gpuvfio_file"))
            and links(topology.get("planned")) and links(topology.get("nccl")) and paths(topology.get("paths"))
            and settings(topology.get("above")))


def probe_argv(script: str) -> list[str]:
    """The probe as one command: its text is ``sh -c``'s argument (shlex-quoted by Session.run),
    so nothing is uploaded and nothing stays in the guest. It must stay well under dropbear's
    9000-byte command limit (MAX_CMD_LEN); tests/unit/test_verify.py checks its size."""
    return ["sh", "-c", script, PROBE_NAME]


def run_probe(session, *, timeout: float = 120.0, progress=lambda line: None, clock: Clock = SYSTEM_CLOCK) -> dict:
    """The guest's facts (parse_probe); VerifyError when the probe fails or answers garbage."""
    probe_sh = (read_regular(PROBE, 64 << 10) or b"").decode("utf-8")
    began = clock.monotonic()
    status, out, err = session.run(probe_argv(probe_sh), timeout=timeout)
    progress(f"  guest probe: exit {status} ({clock.monotonic() - began:.1f}s)")
    if status:
        raise VerifyError(f"the guest probe failed (exit {status}): {err.strip()[:200]}")
    return parse_probe(out)


def verify_guest(session, expected: list[Expected], *, bandwidth: bool = True, timeout: float = 600.0,
                 probe_timeout: float = 120.0, gates: Gates = Gates(), verifier_args: tuple[str, ...] = (),
                 nccl_paths: Mapping[tuple[str, str], str] | None = None,
                 progress=lambda line: None, clock: Clock = SYSTEM_CLOCK) -> VerifyReport:
    """Run the probe (and the verifier where the guest has python3) and judge; always a report.

    The probe travels as ``sh -c``'s argument, the verifier on ``python3 -``'s stdin: one SSH
    channel each, no SFTP subsystem to ask for (dropbear has none), no files left in the guest.
    ``probe_timeout`` bounds the probe (its forks take seconds under emulation, minutes under two
    layers of it), ``timeout`` the verifier (bandwidth runs included). SSH failures themselves
    (no connection) are raised: there is no guest to judge. ``nccl_paths``: NCCL's path type
    between each pair of the expected GPUs on the host (host addresses, the smaller first).
    """
    try:
        probe = run_probe(session, timeout=probe_timeout, progress=progress, clock=clock)
    except VerifyError as exc:
        return dataclasses.replace(report([check("probe", FAIL, reason=str(exc))], {}, None), expected=list(expected))
    verifier = problem = None
    if probe["python3"]:
        # Too long for a command line everywhere (dropbear refuses commands over 9000 bytes,
        # MAX_CMD_LEN): python3 reads the program from stdin, all of it before running it.
        argv = [probe["python3"], "-", *verifier_args] + ([] if bandwidth else ["--no-bandwidth"])
        began = clock.monotonic()
        status, out, err = session.run(argv, timeout=timeout, stdin=verifier_program())
        progress(f"  in-guest verifier: exit {status} ({clock.monotonic() - began:.1f}s)")
        try:
            verifier = parse_verifier(out)
        except VerifyError as exc:
            problem = f"{exc} (exit {status}{': ' + err.strip()[-200:] if err.strip() else ''})"
    try:
        result = judge(probe, verifier, expected, gates=gates, bandwidth=bandwidth, verifier_problem=problem,
                       nccl_paths=nccl_paths)
    except (KeyError, TypeError, ValueError, AttributeError) as exc:  # a shape shape_problem did not foresee
        result = report([check("verifier", FAIL, reason=f"the guest's answer could not be judged: "
                                                         f"{type(exc).__name__}: {exc}")], probe, None)
    return dataclasses.replace(result, expected=list(expected))
