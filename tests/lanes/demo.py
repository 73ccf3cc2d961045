"""The end-to-end demo: GPU passthrough with gpuvfio on an emulated GPU host, watched live.

    python -m tests.lanes.demo [--out DIR]      (from the repository root, as root)

1. builds the tiny second-level guest on this machine (busybox + dropbear, cached);
2. boots the "GPU host": this machine's kernel under QEMU (TCG) with an emulated
   Intel IOMMU and a GPU-shaped PCI topology (tests/lanes/kernel.py), where the
   QEMU ``edu`` device 1234:11e8 at 0000:02:00.0 stands in for the GPU;
3. inside it, starts libvirtd and runs, printing each command and its output as it
   happens: ``gpuvfio list --all``, ``gpuvfio doctor``, the bind plan (``gpuvfio bind
   0000:02:00.0 --dry-run``), the domain XML (``gpuvfio xml ...``, also defined and
   undefined in that libvirtd), then ``gpuvfio attach ...`` (bind to vfio-pci, define,
   start the second-level guest, wait for SSH, verify -- progress and the verification
   report) and ``gpuvfio detach ...``;
4. leaves the JSON outputs (attach report, verification report, plan, inventory,
   doctor, detach, status) and the transcript under ``demo-out/``.

Takes ~4-6 minutes on 2 cores (the second-level guest boots under two layers of
emulation).  Exit status 0 when the device was verified in the second-level guest
and given back afterwards.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

from tests.lanes import guest as gl
from tests.lanes import nested

REPO = nested.REPO


def _say(text: str = "") -> None:
    sys.stdout.write(text + "\n")
    sys.stdout.flush()


def _json(files: dict[str, str], name: str):
    try:
        return json.loads(files.get(name + ".out", ""))
    except ValueError:
        return None


def write_outputs(result: nested.NestedResult, out: str) -> list[str]:
    """The JSON outputs and logs of the run under ``out``; returns the file names."""
    files = result.files
    written = []

    def put(name: str, text: str) -> None:
        with open(os.path.join(out, name), "w") as f:
            f.write(text if text.endswith("\n") or not text else text + "\n")
        written.append(name)

    for source, target in (("list_json", "list.json"), ("doctor_json", "doctor.json"),
                           ("plan_json", "bind-plan.json"), ("define", "define.json"),
                           ("attach", "attach.json"), ("attached_status", "status-attached.json"),
                           ("detach", "detach.json"), ("detached_status", "status-detached.json")):
        data = _json(files, source)
        if data is not None:
            put(target, json.dumps(data, indent=2))
    attach = _json(files, "attach")
    if attach:
        if attach.get("verify") is not None:
            put("verify.json", json.dumps(attach["verify"], indent=2))
        if attach.get("xml"):
            put("attach-domain.xml", attach["xml"])
    for source, target in (("xml.out", "domain.xml"), ("timings", "timings.txt"),
                           ("nested.qemu.log", "nested-qemu.log"), ("libvirtd.json", "libvirtd.json"),
                           ("errors", "errors.txt")):
        if files.get(source):
            put(target, files[source])
    put("transcript.txt", result.guest.stdout)
    if result.guest.stderr.strip():
        put("guest-stderr.txt", result.guest.stderr)
    return written


def verdict(result: nested.NestedResult) -> tuple[bool, list[str]]:
    """Did the device reach the second-level guest and come back? (ok, reasons)"""
    files = result.files
    problems = []
    attach = _json(files, "attach") or {}
    checks = {c["id"]: c for c in (attach.get("verify") or {}).get("checks", [])}
    if not attach.get("ok"):
        problems.append("attach did not succeed")
    if checks.get("pci_present", {}).get("status") != "pass":
        problems.append("the edu device was not seen in the second-level guest")
    detach = _json(files, "detach") or {}
    if not detach.get("undefined") or (detach.get("restored") or {}).get("failed"):
        problems.append("detach did not undefine the guest and restore the device")
    if files.get("detached.drivers", "").strip().split("|")[1:] != ["-", "(null)"]:
        problems.append(f"edu not back to no driver: {files.get('detached.drivers', '?').strip()}")
    if files.get("errors"):
        problems.append("the guest script reported errors (errors.txt)")
    return not problems, problems


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tests.lanes.demo", description=__doc__.split("\n")[0])
    parser.add_argument("--out", default=os.path.join(REPO, "demo-out"), help="where the outputs go")
    parser.add_argument("--timeout", type=int, default=nested.DEFAULT_TIMEOUT,
                        help="seconds for the whole emulated run")
    args = parser.parse_args(argv)

    reason = nested.skip_reason()
    if reason:
        _say(f"demo: cannot run the emulated GPU host here: {reason}")
        return 2
    if os.geteuid() != 0:
        _say("demo: needs root (libvirt and QEMU, as in `make test`)")
        return 2
    out = os.path.abspath(args.out)
    if os.path.isdir(out):
        for entry in os.listdir(out):  # only our own outputs: plain files
            path = os.path.join(out, entry)
            if os.path.isfile(path) and not os.path.islink(path):
                os.unlink(path)
    os.makedirs(out, exist_ok=True)

    began = time.monotonic()
    _say("== gpuvfio end to end: GPU passthrough on an emulated GPU host")
    _say("   the 'GPU' is QEMU's edu device (1234:11e8) at 0000:02:00.0, alone in its IOMMU group")
    _say("\n== building the tiny second-level guest (busybox + dropbear; cached)")
    t = time.monotonic()
    image = gl.build_guest()
    _say(f"kernel {image.kernel}\ninitrd {image.initrd}\nhost key {image.host_key_fingerprint} (pinned), "
         f"client key {image.client_key}  [{time.monotonic() - t:.1f}s]")
    _say("\n== booting the emulated GPU host: this machine's kernel under QEMU TCG, emulated Intel IOMMU "
         "(~30 s) ...")
    try:
        result = nested.run(nested.ALL_PARTS, timeout=args.timeout, image=image,
                            follow=lambda text: (sys.stdout.write(text), sys.stdout.flush()))
    except Exception as exc:  # noqa: BLE001 - tell the person, leave what there is
        _say(f"\ndemo: the emulated run failed: {exc}")
        return 1
    written = write_outputs(result, out)
    ok, problems = verdict(result)
    _say(f"\n== outputs in {os.path.relpath(out, os.getcwd()) if out.startswith(os.getcwd()) else out}/: "
         + ", ".join(sorted(written)))
    _say(f"== {'PASS' if ok else 'FAIL'}: "
         + ("the edu device was passed through, seen in the second-level guest, and given back"
            if ok else "; ".join(problems))
         + f" ({time.monotonic() - began:.0f}s in all)")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
