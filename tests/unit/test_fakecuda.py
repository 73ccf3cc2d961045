"""The stand-in driver libraries themselves (tests/fakecuda: libcuda.so.1, libnvidia-ml.so.1,
libnccl.so.2), called through ctypes as the verifier calls them -- no verifier here.

What the verifier's tests rely on is checked directly: the stream model (work queued behind a
spin kernel runs only once its flag is set; waiting first is CUDA_ERROR_LAUNCH_TIMEOUT),
events that time the drained copies, the kernels, several devices and peer copies, NCCL's
all-reduce, and every failure knob. Each test loads its own copy of the library (fresh state);
knobs are environment variables the library reads when called.
"""

from __future__ import annotations

import ctypes
import os
import shutil
import struct
import time

import pytest

from tests.conftest import build_fakecuda

c_u64, c_size, c_ptr, c_uint = ctypes.c_uint64, ctypes.c_size_t, ctypes.c_void_p, ctypes.c_uint
PATTERN = 0x9E3779B97F4A7C15
MASK = (1 << 64) - 1
PTX = b"""
.version 6.0
.target sm_60
.address_size 64
.visible .entry gpuvfio_saxpy(.param .u32 n, .param .f32 a, .param .u64 x, .param .u64 y) { ret; }
.visible .entry gpuvfio_spin(.param .u64 flag, .param .u64 timeout_ns) { ret; }
.visible .entry gpuvfio_fill(.param .u64 buf, .param .u64 words, .param .u64 seed) { ret; }
.visible .entry gpuvfio_check(.param .u64 buf, .param .u64 words, .param .u64 seed, .param .u64 errors) { ret; }
.visible .entry gpuvfio_chase(.param .u64 start, .param .u32 hops, .param .u64 sink) { ret; }
\0"""
HOLD_NS = 30 * 10**9
ARGTYPES = {
    "cuGetErrorName": [ctypes.c_int, ctypes.POINTER(ctypes.c_char_p)],
    "cuGetErrorString": [ctypes.c_int, ctypes.POINTER(ctypes.c_char_p)],
    "cuDevicePrimaryCtxRetain": [ctypes.POINTER(c_ptr), ctypes.c_int],
    "cuCtxSetCurrent": [c_ptr], "cuCtxEnablePeerAccess": [c_ptr, c_uint],
    "cuMemAlloc_v2": [ctypes.POINTER(c_u64), c_size], "cuMemFree_v2": [c_u64],
    "cuMemHostAlloc": [ctypes.POINTER(c_ptr), c_size, c_uint], "cuMemFreeHost": [c_ptr],
    "cuMemHostGetDevicePointer_v2": [ctypes.POINTER(c_u64), c_ptr, c_uint],
    "cuMemcpyHtoDAsync_v2": [c_u64, c_ptr, c_size, c_ptr], "cuMemcpyDtoHAsync_v2": [c_ptr, c_u64, c_size, c_ptr],
    "cuMemcpyDtoDAsync_v2": [c_u64, c_u64, c_size, c_ptr],
    "cuMemcpyPeerAsync": [c_u64, c_ptr, c_u64, c_ptr, c_size, c_ptr],
    "cuMemcpyHtoD_v2": [c_u64, c_ptr, c_size], "cuMemcpyDtoH_v2": [c_ptr, c_u64, c_size],
    "cuMemsetD8Async": [c_u64, ctypes.c_ubyte, c_size, c_ptr], "cuMemsetD32Async": [c_u64, c_uint, c_size, c_ptr],
    "cuStreamCreate": [ctypes.POINTER(c_ptr), c_uint], "cuStreamSynchronize": [c_ptr], "cuStreamQuery": [c_ptr],
    "cuStreamDestroy_v2": [c_ptr],
    "cuEventCreate": [ctypes.POINTER(c_ptr), c_uint], "cuEventRecord": [c_ptr, c_ptr], "cuEventQuery": [c_ptr],
    "cuEventSynchronize": [c_ptr], "cuEventElapsedTime": [ctypes.POINTER(ctypes.c_float), c_ptr, c_ptr],
    "cuEventDestroy_v2": [c_ptr],
    "cuModuleLoadData": [ctypes.POINTER(c_ptr), ctypes.c_char_p],
    "cuModuleGetFunction": [ctypes.POINTER(c_ptr), c_ptr, ctypes.c_char_p],
    "cuLaunchKernel": [c_ptr] + [c_uint] * 7 + [c_ptr, c_ptr, c_ptr],
    "nvmlDeviceGetHandleByIndex_v2": [c_uint, ctypes.POINTER(c_ptr)],
}


class PciInfo(ctypes.Structure):
    _fields_ = [("busIdLegacy", ctypes.c_char * 16), ("domain", c_uint), ("bus", c_uint), ("device", c_uint),
                ("pciDeviceId", c_uint), ("pciSubSystemId", c_uint), ("busId", ctypes.c_char * 32)]


