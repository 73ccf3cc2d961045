"""``gpuvfio testbed run``: provision each variant, measure, tear down, resume after interruption.

The results directory is the record: ``<out>/results/<variant>/rep-<n>.json`` is written
atomically when a repetition is done, so a second run skips what exists. A variant's
guest is always detached (and its devices restored, its vGPU removed) before the next
variant starts -- also on Ctrl-C, SIGTERM or SIGHUP (a remote run's SSH channel closing,
see testbed/remote.py) -- and a guest left over from an interrupted
run is detached first.
"""

from __future__ import annotations

import contextlib
import json
import os
import platform
import signal
import subprocess
import sys
import threading
import time
import uuid as uuidlib

from gpuvfio.errors import GpuvfioError
from gpuvfio.hostroot import HostRoot
from gpuvfio.journal import atomic_write
from gpuvfio.testbed.plan import addresses_for, options_for
from gpuvfio.testbed.spec import Spec, Variant


def _metrics(report: dict) -> dict:
    bw = next(iter(report.get("bandwidth_gbps", {}).values()), {})
    facts = report.get("facts") or {}
    latency = next(iter((facts.get("latency") or {}).values()), {})
    compute = next(iter((facts.get("compute") or {}).values()), {})
    return {"h2d_gbps": bw.get("h2d"), "d2h_gbps": bw.get("d2h"), "d2d_gbps": bw.get("d2d"),
            "latency_p50_us": latency.get("p50_us"), "latency_p99_us": latency.get("p99_us"),
            "saxpy_ms": compute.get("launch_ms")}


def identity(host: HostRoot, conn=None, gpus: list[str] | None = None) -> dict:
    """The system description every result is read against (MLPerf's system-description
    fields where they apply to a hypervisor, plus the IOMMU and hugepage facts)."""
    from gpuvfio.address import PciAddress
    from gpuvfio.inventory import read_inventory
    from gpuvfio.kernel import read_kernel
    from gpuvfio.numa import read_numa
    from gpuvfio.pciids import PciIds

    cpuinfo = host.read(host.path("proc", "cpuinfo")) or ""
    model = next((line.split(":", 1)[1].strip() for line in cpuinfo.splitlines() if line.startswith("model name")),
                 None)
    sockets = {line.split(":", 1)[1].strip() for line in cpuinfo.splitlines() if line.startswith("physical id")}
    kernel = read_kernel(host)
    nodes = read_numa(host)
    os_release = host.read(host.config_path("etc", "os-release")) or ""
    pretty = next((line.split("=", 1)[1].strip().strip('"') for line in os_release.splitlines()
                   if line.startswith("PRETTY_NAME=")), None)
    driver = (host.read(host.sys_path("module", "nvidia", "version")) or "").strip() or None
    accelerators = []
    if gpus:
        inventory = read_inventory(host, names=PciIds.load(host.root))
        for gpu in gpus:
            fn = inventory.functions.get(PciAddress.parse(gpu))
            if fn is not None:
                accelerators.append({"address": gpu, "model": fn.device_name or f"{fn.vendor}:{fn.device}",
                                     "numa_node": fn.numa_node,
                                     "link_max": f"Gen{fn.link.max_gen} x{fn.link.max_width}"
                                     if fn.link and fn.link.max_gen else None})
    ident = {"host_cpu": model, "host_sockets": len(sockets) or None,
             "host_cpus": sum(len(n.cpus) for n in nodes) or None,
             "host_memory_kb": sum(n.mem_total_kb or 0 for n in nodes) or None, "host_os": pretty,
             "host_kernel": kernel.release, "host_nvidia_driver": driver, "accelerators": accelerators,
             "accelerator_count": len(accelerators), "iommu": kernel.iommu_vendor,
             "iommu_mode": "pt" if kernel.param("iommu") == "pt" else "translated", "numa_nodes": len(nodes),
             "hugepage_sizes_kb": sorted({size for n in nodes for size in n.hugepages}),
             "python": platform.python_version(), "qemu_version": None, "libvirt_version": None}
    if conn is not None:
        try:
            version = conn.getVersion()
            ident["qemu_version"] = f"{version // 1000000}.{version // 1000 % 1000}.{version % 1000}"
            lib = conn.getLibVersion()
            ident["libvirt_version"] = f"{lib // 1000000}.{lib // 1000 % 1000}.{lib % 1000}"
        except Exception:  # noqa: BLE001 - identity is best effort
            pass
    return ident


