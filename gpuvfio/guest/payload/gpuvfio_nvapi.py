"""gpuvfio in-guest verifier, its driver layer: NVML, the CUDA driver API and NCCL through
ctypes, and one GPU's context, kernels, streams, buffers and events (see verifier.py).

Standard library only (python3 >= 3.6). Loaded beside verifier.py when that runs as a file,
or put in place by the bootstrap gpuvfio.guest.payload.verifier_program() sends on stdin.
"""

import ctypes
import os
import platform

PATTERN_K = 0x9E3779B97F4A7C15  # kernels.cu: word i holds (i * K) ^ seed
SPIN_TIMEOUT_NS = 10 * 1000 ** 3  # the hold gives up by itself: a lost flag cannot hang the GPU
VIRT_MODES = {0: "None", 1: "Pass-Through", 2: "VGPU", 3: "Host-VGPU", 4: "Host-VSGA"}
# set_mempolicy(2) by architecture (asm-generic/unistd.h; arch/x86/entry/syscalls/syscall_64.tbl)
SET_MEMPOLICY = {"x86_64": 238, "aarch64": 237}
MPOL_DEFAULT, MPOL_PREFERRED = 0, 1
def kernels_ptx():
    """kernels.cu as PTX: given to this module by the stdin bootstrap (KERNELS_PTX), else read
    from kernels.ptx beside this file."""
    text = globals().get("KERNELS_PTX")
    if text is None:
        with open(os.path.join(os.path.dirname(os.path.abspath(__file__)), "kernels.ptx")) as handle:
            text = handle.read()
    return text


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


def load(soname, what):
    """A driver library, or a Failure saying which is missing."""
    try:
        return ctypes.CDLL(soname)
    except OSError as exc:
        raise Failure("%s not found (no %s in the guest): %s" % (soname, what, exc))


def entry(lib, name):
    """An entry point of a loaded library, or a Failure naming it (an older driver lacks it)."""
    func = getattr(lib, name, None)
    if func is None:  # _name: the name given to CDLL (a documented attribute, ctypes docs "Loading shared libraries")
        raise Failure("%s has no %s (driver too old)" % (os.path.basename(lib._name or "?"), name))
    return func


class Nvml(object):
    def __init__(self):
        self.lib = load("libnvidia-ml.so.1", "NVIDIA driver")
        self.call("nvmlInit_v2")

    def call(self, name, *args):
        rc = entry(self.lib, name)(*args)
        if rc != 0:
            text = ""
            try:
                self.lib.nvmlErrorString.restype = ctypes.c_char_p
                text = (self.lib.nvmlErrorString(rc) or b"").decode(errors="replace")
            except AttributeError:
                pass
            raise Failure("%s returned NVML error %d%s" % (name, rc, " (%s)" % text if text else ""))

    def uint(self, name, handle):
        value = ctypes.c_uint()
        self.call(name, handle, ctypes.byref(value))
        return value.value

    def optional(self, func):
        try:
            return func()
        except Failure as exc:
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
        return {"driver_version": version.value.decode(), "cuda_driver_version": cuda.value, "devices": devices}

    def device(self, handle):
        name = ctypes.create_string_buffer(96)
        self.call("nvmlDeviceGetName", handle, name, ctypes.c_uint(96))
        pci = PciInfo()
        self.call("nvmlDeviceGetPciInfo_v3", handle, ctypes.byref(pci))
        mode, bar1 = ctypes.c_int(), Bar1Memory()
        ecc_cur, ecc_pend, mig_cur, mig_pend = ctypes.c_int(), ctypes.c_int(), ctypes.c_uint(), ctypes.c_uint()

        def read(call, *args):
            return lambda: self.call(call, handle, *args)
        virt = self.optional(lambda: (read("nvmlDeviceGetVirtualizationMode", ctypes.byref(mode))(),
                                      VIRT_MODES.get(mode.value, str(mode.value)))[1])
        bar1_total = self.optional(lambda: (read("nvmlDeviceGetBAR1MemoryInfo", ctypes.byref(bar1))(),
                                            bar1.bar1Total)[1])
        ecc = self.optional(lambda: (read("nvmlDeviceGetEccMode", ctypes.byref(ecc_cur), ctypes.byref(ecc_pend))(),
                                     bool(ecc_cur.value))[1])
        mig = self.optional(lambda: (read("nvmlDeviceGetMigMode", ctypes.byref(mig_cur), ctypes.byref(mig_pend))(),
                                     bool(mig_cur.value))[1])
        return {"name": name.value.decode(errors="replace"), "bus_id": pci.busId.decode().lower(),
                "pci_device_id": "%08x" % pci.pciDeviceId, "virtualization_mode": virt,
                "bar1_bytes": bar1_total, "ecc": ecc, "mig": mig, "link_idle": self.link(handle), "_handle": handle}

    def link(self, handle):
        try:
            return {"current_gen": self.uint("nvmlDeviceGetCurrPcieLinkGeneration", handle),
                    "current_width": self.uint("nvmlDeviceGetCurrPcieLinkWidth", handle),
                    "max_gen": self.uint("nvmlDeviceGetMaxPcieLinkGeneration", handle),
                    "max_width": self.uint("nvmlDeviceGetMaxPcieLinkWidth", handle)}
        except Failure as exc:
            return {"error": str(exc)}