class Cuda:
    """One loaded copy of the stand-in libcuda.so.1, with a few helpers."""

    def __init__(self, path):
        self.lib = ctypes.CDLL(path)
        self.modules, self.module = {}, None
        for name, types in ARGTYPES.items():
            if hasattr(self.lib, name):
                getattr(self.lib, name).argtypes = types
        self.lib.nvmlErrorString.restype = ctypes.c_char_p

    def __call__(self, name, *args):
        return getattr(self.lib, name)(*args)

    def ok(self, name, *args):
        rc = self(name, *args)
        assert rc == 0, "%s returned %d (%s)" % (name, rc, self.name(rc))

    def name(self, rc):
        out = ctypes.c_char_p()
        self.lib.cuGetErrorName(rc, ctypes.byref(out))
        return out.value and out.value.decode()

    def start(self, dev=0):
        """cuInit, the device's primary context made current; returns the context."""
        self.ok("cuInit", 0)
        return self.context(dev)

    def context(self, dev):
        ctx = c_ptr()
        self.ok("cuDevicePrimaryCtxRetain", ctypes.byref(ctx), dev)
        self.ok("cuCtxSetCurrent", ctx)
        if ctx.value not in self.modules:
            self.modules[ctx.value] = c_ptr()
            self.ok("cuModuleLoadData", ctypes.byref(self.modules[ctx.value]), PTX)
        self.module = self.modules[ctx.value]
        return ctx

    def use(self, ctx):
        """Make a context current, and its module the one launches use."""
        self.ok("cuCtxSetCurrent", ctx)
        self.module = self.modules[ctx.value]

    def alloc(self, size):
        ptr = c_u64()
        self.ok("cuMemAlloc_v2", ctypes.byref(ptr), size)
        return ptr.value

    def host(self, size, flags=0x3):
        ptr = c_ptr()
        self.ok("cuMemHostAlloc", ctypes.byref(ptr), size, flags)
        ctypes.memset(ptr.value, 0, size)
        return ptr.value

    def stream(self, flags=1):
        handle = c_ptr()
        self.ok("cuStreamCreate", ctypes.byref(handle), flags)
        return handle

    def event(self, flags=0):
        handle = c_ptr()
        self.ok("cuEventCreate", ctypes.byref(handle), flags)
        return handle

    def launch(self, kernel, stream, *args, grid=1, block=1):
        func = c_ptr()
        self.ok("cuModuleGetFunction", ctypes.byref(func), self.module, b"gpuvfio_" + kernel.encode())
        params = (c_ptr * len(args))(*(ctypes.cast(ctypes.byref(a), c_ptr) for a in args))
        return self("cuLaunchKernel", func, grid, 1, 1, block, 1, 1, 0, stream, params, None)

    def flag(self):
        """A pinned, mapped word for gpuvfio_spin: (host value, device address)."""
        host = self.host(64)
        dev = c_u64()
        self.ok("cuMemHostGetDevicePointer_v2", ctypes.byref(dev), host, 0)
        assert dev.value == host  # unified addressing
        return ctypes.c_uint32.from_address(host), dev.value

    def hold(self, stream, flag_dev, timeout_ns=HOLD_NS):
        assert self.launch("spin", stream, c_u64(flag_dev), c_u64(timeout_ns)) == 0

    def elapsed(self, start, stop):
        ms = ctypes.c_float()
        rc = self("cuEventElapsedTime", ctypes.byref(ms), start, stop)
        return rc, ms.value

    def u32(self, dptr):
        out = ctypes.c_uint32()
        self.ok("cuMemcpyDtoH_v2", ctypes.byref(out), dptr, 4)
        return out.value


@pytest.fixture
def libdir(tmp_path, fakecuda_libdir):
    """A private copy of the libraries: a fresh driver state for each test."""
    out = tmp_path / "lib"
    out.mkdir()
    for name in ("libcuda.so.1", "libnccl.so.2"):
        shutil.copy(os.path.join(fakecuda_libdir, name), out / name)
    return out


@pytest.fixture
def cuda(libdir, monkeypatch):
    for knob in [k for k in os.environ if k.startswith(("FAKECUDA_", "FAKENVML_", "FAKENCCL_"))]:
        monkeypatch.delenv(knob)
    return Cuda(str(libdir / "libcuda.so.1"))


@pytest.fixture
def nccl(libdir, cuda):
    lib = ctypes.CDLL(str(libdir / "libnccl.so.2"))
    lib.ncclGetErrorString.restype = ctypes.c_char_p
    lib.ncclAllReduce.argtypes = [c_u64, c_u64, c_size, ctypes.c_int, ctypes.c_int, c_ptr, c_ptr]
    lib.ncclCommDestroy.argtypes = [c_ptr]
    return lib


def pattern(i, seed):
    return ((i * PATTERN) & MASK) ^ seed


def f32(value):
    return struct.unpack("<I", struct.pack("<f", value))[0]


# -- initialisation, errors, devices -------------------------------------------------------------

@pytest.mark.parametrize("code, name", [
    (0, "CUDA_SUCCESS"), (1, "CUDA_ERROR_INVALID_VALUE"), (2, "CUDA_ERROR_OUT_OF_MEMORY"),
    (3, "CUDA_ERROR_NOT_INITIALIZED"), (100, "CUDA_ERROR_NO_DEVICE"), (101, "CUDA_ERROR_INVALID_DEVICE"),
    (200, "CUDA_ERROR_INVALID_IMAGE"), (217, "CUDA_ERROR_PEER_ACCESS_UNSUPPORTED"), (500, "CUDA_ERROR_NOT_FOUND"),
    (600, "CUDA_ERROR_NOT_READY"), (700, "CUDA_ERROR_ILLEGAL_ADDRESS"), (702, "CUDA_ERROR_LAUNCH_TIMEOUT"),
    (704, "CUDA_ERROR_PEER_ACCESS_ALREADY_ENABLED"), (802, "CUDA_ERROR_SYSTEM_NOT_READY"),
    (999, "CUDA_ERROR_UNKNOWN")])
