#!/usr/bin/env python3
"""gpuvfio in-guest verifier: facts and measurements from inside a guest, as one JSON object.

Standard library only (any python3 >= 3.6; nothing is installed in the guest). NVML through
ctypes (libnvidia-ml.so.1): driver and CUDA versions, virtualization mode, BAR1, ECC, MIG and
the PCIe link, read while a copy runs (idle links train down). The CUDA driver API through
ctypes (libcuda.so.1), measuring the way NVIDIA's nvbandwidth does (its README and
testcases_ce.cpp): pinned host memory placed on the GPU's NUMA node; a spin kernel holds
the stream on a pinned host flag until every copy is queued, so queueing is not timed; CUDA
events around the copies; warm-up copies first; the median of the samples; host->device,
device->host, both at once on two streams, device->device; every buffer checked whole
against a non-repeating pattern, on the GPU. Host-device latency is a pointer chase over
pinned host memory (one dependent PCIe read per hop); the API overhead of a small copy is
reported apart. With two or more GPUs: the peer access matrix, peer copy bandwidth (data
checked), and with libnccl.so.2 an all-reduce reported as nccl-tests does (busbw = algbw x
2(n-1)/n, or (n-1)/(n+1) for NVLS), run as a job without NCCL settings would (NCCL's own files
name the topology file) and with NCCL's own view of the topology (NCCL_TOPO_DUMP_FILE)
reported beside the file's. The kernels are gpuvfio/guest/payload/kernels.cu as PTX for Pascal and newer;
the driver layer (NVML, CUDA, NCCL through ctypes; one GPU's resources) is gpuvfio_nvapi.py.

It only gathers facts; gpuvfio/guest/verify.py on the host turns them into checks against
what the host assigned. Whatever fails -- a missing symbol, a driver error, a zero elapsed
time, a bug here -- is reported under "errors" with its reason; the JSON is always printed:
one line ``GPUVFIO-VERIFIER <json>`` on stdout.
"""

import ctypes
import json
import os
import random
import shutil
import statistics
import struct
import sys
import tempfile
import time
import traceback

from gpuvfio_ncclconf import ETC_FILE, pairs, user_file
from gpuvfio_ncclpaths import gpu_paths
from gpuvfio_ncclxml import load_topology
from gpuvfio_nvapi import PTR, SIZE, U64, Cuda, Device, Failure, NumaPlacement, Nvml, entry, load, seconds

MARKER = "GPUVFIO-VERIFIER"
# Where gpuvfio attach writes the guest's NCCL topology file (gpuvfio.domain.nccl_topo.GUEST_FILE;
# a test holds the two equal: this program imports nothing of gpuvfio).
PLAN_TOPO_FILE = "/etc/gpuvfio/nccl-topo.xml"
TOPO_BYTES = 1 << 20
ABOVE_MAX = 64  # NCCL settings reported from the environment and the user's file
SHOWN = 200  # characters of a key or value reported


