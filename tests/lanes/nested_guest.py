"""Nested lane, guest side: runs INSIDE the kernel-lane guest (started by tests/lanes/nested.py).

The kernel-lane guest is the emulated GPU host: a real kernel with an emulated
Intel IOMMU, two NUMA nodes and QEMU edu devices (see the topology in
tests/lanes/kernel.py): EDU at 0000:02:00.0 alone in its IOMMU group, one edu on
node 0's expander and two behind an emulated PCIe switch on node 1's.  In it this script
starts a private libvirtd (tests/lanes/daemon.py works unchanged there: /etc,
/var, /run and /tmp are writable overlays or tmpfs, PID 1 is virtme's init, the
daemons run under daemon.py's reaper), then runs real gpuvfio commands against
the guest's real sysfs and that libvirtd, in order:

  inventory  gpuvfio list --all, gpuvfio doctor (and their --json forms)
  plan       gpuvfio bind EDU --dry-run (and --json)
  domain     gpuvfio xml EDU ...; xml --define (twice: defined, then unchanged);
             the definition read back from libvirt, then undefined
  attach     gpuvfio attach DEVICES ... --json with the node-0 edu and the two edus
             behind the switch, --topology mirror over two guest NUMA cells (bind,
             define, start the second-level guest, wait for SSH, verify), the state
             while it runs, the second-level guest's PCI tree as it sees it (over
             SSH: lspci -t where its lspci has -t, else the sysfs paths and each
             device's numa_node), then gpuvfio detach ... --json and the state after

Each command is announced on stdout ("$ gpuvfio ...") and its output printed
when it ends; attach/detach stream their progress while they run (the host side
can follow stdout live).  Everything is also recorded in $OUT for the tests:
<name>.rc/.out/.err per command, <name>.drivers / <name>.vfio snapshots of the
watched devices (EDU and the attached ones: "ADDR|driver or -|driver_override" a
line), "timings", "errors" (a failed part is recorded and the script goes on),
"libvirtd.json", the emulated host's own tree ("host.lspci_t", "host.groups",
"host.switch_port.lspci": lspci -vvv of the switch's first downstream port), the
second-level guest's ("nested.lspci_t", "nested.tree", "nested.nodes"), and the QEMU
capabilities libvirt probed ("qemucaps--*"), which the host caches so the next boot
skips the ~20 s probe.

Commands run as forked children of this process, which imported the CLI once:
under TCG a fresh ``python -m gpuvfio`` costs 10-35 s of imports over 9p (see
tests/kernel/test_kernel_binding.py).  attach and detach run with ``--json -v``: the JSON
report on stdout, gpuvfio's progress (each step, each command in the guest with its
duration) on stderr, streamed live; attach gets ``--probe-timeout`` (PROBE_TIMEOUT)
for the guest probe, whose forks are slow under two layers of emulation, and
``--console-log`` for the second-level guest's serial console (returned as
nested.console.log).
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import shlex
import shutil
import sys
import time
import traceback

QEMU_CAPS_DIR = "/var/cache/libvirt/qemu/capabilities"
# gpuvfio verify gives the guest probe (gpuvfio/guest/payload/probe.sh) 120 s by default. The
# probe forks a few processes per sysfs attribute: seconds under one layer of TCG, more under
# two when the machine is loaded, so attach here allows it this much (--probe-timeout).
PROBE_TIMEOUT = 600.0
CONSOLE_LOG = "/tmp/gpuvfio-nested-console.log"
PARTS = ("inventory", "plan", "domain", "attach")
# Run in the second-level guest (busybox sh) over SSH: its lspci -t if it has one (busybox's
# has no -t), then every PCI device's sysfs path, numa_node and IDs, then its NUMA nodes.
# No fork per device (cd -P and read are builtins): forks are slow under two layers of TCG.
TREE_LOOP = r"""
for d in /sys/bus/pci/devices/*; do
  cd -P "$d" || continue
  n=-; v=-; i=-; c=-
  read -r n < numa_node; read -r v < vendor; read -r i < device; read -r c < class
  echo "$PWD|$n|$v|$i|$c"
done
"""
NESTED_TREE_SCRIPT = r"""
echo '== lspci -t'
lspci -t 2>&1
echo "== rc $?"
echo '== tree'
""" + TREE_LOOP + r"""echo '== nodes'
for n in /sys/devices/system/node/node*; do
  [ -e "$n/cpulist" ] || continue
  c=$(cat "$n/cpulist")  # a binary sysfs attribute: read, a byte at a time, gets nothing
  echo "${n##*/}|$c"