def test_error_names_without_init(cuda, code, name):
    assert cuda.name(code) == name


def test_error_texts_and_unknown_codes(cuda):
    text = ctypes.c_char_p()
    cuda.ok("cuGetErrorString", 100, ctypes.byref(text))
    assert text.value == b"no CUDA-capable device is detected"
    cuda.ok("cuGetErrorString", 802, ctypes.byref(text))
    assert text.value == b"system not yet initialized"
    assert cuda("cuGetErrorString", 12345, ctypes.byref(text)) == 1 and text.value is None
    assert cuda("cuGetErrorName", 12345, ctypes.byref(text)) == 1 and text.value is None


@pytest.mark.parametrize("code", [100, 802])
def test_init_error_knob(cuda, monkeypatch, code):
    count = ctypes.c_int()
    monkeypatch.setenv("FAKECUDA_INIT_ERROR", str(code))
    assert cuda("cuInit", 0) == code
    assert cuda("cuDeviceGetCount", ctypes.byref(count)) == 3  # still not initialised
    version = ctypes.c_int()
    cuda.ok("cuDriverGetVersion", ctypes.byref(version))  # needs no cuInit
    monkeypatch.delenv("FAKECUDA_INIT_ERROR")
    cuda.ok("cuInit", 0)
    cuda.ok("cuDeviceGetCount", ctypes.byref(count))
    assert count.value == 1


def test_memory_needs_a_current_retained_context(cuda):
    ptr, ctx = c_u64(), c_ptr()
    cuda.ok("cuInit", 0)
    assert cuda("cuMemAlloc_v2", ctypes.byref(ptr), 64) == 201
    cuda.ok("cuDevicePrimaryCtxRetain", ctypes.byref(ctx), 0)
    cuda.ok("cuCtxSetCurrent", ctx)
    cuda.ok("cuMemAlloc_v2", ctypes.byref(ptr), 64)
    assert cuda("cuMemFree_v2", ptr.value + 8) == 1  # not an allocation: an error, not a crash
    cuda.ok("cuMemFree_v2", ptr.value)
    assert cuda("cuMemFree_v2", ptr.value) == 1
    cuda.ok("cuDevicePrimaryCtxRelease_v2", 0)  # the last reference: the context is destroyed
    assert cuda("cuMemAlloc_v2", ctypes.byref(ptr), 64) == 201


def test_several_devices_have_their_bus_ids_contexts_and_nvml_handles(cuda, monkeypatch):
    monkeypatch.setenv("FAKECUDA_NDEV", "4")
    cuda.ok("cuInit", 0)
    count, dev, value = ctypes.c_int(), ctypes.c_int(), ctypes.c_int()
    cuda.ok("cuDeviceGetCount", ctypes.byref(count))
    assert count.value == 4
    buses, contexts = [], set()
    for index in range(4):
        cuda.ok("cuDeviceGet", ctypes.byref(dev), index)
        bus = ctypes.create_string_buffer(32)
        cuda.ok("cuDeviceGetPCIBusId", bus, 32, dev)
        buses.append(bus.value.decode())
        cuda.ok("cuDeviceGetAttribute", ctypes.byref(value), 75, dev)
        assert value.value == 9
        cuda.ok("cuDeviceGetAttribute", ctypes.byref(value), 76, dev)
        assert value.value == 0
        ctx = c_ptr()
        cuda.ok("cuDevicePrimaryCtxRetain", ctypes.byref(ctx), dev)
        again = c_ptr()
        cuda.ok("cuDevicePrimaryCtxRetain", ctypes.byref(again), dev)
        assert again.value == ctx.value  # the primary context: one per device
        contexts.add(ctx.value)
    assert buses == ["0000:01:00.0", "0000:02:00.0", "0000:03:00.0", "0000:04:00.0"]
    assert len(contexts) == 4
    assert cuda("cuDeviceGet", ctypes.byref(dev), 4) == 101
    nvml_count, handle, pci = ctypes.c_uint(), c_ptr(), PciInfo()
    cuda.ok("nvmlInit_v2")
    cuda.ok("nvmlDeviceGetCount_v2", ctypes.byref(nvml_count))
    assert nvml_count.value == 4
    seen = []
    for index in range(4):
        cuda.ok("nvmlDeviceGetHandleByIndex_v2", index, ctypes.byref(handle))
        cuda.ok("nvmlDeviceGetPciInfo_v3", handle, ctypes.byref(pci))
        seen.append((pci.busId.decode(), pci.bus))
    assert seen == [("00000000:0%d:00.0" % (i + 1), i + 1) for i in range(4)]
    assert cuda("nvmlDeviceGetHandleByIndex_v2", 4, ctypes.byref(handle)) == 2