# -- CUDA driver API -----------------------------------------------------------------------------
U64, SIZE, PTR, UINT = ctypes.c_uint64, ctypes.c_size_t, ctypes.c_void_p, ctypes.c_uint
# Every entry point whose arguments ctypes would otherwise pass as 32-bit ints (cuda.h).
ARGTYPES = {
    "cuMemcpyHtoDAsync_v2": [U64, PTR, SIZE, PTR], "cuMemcpyDtoHAsync_v2": [PTR, U64, SIZE, PTR],
    "cuMemcpyDtoDAsync_v2": [U64, U64, SIZE, PTR], "cuMemcpyPeerAsync": [U64, PTR, U64, PTR, SIZE, PTR],
    "cuMemcpyDtoH_v2": [PTR, U64, SIZE], "cuMemFree_v2": [U64], "cuMemsetD8Async": [U64, ctypes.c_ubyte, SIZE, PTR],
    "cuMemsetD32Async": [U64, UINT, SIZE, PTR], "cuMemHostAlloc": [ctypes.POINTER(PTR), SIZE, UINT],
    "cuMemHostGetDevicePointer_v2": [ctypes.POINTER(U64), PTR, UINT], "cuMemAlloc_v2": [ctypes.POINTER(U64), SIZE],
    "cuLaunchKernel": [PTR] + [UINT] * 7 + [PTR, PTR, PTR],
}


class Cuda(object):
    HOST_ALLOC_PORTABLE, HOST_ALLOC_DEVICEMAP = 0x01, 0x02

    def __init__(self):
        self.lib = load("libcuda.so.1", "CUDA driver")
        for name, types in ARGTYPES.items():
            func = getattr(self.lib, name, None)
            if func is not None:
                func.argtypes = types
        self.call("cuInit", ctypes.c_uint(0))

    def error(self, rc):
        """CUDA_ERROR_NAME (its text), from the driver itself when it can say."""
        name, text = ctypes.c_char_p(), ctypes.c_char_p()
        for func, out in (("cuGetErrorName", name), ("cuGetErrorString", text)):
            try:
                getattr(self.lib, func)(rc, ctypes.byref(out))
            except AttributeError:
                pass
        label = (name.value or b"").decode(errors="replace") or "CUDA error %d" % rc
        return label + (" (%s)" % text.value.decode(errors="replace") if text.value else "")

    def call(self, name, *args):
        rc = entry(self.lib, name)(*args)
        if rc != 0:
            raise Failure("%s failed: %s" % (name, self.error(rc)))

    def devices(self):
        count, version = ctypes.c_int(), ctypes.c_int()
        self.call("cuDeviceGetCount", ctypes.byref(count))
        self.call("cuDriverGetVersion", ctypes.byref(version))
        out = []
        for index in range(count.value):
            dev, major, minor, mem = ctypes.c_int(), ctypes.c_int(), ctypes.c_int(), ctypes.c_size_t()
            self.call("cuDeviceGet", ctypes.byref(dev), ctypes.c_int(index))
            name, bus = ctypes.create_string_buffer(128), ctypes.create_string_buffer(32)
            self.call("cuDeviceGetName", name, ctypes.c_int(128), dev)
            self.call("cuDeviceGetPCIBusId", bus, ctypes.c_int(32), dev)
            self.call("cuDeviceTotalMem_v2", ctypes.byref(mem), dev)
            self.call("cuDeviceGetAttribute", ctypes.byref(major), ctypes.c_int(75), dev)  # COMPUTE_CAPABILITY_MAJOR
            self.call("cuDeviceGetAttribute", ctypes.byref(minor), ctypes.c_int(76), dev)
            out.append({"index": index, "name": name.value.decode(errors="replace"),
                        "bus_id": bus.value.decode().lower(), "memory_bytes": mem.value,
                        "compute_capability": "%d.%d" % (major.value, minor.value)})
        return {"driver_version": version.value, "devices": out}


def seconds(start, stop, cuda):
    ms = ctypes.c_float()
    cuda.call("cuEventElapsedTime", ctypes.byref(ms), start, stop)
    if not ms.value > 0:  # also NaN
        raise Failure("cuEventElapsedTime gave %r ms: the events did not time the work" % ms.value)
    return ms.value / 1000.0