done
echo '== end'
"""


class Run:
    def __init__(self, config: dict) -> None:
        self.config = config
        self.out = os.environ["OUT"]
        self.edu = config["edu"]
        # The devices each snapshot records: EDU (plan, domain) and the attached ones.
        self.watch = list(dict.fromkeys([self.edu, *(config.get("attach_devices") or [self.edu])]))
        self.ssh_port: int | None = None  # the second-level guest's forwarded SSH port
        self.main = None  # gpuvfio.cli.main, once imported

    # -- recording -------------------------------------------------------------------

    def put(self, name: str, text: str) -> None:
        with open(os.path.join(self.out, name), "w") as f:
            f.write(text)

    def log(self, name: str, text: str) -> None:
        with open(os.path.join(self.out, name), "a") as f:
            f.write(text)

    def say(self, text: str = "") -> None:
        sys.stdout.write(text + "\n")
        sys.stdout.flush()

    @contextlib.contextmanager
    def part(self, label: str):
        """One part; a failure is recorded in $OUT/errors and shown, and the script goes on."""
        try:
            yield
        except BaseException as exc:  # noqa: BLE001 - record everything, go on
            if isinstance(exc, KeyboardInterrupt):
                raise
            text = "".join(traceback.format_exception(type(exc), exc, exc.__traceback__))
            self.log("errors", f"--- {label}\n{text}")
            self.say(f"!! {label} failed: {type(exc).__name__}: {exc}")

    # -- gpuvfio commands ------------------------------------------------------------

    def _child(self, argv: list[str], name: str) -> None:
        for fd, suffix, flags in ((0, None, os.O_RDONLY),
                                  (1, ".out", os.O_WRONLY | os.O_CREAT | os.O_TRUNC),
                                  (2, ".err", os.O_WRONLY | os.O_CREAT | os.O_TRUNC)):
            path = os.devnull if suffix is None else os.path.join(self.out, name + suffix)
            new = os.open(path, flags, 0o644)
            os.dup2(new, fd)
            os.close(new)
        code = 1
        try:
            code = self.main(list(argv))
        except BaseException:  # noqa: BLE001
            traceback.print_exc()
        finally:
            for stream in (sys.stdout, sys.stderr):
                with contextlib.suppress(Exception):
                    stream.flush()
        os._exit(code)  # a forked child: leave without the parent's atexit handlers and buffers

    def gv(self, name: str, *argv: str, stream: bool = False, show: str = "out") -> int:
        """Run ``gpuvfio ARGV`` in a forked child; record and print it. ``show``: out | none."""
        self.say(f"\n$ gpuvfio {shlex.join(argv)}")
        sys.stderr.flush()
        began = time.monotonic()
        pid = os.fork()
        if pid == 0:
            try:
                self._child(list(argv), name)
            finally:
                os._exit(99)
        err_path = os.path.join(self.out, name + ".err")
        shown = 0

        def pump() -> None:
            nonlocal shown
            try:
                with open(err_path, "rb") as f:
                    f.seek(shown)
                    data = f.read()
            except FileNotFoundError:
                return
            if data:
                shown += len(data)
                sys.stdout.write(data.decode(errors="replace"))
                sys.stdout.flush()

        while True:
            done, status = os.waitpid(pid, os.WNOHANG)
            if done:
                break
            if stream:
                pump()
            time.sleep(0.25)
        rc = 128 + os.WTERMSIG(status) if os.WIFSIGNALED(status) else os.WEXITSTATUS(status)
        seconds = time.monotonic() - began
        self.put(name + ".rc", f"{rc}\n")
        self.log("timings", f"{seconds:7.2f} {name}\n")
        pump()
        if show == "out":
            with open(os.path.join(self.out, name + ".out"), errors="replace") as f:
                text = f.read()
            if text:
                sys.stdout.write(text if text.endswith("\n") else text + "\n")
        self.say(f"[exit {rc}, {seconds:.1f}s" + ("; output recorded]" if show == "none" else "]"))
        return rc

    def rc_of(self, name: str) -> int | None:
        try:
            with open(os.path.join(self.out, name + ".rc")) as f:
                return int(f.read().strip())
        except (OSError, ValueError):
            return None

    def json_of(self, name: str) -> dict | None:
        try:
            with open(os.path.join(self.out, name + ".out")) as f:
                return json.loads(f.read())
        except (OSError, ValueError):
            return None

    # -- the watched devices ---------------------------------------------------------

    def snap(self, name: str) -> None:
        lines = []
        for address in self.watch:
            base = f"/sys/bus/pci/devices/{address}"
            link = os.path.join(base, "driver")
            driver = os.path.basename(os.readlink(link)) if os.path.lexists(link) else "-"
            try:
                with open(os.path.join(base, "driver_override")) as f:
                    override = f.read().strip()
            except OSError:
                override = "?"
            lines.append(f"{address}|{driver}|{override}\n")
        self.put(name + ".drivers", "".join(lines))
        nodes = sorted(os.listdir("/dev/vfio")) if os.path.isdir("/dev/vfio") else []
        self.put(name + ".vfio", "".join(n + "\n" for n in nodes))


def _render_report(run: Run, report: dict) -> None:
    """The attach report as a person reads it: the steps, then the verification checks."""
    run.say("steps:")
    for step in report.get("steps", []):
        run.say(f"  {'ok  ' if step['ok'] else 'FAIL'} {step['step']:14} {step['seconds']:7.1f}s"
                + (f"  {step['error']}" if step.get("error") else ""))
    if report.get("rolled_back"):
        run.say(f"rolled back: {', '.join(report['rolled_back'])}")
    verify = report.get("verify")
    if verify:
        run.say("verification (in the second-level guest):")
        from gpuvfio.cli import render  # imported by the preload already

        render.print_verify(verify)  # as gpuvfio attach prints it
        sys.stdout.flush()
        facts = verify.get("facts") or {}
        run.say(f"guest kernel: {facts.get('guest_kernel')}")
        for dev in facts.get("pci") or []:
            run.say(f"  guest PCI {dev['address']} {dev['vendor_id']}:{dev['device_id']} "
                    f"class {dev['class_id']} driver {dev['driver'] or '-'}")
    run.say(f"ok: {report.get('ok')}")


def run_text(run: Run, name: str) -> str:
    with open(os.path.join(run.out, name), errors="replace") as f:
        return f.read()


def split_sections(text: str) -> dict[str, str]:
    """NESTED_TREE_SCRIPT's output: '== NAME' lines start sections."""
    sections: dict[str, list[str]] = {}
    current = None
    for line in text.splitlines():
        if line.startswith("== "):
            current = line[3:].strip()
            sections.setdefault(current, [])
        elif current is not None:
            sections[current].append(line)
    return {k: "".join(v + "\n" for v in lines) for k, lines in sections.items()}