def test_no_devices_mig_and_vgpu_knobs(cuda, monkeypatch):
    count, nvml_count, handle = ctypes.c_int(), ctypes.c_uint(), c_ptr()
    cur, pend, mode = ctypes.c_uint(), ctypes.c_uint(), ctypes.c_int()
    cuda.ok("cuInit", 0)
    cuda.ok("nvmlInit_v2")
    monkeypatch.setenv("FAKECUDA_NODEV", "1")
    cuda.ok("cuDeviceGetCount", ctypes.byref(count))
    cuda.ok("nvmlDeviceGetCount_v2", ctypes.byref(nvml_count))
    assert (count.value, nvml_count.value) == (0, 0)
    monkeypatch.delenv("FAKECUDA_NODEV")
    cuda.ok("nvmlDeviceGetHandleByIndex_v2", 0, ctypes.byref(handle))
    cuda.ok("nvmlDeviceGetMigMode", handle, ctypes.byref(cur), ctypes.byref(pend))
    cuda.ok("nvmlDeviceGetVirtualizationMode", handle, ctypes.byref(mode))
    assert (cur.value, mode.value) == (0, 1)
    monkeypatch.setenv("FAKECUDA_MIG", "1")  # MIG on, no instances: NVML sees the GPU, CUDA none
    cuda.ok("cuDeviceGetCount", ctypes.byref(count))
    cuda.ok("nvmlDeviceGetCount_v2", ctypes.byref(nvml_count))
    cuda.ok("nvmlDeviceGetMigMode", handle, ctypes.byref(cur), ctypes.byref(pend))
    assert (count.value, nvml_count.value, cur.value, pend.value) == (0, 1, 1, 1)
    monkeypatch.setenv("FAKECUDA_VGPU", "1")
    cuda.ok("nvmlDeviceGetVirtualizationMode", handle, ctypes.byref(mode))
    assert mode.value == 2


def test_nvml_init_error_knob(cuda, monkeypatch):
    count = ctypes.c_uint()
    monkeypatch.setenv("FAKENVML_INIT_ERROR", "9")
    assert cuda("nvmlInit_v2") == 9
    assert cuda.lib.nvmlErrorString(9) == b"Driver Not Loaded"
    assert cuda("nvmlDeviceGetCount_v2", ctypes.byref(count)) == 1  # Uninitialized
    assert cuda.lib.nvmlErrorString(1) == b"Uninitialized"


# -- the stream model ------------------------------------------------------------------------

def test_copies_behind_a_spin_wait_for_the_flag(cuda):
    cuda.start()
    flag, flag_dev = cuda.flag()
    size = 1 << 20
    src, out, dst = cuda.host(size), cuda.host(size), cuda.alloc(size)
    ctypes.memmove(src, os.urandom(size), size)
    stream, other, done = cuda.stream(), cuda.stream(), cuda.event()
    cuda.ok("cuMemsetD8Async", dst, 0, size, stream)  # nothing pending: runs at once
    assert ctypes.string_at(dst, size) == bytes(size)
    cuda.hold(stream, flag_dev)
    assert cuda("cuStreamQuery", stream) == 600
    cuda.ok("cuMemcpyHtoDAsync_v2", dst, src, size, stream)
    cuda.ok("cuEventRecord", done, stream)
    cuda.ok("cuMemcpyDtoHAsync_v2", out, dst, size, stream)
    cuda.ok("cuMemsetD8Async", cuda.alloc(64), 1, 64, other)  # other streams are not held
    assert cuda("cuEventQuery", done) == 600 and cuda("cuStreamQuery", stream) == 600
    assert ctypes.string_at(dst, size) == bytes(size) and ctypes.string_at(out, size) == bytes(size)
    flag.value = 1  # the caller releases the hold; the next call sees it
    cuda.ok("cuEventQuery", done)
    assert ctypes.string_at(out, size) == ctypes.string_at(src, size)
    cuda.ok("cuStreamSynchronize", stream)


@pytest.mark.parametrize("wait", ["stream", "event"])
def test_waiting_before_releasing_the_flag_is_a_launch_timeout(cuda, wait):
    cuda.start()
    _flag, flag_dev = cuda.flag()
    src, dst = cuda.host(4096), cuda.alloc(4096)
    ctypes.memset(src, 7, 4096)
    stream, done = cuda.stream(), cuda.event()
    cuda.hold(stream, flag_dev)
    cuda.ok("cuMemcpyHtoDAsync_v2", dst, src, 4096, stream)
    cuda.ok("cuEventRecord", done, stream)
    rc = cuda("cuStreamSynchronize", stream) if wait == "stream" else cuda("cuEventSynchronize", done)
    assert rc == 702 and cuda.name(rc) == "CUDA_ERROR_LAUNCH_TIMEOUT"
    assert ctypes.string_at(dst, 4096) == b"\7" * 4096  # drained all the same
    cuda.ok("cuStreamSynchronize", stream)


def test_a_spin_past_its_timeout_ends_as_the_kernel_would(cuda):
    cuda.start()
    _flag, flag_dev = cuda.flag()
    stream = cuda.stream()
    cuda.hold(stream, flag_dev, timeout_ns=1_000_000)
    time.sleep(0.01)
    cuda.ok("cuStreamSynchronize", stream)


def test_calls_that_wait_for_a_held_stream_time_out(cuda):
    """Pageable async copies, the legacy default stream against a blocking stream, and freeing
    memory a queued copy uses all wait for the stream, as CUDA's do."""
    cuda.start()
    flag, flag_dev = cuda.flag()
    dst = cuda.alloc(64)
    pageable = ctypes.create_string_buffer(b"x" * 64)
    stream = cuda.stream()
    cuda.hold(stream, flag_dev)
    assert cuda("cuMemcpyHtoDAsync_v2", dst, pageable, 64, stream) == 702
    assert ctypes.string_at(dst, 64) == b"x" * 64
    blocking = cuda.stream(flags=0)
    cuda.hold(blocking, flag_dev)
    assert cuda("cuMemcpyHtoD_v2", dst, pageable, 64) == 702
    nonblocking = cuda.stream(flags=1)
    cuda.hold(nonblocking, flag_dev)
    cuda.ok("cuMemcpyHtoD_v2", dst, pageable, 64)  # independent of the legacy stream
    assert cuda("cuStreamQuery", nonblocking) == 600
    pinned = cuda.host(64)
    cuda.ok("cuMemcpyHtoDAsync_v2", dst, pinned, 64, nonblocking)
    assert cuda("cuMemFreeHost", pinned) == 702  # freed once the copy ran
    flag.value = 1
    cuda.ok("cuStreamSynchronize", nonblocking)