def placement(xml: str | None) -> dict | None:
    """What the variant's domain really got (auto choices resolved), read from its XML."""
    if not xml:
        return None
    from lxml import etree

    root = etree.fromstring(xml.encode())
    page = root.find("memoryBacking/hugepages/page")
    pins = sorted({cpu for pin in root.iterfind("cputune/vcpupin") for cpu in (pin.get("cpuset") or "").split(",")
                   if cpu}, key=lambda c: int(c.split("-")[0]))
    return {"vcpus": int(root.findtext("vcpu") or 0), "memory_kib": int(root.findtext("memory") or 0),
            "hugepage_kib": int(page.get("size")) if page is not None else None,
            "numa_nodeset": root.find("numatune/memory").get("nodeset") if root.find("numatune/memory") is not None
            else None,
            "vcpu_pins": ",".join(pins) or None, "machine": root.find("os/type").get("machine")}


def _guest_facts(report: dict) -> dict:
    facts = report.get("facts") or {}
    nvml = facts.get("nvml") or {}
    device = (nvml.get("devices") or [{}])[0]
    link = None
    for check in report.get("checks", []):
        if check["id"] == "pcie_link" and check.get("observed"):
            link = check["observed"]
    return {"guest_kernel": facts.get("guest_kernel"), "driver_version": nvml.get("driver_version"),
            "cuda_driver_version": nvml.get("cuda_driver_version"),
            "virtualization_mode": device.get("virtualization_mode"), "pcie_link_under_load": link}


class _Interrupted(BaseException):
    pass


class _Signals:
    """SIGINT, SIGTERM and SIGHUP interrupt the run once. While a teardown runs they are only
    noted, and raised after it: a remote Ctrl-C brings a hangup and a TERM moments apart,
    and a teardown cut in half would leave a guest, a vGPU or a binding behind."""

    SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)

    def __init__(self) -> None:
        self.deferring, self.pending, self.fired = 0, None, False
        self.previous: dict = {}

    def handler(self, signum, frame) -> None:
        if self.deferring or self.fired:
            self.pending = signum
            return
        self.fired = True
        raise _Interrupted()

    def install(self) -> None:
        if threading.current_thread() is threading.main_thread():
            self.previous = {sig: signal.signal(sig, self.handler) for sig in self.SIGNALS}

    def uninstall(self) -> None:
        for sig, handler in self.previous.items():
            signal.signal(sig, handler)

    @contextlib.contextmanager
    def deferred(self):
        self.deferring += 1
        try:
            yield
        finally:
            self.deferring -= 1
        if not self.deferring and self.pending is not None and not self.fired:
            self.fired = True
            raise _Interrupted()


def run_testbed(host: HostRoot, spec: Spec, out: str, *, conn, known_hosts_default: str | None,
                bind_step, restore_step, vgpu_writer=None, progress=lambda line: None, nvml_factory=None) -> dict:
    if nvml_factory is None:
        from gpuvfio.vgpusched import Nvml as nvml_factory
    os.makedirs(os.path.join(out, "results"), exist_ok=True)
    atomic_write(os.path.join(out, "identity.json"), json.dumps(identity(host, conn, spec.gpus), indent=2))
    signals = _Signals()
    signals.install()
    summary = {}
    try:
        for variant in spec.variants:
            summary[variant.name] = _run_variant(host, spec, variant, out, conn, known_hosts_default,
                                                 bind_step, restore_step, vgpu_writer, progress, nvml_factory,
                                                 signals)
    except (_Interrupted, KeyboardInterrupt):
        raise GpuvfioError("testbed run interrupted; everything was torn down; run it again to resume") from None
    finally:
        signals.uninstall()
    return summary


