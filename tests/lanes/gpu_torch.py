#!/usr/bin/env python3
"""The GPU lane's framework measurement: copy bandwidth with PyTorch, latency with CuPy.

An independent figure beside gpuvfio's in-guest verifier and tests/lanes/gpu_bench.cu
(tests/lanes/gpu_lane.sh runs all three with the same sizes; tests/lanes/gpu_record.py
compares them). It uses PyTorch and CuPy where python3 has them (its JSON records their
versions; whichever is missing is reported under "errors"):

* copies with PyTorch: pinned host tensors (``pin_memory=True``), ``copy_(...,
  non_blocking=True)`` on a side stream, ``torch.cuda.Event`` timing; per test
  ``--warmups`` untimed copies, then ``--samples`` samples of ``--copies`` copies of
  ``--size-mib``, bandwidth = size * copies / elapsed in GB/s (1e9), the median reported.
  The stream is held while a sample is queued with ``torch.cuda._sleep`` (a spin of a
  fixed number of GPU cycles: PyTorch's own way to hold a stream; the JSON says whether it
  covered the queueing), then H2D, D2D, D2H, and bidirectional (H2D and D2H on two
  streams started together, each timed by its own events, total = their sum);
* the data is checked whole: a non-repeating 64-bit pattern, host -> GPU -> GPU -> host;
* latency with a CuPy RawKernel: one thread chases pointers stored in mapped pinned host
  memory (volatile loads), ``--hops`` hops per sample, microseconds per hop, in the
  verifier's layout (2048 nodes a page apart, a shuffled cycle) and nvbandwidth's (a
  2 MiB ring, 128-byte stride).

Prints one line ``GPU-TORCH <json>`` with the keys gpu_bench prints (h2d_gbps, d2h_gbps,
bidir_h2d_gbps, bidir_d2h_gbps, bidir_total_gbps, d2d_gbps, latency_us); whatever cannot
run (no torch, no CUDA, no CuPy) is null with the reason under "errors". It never
crashes and always exits 0. It changes none of the card's settings.
"""

import argparse
import json
import random
import statistics
import sys
import time
import traceback

MARKER = "GPU-TORCH"
PATTERN_K = 0x1E3779B97F4A7C15  # odd and below 2**63: torch's int64 arithmetic wraps the product
HOLD_CYCLES = 20000000  # ~10 ms at 2 GHz, ~60 ms at an idle 345 MHz: long enough to queue 16 copies
CHASE = r"""
extern "C" __global__ void gpu_torch_chase(unsigned long long start, unsigned long long hops,
                                           unsigned long long *sink)
{
    const volatile unsigned long long *p = (const volatile unsigned long long *)start;
    for (unsigned long long i = 0; i < hops; i++) p = (const volatile unsigned long long *)*p;
    *sink = (unsigned long long)p;
}
"""


def reason(exc):
    frame = traceback.extract_tb(exc.__traceback__)[-1] if exc.__traceback__ else None
    where = " (line %d)" % frame.lineno if frame else ""
    return "%s: %s%s" % (type(exc).__name__, exc, where)


def summary(values):
    return statistics.median(values) if values else None


