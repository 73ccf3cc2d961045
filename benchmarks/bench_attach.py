#!/usr/bin/env python3
"""gpuvfio attach (no devices) to a finished verification, side by side with the same boot done by
hand, as a ratio measured in one run (benchmarks/ratios.py).

Daemon lane: a private libvirtd, the tiny busybox + dropbear guest under QEMU (TCG).
gpuvfio: ``gpuvfio attach --name gpuvfio-bench ... --json`` as a process (plan, XML, define,
start, SSH with a pinned key, probe + checks). By hand, as an admin types it: ``virsh create``
of the same XML, then OpenSSH with the same pinned key, tried every 0.1 s until ``uname -r``
answers. Each run's guest is torn down after it, untimed. Goal (issue 39): at most 1.05x. The
attach runs' own step times (its --json "steps") are given beside it, as medians, so what
gpuvfio adds beyond the boot is seen phase by phase.
Usage: benchmarks/bench_attach.py [--runs N] [--json] [--strict]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(HERE)
sys.path.insert(0, HERE)
sys.path.insert(0, REPO)

from ratios import GPUVFIO, Goal, base_env, load, measure, report  # noqa: E402

OURS, BY_HAND = "gpuvfio-bench", "gpuvfio-byhand"
# The admin's loop; its values come as positional parameters, never inside the script's text.
HAND_LOOP = ('virsh -q -c "$1" create "$2" >/dev/null || exit 2\n'
             'until ssh -q -p "$3" -i "$4" -o UserKnownHostsFile="$5" -o StrictHostKeyChecking=yes '
             '-o BatchMode=yes -o ConnectTimeout=5 root@127.0.0.1 uname -r >/dev/null 2>&1; do sleep 0.1; done')


def attach_goal(uri: str, image, tmp: str, env: dict[str, str]) -> Goal:
    """gpuvfio attach against virsh create + an ssh loop, each on its own pinned port."""
    from gpuvfio.ops.context import live_context
    from gpuvfio.ops.domains import domain_request, provision_xml
    from tests.lanes import guest as gl

    ports, known = {}, {}
    for name in (OURS, BY_HAND):
        ports[name] = gl.free_port()
        known[name] = os.path.join(tmp, f"known_hosts.{name}")
        with open(known[name], "w") as handle:
            handle.write(f"[127.0.0.1]:{ports[name]} {image.host_key_line}\n")
    request = domain_request(BY_HAND, vcpus=1, memory="256M", hugepages="none", numa="none", firmware="bios",
                             virt_type="qemu", kernel=image.kernel, initrd=image.initrd,
                             cmdline=gl.KERNEL_CMDLINE, user_net_ssh_port=ports[BY_HAND])
    xml_path = os.path.join(tmp, "byhand.xml")
    with open(xml_path, "w") as handle:
        handle.write(provision_xml(live_context("/"), [], request).xml)
    ours = [GPUVFIO, "attach", "--name", OURS, "--virt-type", "qemu", "--firmware", "bios", "--numa", "none",
            "--hugepages", "none", "--vcpus", "1", "--memory", "256M", "--kernel", image.kernel,
            "--initrd", image.initrd, "--cmdline", gl.KERNEL_CMDLINE, "--user-net-ssh-port", str(ports[OURS]),
            "--ssh-key", image.client_key, "--known-hosts", known[OURS], "--connect", uri, "--json"]
    anchor = ["sh", "-c", HAND_LOOP, "by-hand", uri, xml_path, str(ports[BY_HAND]), image.client_key,
              known[BY_HAND]]
    return Goal("attach, tiny guest, verified / virsh create + ssh loop", ours, anchor, 1.05,
                env={"GPUVFIO_STATE_DIR": env["GPUVFIO_STATE_DIR"]}, exit_codes=(0,), ours_out=[],
                reset=lambda: _tear_down(uri, env))


def _tear_down(uri: str, env: dict[str, str]) -> None:
    """Whichever guest the last run left: gpuvfio's through gpuvfio detach, the other destroyed."""
    import libvirt

    conn = libvirt.open(uri)
    try:
        names = {dom.name() for dom in conn.listAllDomains()}
    finally:
        conn.close()
    if OURS in names:
        subprocess.run([GPUVFIO, "detach", OURS, "--connect", uri, "--timeout", "0"], capture_output=True,
                       env=env, check=True)
    if BY_HAND in names:
        subprocess.run(["virsh", "-q", "-c", uri, "destroy", BY_HAND], capture_output=True, check=True)


def step_medians(outputs: list[bytes], totals: list[float]) -> dict[str, float]:
    """Median seconds of each attach step over the runs, and of what lies outside every step
    (start-up, the plan, printing): "outside steps"."""
    per_step: dict[str, list[float]] = {}
    outside = []
    for out, total in zip(outputs, totals):
        steps = json.loads(out)["steps"]
        for step in steps:
            per_step.setdefault(step["step"], []).append(step["seconds"])
        outside.append(total - sum(step["seconds"] for step in steps))
    medians = {name: statistics.median(times) for name, times in per_step.items()}
    medians["outside steps"] = statistics.median(outside)
    return medians


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=5)
    parser.add_argument("--json", action="store_true")
    parser.add_argument("--strict", action="store_true", help="exit 1 when the goal is missed")
    args = parser.parse_args()
    import libvirt

    from tests.lanes import guest as gl
    from tests.lanes.daemon import LibvirtDaemon

    libvirt.registerErrorHandler(lambda *a: None, None)
    image = gl.build_guest()
    with LibvirtDaemon() as daemon, tempfile.TemporaryDirectory() as tmp:
        env = {**base_env(REPO), "GPUVFIO_STATE_DIR": os.path.join(tmp, "state")}
        goal = attach_goal(daemon.uri, image, tmp, env)
        before = load()
        measure([goal], args.runs, env)  # its first round (the qemu driver's capability probe) uncounted
    steps = step_medians(goal.ours_out or [], goal.ours_s)
    missed = report("tiny guest, attach to a verified guest", [goal], args.runs, before, as_json=args.json,
                    extra={"attach_step_ms": {name: round(s * 1000, 1) for name, s in steps.items()}})
    if not args.json:
        print("gpuvfio attach, median seconds per step: "
              + ", ".join(f"{name} {seconds:.2f}" for name, seconds in steps.items()))
    return 1 if missed and args.strict else 0


if __name__ == "__main__":
    sys.exit(main())
