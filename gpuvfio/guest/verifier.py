#!/usr/bin/env python3
"""gpuvfio in-guest verifier: facts and measurements from inside a guest, as one JSON object.

Standard library only (runs on any python3 >= 3.6 in the guest; nothing is installed).
NVML through ctypes (libnvidia-ml.so.1, or the pynvml module when present) for driver and
CUDA versions, virtualization mode, PCIe generation/width (read while a copy runs: idle
links drop to a lower generation), BAR1, ECC and MIG mode. The CUDA driver API through
ctypes (libcuda.so.1) for bandwidth the way NVIDIA's nvbandwidth measures it: pinned
host memory (cuMemHostAlloc), CUDA events around N asynchronous copies, several samples,
the median reported, data verified after the copies. Plus small-copy latency.

It only gathers facts; gpuvfio/verify.py on the host turns them into checks against what
the host assigned. Anything that cannot run is reported with the reason, never faked.
Output: one line ``GPUVFIO-VERIFIER <json>`` on stdout.
"""

import ctypes
import json
import os
import statistics
import sys
import time

MARKER = "GPUVFIO-VERIFIER"
VIRT_MODES = {0: "None", 1: "Pass-Through", 2: "VGPU", 3: "Host-VGPU", 4: "Host-VSGA"}


class Failure(Exception):
    pass


# -- NVML ------------------------------------------------------------------------------------
class PciInfo(ctypes.Structure):  # nvmlPciInfo_t (nvml.h, v3 layout)
    _fields_ = [("busIdLegacy", ctypes.c_char * 16), ("domain", ctypes.c_uint), ("bus", ctypes.c_uint),
                ("device", ctypes.c_uint), ("pciDeviceId", ctypes.c_uint), ("pciSubSystemId", ctypes.c_uint),
                ("busId", ctypes.c_char * 32)]


class Bar1Memory(ctypes.Structure):  # nvmlBAR1Memory_t
    _fields_ = [("bar1Total", ctypes.c_ulonglong), ("bar1Free", ctypes.c_ulonglong),
                ("bar1Used", ctypes.c_ulonglong)]