def sysfs_first_line(path):
    try:
        with open(path) as handle:
            return handle.readline().strip()
    except (OSError, ValueError):
        return None


def parse_cpulist(text):
    cpus = set()
    for part in (text or "").split(","):
        if part:
            low, _, high = part.partition("-")
            cpus.update(range(int(low), int(high or low) + 1))
    return cpus


class NumaPlacement(object):
    """Host memory on the GPU's NUMA node, as nvbandwidth wants it: this thread runs on that
    node's CPUs and prefers its memory (set_mempolicy MPOL_PREFERRED) while the pinned buffers
    are allocated and first touched; undone afterwards."""

    def __init__(self, root, bus_id):
        """``root``: where the guest's /sys is found (the verifier's --root, "/" in a guest)."""
        self.node, self.policy, self.saved = None, "none", None
        node_dir = os.path.join(root, "sys", "devices", "system", "node")
        value = sysfs_first_line(os.path.join(root, "sys", "bus", "pci", "devices", bus_id, "numa_node"))
        nodes = [n for n in (os.listdir(node_dir) if os.path.isdir(node_dir) else [])
                 if n.startswith("node") and n[4:].isdigit()]
        if value is None or not value.lstrip("-").isdigit() or int(value) < 0:
            self.policy = "none (the guest gives the GPU no NUMA node)"
            return
        self.node = int(value)
        if len(nodes) < 2:
            self.policy = "none (one NUMA node in the guest)"
            return
        try:
            self.saved = os.sched_getaffinity(0)
            cpus = parse_cpulist(sysfs_first_line(os.path.join(node_dir, "node%d" % self.node, "cpulist")))
            if cpus:
                os.sched_setaffinity(0, cpus)
            number = SET_MEMPOLICY.get(platform.machine())
            if number is None:
                self.policy = "CPU affinity only (no set_mempolicy number for %s)" % platform.machine()
                return
            mask = ctypes.c_ulong(1 << self.node)
            libc = ctypes.CDLL(None, use_errno=True)
            if libc.syscall(number, MPOL_PREFERRED, ctypes.byref(mask), ctypes.c_ulong(64)) != 0:
                self.policy = "CPU affinity only (set_mempolicy: errno %d)" % ctypes.get_errno()
                return
            self.policy = "preferred node %d, CPUs of that node" % self.node
        except (OSError, ValueError, AttributeError) as exc:
            self.policy = "none (%s)" % exc

    def undo(self):
        if self.saved is not None:
            try:
                os.sched_setaffinity(0, self.saved)
                number = SET_MEMPOLICY.get(platform.machine())
                if number is not None:
                    ctypes.CDLL(None).syscall(number, MPOL_DEFAULT, None, ctypes.c_ulong(0))
            except OSError:
                pass