def record_nested_tree(run: Run, image: dict) -> None:
    """The second-level guest's PCI tree and NUMA nodes, as that guest sees them (over SSH)."""
    from tests.lanes import guest as gl

    began = time.monotonic()
    pinned = gl.GuestImage(kernel=image["kernel"], kernel_version="", initrd=image["initrd"],
                           host_key_line=image["host_key_line"], host_key_fingerprint="",
                           client_key=image["client_key"], client_key_type="", directory="")
    rc, out, err = gl.ssh_run(pinned, run.ssh_port, NESTED_TREE_SCRIPT, timeout=300)
    seconds = time.monotonic() - began
    run.put("nested.tree.raw", out + (f"--- stderr\n{err}" if err else "") + f"--- rc {rc}\n")
    sections = split_sections(out)
    lspci = sections.get("lspci -t", "")
    run.put("nested.lspci_t", lspci + "".join(f"[{k}]\n" for k in sections if k.startswith("rc ")))
    run.put("nested.tree", sections.get("tree", ""))
    run.put("nested.nodes", sections.get("nodes", ""))
    run.log("timings", f"{seconds:7.2f} second-level tree\n")
    run.say("\n== the second-level guest's PCI tree (sysfs path|numa_node|vendor|device|class)\n"
            + sections.get("tree", "") + "NUMA nodes: " + " ".join(sections.get("nodes", "").split())
            + f"\n[{seconds:.1f}s]")
    if "end" not in sections:
        raise RuntimeError(f"the second-level guest's tree script did not finish (rc {rc}): {err[-500:]}")