class Nvml:
    def __init__(self):
        try:
            self.lib = ctypes.CDLL("libnvidia-ml.so.1")
        except OSError as exc:
            raise Failure("libnvidia-ml.so.1 not found (no NVIDIA driver in the guest): %s" % exc)
        self.call("nvmlInit_v2")

    def call(self, name, *args):
        rc = getattr(self.lib, name)(*args)
        if rc != 0:
            raise Failure("%s returned NVML error %d" % (name, rc))

    def uint(self, name, handle):
        value = ctypes.c_uint()
        self.call(name, handle, ctypes.byref(value))
        return value.value

    def optional(self, func, *args):
        try:
            return func(*args)
        except (Failure, AttributeError) as exc:
            return {"error": str(exc)}

    def facts(self):
        version = ctypes.create_string_buffer(96)
        self.call("nvmlSystemGetDriverVersion", version, ctypes.c_uint(96))
        cuda = ctypes.c_int()
        self.call("nvmlSystemGetCudaDriverVersion_v2", ctypes.byref(cuda))
        count = ctypes.c_uint()
        self.call("nvmlDeviceGetCount_v2", ctypes.byref(count))
        devices = []
        for index in range(count.value):
            handle = ctypes.c_void_p()
            self.call("nvmlDeviceGetHandleByIndex_v2", ctypes.c_uint(index), ctypes.byref(handle))
            devices.append(self.device(handle))
        return {"driver_version": version.value.decode(), "cuda_driver_version": cuda.value,
                "devices": devices}

    def device(self, handle):
        name = ctypes.create_string_buffer(96)
        self.call("nvmlDeviceGetName", handle, name, ctypes.c_uint(96))
        pci = PciInfo()
        self.call("nvmlDeviceGetPciInfo_v3", handle, ctypes.byref(pci))
        mode = ctypes.c_int()
        virt = self.optional(lambda: (self.call("nvmlDeviceGetVirtualizationMode", handle, ctypes.byref(mode)),
                                      VIRT_MODES.get(mode.value, str(mode.value)))[1])
        bar1 = Bar1Memory()
        bar1_total = self.optional(lambda: (self.call("nvmlDeviceGetBAR1MemoryInfo", handle, ctypes.byref(bar1)),
                                            bar1.bar1Total)[1])
        ecc_cur, ecc_pend = ctypes.c_int(), ctypes.c_int()
        ecc = self.optional(lambda: (self.call("nvmlDeviceGetEccMode", handle, ctypes.byref(ecc_cur),
                                               ctypes.byref(ecc_pend)), bool(ecc_cur.value))[1])
        mig_cur, mig_pend = ctypes.c_uint(), ctypes.c_uint()
        mig = self.optional(lambda: (self.call("nvmlDeviceGetMigMode", handle, ctypes.byref(mig_cur),
                                               ctypes.byref(mig_pend)), bool(mig_cur.value))[1])
        return {"name": name.value.decode(), "bus_id": pci.busId.decode().lower(),
                "pci_device_id": "%08x" % pci.pciDeviceId, "virtualization_mode": virt,
                "bar1_bytes": bar1_total, "ecc": ecc, "mig": mig,
                "link_idle": self.link(handle), "_handle": handle}

    def link(self, handle):
        try:
            return {"current_gen": self.uint("nvmlDeviceGetCurrPcieLinkGeneration", handle),
                    "current_width": self.uint("nvmlDeviceGetCurrPcieLinkWidth", handle),
                    "max_gen": self.uint("nvmlDeviceGetMaxPcieLinkGeneration", handle),
                    "max_width": self.uint("nvmlDeviceGetMaxPcieLinkWidth", handle)}
        except Failure as exc:
            return {"error": str(exc)}


# -- CUDA driver API -----------------------------------------------------------------------------
class Cuda:
    HOST_ALLOC_PORTABLE = 0x01

    def __init__(self):
        try:
            self.lib = ctypes.CDLL("libcuda.so.1")
        except OSError as exc:
            raise Failure("libcuda.so.1 not found (no CUDA driver in the guest): %s" % exc)
        self.lib.cuMemcpyHtoDAsync_v2.argtypes = [ctypes.c_uint64, ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p]
        self.lib.cuMemcpyDtoHAsync_v2.argtypes = [ctypes.c_void_p, ctypes.c_uint64, ctypes.c_size_t, ctypes.c_void_p]
        self.lib.cuMemcpyDtoDAsync_v2.argtypes = [ctypes.c_uint64, ctypes.c_uint64, ctypes.c_size_t, ctypes.c_void_p]
        self.lib.cuMemcpyHtoD_v2.argtypes = [ctypes.c_uint64, ctypes.c_void_p, ctypes.c_size_t]
        self.lib.cuMemFree_v2.argtypes = [ctypes.c_uint64]
        self.lib.cuMemsetD8_v2.argtypes = [ctypes.c_uint64, ctypes.c_ubyte, ctypes.c_size_t]
        self.call("cuInit", ctypes.c_uint(0))

    def call(self, name, *args):
        rc = getattr(self.lib, name)(*args)
        if rc != 0:
            text = ctypes.c_char_p()
            try:
                self.lib.cuGetErrorString(rc, ctypes.byref(text))
            except AttributeError:
                pass
            raise Failure("%s failed: CUDA error %d %s" % (name, rc, (text.value or b"").decode()))

    def devices(self):
        count = ctypes.c_int()
        self.call("cuDeviceGetCount", ctypes.byref(count))
        version = ctypes.c_int()
        self.call("cuDriverGetVersion", ctypes.byref(version))
        out = []
        for index in range(count.value):
            dev = ctypes.c_int()
            self.call("cuDeviceGet", ctypes.byref(dev), ctypes.c_int(index))
            name = ctypes.create_string_buffer(128)
            self.call("cuDeviceGetName", name, ctypes.c_int(128), dev)
            bus = ctypes.create_string_buffer(32)
            self.call("cuDeviceGetPCIBusId", bus, ctypes.c_int(32), dev)
            mem = ctypes.c_size_t()
            self.call("cuDeviceTotalMem_v2", ctypes.byref(mem), dev)
            out.append({"index": index, "name": name.value.decode(), "bus_id": bus.value.decode().lower(),
                        "memory_bytes": mem.value})
        return {"driver_version": version.value, "devices": out}