class Device(object):
    """One GPU: its primary context, kernels, two streams, two device buffers, events."""

    def __init__(self, cuda, index, bus_id, size):
        self.cuda, self.index, self.bus_id, self.size = cuda, index, bus_id, size
        call = cuda.call
        self.dev, self.ctx = ctypes.c_int(), ctypes.c_void_p()
        call("cuDeviceGet", ctypes.byref(self.dev), ctypes.c_int(index))
        call("cuDevicePrimaryCtxRetain", ctypes.byref(self.ctx), self.dev)
        self.retained, self.freed = True, []
        self.current()
        self.module = ctypes.c_void_p()
        call("cuModuleLoadData", ctypes.byref(self.module), ctypes.c_char_p(kernels_ptx().encode() + b"\0"))
        self.kernels = {}
        for name in ("saxpy", "spin", "fill", "check", "chase"):
            func = ctypes.c_void_p()
            call("cuModuleGetFunction", ctypes.byref(func), self.module, ("gpuvfio_" + name).encode())
            self.kernels[name] = func
        self.streams = [self.new(lambda p: call("cuStreamCreate", p, ctypes.c_uint(1)), "cuStreamDestroy_v2")
                        for _ in range(2)]  # CU_STREAM_NON_BLOCKING
        self.events = [self.new(lambda p: call("cuEventCreate", p, ctypes.c_uint(0)), "cuEventDestroy_v2")
                       for _ in range(4)]
        self.a, self.b = self.device_alloc(size), self.device_alloc(size)
        self.errors_word = self.device_alloc(8)
        self.flag_host, self.flag_dev = self.mapped(64)

    def current(self):
        self.cuda.call("cuCtxSetCurrent", self.ctx)

    def new(self, create, destroy):
        handle = ctypes.c_void_p()
        create(ctypes.byref(handle))
        self.freed.append((destroy, handle))
        return handle

    def device_alloc(self, size):
        ptr = ctypes.c_uint64()
        self.cuda.call("cuMemAlloc_v2", ctypes.byref(ptr), ctypes.c_size_t(size))
        self.freed.append(("cuMemFree_v2", ptr.value))
        return ptr.value

    def host_alloc(self, size, mapped=False):
        ptr = ctypes.c_void_p()
        flags = Cuda.HOST_ALLOC_PORTABLE | (Cuda.HOST_ALLOC_DEVICEMAP if mapped else 0)
        self.cuda.call("cuMemHostAlloc", ctypes.byref(ptr), ctypes.c_size_t(size), ctypes.c_uint(flags))
        self.freed.append(("cuMemFreeHost", ptr))
        return ptr.value

    def release(self, host):
        """Free pinned host memory now (a GPU's buffers are not kept while the next is measured)."""
        self.freed = [(d, h) for d, h in self.freed if not (d == "cuMemFreeHost" and h.value == host)]
        self.cuda.call("cuMemFreeHost", ctypes.c_void_p(host))

    def mapped(self, size):
        host = self.host_alloc(size, mapped=True)
        ctypes.memset(host, 0, size)
        dev = ctypes.c_uint64()
        self.cuda.call("cuMemHostGetDevicePointer_v2", ctypes.byref(dev), ctypes.c_void_p(host), ctypes.c_uint(0))
        return host, dev.value

    def launch(self, name, grid, block, stream, *args):
        params = (ctypes.c_void_p * len(args))(*(ctypes.cast(ctypes.byref(a), ctypes.c_void_p) for a in args))
        self.cuda.call("cuLaunchKernel", self.kernels[name], grid, 1, 1, block, 1, 1, 0, stream, params, None)

    def blocks(self, words):
        return (words + 255) // 256, 256

    def fill(self, ptr, size, seed, stream):
        words = size // 8
        grid, block = self.blocks(words)
        self.launch("fill", grid, block, stream, ctypes.c_uint64(ptr), ctypes.c_uint64(words), ctypes.c_uint64(seed))

    def mismatches(self, ptr, size, seed, stream):
        """Words of ``ptr`` that differ from the pattern, counted on the GPU (the whole buffer)."""
        words = size // 8
        grid, block = self.blocks(words)
        self.cuda.call("cuMemsetD32Async", self.errors_word, 0, 2, stream)
        self.launch("check", grid, block, stream, ctypes.c_uint64(ptr), ctypes.c_uint64(words),
                    ctypes.c_uint64(seed), ctypes.c_uint64(self.errors_word))
        count = ctypes.c_uint32()
        self.cuda.call("cuStreamSynchronize", stream)
        self.cuda.call("cuMemcpyDtoH_v2", ctypes.byref(count), self.errors_word, 4)
        return count.value

    def held(self, lanes, samples, link_probe=None):
        """nvbandwidth's timing: per sample, each lane's stream is held by a spin kernel on the
        pinned flag, its start event, ``copies`` copies and its stop event are queued, then the
        flag is released and the stop events waited for. Returns {lane: [GB/s per sample]}."""
        call, flag = self.cuda.call, ctypes.c_uint32.from_address(self.flag_host)
        rates, seen = dict((name, []) for name, _s, _b, _e in lanes), None
        for _ in range(samples):
            flag.value = 0
            try:
                for number, (name, stream, nbytes, enqueue) in enumerate(lanes):
                    start, stop = self.events[2 * number], self.events[2 * number + 1]
                    self.launch("spin", 1, 1, stream, ctypes.c_uint64(self.flag_dev),
                                ctypes.c_uint64(SPIN_TIMEOUT_NS))
                    call("cuEventRecord", start, stream)
                    enqueue(stream)
                    call("cuEventRecord", stop, stream)
            finally:
                flag.value = 1  # also when queueing failed: never leave a stream held
            if link_probe is not None and seen is None:
                seen = link_probe()  # while the copies run: the link at its working speed
            for number, (name, stream, nbytes, enqueue) in enumerate(lanes):
                call("cuEventSynchronize", self.events[2 * number + 1])
                rates[name].append(nbytes / seconds(self.events[2 * number], self.events[2 * number + 1],
                                                    self.cuda) / 1e9)
        return rates, seen

    def close(self):
        """Wait for this GPU's queued work in its own context, then free what was made."""
        errors = []
        try:
            self.current()
            self.cuda.call("cuCtxSynchronize")
        except Failure as exc:
            errors.append(str(exc))
        for destroy, handle in reversed(self.freed):
            try:
                self.cuda.call(destroy, handle)
            except Failure as exc:
                errors.append(str(exc))
        self.freed = []
        if self.retained:
            try:
                self.cuda.call("cuDevicePrimaryCtxRelease_v2", self.dev)
            except Failure as exc:
                errors.append(str(exc))
            self.retained = False
        return errors