def same_everywhere(call, ptr, nbytes, value, chunk=16 << 20):
    """Every 4-byte element of device memory equals ``value``: read back in chunks, so a small
    guest needs no second copy of a large buffer in Python."""
    buffer = ctypes.create_string_buffer(min(chunk, nbytes))
    for offset in range(0, nbytes, len(buffer)):
        size = min(len(buffer), nbytes - offset)
        call("cuMemcpyDtoH_v2", buffer, ptr + offset, size)
        if buffer.raw[:size] != value * (size // 4):
            return False
    return True


def summary(rates):
    return {"median": statistics.median(rates), "samples": rates}


def measure(device, opts, link_probe):
    """Bandwidth (nvbandwidth's copy-engine tests), each buffer's data checked whole."""
    call, size, copies = device.cuda.call, device.size, opts.copies
    src, dst, placement = numa_placed_buffers(device, opts.root)
    seed = random.getrandbits(64)
    h2d = copy_batch(call, copies, size, "cuMemcpyHtoDAsync_v2", device.a, src)
    d2h = copy_batch(call, copies, size, "cuMemcpyDtoHAsync_v2", dst, device.b)
    d2d = copy_batch(call, copies, size, "cuMemcpyDtoDAsync_v2", device.b, device.a)
    warm_up(device, opts.warmups, src, dst)
    nbytes = size * copies
    out, mismatches, link = one_way(device, opts.samples, nbytes, (h2d, d2d, d2h), src, dst, seed, link_probe)
    both, mismatches["bidir"] = both_ways(device, opts.samples, nbytes, (h2d, d2h), dst, seed)
    out.update(both)
    device.release(src)
    device.release(dst)
    out.update({"verified": not any(mismatches.values()), "mismatches": mismatches, "link_under_load": link,
                "size_bytes": size, "host_numa_node": placement.node, "host_memory_policy": placement.policy})
    return out


def numa_placed_buffers(device, root):
    """Two pinned host buffers of the copy size, first touched on the GPU's NUMA node as
    nvbandwidth places them, and the placement (what it reports: node and policy)."""
    size = device.size
    placement = NumaPlacement(root, device.bus_id)
    try:
        src, dst = device.host_alloc(size), device.host_alloc(size)
        ctypes.memset(src, 0, size)  # first touch, under the placement
        ctypes.memset(dst, 0, size)
    finally:
        placement.undo()
    return src, dst, placement


def copy_batch(call, copies, size, func, *args):
    """What device.held times: queue ``copies`` copies of ``size`` bytes (``func`` with ``args``)
    on the stream it is given."""
    def enqueue(stream):
        for _ in range(copies):
            call(func, *(args + (size, stream)))
    return enqueue


def warm_up(device, warmups, src, dst):
    """Copies each way on the first stream, not timed, then a sync."""
    call, size, s1 = device.cuda.call, device.size, device.streams[0]
    for func, to, source in (("cuMemcpyHtoDAsync_v2", device.a, src), ("cuMemcpyDtoHAsync_v2", dst, device.b),
                             ("cuMemcpyDtoDAsync_v2", device.b, device.a)):
        for _ in range(warmups):  # untimed: clocks up, mappings and TLBs in place
            call(func, to, source, size, s1)
    call("cuStreamSynchronize", s1)


def one_way(device, samples, nbytes, batches, src, dst, seed, link_probe):
    """Host->device (the link read while it runs), device->device, device->host, one after the
    other on the first stream: the rates, the mismatches and the link under load."""
    call, size, s1 = device.cuda.call, device.size, device.streams[0]
    h2d, d2d, d2h = batches
    # The pattern travels GPU (fill) -> host (src) -> GPU (a) -> GPU (b) -> host (dst) -> GPU (a):
    # each hop is checked on the GPU over the whole buffer.
    mismatches = {}
    device.fill(device.b, size, seed, s1)
    call("cuMemcpyDtoHAsync_v2", src, device.b, size, s1)
    call("cuMemsetD8Async", device.a, 0, size, s1)
    out = {}
    rates, link = device.held([("h2d", s1, nbytes, h2d)], samples, link_probe)
    out["h2d"] = summary(rates["h2d"])
    mismatches["h2d"] = device.mismatches(device.a, size, seed, s1)
    call("cuMemsetD8Async", device.b, 0, size, s1)
    rates, _ = device.held([("d2d", s1, nbytes, d2d)], samples)
    out["d2d"] = summary(rates["d2d"])
    mismatches["d2d"] = device.mismatches(device.b, size, seed, s1)
    ctypes.memset(dst, 0, size)
    rates, _ = device.held([("d2h", s1, nbytes, d2h)], samples)
    out["d2h"] = summary(rates["d2h"])
    call("cuMemsetD8Async", device.a, 0, size, s1)
    call("cuMemcpyHtoDAsync_v2", device.a, dst, size, s1)
    mismatches["d2h"] = device.mismatches(device.a, size, seed, s1)
    return out, mismatches, link


def both_ways(device, samples, nbytes, batches, dst, seed):
    """Host->device and device->host at once: the rates (each way and their sum) and the
    mismatches in what went up and what came down."""
    call, size = device.cuda.call, device.size
    s1, s2 = device.streams
    h2d, d2h = batches
    # Both directions at once, each on its own stream and copy engine.
    ctypes.memset(dst, 0, size)
    call("cuMemsetD8Async", device.a, 0, size, s1)
    call("cuStreamSynchronize", s1)
    rates, _ = device.held([("h2d", s1, nbytes, h2d), ("d2h", s2, nbytes, d2h)], samples)
    call("cuStreamSynchronize", s2)
    out = {"bidir_h2d": summary(rates["h2d"]), "bidir_d2h": summary(rates["d2h"])}
    out["bidir_total"] = summary([a + b for a, b in zip(rates["h2d"], rates["d2h"])])
    mismatches = device.mismatches(device.a, size, seed, s1)  # what went up ...
    call("cuMemsetD8Async", device.a, 0, size, s1)
    call("cuMemcpyHtoDAsync_v2", device.a, dst, size, s1)
    mismatches += device.mismatches(device.a, size, seed, s1)  # ... and what came down
    return out, mismatches


def latency(device, opts):
    """nvbandwidth's host-device latency: one GPU thread follows a chain of pointers through
    pinned host memory, a random cycle at page stride so no hop is prefetched or cached."""
    entries, stride = 2048, 4096
    host, dev = device.mapped(entries * stride)
    order = list(range(entries))
    random.Random(1).shuffle(order)
    for here, there in zip(order, order[1:] + order[:1]):
        ctypes.c_uint64.from_address(host + here * stride).value = dev + there * stride
    sink = device.device_alloc(8)
    start, stop = device.events[0], device.events[1]
    stream = device.streams[0]
    args = (ctypes.c_uint64(dev + order[0] * stride), ctypes.c_uint32(opts.hops), ctypes.c_uint64(sink))
    device.launch("chase", 1, 1, stream, *args)  # warm-up
    samples = []
    for _ in range(opts.samples):
        device.cuda.call("cuEventRecord", start, stream)
        device.launch("chase", 1, 1, stream, *args)
        device.cuda.call("cuEventRecord", stop, stream)
        device.cuda.call("cuEventSynchronize", stop)
        samples.append(seconds(start, stop, device.cuda) * 1e6 / opts.hops)
    return {"hops": opts.hops, "stride_bytes": stride, "samples_us": samples, "median_us": statistics.median(samples)}


def copy_overhead(device, count):
    """What a small copy costs the caller: a 4-byte async copy from pinned memory and a stream
    sync, timed on the CPU (driver and PCIe round trip together; not the link's latency)."""
    host = device.host_alloc(64)
    stream = device.streams[0]
    times = []
    for _ in range(count):
        begin = time.perf_counter()
        device.cuda.call("cuMemcpyHtoDAsync_v2", device.a, ctypes.c_void_p(host), 4, stream)
        device.cuda.call("cuStreamSynchronize", stream)
        times.append((time.perf_counter() - begin) * 1e6)
    times.sort()
    return {"count": count, "mean_us": statistics.mean(times), "p50_us": times[count // 2],
            "p99_us": times[max(0, -(-99 * count // 100) - 1)], "min_us": times[0], "max_us": times[-1]}


def saxpy(device, launches=20, samples=5):
    """A fixed compute kernel, y = 2x + y over the whole buffer, every step on one stream."""
    call, n, stream = device.cuda.call, device.size // 4, device.streams[0]
    one = struct.unpack("<I", struct.pack("<f", 1.0))[0]
    call("cuMemsetD32Async", device.a, one, n, stream)  # x = 1
    call("cuMemsetD32Async", device.b, 0, n, stream)  # y = 0
    grid, block = device.blocks(n)
    args = (ctypes.c_uint32(n), ctypes.c_float(2.0), ctypes.c_uint64(device.a), ctypes.c_uint64(device.b))
    device.launch("saxpy", grid, block, stream, *args)  # warm-up
    start, stop = device.events[0], device.events[1]
    times = []
    for _ in range(samples):
        call("cuEventRecord", start, stream)
        for _ in range(launches):
            device.launch("saxpy", grid, block, stream, *args)
        call("cuEventRecord", stop, stream)
        call("cuEventSynchronize", stop)
        times.append(seconds(start, stop, device.cuda) * 1000.0 / launches)
    call("cuStreamSynchronize", stream)
    verified = same_everywhere(call, device.b, n * 4, struct.pack("<f", 2.0 * (1 + launches * samples)))
    per_launch = statistics.median(times)
    return {"elements": n, "launch_ms": per_launch, "samples_ms": times, "gflops": 2.0 * n / per_launch / 1e6,
            "gbps": 12.0 * n / per_launch / 1e6, "verified": verified}


def peers(devices, opts):
    """The peer access matrix, and for each pair that has access a timed peer copy (held like
    the host copies) with the destination checked whole: a clique can enable P2P that then
    moves the wrong data."""
    call = devices[0].cuda.call
    access = []
    for one in devices:
        row = []
        for other in devices:
            can = ctypes.c_int(0)
            if one is not other:
                call("cuDeviceCanAccessPeer", ctypes.byref(can), one.dev, other.dev)
            row.append(bool(can.value))
        access.append(row)
    bandwidth = {}
    for i, src in enumerate(devices):
        for j, dst in enumerate(devices):
            if not access[i][j]:
                continue
            key = "%s->%s" % (src.bus_id, dst.bus_id)
            try:
                src.current()
                try:
                    call("cuCtxEnablePeerAccess", dst.ctx, ctypes.c_uint(0))
                except Failure as exc:
                    if "ALREADY_ENABLED" not in str(exc):
                        raise
                seed, size, stream = random.getrandbits(64), src.size, src.streams[0]
                src.fill(src.a, size, seed, stream)

                def enqueue(s, src=src, dst=dst):
                    for _ in range(opts.copies):
                        call("cuMemcpyPeerAsync", dst.b, dst.ctx, src.a, src.ctx, size, s)
                call("cuStreamSynchronize", stream)
                rates, _ = src.held([("p2p", stream, size * opts.copies, enqueue)], opts.samples)
                call("cuStreamSynchronize", stream)
                dst.current()
                wrong = dst.mismatches(dst.b, size, seed, dst.streams[0])
                bandwidth[key] = dict(summary(rates["p2p"]), verified=wrong == 0, mismatches=wrong)
            except Failure as exc:
                bandwidth[key] = {"error": str(exc)}
    return {"bus_ids": [d.bus_id for d in devices], "access": access, "bandwidth": bandwidth}


def gpu_links(data):
    """The link attributes of each GPU's <pci> node in an NCCL topology XML, by lower-case bus id:
    a <pci> whose class is 0x03... or that holds a <gpu> (NCCL's dump), with the count of NVLinks
    NCCL found where it lists any. Read as NCCL reads the file and its own dump
    (gpuvfio_ncclxml, NCCL's xmlLoadSub rules, v2.30.7-1): an attribute with an empty key, left
    by a space before "/>", is one more attribute, not a reason to pass the node over; a file
    NCCL refuses raises ValueError with NCCL's reason."""
    out = {}
    for system in load_topology(data):
        _pci_links(system, out)
    return out


def _pci_links(node, out):
    for sub in node.subs:
        if sub.name == "pci" and sub.get("busid"):
            gpus = [g for g in sub.subs if g.name == "gpu"]
            if gpus or (sub.get("class") or "").lower().startswith("0x03"):
                entry = out[sub.get("busid").lower()] = {"link_speed": sub.get("link_speed"),
                                                         "link_width": sub.get("link_width")}
                links = [n for g in gpus for n in g.subs if n.name == "nvlink"]
                if links:
                    entry["nvlink"] = sum(int(n.get("count") or 1) for n in links)
        _pci_links(sub, out)


def read_bytes(path):
    with open(path, "rb") as handle:
        return handle.read(TOPO_BYTES)


class TopologyView(object):
    """NCCL_TOPO_FILE and NCCL_TOPO_DUMP_FILE for the all-reduce, set before NCCL starts.

    NCCL runs as a job started without NCCL settings would: every NCCL_* variable the verifier
    was started with is taken out of its environment (and reported, as NCCL ranks it above the
    files), so that the files NCCL reads at init decide which topology file it loads:
    $HOME/.nccl.conf, then /etc/nccl.conf, the first record of a key winning (src/misc/param.cc
    initEnvFunc and setEnvFile, v2.30.7-1; read here by gpuvfio_ncclconf). What the user's file
    sets is reported too: it wins over /etc/nccl.conf, where gpuvfio names its file. Under a
    stand-in root (--root, tests) NCCL would read the machine's own files, so the verifier names
    the file it found under the root itself. ``--nccl-topo-file`` names one outright. The dump
    goes to a directory of its own, written by rank 0 (NCCL_TOPO_DUMP_FILE_RANK)."""

    def __init__(self, opts):
        self.root = opts.root
        self.above = [{"source": "environment", "key": key, "value": os.environ.pop(key)[:SHOWN]}
                      for key in sorted(k for k in os.environ if k.startswith("NCCL_"))]
        self.file = self.source = None
        if opts.nccl_topo_file:
            self.file, self.source = opts.nccl_topo_file, "option"
            os.environ["NCCL_TOPO_FILE"] = opts.nccl_topo_file
        else:
            self._from_files()
        self.directory = tempfile.mkdtemp(prefix="gpuvfio-nccl-")
        self.dump = os.path.join(self.directory, "topology.xml")
        os.environ["NCCL_TOPO_DUMP_FILE"] = self.dump
        os.environ["NCCL_TOPO_DUMP_FILE_RANK"] = "0"

    def under_root(self, path):
        return path if self.root == "/" else os.path.join(self.root, path.lstrip("/"))

    def _from_files(self):
        """The NCCL_TOPO_FILE NCCL takes from $HOME/.nccl.conf or /etc/nccl.conf, and what the
        former sets beside it."""
        user = user_file(os.environ)
        for path, source in ((user, "~/.nccl.conf"), (ETC_FILE, ETC_FILE)):
            try:
                data = read_bytes(self.under_root(path)) if path else None
            except (OSError, ValueError):
                data = None  # fopen failing: NCCL goes on
            for key, value in pairs(data or b""):
                key, value = key.decode("utf-8", "replace"), value.decode("utf-8", "replace")
                if source != ETC_FILE and len(self.above) < ABOVE_MAX:
                    self.above.append({"source": source, "key": key[:SHOWN], "value": value[:SHOWN]})
                if key == "NCCL_TOPO_FILE" and self.source is None:
                    self.file, self.source = value, source
        if self.file and self.root != "/":
            os.environ["NCCL_TOPO_FILE"] = self.under_root(self.file)

    def report(self):
        """The file NCCL reads and where that came from, its GPUs (``planned``) beside NCCL's
        (``nccl``), each by bus id, NCCL's path type between each pair of its GPUs (``paths``:
        [bus id, bus id, type], the smaller first), the settings ranked above /etc/nccl.conf
        (``above``) and gpuvfio's own file where the guest has it (``gpuvfio_file``)."""
        own = os.path.isfile(self.under_root(PLAN_TOPO_FILE))
        out = {"file": self.file, "source": self.source, "planned": None, "nccl": None, "paths": None, "error": None,
               "above": self.above[:ABOVE_MAX], "gpuvfio_file": PLAN_TOPO_FILE if own else None}
        problems = []
        if self.file:
            try:
                out["planned"] = gpu_links(read_bytes(self.under_root(self.file) if self.source != "option"
                                                      else self.file))
            except (OSError, ValueError) as exc:
                problems.append("the topology file could not be read: %s" % exc)
        try:
            dump = read_bytes(self.dump)
            out["nccl"] = gpu_links(dump)
            # NCCL's path type between each pair of GPUs of its dump, by NCCL's rules (gpuvfio_ncclpaths)
            out["paths"] = [[a, b, kind] for (a, b), kind in sorted(gpu_paths(load_topology(dump)).items())]
        except OSError:
            problems.append("NCCL wrote no topology dump (NCCL_TOPO_DUMP_FILE needs NCCL 2.6 or later)")
        except ValueError as exc:
            problems.append("NCCL's topology dump could not be read: %s" % exc)
        out["error"] = "; ".join(problems) or None
        return out

    def close(self):
        shutil.rmtree(self.directory, ignore_errors=True)


class Nccl(object):
    def __init__(self):
        self.lib = load("libnccl.so.2", "NCCL")
        entry(self.lib, "ncclGetErrorString").restype = ctypes.c_char_p
        entry(self.lib, "ncclAllReduce").argtypes = [U64, U64, SIZE, ctypes.c_int, ctypes.c_int, PTR, PTR]

    def call(self, name, *args):
        rc = entry(self.lib, name)(*args)
        if rc != 0:
            raise Failure("%s failed: NCCL error %d (%s)" % (name, rc, (self.lib.ncclGetErrorString(rc) or b"")
                                                              .decode(errors="replace")))


def allreduce(devices, opts, sizes=(8 << 20, 64 << 20)):
    """An all-reduce over every GPU, reported as nccl-tests does: algbw = bytes / time, busbw =
    algbw x its factor for the algorithm NCCL was told to use (``busbw_factor``), rank k
    contributes k + 1 everywhere; with the topology NCCL worked from (TopologyView) beside
    gpuvfio's file."""
    view = TopologyView(opts)
    try:
        nccl, n = Nccl(), len(devices)
        comms = (ctypes.c_void_p * n)()
        version = ctypes.c_int()
        nccl.call("ncclGetVersion", ctypes.byref(version))
        nccl.call("ncclCommInitAll", comms, n, (ctypes.c_int * n)(*(d.index for d in devices)))
        topology, algo = view.report(), nccl_algo()
    finally:
        view.close()
    call = devices[0].cuda.call
    results = []
    try:
        for nbytes in sorted(set(min(s, devices[0].size) for s in sizes + (devices[0].size,))):
            count = nbytes // 4
            for rank, dev in enumerate(devices):
                dev.current()
                value = struct.unpack("<I", struct.pack("<f", float(rank + 1)))[0]
                call("cuMemsetD32Async", dev.a, value, count, dev.streams[0])
                call("cuStreamSynchronize", dev.streams[0])

            def once():
                nccl.call("ncclGroupStart")
                try:
                    for rank, dev in enumerate(devices):
                        nccl.call("ncclAllReduce", dev.a, dev.b, count, 7, 0, comms[rank], dev.streams[0])  # f32 sum
                finally:
                    nccl.call("ncclGroupEnd")  # never leave a group open
            once()  # warm-up
            for dev in devices:
                call("cuStreamSynchronize", dev.streams[0])
            for dev in devices:
                dev.current()
                call("cuEventRecord", dev.events[0], dev.streams[0])
            for _ in range(opts.nccl_iters):
                once()
            elapsed = 0.0
            for dev in devices:
                dev.current()
                call("cuEventRecord", dev.events[1], dev.streams[0])
                call("cuEventSynchronize", dev.events[1])
                elapsed = max(elapsed, seconds(dev.events[0], dev.events[1], dev.cuda))
            per = elapsed / opts.nccl_iters
            want = struct.pack("<f", n * (n + 1) / 2.0)
            verified = True
            for dev in devices:  # every element of every rank's result
                dev.current()
                verified = verified and same_everywhere(call, dev.b, nbytes, want)
            algbw = nbytes / per / 1e9
            results.append({"bytes": nbytes, "time_us": per * 1e6, "algbw_gbps": algbw,
                            "busbw_gbps": algbw * busbw_factor(n, algo), "verified": verified})
    finally:
        for comm in comms:
            if comm:
                nccl.lib.ncclCommDestroy(ctypes.c_void_p(comm))
    return {"version": version.value, "devices": n, "iterations": opts.nccl_iters, "op": "sum", "dtype": "float32",
            "algorithm": algo, "busbw_factor": busbw_factor(n, algo), "results": results, "topology": topology}


def busbw_factor(nranks, algo):
    """nccl-tests' bus bandwidth factor of an all-reduce (src/all_reduce.cu AllReduceGetBw, commit
    03a204a1): (n-1)/(n+1) where NCCL_ALGO is exactly NVLS or NVLSTREE (NVLink SHARP reduces in
    the switch), else 2(n-1)/n (doc/PERFORMANCE.md); 0 for one rank, as there."""
    if algo in ("NVLS", "NVLSTREE"):
        return (nranks - 1.0) / (nranks + 1.0)
    return 2.0 * (nranks - 1) / nranks


def nccl_algo():
    """NCCL_ALGO as nccl-tests reads it once NCCL is up: the C library's getenv, which also sees
    what NCCL set from its own files at init (src/misc/param.cc setEnvFile); Python's os.environ
    is a copy taken at start and does not."""
    libc = ctypes.CDLL(None)
    libc.getenv.restype = ctypes.c_char_p
    value = libc.getenv(b"NCCL_ALGO")
    return value.decode("utf-8", "replace") if value is not None else None


def stage(out, key, func, *args):
    """Run one part; whatever it raises becomes out["errors"][key] and the rest goes on."""
    try:
        return func(*args)
    except Failure as exc:
        out["errors"][key] = str(exc)
    except Exception as exc:  # a bug here or a driver doing the unexpected: reported, not fatal
        out["errors"][key] = "%s: %s (at %s)" % (type(exc).__name__, exc,
                                                 traceback.extract_tb(sys.exc_info()[2])[-1][2])
    return None


def run(args, out):
    wanted = [d.strip().lower()[-12:] for d in args.devices.split(",") if d.strip()]
    out["method"] = {"size_bytes": args.size_mib << 20, "copies": args.copies, "samples": args.samples,
                     "warmups": args.warmups, "pinned": True,
                     "hold": "spin kernel on a pinned host flag until all copies are queued",
                     "pattern": "word i = (i * 0x9E3779B97F4A7C15) ^ seed, the whole buffer checked on the GPU",
                     "latency_hops": args.hops, "overhead_count": args.overhead_count,
                     "statistic": "median of samples"}
    nvml = stage(out, "nvml", Nvml)
    if nvml is not None:
        out["nvml"] = stage(out, "nvml", nvml.facts)
    cuda = stage(out, "cuda", Cuda)
    if cuda is not None:
        out["cuda"] = stage(out, "cuda", cuda.devices)
    if cuda is None or out["cuda"] is None or args.no_bandwidth:
        return
    handles = dict((d["bus_id"][-12:], d["_handle"]) for d in (out["nvml"] or {}).get("devices", []))
    devices = []
    try:
        for info in out["cuda"]["devices"]:
            bus = info["bus_id"]
            if wanted and bus[-12:] not in wanted:
                continue
            device = stage(out, "bandwidth " + bus, Device, cuda, info["index"], bus, args.size_mib << 20)
            if device is None:
                continue
            devices.append(device)
            probe = None
            if nvml is not None and bus[-12:] in handles:
                probe = lambda h=handles[bus[-12:]]: nvml.link(h)  # noqa: E731
            for key, func, extra in (("bandwidth", measure, (args, probe)), ("latency", latency, (args,)),
                                     ("copy_overhead", copy_overhead, (args.overhead_count,)),
                                     ("compute", saxpy, ())):
                device.current()
                result = stage(out, key + " " + bus, func, device, *extra)
                if result is not None:
                    out[key][bus] = result
        if len(devices) >= 2:
            out["p2p"] = stage(out, "p2p", peers, devices, args)
            out["nccl"] = stage(out, "nccl", allreduce, devices, args)
    finally:
        for device in devices:
            for problem in device.close():
                out["errors"].setdefault("cleanup " + device.bus_id, problem)


def main(argv):
    import argparse

    parser = argparse.ArgumentParser(description="gpuvfio in-guest verifier")
    parser.add_argument("--size-mib", type=int, default=512, help="buffer size (nvbandwidth: 512 MiB)")
    parser.add_argument("--copies", type=int, default=16, help="copies per sample (nvbandwidth: 16)")
    parser.add_argument("--samples", type=int, default=3, help="samples, the median is reported (nvbandwidth: 3)")
    parser.add_argument("--warmups", type=int, default=4, help="untimed copies first (nvbandwidth: 4)")
    parser.add_argument("--hops", type=int, default=100000, help="pointer-chase hops per latency sample")
    parser.add_argument("--overhead-count", type=int, default=2000, help="small copies timed for the API overhead")
    parser.add_argument("--nccl-iters", type=int, default=10, help="timed all-reduces per size")
    parser.add_argument("--no-bandwidth", action="store_true")
    parser.add_argument("--root", default="/", help="where /sys is read from (a recorded tree in tests)")
    parser.add_argument("--nccl-topo-file", default="",
                        help="the NCCL topology file the all-reduce runs with (default: the one NCCL's own "
                             "files name, $HOME/.nccl.conf then %s, under --root)" % ETC_FILE)
    parser.add_argument("--devices", default="",
                        help="measure only these PCI addresses (comma-separated; the bare-metal baseline)")
    args = parser.parse_args(argv)
    for name in ("size_mib", "copies", "samples", "hops", "overhead_count", "nccl_iters"):
        if getattr(args, name) < 1:
            parser.error("--%s must be at least 1" % name.replace("_", "-"))
    if args.warmups < 0:
        parser.error("--warmups must be 0 or more")
    out = {"version": 2, "python": sys.version.split()[0], "method": None, "nvml": None, "cuda": None,
           "bandwidth": {}, "latency": {}, "copy_overhead": {}, "compute": {}, "p2p": None, "nccl": None, "errors": {}}
    stage(out, "verifier", run, args, out)
    for dev in (out["nvml"] or {}).get("devices", []):
        dev.pop("_handle", None)
    sys.stdout.write(MARKER + " " + json.dumps(out, default=str) + "\n")
    sys.stdout.flush()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