def test_events_time_the_drained_copies_not_the_hold(cuda, monkeypatch):
    cuda.start()
    flag, flag_dev = cuda.flag()
    size = 32 << 20
    src, dst = cuda.host(size), cuda.alloc(size)
    stream = cuda.stream()
    e0, e1, e2 = cuda.event(), cuda.event(), cuda.event()
    cuda.ok("cuMemcpyHtoDAsync_v2", dst, src, size, stream)  # warm-up: pages touched
    cuda.hold(stream, flag_dev)
    cuda.ok("cuEventRecord", e0, stream)
    cuda.ok("cuMemcpyHtoDAsync_v2", dst, src, size, stream)
    cuda.ok("cuEventRecord", e1, stream)
    for _ in range(8):
        cuda.ok("cuMemcpyHtoDAsync_v2", dst, src, size, stream)
    cuda.ok("cuEventRecord", e2, stream)
    assert cuda.elapsed(e0, e2)[0] == 600  # not drained yet
    time.sleep(0.3)
    flag.value = 1
    begin = time.perf_counter()
    cuda.ok("cuEventSynchronize", e2)
    wall_ms = (time.perf_counter() - begin) * 1000
    (rc1, one), (rc8, eight), (rc, total) = cuda.elapsed(e0, e1), cuda.elapsed(e1, e2), cuda.elapsed(e0, e2)
    assert rc1 == rc8 == rc == 0
    assert 0 < one < eight and eight > 2 * one  # each event stamped as the queue drained
    assert total <= wall_ms + 1 and total < 300  # the copies' time, not the hold before them
    never = cuda.event()
    assert cuda.elapsed(never, e2)[0] == 600
    monkeypatch.setenv("FAKECUDA_ZERO_TIME", "1")
    assert cuda.elapsed(e0, e2) == (0, 0.0)
    untimed = cuda.event(flags=2)  # CU_EVENT_DISABLE_TIMING
    cuda.ok("cuEventRecord", untimed, stream)
    assert cuda.elapsed(e0, untimed)[0] == 400


def test_two_streams_held_on_one_flag(cuda):
    """The bidirectional measurement: H2D on one stream, D2H on another, one flag."""
    cuda.start()
    flag, flag_dev = cuda.flag()
    size = 4 << 20
    up_src, down_dst = cuda.host(size), cuda.host(size)
    a, b = cuda.alloc(size), cuda.alloc(size)
    ctypes.memmove(up_src, os.urandom(size), size)
    cuda.ok("cuMemcpyHtoD_v2", b, os.urandom(size), size)
    lanes = []
    for kind in ("h2d", "d2h"):
        stream, start, stop = cuda.stream(), cuda.event(), cuda.event()
        cuda.hold(stream, flag_dev)
        cuda.ok("cuEventRecord", start, stream)
        for _ in range(3):
            if kind == "h2d":
                cuda.ok("cuMemcpyHtoDAsync_v2", a, up_src, size, stream)
            else:
                cuda.ok("cuMemcpyDtoHAsync_v2", down_dst, b, size, stream)
        cuda.ok("cuEventRecord", stop, stream)
        lanes.append((stream, start, stop))
    assert all(cuda("cuStreamQuery", s) == 600 for s, _, _ in lanes)
    flag.value = 1
    for stream, start, stop in lanes:
        cuda.ok("cuEventSynchronize", stop)
        rc, ms = cuda.elapsed(start, stop)
        assert rc == 0 and ms > 0
    assert ctypes.string_at(a, size) == ctypes.string_at(up_src, size)
    assert ctypes.string_at(down_dst, size) == ctypes.string_at(b, size)


# -- kernels ------------------------------------------------------------------------------------