def _rep_path(out: str, variant: Variant, rep: int) -> str:
    return os.path.join(out, "results", variant.name, f"rep-{rep}.json")


def write_rep(out, variant, rep, report, extra) -> None:
    os.makedirs(os.path.join(out, "results", variant.name), exist_ok=True)
    extra = dict(extra)
    metrics = {**_metrics(report), **extra.pop("metrics", {})}
    provisioning = {k: v for k, v in (("hugepages", variant.hugepages), ("numa", variant.numa),
                                       ("profile", variant.profile), ("scheduler", variant.scheduler))
                    if v is not None and variant.kind != "baremetal"}
    record = {"variant": variant.name, "kind": variant.kind, "rep": rep, "metrics": metrics,
              "provisioning": provisioning,
              "guest": _guest_facts(report), "verify": report, **extra}
    atomic_write(_rep_path(out, variant, rep), json.dumps(record, indent=2))


def _run_variant(host, spec, variant, out, conn, known_hosts_default, bind_step, restore_step, vgpu_writer,
                 progress, nvml_factory, signals) -> dict:
    todo = [r for r in range(spec.repetitions) if not os.path.exists(_rep_path(out, variant, r))]
    if not todo:
        progress(f"{variant.name}: done already ({spec.repetitions} repetitions)")
        return {"ran": 0}
    if variant.kind == "baremetal":
        for rep in todo:
            progress(f"{variant.name}: repetition {rep + 1}/{spec.repetitions} on this host")
            write_rep(out, variant, rep, _verify_here(), {})
        return {"ran": len(todo)}
    return _run_guest_variant(host, spec, variant, out, conn, known_hosts_default, bind_step, restore_step,
                              vgpu_writer, todo, progress, nvml_factory, signals)


def _verify_here() -> dict:
    """The baseline: probe and verifier run directly on this host (no SSH)."""
    from gpuvfio.guest import PROBE, VERIFIER
    from gpuvfio.verify import evaluate, parse_probe, parse_verifier

    probe = parse_probe(subprocess.run(["sh", PROBE], capture_output=True, text=True, check=True).stdout)
    verifier = parse_verifier(subprocess.run([sys.executable, VERIFIER], capture_output=True, text=True,
                                             check=True).stdout)
    return evaluate(probe, verifier, [])


def _create_vgpu(host, inventory, variant, options, addresses, vgpu_writer):
    from gpuvfio.domainspec import MDEV_NAMESPACE
    from gpuvfio.vgpu import mig_backed
    from gpuvfio.vgpucmd import create

    fn = inventory.functions[addresses[0]]
    uuid = None
    if fn.mdev_types:
        from gpuvfio.vgpu import pick_mdev

        type_id = pick_mdev(inventory, addresses[0], variant.profile)
        uuid = str(uuidlib.uuid5(MDEV_NAMESPACE, f"{options.name}/{addresses[0]}/{type_id}"))
    made = create(host, addresses[0], variant.profile, writer=vgpu_writer, uuid=uuid)
    record = {"profile": variant.profile, "kind": made["kind"], "type": made["type"],
              "mig_backed": mig_backed(variant.profile)}
    return made.get("uuid") or made.get("vf"), record


def _teardown(host, conn, variant, options, restore_step, vgpu_instance, vgpu_writer, scheduled, nvml_factory,
              progress) -> None:
    """Guest, then vGPU, then scheduler policy (NVML changes it only with no vGPU VM running);
    every step is tried even when one before it failed."""
    from gpuvfio import guests
    from gpuvfio.attach import detach

    failures = []
    try:
        if guests.lookup(conn, options.name) is not None:
            progress(f"{variant.name}: detach")
            detach(conn, options.name, restore_step=restore_step, timeout=10)
    except GpuvfioError as exc:
        failures.append(f"detach {options.name}: {exc}")
    if vgpu_instance is not None:
        from gpuvfio.vgpucmd import remove

        try:
            remove(host, vgpu_instance, writer=vgpu_writer)
        except GpuvfioError as exc:
            failures.append(f"vGPU {vgpu_instance}: {exc}")
    if scheduled:
        from gpuvfio.vgpusched import undo_set

        address, before, journaled = scheduled
        failed = undo_set(host, address, before, journaled, nvml_factory=nvml_factory)
        failures += failed
        if not failed:
            progress(f"{variant.name}: vGPU scheduler put back")
    if failures:
        raise GpuvfioError(f"{variant.name}: teardown incomplete ({'; '.join(failures)}); gpuvfio restore "
                           "retries from the journal")