class Bench:
    """Bandwidth and latency on one device, nvbandwidth-style."""

    def __init__(self, cuda, index, size, copies, samples):
        self.cuda, self.size, self.copies, self.samples = cuda, size, copies, samples
        call = cuda.call
        dev = ctypes.c_int()
        call("cuDeviceGet", ctypes.byref(dev), ctypes.c_int(index))
        self.ctx = ctypes.c_void_p()
        call("cuDevicePrimaryCtxRetain", ctypes.byref(self.ctx), dev)
        self.dev = dev
        call("cuCtxSetCurrent", self.ctx)
        self.stream = ctypes.c_void_p()
        call("cuStreamCreate", ctypes.byref(self.stream), ctypes.c_uint(1))  # CU_STREAM_NON_BLOCKING
        self.host_src, self.host_dst = ctypes.c_void_p(), ctypes.c_void_p()
        call("cuMemHostAlloc", ctypes.byref(self.host_src), ctypes.c_size_t(size), ctypes.c_uint(Cuda.HOST_ALLOC_PORTABLE))
        call("cuMemHostAlloc", ctypes.byref(self.host_dst), ctypes.c_size_t(size), ctypes.c_uint(Cuda.HOST_ALLOC_PORTABLE))
        self.dev_a, self.dev_b = ctypes.c_uint64(), ctypes.c_uint64()
        call("cuMemAlloc_v2", ctypes.byref(self.dev_a), ctypes.c_size_t(size))
        call("cuMemAlloc_v2", ctypes.byref(self.dev_b), ctypes.c_size_t(size))
        self.start, self.stop = ctypes.c_void_p(), ctypes.c_void_p()
        call("cuEventCreate", ctypes.byref(self.start), ctypes.c_uint(0))
        call("cuEventCreate", ctypes.byref(self.stop), ctypes.c_uint(0))
        pattern = bytes(range(256)) * (4096 // 256)
        block = pattern * max(1, min(size, 1 << 20) // len(pattern))
        for offset in range(0, size, len(block)):
            chunk = block[:min(len(block), size - offset)]
            ctypes.memmove(self.host_src.value + offset, chunk, len(chunk))

    def _timed(self, enqueue, during=None):
        call = self.cuda.call
        enqueue()  # warm-up copy
        call("cuStreamSynchronize", self.stream)
        rates, seen = [], None
        for _ in range(self.samples):
            call("cuEventRecord", self.start, self.stream)
            for _ in range(self.copies):
                enqueue()
            call("cuEventRecord", self.stop, self.stream)
            if during is not None and seen is None:
                seen = during()  # while the copies run: the link is at its working speed
            call("cuEventSynchronize", self.stop)
            ms = ctypes.c_float()
            call("cuEventElapsedTime", ctypes.byref(ms), self.start, self.stop)
            rates.append(self.size * self.copies / (ms.value / 1000.0) / 1e9)
        return {"median": statistics.median(rates), "samples": rates}, seen

    def run(self, link_probe=None):
        lib, size, stream = self.cuda.lib, self.size, self.stream
        results = {}
        results["h2d"], link = self._timed(
            lambda: self.cuda.call("cuMemcpyHtoDAsync_v2", self.dev_a.value, self.host_src, size, stream),
            link_probe)
        results["d2d"], _ = self._timed(
            lambda: self.cuda.call("cuMemcpyDtoDAsync_v2", self.dev_b.value, self.dev_a.value, size, stream))
        results["d2h"], _ = self._timed(
            lambda: self.cuda.call("cuMemcpyDtoHAsync_v2", self.host_dst, self.dev_b.value, size, stream))
        self.cuda.call("cuStreamSynchronize", stream)
        # The data went host -> A -> B -> host: it must come back unchanged.
        verified = ctypes.string_at(self.host_src.value, size) == ctypes.string_at(self.host_dst.value, size)
        del lib
        return results, verified, link

    def latency(self, count=2000):
        one = ctypes.c_uint32(0xC0FFEE)
        self.cuda.call("cuCtxSetCurrent", self.ctx)
        times = []
        for _ in range(count):
            begin = time.perf_counter()
            self.cuda.call("cuMemcpyHtoD_v2", self.dev_a.value, ctypes.byref(one), 4)
            times.append((time.perf_counter() - begin) * 1e6)
        times.sort()
        return {"count": count, "mean_us": statistics.mean(times), "p50_us": times[len(times) // 2],
                "p99_us": times[int(len(times) * 0.99) - 1], "min_us": times[0], "max_us": times[-1]}

    def close(self):
        call = self.cuda.call
        for event in (self.start, self.stop):
            call("cuEventDestroy_v2", event)
        call("cuMemFree_v2", self.dev_a.value)
        call("cuMemFree_v2", self.dev_b.value)
        call("cuMemFreeHost", self.host_src)
        call("cuMemFreeHost", self.host_dst)
        call("cuStreamDestroy_v2", self.stream)
        call("cuDevicePrimaryCtxRelease_v2", self.dev)


def main(argv):
    import argparse

    parser = argparse.ArgumentParser(description="gpuvfio in-guest verifier")
    parser.add_argument("--size-mib", type=int, default=256)
    parser.add_argument("--copies", type=int, default=8)
    parser.add_argument("--samples", type=int, default=5)
    parser.add_argument("--no-bandwidth", action="store_true")
    args = parser.parse_args(argv)
    out = {"version": 1, "python": sys.version.split()[0], "nvml": None, "cuda": None, "bandwidth": {},
           "latency": {}, "errors": {}}
    nvml = None
    try:
        nvml = Nvml()
        out["nvml"] = nvml.facts()
    except Failure as exc:
        out["errors"]["nvml"] = str(exc)
    try:
        cuda = Cuda()
        out["cuda"] = cuda.devices()
    except Failure as exc:
        cuda = None
        out["errors"]["cuda"] = str(exc)
    if cuda is not None and not args.no_bandwidth:
        handles = {d["bus_id"][-12:]: d["_handle"] for d in (out["nvml"] or {}).get("devices", [])}
        for dev in out["cuda"]["devices"]:
            key = dev["bus_id"][-12:]
            probe = None
            if nvml is not None and key in handles:
                probe = lambda h=handles[key]: nvml.link(h)  # noqa: E731
            try:
                bench = Bench(cuda, dev["index"], args.size_mib << 20, args.copies, args.samples)
                try:
                    results, verified, link = bench.run(probe)
                    results["verified"] = verified
                    results["link_under_load"] = link
                    results["size_bytes"] = args.size_mib << 20
                    out["bandwidth"][dev["bus_id"]] = results
                    out["latency"][dev["bus_id"]] = bench.latency()
                finally:
                    bench.close()
            except Failure as exc:
                out["errors"]["bandwidth " + dev["bus_id"]] = str(exc)
    for dev in (out["nvml"] or {}).get("devices", []):
        dev.pop("_handle", None)
    sys.stdout.write(MARKER + " " + json.dumps(out) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