def copies(args, out):
    import torch

    out["torch"] = {"version": torch.__version__, "cuda": torch.version.cuda}
    if not torch.cuda.is_available():
        raise RuntimeError("torch.cuda.is_available() is False")
    dev = torch.device("cuda", args.device)
    torch.cuda.set_device(dev)
    props = torch.cuda.get_device_properties(dev)
    bus = None
    if hasattr(props, "pci_bus_id"):
        bus = "%04x:%02x:%02x.0" % (getattr(props, "pci_domain_id", 0), props.pci_bus_id, props.pci_device_id)
    out["device"] = {"index": args.device, "name": props.name, "bus_id": bus,
                     "compute_capability": "%d.%d" % (props.major, props.minor)}
    size = args.size_mib << 20
    words = size // 8
    seed = random.getrandbits(62)

    def pattern():
        return torch.arange(words, dtype=torch.int64, device=dev).mul_(PATTERN_K).bitwise_xor_(seed)

    a = pattern()
    src = torch.empty(words, dtype=torch.int64, pin_memory=True)
    dst = torch.empty(words, dtype=torch.int64, pin_memory=True)
    src.copy_(a)
    b = torch.full((words,), -1, dtype=torch.int64, device=dev)
    a.fill_(-1)
    dst.fill_(-1)  # poisoned: stale data cannot pass the check
    torch.cuda.synchronize()
    s1, s2 = torch.cuda.Stream(dev), torch.cuda.Stream(dev)
    hold = getattr(torch.cuda, "_sleep", None)
    out["method"]["hold"] = ("torch.cuda._sleep(%d cycles) before the start event while the copies are queued"
                             % HOLD_CYCLES) if hold else "none (torch.cuda._sleep is missing)"
    covered = []

    def held(lanes):
        """lanes: (name, stream, copy function); returns {name: [GB/s per sample]}."""
        for _ in range(args.warmups):
            for _name, stream, func in lanes:
                with torch.cuda.stream(stream):
                    func()
        torch.cuda.synchronize()
        rates = {name: [] for name, _s, _f in lanes}
        for _ in range(args.samples):
            first = lanes[0][1]
            before = torch.cuda.Event(enable_timing=True)
            go = torch.cuda.Event()
            events = {name: (torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True))
                      for name, _s, _f in lanes}
            began = time.perf_counter()
            before.record(first)
            if hold:
                with torch.cuda.stream(first):
                    hold(HOLD_CYCLES)
            go.record(first)
            for name, stream, _f in lanes:
                if stream is not first:
                    stream.wait_event(go)  # both directions start together
                events[name][0].record(stream)
            for _ in range(args.copies):
                for _name, stream, func in lanes:
                    with torch.cuda.stream(stream):
                        func()
            for name, stream, _f in lanes:
                events[name][1].record(stream)
            queued = time.perf_counter() - began
            for name, _s, _f in lanes:
                start, stop = events[name]
                stop.synchronize()
                ms = start.elapsed_time(stop)
                if not ms > 0:
                    raise RuntimeError("zero or negative elapsed time between CUDA events")
                rates[name].append(size * args.copies / (ms / 1e3) / 1e9)
            if hold:
                held_ms = before.elapsed_time(events[lanes[0][0]][0])
                covered.append(held_ms / 1e3 >= queued)
        return rates

    def h2d():
        a.copy_(src, non_blocking=True)

    def d2d():
        b.copy_(a, non_blocking=True)

    def d2h():
        dst.copy_(b, non_blocking=True)

    mismatches = {}
    rates = held([("h2d", s1, h2d)])
    out["samples"]["h2d"] = rates["h2d"]
    torch.cuda.synchronize()
    mismatches["h2d"] = int((a != pattern()).sum().item())
    rates = held([("d2d", s1, d2d)])
    out["samples"]["d2d"] = rates["d2d"]
    torch.cuda.synchronize()
    mismatches["d2d"] = int((b != pattern()).sum().item())
    rates = held([("d2h", s1, d2h)])
    out["samples"]["d2h"] = rates["d2h"]
    torch.cuda.synchronize()
    mismatches["d2h"] = int((dst != src).sum().item())
    dst.fill_(-1)
    rates = held([("bidir_h2d", s1, h2d), ("bidir_d2h", s2, d2h)])
    torch.cuda.synchronize()
    mismatches["bidir"] = int((dst != src).sum().item()) + int((a != pattern()).sum().item())
    out["samples"]["bidir_h2d"], out["samples"]["bidir_d2h"] = rates["bidir_h2d"], rates["bidir_d2h"]
    out["samples"]["bidir_total"] = [x + y for x, y in zip(rates["bidir_h2d"], rates["bidir_d2h"])]
    for key in ("h2d", "d2h", "d2d", "bidir_h2d", "bidir_d2h", "bidir_total"):
        out[key + "_gbps"] = summary(out["samples"][key])
    out["mismatches"] = mismatches
    out["verified"] = not any(mismatches.values())
    out["hold_covered_queueing"] = all(covered) if covered else None