def test_fill_and_check_agree_and_check_counts_corruption(cuda, monkeypatch):
    cuda.start()
    words, seed = 1 << 17, 0x1234_5678_9ABC_DEF0
    size = words * 8
    buf, copy, errors = cuda.alloc(size), cuda.alloc(size), cuda.alloc(4)
    stream = cuda.stream()

    def check(ptr, grid=512, block=256):
        cuda.ok("cuMemsetD32Async", errors, 0, 1, stream)
        assert cuda.launch("check", stream, c_u64(ptr), c_u64(words), c_u64(seed), c_u64(errors),
                           grid=grid, block=block) == 0
        cuda.ok("cuStreamSynchronize", stream)
        return cuda.u32(errors)

    assert cuda.launch("fill", stream, c_u64(buf), c_u64(words), c_u64(seed), grid=1, block=32) == 0
    host = ctypes.string_at(buf, size)
    for i in (0, 1, 2, words // 2, words - 1):
        assert struct.unpack_from("<Q", host, i * 8)[0] == pattern(i, seed)
    assert check(buf) == 0
    assert check(buf, grid=1, block=1) == 0  # the whole buffer whatever the grid
    cuda.ok("cuMemcpyHtoD_v2", buf + 8 * 100, struct.pack("<Q", 0), 8)
    assert check(buf) == 1
    assert check(buf, grid=1, block=1) == 1
    cuda.launch("fill", stream, c_u64(buf), c_u64(words), c_u64(seed), grid=512, block=256)
    monkeypatch.setenv("FAKECUDA_CORRUPT", "1")  # D2H copies flip a byte in the middle
    pinned = cuda.host(size)
    cuda.ok("cuMemcpyDtoHAsync_v2", pinned, buf, size, stream)
    exact = ctypes.create_string_buffer(size)
    cuda.ok("cuMemcpyDtoH_v2", exact, buf, size)  # results read back synchronously stay exact
    assert exact.raw == ctypes.string_at(buf, size) != ctypes.string_at(pinned, size)
    monkeypatch.delenv("FAKECUDA_CORRUPT")
    cuda.ok("cuMemcpyHtoDAsync_v2", copy, pinned, size, stream)
    assert check(copy) == 1
    assert check(buf) == 0


def test_saxpy_covers_min_of_n_and_threads(cuda):
    cuda.start()
    n = 1000
    x, y = cuda.alloc(4 * n), cuda.alloc(4 * n)
    stream = cuda.stream()
    cuda.ok("cuMemsetD32Async", x, f32(1.5), n, stream)
    cuda.ok("cuMemsetD32Async", y, f32(1.0), n, stream)
    assert cuda.launch("saxpy", stream, c_uint(n), ctypes.c_float(2.0), c_u64(x), c_u64(y), grid=2, block=256) == 0
    cuda.ok("cuStreamSynchronize", stream)
    out = struct.unpack("<%df" % n, ctypes.string_at(y, 4 * n))
    assert out[:512] == (4.0,) * 512 and out[512:] == (1.0,) * (n - 512)


def test_chase_follows_pointers_and_a_bad_one_is_an_illegal_address(cuda):
    cuda.start()
    entries, stride = 64, 4096
    host = cuda.host(entries * stride)
    order = list(range(entries))
    order = order[::3] + order[1::3] + order[2::3]  # a cycle through every entry
    for here, there in zip(order, order[1:] + order[:1]):
        ctypes.c_uint64.from_address(host + here * stride).value = host + there * stride
    sink = cuda.alloc(8)
    stream = cuda.stream()
    for hops in (0, 1, 5, entries, entries + 7):
        assert cuda.launch("chase", stream, c_u64(host + order[0] * stride), c_uint(hops), c_u64(sink)) == 0
        got = ctypes.c_uint64()
        cuda.ok("cuMemcpyDtoH_v2", ctypes.byref(got), sink, 8)
        assert got.value == host + order[hops % entries] * stride
    ctypes.c_uint64.from_address(host + order[3] * stride).value = 0x10  # not memory the GPU has
    cuda.launch("chase", stream, c_u64(host + order[0] * stride), c_uint(10), c_u64(sink))
    rc = cuda("cuStreamSynchronize", stream)
    assert rc == 700 and cuda.name(rc) == "CUDA_ERROR_ILLEGAL_ADDRESS"
    assert cuda("cuMemAlloc_v2", ctypes.byref(c_u64()), 8) == 700  # sticky, as a real fault is


def test_modules_know_only_the_named_entries(cuda):
    cuda.start()
    module, func = c_ptr(), c_ptr()
    assert cuda("cuModuleLoadData", ctypes.byref(module), b".version 6.0\n.target sm_60\n") == 200
    cuda.ok("cuModuleLoadData", ctypes.byref(module), b".visible .entry gpuvfio_fill(.param .u64 a) { ret; }")
    cuda.ok("cuModuleGetFunction", ctypes.byref(func), module, b"gpuvfio_fill")
    assert cuda("cuModuleGetFunction", ctypes.byref(func), module, b"gpuvfio_chase") == 500
    assert cuda("cuModuleGetFunction", ctypes.byref(func), module, b"gpuvfio_fil") == 500
    cuda.ok("cuModuleUnload", module)
    assert cuda("cuModuleGetFunction", ctypes.byref(func), module, b"gpuvfio_fill") == 400


# -- several devices -----------------------------------------------------------------------------

def two_devices(cuda, monkeypatch):
    monkeypatch.setenv("FAKECUDA_NDEV", "2")
    cuda.ok("cuInit", 0)
    ctx1 = cuda.context(1)
    ctx0 = cuda.context(0)
    return ctx0, ctx1


def test_peer_access_and_peer_copies(cuda, monkeypatch):
    ctx0, ctx1 = two_devices(cuda, monkeypatch)
    can = ctypes.c_int()
    cuda.ok("cuDeviceCanAccessPeer", ctypes.byref(can), 0, 1)
    assert can.value == 1
    cuda.ok("cuDeviceCanAccessPeer", ctypes.byref(can), 0, 0)
    assert can.value == 0
    cuda.ok("cuCtxEnablePeerAccess", ctx1, 0)
    assert cuda("cuCtxEnablePeerAccess", ctx1, 0) == 704
    size = 1 << 20
    src = cuda.alloc(size)
    data = os.urandom(size)
    cuda.ok("cuMemcpyHtoD_v2", src, data, size)
    stream0 = cuda.stream()
    cuda.ok("cuCtxSetCurrent", ctx1)
    dst = cuda.alloc(size)
    cuda.ok("cuCtxSetCurrent", ctx0)
    cuda.ok("cuMemcpyPeerAsync", dst, ctx1, src, ctx0, size, stream0)
    cuda.ok("cuStreamSynchronize", stream0)
    assert ctypes.string_at(dst, size) == data
    monkeypatch.setenv("FAKECUDA_P2P_CORRUPT", "1")
    cuda.ok("cuMemcpyPeerAsync", dst, ctx1, src, ctx0, size, stream0)
    cuda.ok("cuStreamSynchronize", stream0)
    got = ctypes.string_at(dst, size)
    assert [i for i in range(size) if got[i] != data[i]] == [size // 2]
    cuda.ok("cuMemcpyDtoDAsync_v2", dst, src, size, stream0)  # UVA copy between devices: peer too
    assert ctypes.string_at(dst, size) != data


def test_no_peer_knob(cuda, monkeypatch):
    _ctx0, ctx1 = two_devices(cuda, monkeypatch)
    monkeypatch.setenv("FAKECUDA_NOPEER", "1")
    can = ctypes.c_int(7)
    cuda.ok("cuDeviceCanAccessPeer", ctypes.byref(can), 0, 1)
    assert can.value == 0
    rc = cuda("cuCtxEnablePeerAccess", ctx1, 0)
    assert rc == 217 and cuda.name(rc) == "CUDA_ERROR_PEER_ACCESS_UNSUPPORTED"


def test_kernels_and_events_belong_to_their_context(cuda, monkeypatch):
    ctx0, ctx1 = two_devices(cuda, monkeypatch)
    stream0, event0 = cuda.stream(), cuda.event()
    cuda.ok("cuCtxSetCurrent", ctx1)
    stream1 = cuda.stream()
    assert cuda("cuEventRecord", event0, stream1) == 400
    buf = cuda.alloc(64)
    cuda.use(ctx0)
    assert cuda.launch("fill", stream1, c_u64(buf), c_u64(8), c_u64(0)) == 400
    assert cuda.launch("fill", stream0, c_u64(buf), c_u64(8), c_u64(0)) == 0  # device 1's memory, no peer access
    assert cuda("cuStreamSynchronize", stream0) == 700


# -- NCCL ------------------------------------------------------------------------------------------

def nccl_ranks(cuda, nccl, monkeypatch, n, count):
    monkeypatch.setenv("FAKECUDA_NDEV", str(n))
    cuda.ok("cuInit", 0)
    ranks = []
    for dev in range(n):
        ctx = cuda.context(dev)
        send, recv = cuda.alloc(4 * count), cuda.alloc(4 * count)
        stream = cuda.stream()
        cuda.ok("cuMemsetD32Async", send, f32(dev + 1.0), count, stream)
        cuda.ok("cuMemsetD32Async", recv, 0, count, stream)
        ranks.append((ctx, send, recv, stream))
    comms = (c_ptr * n)()
    assert nccl.ncclCommInitAll(comms, n, (ctypes.c_int * n)(*range(n))) == 0
    return ranks, comms


def all_reduce(nccl, ranks, comms, count):
    assert nccl.ncclGroupStart() == 0
    for rank, (_ctx, send, recv, stream) in enumerate(ranks):
        assert nccl.ncclAllReduce(send, recv, count, 7, 0, comms[rank], stream) == 0
    assert nccl.ncclGroupEnd() == 0


def floats(ptr, count):
    return struct.unpack("<%df" % count, ctypes.string_at(ptr, 4 * count))


@pytest.mark.parametrize("n", [2, 4])
def test_nccl_all_reduce_sums_every_rank(cuda, nccl, monkeypatch, n):
    version = ctypes.c_int()
    assert nccl.ncclGetVersion(ctypes.byref(version)) == 0 and version.value == 22304
    count = 10001
    ranks, comms = nccl_ranks(cuda, nccl, monkeypatch, n, count)
    all_reduce(nccl, ranks, comms, count)
    for ctx, _send, recv, stream in ranks:
        cuda.ok("cuCtxSetCurrent", ctx)
        cuda.ok("cuStreamSynchronize", stream)
        assert floats(recv, count) == (n * (n + 1) / 2.0,) * count
    monkeypatch.setenv("FAKENCCL_CORRUPT", "1")
    _ctx, send0, _recv, _stream = ranks[0]
    ranks[0] = (_ctx, send0, send0, _stream)  # rank 0 in place
    all_reduce(nccl, ranks, comms, count)
    for _ctx, _send, recv, stream in ranks:
        cuda.ok("cuStreamSynchronize", stream)
    first = floats(send0, count)
    want = n * (n + 1) / 2.0
    assert first[count // 2] == want + 1.0 and first[:count // 2] == (want,) * (count // 2)
    assert floats(ranks[1][2], count) == (want,) * count
    for comm in comms:
        assert nccl.ncclCommDestroy(comm) == 0


def test_nccl_work_waits_on_held_streams(cuda, nccl, monkeypatch):
    count = 1024
    ranks, comms = nccl_ranks(cuda, nccl, monkeypatch, 2, count)
    flag, flag_dev = cuda.flag()  # pinned by the current context (device 1), mapped, portable
    for ctx, _send, _recv, stream in ranks:
        cuda.use(ctx)
        cuda.hold(stream, flag_dev)
    all_reduce(nccl, ranks, comms, count)
    assert floats(ranks[0][2], count) == (0.0,) * count
    assert cuda("cuStreamQuery", ranks[1][3]) == 600
    flag.value = 1
    for ctx, _send, recv, stream in ranks:
        cuda.ok("cuCtxSetCurrent", ctx)
        cuda.ok("cuStreamSynchronize", stream)
        assert floats(recv, count) == (3.0,) * count
    flag.value = 0
    for ctx, _send, _recv, stream in ranks:
        cuda.use(ctx)
        cuda.hold(stream, flag_dev)
    all_reduce(nccl, ranks, comms, count)
    cuda.ok("cuCtxSetCurrent", ranks[0][0])
    assert cuda("cuStreamSynchronize", ranks[0][3]) == 702  # waited before the flag


def test_nccl_errors(cuda, nccl, monkeypatch):
    comms = (c_ptr * 2)()
    monkeypatch.setenv("FAKECUDA_NDEV", "2")
    monkeypatch.setenv("FAKENCCL_ERROR", "2")
    assert nccl.ncclCommInitAll(comms, 2, None) == 2
    assert nccl.ncclGetErrorString(2).startswith(b"unhandled system error")
    monkeypatch.delenv("FAKENCCL_ERROR")
    assert nccl.ncclCommInitAll(comms, 2, (ctypes.c_int * 2)(0, 5)) == 4  # no such device
    assert nccl.ncclCommInitAll(comms, 2, None) == 0
    cuda.ok("cuInit", 0)
    cuda.context(0)
    buf = cuda.alloc(64)
    assert nccl.ncclAllReduce(buf, buf, 16, 0, 0, comms[0], None) == 4  # ncclInt8
    assert nccl.ncclAllReduce(buf, buf, 16, 7, 1, comms[0], None) == 4  # ncclProd
    assert nccl.ncclGetErrorString(4).startswith(b"invalid argument")
    assert nccl.ncclGroupEnd() == 5
    for comm in comms:
        assert nccl.ncclCommDestroy(comm) == 0


def test_nccl_topology_dump_echoes_the_topology_files_gpus(cuda, nccl, monkeypatch, tmp_path):
    """NCCL_TOPO_DUMP_FILE: the stand-in writes its "NCCL view" at ncclCommInitAll, taking each
    GPU's link attributes from NCCL_TOPO_FILE where the file names the GPU's bus id (as NCCL keeps
    a file's attributes), else its own (32.0 GT/s PCIe, FAKECUDA_WIDTH)."""
    topo, dump = tmp_path / "topo.xml", tmp_path / "dump.xml"
    topo.write_text('<system version="1"><cpu numaid="0">\n'
                    '<pci busid="0000:01:00.0" class="0x030200" link_speed="16.0 GT/s PCIe" link_width="8"/>\n'
                    '<pci busid="0000:07:00.0" class="0x030200" link_speed="2.5 GT/s PCIe" link_width="1"/>\n'
                    '</cpu></system>\n')
    monkeypatch.setenv("NCCL_TOPO_FILE", str(topo))
    monkeypatch.setenv("NCCL_TOPO_DUMP_FILE", str(dump))
    monkeypatch.setenv("FAKECUDA_WIDTH", "4")
    ranks, comms = nccl_ranks(cuda, nccl, monkeypatch, 2, 16)

    def links():
        import xml.etree.ElementTree as ET
        return {p.get("busid"): (p.get("link_speed"), p.get("link_width"), p.find("gpu").get("rank"))
                for p in ET.parse(dump).getroot().iter("pci")}
    assert links() == {"0000:01:00.0": ("16.0 GT/s PCIe", "8", "0"), "0000:02:00.0": ("32.0 GT/s PCIe", "4", "1")}
    for comm in comms:
        assert nccl.ncclCommDestroy(comm) == 0
    monkeypatch.setenv("FAKENCCL_IGNORE_TOPO", "1")  # as a NCCL that never loaded the file
    comms = (c_ptr * 2)()
    assert nccl.ncclCommInitAll(comms, 2, None) == 0
    assert links()["0000:01:00.0"] == ("32.0 GT/s PCIe", "4", "0")
    for comm in comms:
        assert nccl.ncclCommDestroy(comm) == 0
    dump.unlink()
    monkeypatch.delenv("NCCL_TOPO_DUMP_FILE")
    assert nccl.ncclCommInitAll(comms, 2, None) == 0 and not dump.exists()  # no dump asked: none written
    for comm in comms:
        assert nccl.ncclCommDestroy(comm) == 0


# -- the library directories ------------------------------------------------------------------------

def test_library_directories(fakecuda_libdir, fakecuda_nonccl_libdir, fakecuda_old_libdir):
    assert sorted(os.listdir(fakecuda_libdir)) == ["libcuda.so.1", "libnccl.so.2", "libnvidia-ml.so.1"]
    assert sorted(os.listdir(fakecuda_nonccl_libdir)) == ["libcuda.so.1", "libnvidia-ml.so.1"]
    assert sorted(os.listdir(fakecuda_old_libdir)) == ["libcuda.so.1", "libnvidia-ml.so.1"]


def test_old_driver_lacks_the_newer_symbols(fakecuda_old_libdir, fakecuda_libdir, tmp_path):
    for name in ("cuMemHostGetDevicePointer_v2", "cuGetErrorName"):
        old = ctypes.CDLL(os.path.join(fakecuda_old_libdir, "libcuda.so.1"))
        assert not hasattr(old, name)
        assert hasattr(ctypes.CDLL(os.path.join(fakecuda_libdir, "libcuda.so.1")), name)
    old = ctypes.CDLL(os.path.join(fakecuda_old_libdir, "libcuda.so.1"))
    assert hasattr(old, "cuGetErrorString") and hasattr(old, "cuMemHostAlloc") and hasattr(old, "nvmlInit_v2")
    again = build_fakecuda(str(tmp_path / "again"), nccl=False, old_driver=True)  # the builder itself
    assert not hasattr(ctypes.CDLL(os.path.join(again, "libcuda.so.1")), "cuGetErrorName")