def _run_guest_variant(host, spec, variant, out, conn, known_hosts_default, bind_step, restore_step, vgpu_writer,
                       todo, progress, nvml_factory, signals) -> dict:
    from gpuvfio import guests
    from gpuvfio.attach import attach, detach
    from gpuvfio.inventory import read_inventory
    from gpuvfio.numa import read_numa
    from gpuvfio.ssh import Session, SshTarget
    from gpuvfio.verify import expectations, verify_guest

    inventory, nodes = read_inventory(host), read_numa(host)
    options = options_for(spec, variant, inventory, nodes)
    leftover = guests.lookup(conn, options.name)
    if leftover is not None:
        progress(f"{variant.name}: detaching {options.name} left from an interrupted run")
        detach(conn, options.name, restore_step=restore_step, timeout=10)
    addresses = addresses_for(spec, variant)
    vgpu_instance, vgpu_record, scheduled = None, {}, None
    ssh = SshTarget(spec.ssh.get("host", "127.0.0.1"), spec.ssh.get("port", 22), spec.ssh.get("user", "root"),
                    spec.ssh.get("key"), spec.ssh.get("known_hosts"), bool(spec.ssh.get("trust_on_first_use")))
    try:
        if variant.kind == "vgpu":
            if variant.scheduler:
                # Before the vGPU exists: NVML changes the policy only while no vGPU VM runs.
                from gpuvfio.vgpusched import set_policy

                with nvml_factory() as nvml:
                    applied = set_policy(host, nvml, addresses[0], variant.scheduler)
                if applied["result"] == "set":  # what teardown puts back: this variant's change only
                    scheduled = (addresses[0], applied["before"], applied["journaled"])
                progress(f"{variant.name}: vGPU scheduler of {addresses[0]}: {applied['policy']} "
                         f"({applied['result']})")
                vgpu_record["scheduler"] = {k: applied.get(k) for k in ("policy", "arr", "timeslice", "previous")}
            vgpu_instance, made = _create_vgpu(host, inventory, variant, options, addresses, vgpu_writer)
            vgpu_record.update(made)
        extra = {"vgpu": vgpu_record} if vgpu_record else {}
        progress(f"{variant.name}: attach")
        started = time.monotonic()
        result = attach(host, addresses, options, conn=conn,
                        ssh=ssh, bind_step=bind_step if variant.kind == "passthrough" else None,
                        restore_step=restore_step, known_hosts_default=known_hosts_default,
                        boot_timeout=spec.ssh.get("boot_timeout", 300))
        took = time.monotonic() - started
        first, rest = todo[0], todo[1:]
        extra["placement"] = placement(result.xml)
        write_rep(out, variant, first, result.report, {"metrics": {"time_to_verified_s": took},
                                                          "attach_steps": result.steps, **extra})
        expected = expectations(inventory, [a for a in addresses if variant.kind == "passthrough"])
        for rep in rest:
            progress(f"{variant.name}: repetition {rep + 1}/{spec.repetitions}")
            with Session(SshTarget(ssh.host, ssh.port, ssh.user, ssh.key, ssh.known_hosts, ssh.trust_on_first_use),
                         known_hosts_default) as session:
                write_rep(out, variant, rep, verify_guest(session, expected), extra)
    finally:
        with signals.deferred():
            _teardown(host, conn, variant, options, restore_step, vgpu_instance, vgpu_writer, scheduled,
                      nvml_factory, progress)
    return {"ran": len(todo)}