def build_chain(words, dev, nodes, stride, shuffled):
    """Write a cycle of pointers into ``words`` (a uint64 numpy view of the host buffer whose
    device address is ``dev``): node k, ``stride`` bytes apart, points to the next node in
    ``order`` (shuffled with a fixed seed, or in address order). Returns the order."""
    import numpy

    words[:] = 0
    order = list(range(nodes))
    if shuffled:
        random.Random(1).shuffle(order)
    index = numpy.array(order, dtype=numpy.uint64)
    after = numpy.roll(index, -1)
    words[(index * numpy.uint64(stride // 8)).astype(numpy.int64)] = numpy.uint64(dev) + after * numpy.uint64(stride)
    return order


def latency(args, out):
    import ctypes

    import cupy
    import numpy

    out["cupy"] = {"version": cupy.__version__}
    cupy.cuda.Device(args.device).use()
    runtime = cupy.cuda.runtime
    kernel = cupy.RawKernel(CHASE, "gpu_torch_chase")
    stream = cupy.cuda.Stream(non_blocking=True)
    sink = cupy.zeros(1, dtype=cupy.uint64)
    layouts = {"latency_us": (2048, 4096, True), "latency_ring128_us": ((2 << 20) // 128, 128, False)}
    out["method"]["latency_layouts"] = {"latency_us": "2048 nodes 4096 bytes apart, shuffled cycle",
                                        "latency_ring128_us": "2097152-byte ring, 128-byte stride"}
    flags = 0x02 | 0x01  # cudaHostAllocMapped | cudaHostAllocPortable
    for key, (nodes, stride, shuffled) in layouts.items():
        nbytes = nodes * stride
        host = runtime.hostAlloc(nbytes, flags)
        try:
            try:
                dev = runtime.pointerGetAttributes(host).devicePointer
            except Exception:  # noqa: BLE001 -- unified addressing: the host address is the device's
                dev = host
            words = numpy.ctypeslib.as_array((ctypes.c_uint64 * (nbytes // 8)).from_address(host))
            order = build_chain(words, dev, nodes, stride, shuffled)
            first = numpy.uint64(dev + order[0] * stride)
            hops = numpy.uint64(args.hops)
            with stream:  # RawKernel launches on the current stream
                kernel((1,), (1,), (first, hops, sink))  # warm-up
            stream.synchronize()
            start, stop = cupy.cuda.Event(), cupy.cuda.Event()
            samples = []
            for _ in range(args.samples):
                with stream:
                    start.record(stream)
                    kernel((1,), (1,), (first, hops, sink))
                    stop.record(stream)
                stop.synchronize()
                ms = cupy.cuda.get_elapsed_time(start, stop)
                if not ms > 0:
                    raise RuntimeError("zero or negative elapsed time between CUDA events")
                samples.append(ms * 1e3 / args.hops)
            end = int(sink.get()[0])
            out["samples"][key] = samples
            out[key] = summary(samples)
            out[key.replace("_us", "") + "_chain_verified"] = end == dev + order[args.hops % nodes] * stride
        finally:
            runtime.freeHost(host)


def main(argv):
    parser = argparse.ArgumentParser(description="GPU lane: copy bandwidth (PyTorch) and latency (CuPy)")
    parser.add_argument("--size-mib", type=int, default=512)
    parser.add_argument("--copies", type=int, default=16)
    parser.add_argument("--samples", type=int, default=3)
    parser.add_argument("--warmups", type=int, default=4)
    parser.add_argument("--hops", type=int, default=100000)
    parser.add_argument("--device", type=int, default=0)
    out = {"version": 1, "tool": "gpu_torch", "python": sys.version.split()[0], "device": None,
           "method": None, "h2d_gbps": None, "d2h_gbps": None, "bidir_h2d_gbps": None, "bidir_d2h_gbps": None,
           "bidir_total_gbps": None, "d2d_gbps": None, "latency_us": None, "latency_ring128_us": None,
           "samples": {}, "verified": None, "errors": {}}
    began = time.perf_counter()
    try:
        args = parser.parse_args(argv)
        for name in ("size_mib", "copies", "samples", "hops"):
            if getattr(args, name) < 1:
                raise ValueError("--%s must be at least 1" % name.replace("_", "-"))
        out["method"] = {"size_bytes": args.size_mib << 20, "copies": args.copies, "samples": args.samples,
                         "warmups": args.warmups, "pinned": True, "statistic": "median of samples",
                         "latency_hops": args.hops,
                         "api": "torch: pin_memory tensors, copy_(non_blocking=True), torch.cuda.Event; "
                                "cupy: RawKernel over cudaHostAlloc(mapped) memory"}
    except SystemExit as exc:  # argparse's own exit: reported, not fatal
        out["errors"]["arguments"] = "bad arguments (exit %s)" % exc.code
        args = None
    except Exception as exc:  # noqa: BLE001
        out["errors"]["arguments"] = reason(exc)
        args = None
    if args is not None:
        for key, func in (("torch", copies), ("cupy", latency)):
            try:
                func(args, out)
            except Exception as exc:  # noqa: BLE001 -- always a report
                out["errors"][key] = reason(exc)
    out["elapsed_s"] = round(time.perf_counter() - began, 3)
    sys.stdout.write(MARKER + " " + json.dumps(out, default=str) + "\n")
    sys.stdout.flush()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
