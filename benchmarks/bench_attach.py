#!/usr/bin/env python3
"""gpuvfio attach (no devices) to a finished verification, vs the same boot done by hand.

Daemon lane: a private libvirtd, the tiny busybox + dropbear guest under QEMU (TCG).
gpuvfio: ``gpuvfio attach --name gpuvfio-bench ... --json`` as a process (XML, define,
start, SSH with a pinned key, probe + checks). By hand: ``virsh create`` of the same XML,
then an SSH loop (paramiko, same pinned key) until ``uname -r`` answers. Teardown is not
timed. Ratio of medians; goal: gpuvfio's own overhead under 10% (ratio < 1.10).
Usage: benchmarks/bench_attach.py [--runs N]
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)
# The console script users run (the venv's, installed from this checkout).
GPUVFIO = os.path.join(os.path.dirname(sys.executable), "gpuvfio")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=5)
    args = parser.parse_args()
    import libvirt

    from gpuvfio.guest.ssh import Session, SshTarget
    from gpuvfio.ops.context import live_context
    from gpuvfio.ops.domains import domain_request, provision_xml
    from tests.lanes import guest as gl
    from tests.lanes.daemon import LibvirtDaemon

    libvirt.registerErrorHandler(lambda *a: None, None)
    image = gl.build_guest()
    ours, theirs = [], []
    with LibvirtDaemon() as daemon, tempfile.TemporaryDirectory() as tmp:
        env = {**os.environ, "PYTHONPATH": REPO, "GPUVFIO_STATE_DIR": os.path.join(tmp, "state")}
        for run in range(args.runs):
            port = gl.free_port()
            known = os.path.join(tmp, f"known_hosts.{run}")
            with open(known, "w") as handle:
                handle.write(f"[127.0.0.1]:{port} {image.host_key_line}\n")
            name = "gpuvfio-bench"
            cmd = [GPUVFIO, "attach", "--name", name, "--virt-type", "qemu", "--firmware",
                   "bios", "--numa", "none", "--hugepages", "none", "--vcpus", "1", "--memory", "256M",
                   "--kernel", image.kernel, "--initrd", image.initrd, "--cmdline", gl.KERNEL_CMDLINE,
                   "--user-net-ssh-port", str(port), "--ssh-key", image.client_key, "--known-hosts", known,
                   "--connect", daemon.uri, "--json"]
            start = time.perf_counter()
            proc = subprocess.run(cmd, capture_output=True, text=True, env=env)
            ours.append(time.perf_counter() - start)
            if proc.returncode:
                raise SystemExit(f"gpuvfio attach failed: {proc.stderr.strip()[-300:]}")
            subprocess.run([GPUVFIO, "detach", name, "--connect", daemon.uri, "--timeout",
                            "0"], capture_output=True, env=env, check=True)
            # By hand: the same XML, virsh create, SSH until uname answers.
            port = gl.free_port()
            with open(known, "w") as handle:
                handle.write(f"[127.0.0.1]:{port} {image.host_key_line}\n")
            request = domain_request("gpuvfio-byhand", vcpus=1, memory="256M", hugepages="none", numa="none",
                                     firmware="bios", virt_type="qemu", kernel=image.kernel, initrd=image.initrd,
                                     cmdline=gl.KERNEL_CMDLINE, user_net_ssh_port=port)
            xml_path = os.path.join(tmp, "byhand.xml")
            with open(xml_path, "w") as handle:
                handle.write(provision_xml(live_context("/"), [], request).xml)
            start = time.perf_counter()
            subprocess.run(["virsh", "-c", daemon.uri, "create", xml_path], check=True, capture_output=True)
            session = Session(SshTarget("127.0.0.1", port, "root", image.client_key, known)).connect()
            status, out, _err = session.run(["uname", "-r"])
            theirs.append(time.perf_counter() - start)
            session.close()
            assert status == 0 and out.strip() == image.kernel_version
            subprocess.run(["virsh", "-c", daemon.uri, "destroy", "gpuvfio-byhand"], check=True, capture_output=True)
    o, t = statistics.median(ours), statistics.median(theirs)
    print(f"tiny guest, median of {args.runs} runs each")
    print(f"gpuvfio attach (define, start, ssh, verify)   {o:7.2f} s")
    print(f"virsh create + ssh loop until uname answers   {t:7.2f} s")
    print(f"  ratio {o / t:.2f} (goal < 1.10)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