def main(config: dict) -> int:
    sys.dont_write_bytecode = True
    os.environ["PYTHONDONTWRITEBYTECODE"] = "1"
    for var in ("GPUVFIO_ROOT", "LIBVIRT_DEFAULT_URI"):
        os.environ.pop(var, None)
    os.chdir(config["repo"])
    sys.stdout.reconfigure(line_buffering=True)
    run = Run(config)
    parts = config.get("parts") or list(PARTS)
    edu = config["edu"]
    t0 = time.monotonic()
    run.say(f"== kernel-lane guest: {os.uname().release}, edu device {edu} "
            f"(IOMMU group {os.path.basename(os.readlink(f'/sys/bus/pci/devices/{edu}/iommu_group'))})")

    with run.part("preload"):
        from gpuvfio.cli import main as gpuvfio_main  # the whole command line and every service

        for optional in ("libvirt", "paramiko", "jinja2", "lxml.etree", "pydantic", "rich.console", "rich.table"):
            with contextlib.suppress(ImportError):
                __import__(optional)
        run.main = gpuvfio_main
    if run.main is None:
        return 3
    # typer imports more while it parses arguments: parse once here, output discarded.
    with run.part("warm-up"):
        for argv in (["status", "--json"], ["bind", edu, "--dry-run", "--json"]):
            sink = io.StringIO()
            with contextlib.redirect_stdout(sink), contextlib.redirect_stderr(sink):
                run.main(argv)
    run.log("timings", f"{time.monotonic() - t0:7.2f} preload\n")

    state = "/var/lib/gpuvfio"
    try:
        os.makedirs(state, exist_ok=True)
        if not os.access(state, os.W_OK):
            raise OSError("not writable")
    except OSError:
        state = "/tmp/gpuvfio-state"
        os.environ["GPUVFIO_STATE_DIR"] = state
    run.put("state_dir", state + "\n")
    run.snap("initial")
    with run.part("host tree"):
        import subprocess

        from tests.lanes import kernel as kl

        def capture(argv: list[str]) -> str:
            proc = subprocess.run(argv, capture_output=True, text=True, timeout=120)
            return proc.stdout + proc.stderr + ("" if proc.returncode == 0 else f"[exit {proc.returncode}]\n")

        run.put("host.lspci_t", capture(["lspci", "-tvnn"]))
        run.put("host.groups", capture(["sh", "-c", kl.iommu_groups_script()]))
        run.put("host.tree", capture(["sh", "-c", TREE_LOOP]))  # as the second-level guest's is read
        if config.get("switch_port"):
            run.put("host.switch_port.lspci", capture(["lspci", "-vvv", "-s", config["switch_port"]]))
        run.say("\n== the emulated GPU host's PCI tree (lspci -tvnn)\n" + run_text(run, "host.lspci_t"))

    # -- libvirtd in the guest --------------------------------------------------------
    daemon = None
    with run.part("libvirtd"):
        from tests.lanes import daemon as dl

        cached = config.get("qemu_caps_cache")
        restored = []
        if cached and os.path.isdir(cached):
            os.makedirs(QEMU_CAPS_DIR, exist_ok=True)
            for entry in sorted(os.listdir(cached)):
                if entry.endswith(".xml"):
                    shutil.copyfile(os.path.join(cached, entry), os.path.join(QEMU_CAPS_DIR, entry))
                    os.chmod(os.path.join(QEMU_CAPS_DIR, entry), 0o600)
                    restored.append(entry)
        began = time.monotonic()
        run.say("\n== starting libvirtd (+ virtlogd) inside the emulated host")
        daemon = dl.LibvirtDaemon(start_timeout=300).start()
        started = time.monotonic() - began
        import libvirt

        conn = libvirt.open(daemon.uri)
        began = time.monotonic()
        conn.getDomainCapabilities(None, "x86_64", "q35", "qemu")
        probe = time.monotonic() - began
        conn.close()
        info = {"uri": daemon.uri, "start_seconds": round(started, 2), "caps_seconds": round(probe, 2),
                "caps_restored": restored}
        run.put("libvirtd.json", json.dumps(info) + "\n")
        run.say(f"libvirtd up in {started:.1f}s at {daemon.uri}; QEMU capabilities in {probe:.1f}s"
                + (" (cached)" if restored else " (probed)"))
        run.log("timings", f"{started:7.2f} libvirtd start\n{probe:7.2f} qemu capabilities\n")
    uri = daemon.uri if daemon else "qemu:///system"

    image = config["image"]
    # plan and domain: EDU alone, no guest NUMA
    common = ["--virt-type", "qemu", "--firmware", "bios", "--numa", "none", "--hugepages", "none",
              "--vcpus", "1", "--memory", "256M", "--kernel", image["kernel"], "--initrd", image["initrd"],
              "--cmdline", config["cmdline"]]
    # attach: the devices of a host switch and one from the other node, mirrored over two guest cells
    devices = list(config.get("attach_devices") or [edu])
    attach_common = ["--virt-type", "qemu", "--firmware", "bios", "--numa", "auto",
                     "--topology", config.get("topology", "mirror"), "--hugepages", "none",
                     "--vcpus", str(config.get("attach_vcpus", 1)), "--memory", config.get("attach_memory", "256M"),
                     "--kernel", image["kernel"], "--initrd", image["initrd"], "--cmdline", config["cmdline"]]

    if "inventory" in parts:
        with run.part("inventory"):
            run.say("\n== the emulated GPU host: inventory and readiness")
            run.gv("list", "list", "--all")
            run.gv("list_json", "list", "--all", "--json", show="none")
            run.gv("doctor", "doctor")
            run.gv("doctor_json", "doctor", "--json", show="none")

    if "plan" in parts:
        with run.part("plan"):
            run.say("\n== the bind plan (dry run: nothing changes)")
            run.gv("plan", "bind", edu, "--dry-run", "--connect", uri)
            run.gv("plan_json", "bind", edu, "--dry-run", "--connect", uri, "--json", show="none")
            run.snap("plan")

    if "domain" in parts:
        name = config["domain_name"]
        with run.part("domain"):
            run.say("\n== the domain XML, defined in the guest's libvirtd")
            run.gv("xml", "xml", edu, "--name", name, *common)
            run.gv("define", "xml", edu, "--name", name, *common, "--define", "--connect", uri, "--json",
                   show="none")
            run.say(f"define: {(run.json_of('define') or {}).get('define')}")
            run.gv("define_again", "xml", edu, "--name", name, *common, "--define", "--connect", uri,
                   "--json", show="none")
            run.say(f"define again: {(run.json_of('define_again') or {}).get('define')}")
            import libvirt

            conn = libvirt.open(uri)
            try:
                dom = conn.lookupByName(name)
                run.put("defined.xml", dom.XMLDesc(libvirt.VIR_DOMAIN_XML_INACTIVE))
                run.put("defined.json", json.dumps({"persistent": bool(dom.isPersistent()),
                                                    "active": bool(dom.isActive())}) + "\n")
                dom.undefine()
                run.put("undefined.domains", "".join(d.name() + "\n" for d in conn.listAllDomains(0)))
                run.say(f"libvirt holds {name} (persistent, not running); undefined it again")
            finally:
                conn.close()
            run.snap("domain")

    if "attach" in parts:
        name = config["nested_name"]
        with run.part("attach"):
            from tests.lanes import guest as gl

            port = run.ssh_port = gl.free_port()
            known_hosts = "/tmp/gpuvfio-nested-known_hosts"
            with open(known_hosts, "w") as f:
                f.write(f"[127.0.0.1]:{port} {image['host_key_line']}\n")
            run.snap("before")
            run.say(f"\n== attach: bind {', '.join(devices)} to vfio-pci, define and start the second-level "
                    "guest (QEMU TCG inside QEMU TCG; the host's switch and NUMA nodes mirrored), wait for SSH, "
                    "verify")
            # The address is discovered (the forward gpuvfio records in the domain); the key and
            # the pinned host key apply to it all the same.
            with contextlib.suppress(FileNotFoundError):
                os.unlink(CONSOLE_LOG)
            # --yes: the devices are three physical ones (one per switch port and node).
            run.gv("attach", "-v", "attach", *devices, "--yes", "--name", name, *attach_common,
                   "--user-net-ssh-port", str(port),
                   "--ssh-key", image["client_key"], "--known-hosts", known_hosts, "--connect", uri,
                   "--boot-timeout", str(config.get("boot_timeout", 900)), "--console-log", CONSOLE_LOG,
                   "--probe-timeout", str(config.get("probe_timeout", PROBE_TIMEOUT)), "--json",
                   stream=True, show="none")
            with contextlib.suppress(OSError):
                with open(CONSOLE_LOG, errors="replace") as f:
                    run.put("nested.console.log", f.read())
            report = run.json_of("attach")
            if report:
                _render_report(run, report)
                for step in report.get("steps", []):
                    run.log("timings", f"{step['seconds']:7.2f}   attach: {step['step']}\n")
            run.snap("attached")
            import libvirt

            from tests.lanes import daemon as dl

            conn = libvirt.open(uri)
            try:
                try:
                    dom = conn.lookupByName(name)
                    run.put("attached.json", json.dumps({"active": bool(dom.isActive())}) + "\n")
                    run.put("attached.xml", dom.XMLDesc(0))
                except libvirt.libvirtError as exc:
                    run.put("attached.json", json.dumps({"error": str(exc)}) + "\n")
            finally:
                conn.close()
            for pid in dl.qemu_processes({name}):
                run.put("attached.qemu_argv", "\n".join(dl._cmdline(pid)) + "\n")
                # Who QEMU runs as, and who owns what it opens: the group node in QEMU's
                # own /dev (libvirt's mount namespace) and the kernel (on the 9p root, seen
                # through the /tmp overlay; libvirt's DAC driver chowns it, a copy-up).
                facts = {"pid": pid}
                with contextlib.suppress(OSError):
                    with open(f"/proc/{pid}/status") as f:
                        for line in f:
                            if line.startswith(("Uid:", "Gid:")):
                                facts[line.split(":")[0].lower()] = int(line.split()[1])
                paths = {"kernel": image["kernel"]}
                for node in sorted(os.listdir("/dev/vfio")) if os.path.isdir("/dev/vfio") else []:
                    paths[f"/dev/vfio/{node}"] = f"/dev/vfio/{node}"
                    paths[f"qemu /dev/vfio/{node}"] = f"/proc/{pid}/root/dev/vfio/{node}"
                for label, path in paths.items():
                    try:
                        st = os.stat(path)
                        facts[label] = f"{st.st_uid}:{st.st_gid} {st.st_mode & 0o7777:o}"
                    except OSError as exc:
                        facts[label] = f"error: {exc.strerror}"
                run.put("attached.qemu_facts", json.dumps(facts) + "\n")
                run.say(f"QEMU runs as uid {facts.get('uid')} gid {facts.get('gid')}; owners: "
                        + ", ".join(f"{k} {v}" for k, v in facts.items() if k not in ("pid", "uid", "gid")))
            run.gv("attached_status", "status", "--json", show="none")
        with run.part("second-level tree"):
            if run.ssh_port is not None and run.rc_of("attach") == 0:
                record_nested_tree(run, image)
        with run.part("detach"):
            run.say("\n== detach: stop the guest, undefine it, give the devices back")
            run.gv("detach", "-v", "detach", name, "--connect", uri, "--timeout", "5", "--json",
                   stream=True)
            run.snap("detached")
            run.gv("detached_status", "status", "--json", show="none")
            import libvirt

            conn = libvirt.open(uri)
            try:
                run.put("detached.domains", "".join(d.name() + "\n" for d in conn.listAllDomains(0)))
            finally:
                conn.close()
        if daemon is not None:
            with run.part("qemu log"):
                run.put("nested.qemu.log", daemon.qemu_log(name))

    if daemon is not None:
        with run.part("libvirtd stop"):
            if os.path.isdir(QEMU_CAPS_DIR):
                for entry in os.listdir(QEMU_CAPS_DIR):
                    if entry.endswith(".xml"):
                        shutil.copyfile(os.path.join(QEMU_CAPS_DIR, entry),
                                        os.path.join(run.out, f"qemucaps--{entry}"))
            problems = daemon.stop()
            run.put("libvirtd.problems", "".join(p + "\n" for p in problems))
    run.log("timings", f"{time.monotonic() - t0:7.2f} total in the guest\n")
    run.put("finished", "finished\n")
    run.say(f"\n== done in {time.monotonic() - t0:.0f}s (in the guest)")
    return 0
