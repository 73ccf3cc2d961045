/*
 * A stand-in for libcuda.so.1 and libnvidia-ml.so.1 -- NOT a GPU.
 *
 * The unit lane has no NVIDIA hardware, but the in-guest verifier's ctypes code (argument
 * types, call order, stream ordering, event timing, data verification, JSON) must still run
 * somewhere. This library implements the CUDA driver API and NVML entry points the verifier
 * calls. "Device memory" is host RAM (a device pointer is its host address, as with UVA),
 * copies are memcpy, kernels are C functions chosen by name, events are CLOCK_MONOTONIC
 * stamps. Built by tests/conftest.py with gcc (fixtures fakecuda_libdir, fakecuda_nonccl_libdir,
 * fakecuda_old_libdir); tests/fakecuda/fakenccl.c is the matching libnccl.so.2. Never shipped.
 * Single-threaded: no locking (the verifier makes its calls from one thread).
 *
 * DEVICES AND CONTEXTS. FAKECUDA_NDEV devices (default 1, at most 16), ordinal i on bus i+1:
 * "0000:01:00.0", "0000:02:00.0", ... (NVML, one handle per device: "00000000:01:00.0", ...),
 * compute capability 9.0 (attributes 75/76; 33 is the bus number, 19 and 41 -- host mapping,
 * unified addressing -- are 1, the rest 0), FAKECUDA_MEM_MB of memory each (default 81920;
 * cuMemAlloc_v2 beyond it is CUDA_ERROR_OUT_OF_MEMORY).
 * Everything except cuDriverGetVersion and cuGetErrorName/String needs a successful cuInit
 * first (else CUDA_ERROR_NOT_INITIALIZED). cuDevicePrimaryCtxRetain gives one context per
 * device (the same handle each time, reference-counted); allocations, streams, events and
 * modules need a current, retained context (else CUDA_ERROR_INVALID_CONTEXT) and belong to
 * it. When the last reference is released the context is destroyed as CUDA does: its work
 * is drained, its memory, streams, events and modules are freed. Kernels must be launched
 * with their own context current, on a stream of that context; events are recorded on a
 * stream of their own context (else CUDA_ERROR_INVALID_HANDLE). Unknown handles are
 * CUDA_ERROR_INVALID_HANDLE, not a crash; copies, memsets and kernels check their pointers
 * against the allocations (cuMemAlloc_v2 / cuMemHostAlloc; a kernel may touch another device's
 * memory only after cuCtxEnablePeerAccess): a bad pointer passed to a copy or memset is
 * CUDA_ERROR_INVALID_VALUE, one met by a kernel is CUDA_ERROR_ILLEGAL_ADDRESS (700), sticky
 * for that device until its context is destroyed, returned by its later calls.
 *
 * STREAM MODEL. Each stream, and each device's NULL stream (also handles 0x1 and 0x2, the
 * legacy and per-thread default streams), is a FIFO of operations. An operation enqueued on
 * a stream with nothing pending runs at once (copies are memcpy, an event takes its stamp).
 * Launching gpuvfio_spin makes the stream "held": the spin stays at the head until its flag
 * word is non-zero (or its timeout_ns has passed since it reached the head, as the kernel
 * would give up), and later operations queue behind it. Every API call that touches a
 * stream, an event or memory first lets all streams make progress: a head whose flag is now
 * set completes and the queue drains in order, each queued event taking its stamp when it
 * drains, so the time between two events is the queued copies' real memcpy time. Nothing
 * runs in the background: a flag set by the caller is seen at its next call.
 * Waiting while held: cuStreamSynchronize, cuEventSynchronize, cuCtxSynchronize, the
 * synchronous copies and memsets, and (as CUDA does) an async copy whose host side is
 * pageable (not from cuMemHostAlloc, or not PORTABLE and from another context), cuMemFree_v2
 * and cuMemFreeHost of memory a queued operation uses: where the real GPU would wait for a
 * spin whose flag is still 0 (a hang until its timeout), the fake forces that spin to end,
 * drains, and returns CUDA_ERROR_LAUNCH_TIMEOUT (702) -- a verifier that synchronises before
 * releasing its flag is caught. (The free still happens.) cuStreamQuery / cuEventQuery say
 * CUDA_ERROR_NOT_READY (600) while work is pending. Streams created with flags 0 are
 * "blocking": as with CUDA's legacy default stream, work on the NULL stream waits for earlier
 * work on the device's blocking streams and vice versa; CU_STREAM_NON_BLOCKING (1) streams
 * are independent. Streams drain one after the other (in creation order), so two streams held
 * on one flag each time their own copies. cuStreamWaitEvent, cuStreamWaitValue32_v2 (wait
 * until a 32-bit word meets GEQ/EQ/AND/NOR; its address is not checked) and cuLaunchHostFunc
 * queue like anything else (fakenccl uses the last two). cuEventElapsedTime: 600 unless both
 * events were recorded and have completed; 400 for an event created with
 * CU_EVENT_DISABLE_TIMING; a positive time under 1 us reads 0.001 ms (a real clock's tick).
 *
 * KERNELS. cuModuleLoadData takes PTX text: the module has those of gpuvfio_saxpy,
 * gpuvfio_spin, gpuvfio_fill, gpuvfio_check, gpuvfio_chase that the text names (none:
 * CUDA_ERROR_INVALID_IMAGE); cuModuleGetFunction of another name is CUDA_ERROR_NOT_FOUND.
 * cuLaunchKernel takes kernelParams (extra is not supported: CUDA_ERROR_INVALID_VALUE), copies
 * the arguments at launch and runs the kernel on the host when its turn comes:
 *   gpuvfio_saxpy(unsigned n, float a, const float *x, float *y): y[i] = a*x[i] + y[i], i < min(n, threads)
 *   gpuvfio_spin(const volatile unsigned *flag, unsigned long long timeout_ns): holds the stream
 *   gpuvfio_fill(u64 *buf, u64 words, u64 seed): buf[i] = (i * 0x9E3779B97F4A7C15) ^ seed
 *   gpuvfio_check(const u64 *buf, u64 words, u64 seed, unsigned *errors): *errors += mismatches
 *   gpuvfio_chase(const u64 *start, unsigned hops, u64 *sink): p = start; hops x p = *p; *sink = p
 *
 * KNOBS (environment, read when the call is made):
 *   FAKECUDA_NDEV=N        N devices (default 1; max 16), for CUDA and NVML alike
 *   FAKECUDA_NODEV=1       no devices at all (cuInit succeeds, both counts are 0)
 *   FAKECUDA_MIG=1         NVML: MIG mode on (current and pending); CUDA: 0 devices (no instances)
 *   FAKECUDA_VGPU=1        NVML: virtualization mode 2 (VGPU; default 1, pass-through)
 *   FAKECUDA_INIT_ERROR=C  cuInit returns C (e.g. 100 no device, 802 system not ready, 999)
 *   FAKECUDA_NOPEER=1      cuDeviceCanAccessPeer says 0; cuCtxEnablePeerAccess fails (217)
 *   FAKECUDA_CORRUPT=1     each asynchronous device-to-host copy (cuMemcpyDtoHAsync_v2, or
 *                          cuMemcpyAsync from device memory to host memory) flips the byte in the
 *                          middle of its destination
 *   FAKECUDA_P2P_CORRUPT=1 each asynchronous peer copy (cuMemcpyPeerAsync, or a DtoD/cuMemcpyAsync
 *                          between two devices' memory) flips the byte in the middle of its destination
 *                          (the synchronous cuMemcpy*_v2 forms, with which results are read back,
 *                          are never corrupted)
 *   FAKECUDA_ZERO_TIME=1   cuEventElapsedTime reports 0.0 ms
 *   FAKECUDA_MEM_MB=M      memory per device in MiB (default 81920)
 *   FAKECUDA_GEN / FAKECUDA_WIDTH  NVML's current PCIe link (default Gen5 x16; max is 5/16)
 *   FAKENVML_INIT_ERROR=C  nvmlInit_v2 / nvmlInitWithFlags return C (nvmlErrorString has the
 *                          real texts); the other NVML queries then say Uninitialized (1)
 *   FAKENVML_BUSID=ADDR    nvmlDeviceGetHandleByPciBusId_v2 finds only ADDR (the host's GPU);
 *                          without it, the fake's own bus ids and, for old tests, any address
 *   FAKENVML_SCHED=FILE    vGPU scheduler state "policy arr timeslice" (absent: not supported);
 *   FAKENVML_VM_RUNNING=1  setting the scheduler is refused, as while a vGPU VM runs
 * Built with -DFAKECUDA_OLD_DRIVER the library lacks cuMemHostGetDevicePointer_v2 and
 * cuGetErrorName, as an old driver would.
 */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <strings.h>
#include <stdio.h>
#include <time.h>

typedef int CUresult;
typedef uint64_t CUdeviceptr;

enum {
    OK = 0, E_INVALID_VALUE = 1, E_OUT_OF_MEMORY = 2, E_NOT_INITIALIZED = 3, E_INVALID_DEVICE = 101,
    E_INVALID_IMAGE = 200, E_INVALID_CONTEXT = 201, E_PEER_UNSUPPORTED = 217, E_INVALID_HANDLE = 400,
    E_NOT_FOUND = 500, E_NOT_READY = 600, E_ILLEGAL_ADDRESS = 700, E_LAUNCH_TIMEOUT = 702,
    E_PEER_ALREADY = 704, E_PEER_NOT_ENABLED = 705
};

#define MAXDEV 16
#define MIB (1024ULL * 1024ULL)
#define HOST_PORTABLE 0x01u
#define PATTERN 0x9E3779B97F4A7C15ULL

static double now(void) { struct timespec ts; clock_gettime(CLOCK_MONOTONIC, &ts); return ts.tv_sec + ts.tv_nsec / 1e9; }
static long env_long(const char *name, long dflt) { const char *v = getenv(name); return v && *v ? strtol(v, NULL, 0) : dflt; }
static int env_on(const char *name) { return env_long(name, 0) != 0; }

static int nvml_count(void) {
    long n = env_long("FAKECUDA_NDEV", 1);
    if (env_on("FAKECUDA_NODEV") || n < 0) return 0;
    return n > MAXDEV ? MAXDEV : (int)n;
}
static int cuda_count(void) { return env_on("FAKECUDA_MIG") ? 0 : nvml_count(); }

/* -- error names ------------------------------------------------------------------------- */
static const struct { int code; const char *name, *text; } ERRORS[] = {
    {0, "CUDA_SUCCESS", "no error"},
    {1, "CUDA_ERROR_INVALID_VALUE", "invalid argument"},
    {2, "CUDA_ERROR_OUT_OF_MEMORY", "out of memory"},
    {3, "CUDA_ERROR_NOT_INITIALIZED", "initialization error"},
    {4, "CUDA_ERROR_DEINITIALIZED", "driver shutting down"},
    {34, "CUDA_ERROR_STUB_LIBRARY", "CUDA driver is a stub library"},
    {46, "CUDA_ERROR_DEVICE_UNAVAILABLE", "CUDA-capable device(s) is/are busy or unavailable"},
    {100, "CUDA_ERROR_NO_DEVICE", "no CUDA-capable device is detected"},
    {101, "CUDA_ERROR_INVALID_DEVICE", "invalid device ordinal"},
    {200, "CUDA_ERROR_INVALID_IMAGE", "device kernel image is invalid"},
    {201, "CUDA_ERROR_INVALID_CONTEXT", "invalid device context"},
    {217, "CUDA_ERROR_PEER_ACCESS_UNSUPPORTED", "peer access is not supported between these two devices"},
    {400, "CUDA_ERROR_INVALID_HANDLE", "invalid resource handle"},
    {500, "CUDA_ERROR_NOT_FOUND", "named symbol not found"},
    {600, "CUDA_ERROR_NOT_READY", "device not ready"},
    {700, "CUDA_ERROR_ILLEGAL_ADDRESS", "an illegal memory access was encountered"},
    {702, "CUDA_ERROR_LAUNCH_TIMEOUT", "the launch timed out and was terminated"},
    {704, "CUDA_ERROR_PEER_ACCESS_ALREADY_ENABLED", "peer access is already enabled"},
    {705, "CUDA_ERROR_PEER_ACCESS_NOT_ENABLED", "peer access has not been enabled"},
    {802, "CUDA_ERROR_SYSTEM_NOT_READY", "system not yet initialized"},
    {803, "CUDA_ERROR_SYSTEM_DRIVER_MISMATCH", "system has unsupported display driver / cuda driver combination"},
    {999, "CUDA_ERROR_UNKNOWN", "unknown error"},
};
static int error_index(CUresult rc) {
    for (size_t i = 0; i < sizeof ERRORS / sizeof ERRORS[0]; i++) if (ERRORS[i].code == rc) return (int)i;
    return -1;
}
#ifndef FAKECUDA_OLD_DRIVER
CUresult cuGetErrorName(CUresult rc, const char **s) {
    int i = error_index(rc);
    if (!s) return E_INVALID_VALUE;
    *s = i < 0 ? NULL : ERRORS[i].name;
    return i < 0 ? E_INVALID_VALUE : OK;
}
#endif
CUresult cuGetErrorString(CUresult rc, const char **s) {
    int i = error_index(rc);
    if (!s) return E_INVALID_VALUE;
    *s = i < 0 ? NULL : ERRORS[i].text;
    return i < 0 ? E_INVALID_VALUE : OK;
}

/* -- state ---------------------------------------------------------------------------------- */
typedef struct alloc {
    struct alloc *next;
    uintptr_t base; size_t size; int dev; int host; unsigned flags;
} alloc_t;

typedef struct event {
    struct event *next;
    int dev, destroyed, pending; unsigned flags;
    uint64_t rec_seq, done_seq; int rec_stream; double t;
} event_t;

enum { K_SAXPY, K_SPIN, K_FILL, K_CHECK, K_CHASE, NKERN };
static const char *const KERNELS[NKERN] = {"gpuvfio_saxpy", "gpuvfio_spin", "gpuvfio_fill", "gpuvfio_check", "gpuvfio_chase"};

enum { OP_COPY, OP_SET8, OP_SET32, OP_KERNEL, OP_EVENT, OP_WAIT_EVENT, OP_WAIT_VALUE, OP_HOST_FN };
enum { FLIP_NONE, FLIP_D2H, FLIP_P2P };

typedef struct op {
    struct op *next;
    uint64_t seq;
    int kind, kernel, flip, forced, started;
    uintptr_t dst, src; size_t n;          /* copy / memset; memset value in u */
    uint64_t a[4]; float f; unsigned u;    /* kernel arguments, wait value */
    double deadline;                       /* spin */
    event_t *ev;                           /* record */
    int dep_stream; uint64_t dep_seq;      /* wait for an event */
    void (*fn)(void *); void *arg;         /* host function */
} op_t;

typedef struct stream {
    struct stream *next;
    int id, dev, blocking, is_null, destroyed;
    op_t *head, *tail;
} stream_t;

typedef struct module module_t;
typedef struct { module_t *m; int kind; } func_t;
struct module { module_t *next; int dev; unsigned mask; func_t funcs[NKERN]; };

typedef struct { int dev, refs; unsigned peers; } ctx_t;

static int g_init;
static ctx_t g_ctx[MAXDEV];
static __thread ctx_t *g_current;
static int g_sticky[MAXDEV];
static unsigned long long g_used[MAXDEV];
static alloc_t *g_allocs, *g_last_hit;
static event_t *g_events;
static stream_t *g_streams, *g_null[MAXDEV];
static module_t *g_modules;
static uint64_t g_seq;
static int g_stream_ids;

static int valid_dev(int dev) { return dev >= 0 && dev < cuda_count(); }
static int is_ctx(const void *p) {
    return p && (const char *)p >= (const char *)g_ctx && (const char *)p < (const char *)(g_ctx + MAXDEV)
           && ((const char *)p - (const char *)g_ctx) % sizeof(ctx_t) == 0;
}

/* The current context, or why there is none to use. */
static CUresult current(ctx_t **out) {
    if (!g_init) return E_NOT_INITIALIZED;
    if (!g_current || g_current->refs <= 0) return E_INVALID_CONTEXT;
    if (g_sticky[g_current->dev]) return g_sticky[g_current->dev];
    *out = g_current;
    return OK;
}

/* -- memory registry ------------------------------------------------------------------------- */
static alloc_t *find_alloc(uintptr_t p, size_t n) {
    if (g_last_hit && p >= g_last_hit->base && n <= g_last_hit->size && p - g_last_hit->base <= g_last_hit->size - n)
        return g_last_hit;
    for (alloc_t *a = g_allocs; a; a = a->next)
        if (p >= a->base && n <= a->size && p - a->base <= a->size - n) return g_last_hit = a;
    return NULL;
}
/* Memory outside the allocations, or pinned by another context without PORTABLE: for a copy
 * on device `dev` that is pageable host memory (the copy waits for its stream). */
static int pageable_for(uintptr_t p, size_t n, int dev) {
    alloc_t *a = find_alloc(p, n);
    return !a || (a->host && !(a->flags & HOST_PORTABLE) && a->dev != dev);
}
/* What a kernel running on `dev` may touch. */
static int kernel_ok(uintptr_t p, size_t n, int dev) {
    alloc_t *a = find_alloc(p, n);
    if (!a) return 0;
    if (a->host) return (a->flags & HOST_PORTABLE) || a->dev == dev;
    return a->dev == dev || (g_ctx[dev].peers >> a->dev & 1u);
}

/* -- streams ------------------------------------------------------------------------------- */
static stream_t *new_stream(int dev, int blocking, int is_null) {
    stream_t *s = calloc(1, sizeof *s), **tail = &g_streams;
    if (!s) return NULL;
    s->id = ++g_stream_ids; s->dev = dev; s->blocking = blocking; s->is_null = is_null;
    while (*tail) tail = &(*tail)->next;
    *tail = s;
    return s;
}
static stream_t *stream_by_id(int id) {
    for (stream_t *s = g_streams; s; s = s->next) if (s->id == id) return s;
    return NULL;
}
/* A handle as the caller passes it: NULL, 0x1 (legacy) and 0x2 (per-thread) are the current
 * context's NULL stream. */
static CUresult lookup_stream(void *h, stream_t **out) {
    ctx_t *c; CUresult rc;
    if (!h || h == (void *)0x1 || h == (void *)0x2) {
        if ((rc = current(&c))) return rc;
        if (!g_null[c->dev] && !(g_null[c->dev] = new_stream(c->dev, 1, 1))) return E_OUT_OF_MEMORY;
        *out = g_null[c->dev];
        return OK;
    }
    if (!g_init) return E_NOT_INITIALIZED;
    for (stream_t *s = g_streams; s; s = s->next)
        if (s == h && !s->destroyed) { *out = s; return OK; }
    return E_INVALID_HANDLE;
}
static int stream_pending_before(const stream_t *s, uint64_t seq) { return s && s->head && s->head->seq < seq; }

/* Does the head operation `o` of `s` wait for another stream (legacy default-stream sync,
 * cuStreamWaitEvent)? */
static int waits_for_other(const stream_t *s, const op_t *o) {
    if (s->is_null) {
        for (const stream_t *x = g_streams; x; x = x->next)
            if (x != s && x->dev == s->dev && x->blocking && !x->is_null && stream_pending_before(x, o->seq)) return 1;
    } else if (s->blocking && stream_pending_before(g_null[s->dev], o->seq)) {
        return 1;
    }
    if (o->kind == OP_WAIT_EVENT) {
        const stream_t *x = stream_by_id(o->dep_stream);
        if (x && x->head && x->head->seq <= o->dep_seq) return 1;
    }
    return 0;
}
static int value_met(const op_t *o) {
    uint32_t v = *(volatile uint32_t *)o->dst;
    switch (o->u >> 28) {
    case 1: return v == o->a[0];
    case 2: return (v & o->a[0]) != 0;
    case 3: return ~(v | (uint32_t)o->a[0]) != 0;
    default: return v >= o->a[0];
    }
}
/* Does the head operation wait for something of its own (a spin's flag, a 32-bit value)? */
static int waits_for_itself(op_t *o) {
    if (o->forced) return 0;
    if (o->kind == OP_KERNEL && o->kernel == K_SPIN) {
        double t = now();
        if (!o->started) {
            uint64_t timeout = o->a[1];
            o->started = 1;
            o->deadline = timeout > (uint64_t)1e18 ? 1e300 : t + timeout / 1e9;
        }
        if (!kernel_ok(o->a[0], 4, o->u)) return 0;  /* faults when run */
        return *(volatile uint32_t *)(uintptr_t)o->a[0] == 0 && t < o->deadline;
    }
    if (o->kind == OP_WAIT_VALUE) return !value_met(o);
    return 0;
}
static int blocked(const stream_t *s, op_t *o) {
    return !o->forced && (waits_for_other(s, o) || waits_for_itself(o));
}

static void free_event(event_t *e) {
    for (event_t **p = &g_events; *p; p = &(*p)->next) if (*p == e) { *p = e->next; break; }
    free(e);
}

/* Run one operation; a kernel that meets a bad pointer makes its device's error sticky. */
static void run_kernel(op_t *o, int dev) {
    uint64_t *a = o->a;
    switch (o->kernel) {
    case K_SAXPY: {
        uint64_t n = a[0] < a[3] ? a[0] : a[3];  /* a[3]: threads in the grid */
        float *x = (float *)(uintptr_t)a[1], *y = (float *)(uintptr_t)a[2];
        if (n && (!kernel_ok(a[1], n * 4, dev) || !kernel_ok(a[2], n * 4, dev))) { g_sticky[dev] = E_ILLEGAL_ADDRESS; return; }
        for (uint64_t i = 0; i < n; i++) y[i] = o->f * x[i] + y[i];
        return;
    }
    case K_SPIN:
        if (!kernel_ok(a[0], 4, dev)) g_sticky[dev] = E_ILLEGAL_ADDRESS;
        return;
    case K_FILL: {
        uint64_t *buf = (uint64_t *)(uintptr_t)a[0];
        if (a[1] && (a[1] > SIZE_MAX / 8 || !kernel_ok(a[0], a[1] * 8, dev))) { g_sticky[dev] = E_ILLEGAL_ADDRESS; return; }
        for (uint64_t i = 0; i < a[1]; i++) buf[i] = (i * PATTERN) ^ a[2];
        return;
    }
    case K_CHECK: {
        const uint64_t *buf = (const uint64_t *)(uintptr_t)a[0];
        unsigned bad = 0;
        if ((a[1] && (a[1] > SIZE_MAX / 8 || !kernel_ok(a[0], a[1] * 8, dev))) || !kernel_ok(a[3], 4, dev)) {
            g_sticky[dev] = E_ILLEGAL_ADDRESS; return;
        }
        for (uint64_t i = 0; i < a[1]; i++) bad += buf[i] != ((i * PATTERN) ^ a[2]);
        *(unsigned *)(uintptr_t)a[3] += bad;
        return;
    }
    case K_CHASE: {
        uint64_t p = a[0];
        if (!kernel_ok(a[2], 8, dev)) { g_sticky[dev] = E_ILLEGAL_ADDRESS; return; }
        for (unsigned i = 0; i < o->u; i++) {
            if (!kernel_ok(p, 8, dev)) { g_sticky[dev] = E_ILLEGAL_ADDRESS; return; }
            p = *(volatile uint64_t *)(uintptr_t)p;
        }
        *(uint64_t *)(uintptr_t)a[2] = p;
        return;
    }
    }
}
static void run(stream_t *s, op_t *o) {
    switch (o->kind) {
    case OP_COPY:
        memmove((void *)o->dst, (const void *)o->src, o->n);
        if (o->flip != FLIP_NONE && o->n) ((unsigned char *)o->dst)[o->n / 2] ^= 0xff;
        break;
    case OP_SET8: memset((void *)o->dst, (int)(o->u & 0xff), o->n); break;
    case OP_SET32: for (size_t i = 0; i < o->n; i++) ((uint32_t *)o->dst)[i] = o->u; break;
    case OP_KERNEL: run_kernel(o, s->dev); break;
    case OP_EVENT:
        o->ev->pending--;
        if (o->seq == o->ev->rec_seq) { o->ev->t = now(); o->ev->done_seq = o->seq; }
        if (o->ev->destroyed && !o->ev->pending) free_event(o->ev);
        break;
    case OP_HOST_FN: o->fn(o->arg); break;
    default: break;  /* waits: nothing to do once unblocked */
    }
}

/* Let every stream run what it can, until nothing moves. */
static void progress(void) {
    int moved;
    do {
        moved = 0;
        for (stream_t *s = g_streams; s; s = s->next) {
            while (s->head && !blocked(s, s->head)) {
                op_t *o = s->head;
                run(s, o);
                if (!(s->head = o->next)) s->tail = NULL;
                free(o);
                moved = 1;
            }
        }
    } while (moved);
    for (stream_t **p = &g_streams; *p;) {
        stream_t *s = *p;
        if (s->destroyed && !s->head) { *p = s->next; free(s); } else p = &s->next;
    }
}

/* Queue (and, if nothing is in the way, run) an operation. A fault it meets is reported by
 * later calls, as CUDA reports asynchronous errors. */
static CUresult enqueue(stream_t *s, op_t *o) {
    if (g_sticky[s->dev]) { free(o); return g_sticky[s->dev]; }
    o->seq = ++g_seq;
    if (s->tail) s->tail->next = o; else s->head = o;
    s->tail = o;
    progress();
    return OK;
}

/* Waiting: drain until done(arg); where a spin (or a 32-bit wait) with its condition unmet
 * stands in the way, the real GPU would hang: end it, and report CUDA_ERROR_LAUNCH_TIMEOUT. */
typedef int (*done_fn)(const void *arg);
static op_t *blocker(const stream_t *focus, int dev) {
    op_t *best = NULL;
    if (focus && focus->head && waits_for_itself(focus->head)) return focus->head;
    for (int pass = 0; pass < 3 && !best; pass++)
        for (stream_t *s = g_streams; s; s = s->next) {
            if (!s->head || (pass == 0 && s->dev != dev) || (pass < 2 && !waits_for_itself(s->head))) continue;
            if (!best || s->head->seq < best->seq) best = s->head;
        }
    return best;
}
static CUresult wait_for(done_fn done, const void *arg, const stream_t *focus, int dev) {
    CUresult rc = OK;
    for (;;) {
        op_t *o;
        progress();
        if (done(arg) || !(o = blocker(focus, dev))) return rc;
        o->forced = 1;
        rc = E_LAUNCH_TIMEOUT;
    }
}
static int stream_idle(const void *arg) {
    int id = *(const int *)arg;
    const stream_t *s = stream_by_id(id);
    return !s || !s->head;
}
static int dev_idle(const void *arg) {
    int dev = *(const int *)arg;
    for (const stream_t *s = g_streams; s; s = s->next) if (s->dev == dev && s->head) return 0;
    return 1;
}
static int event_done(const void *arg) {
    const event_t *e = arg;
    return e->rec_seq == 0 || e->done_seq == e->rec_seq;
}
static int overlaps(uintptr_t a, size_t an, uintptr_t b, size_t bn) { return a < b + bn && b < a + an; }
static int touches(const op_t *o, uintptr_t base, size_t size) {
    switch (o->kind) {
    case OP_COPY: return overlaps(o->dst, o->n, base, size) || overlaps(o->src, o->n, base, size);
    case OP_SET8: return overlaps(o->dst, o->n, base, size);
    case OP_SET32: return overlaps(o->dst, o->n * 4, base, size);
    case OP_WAIT_VALUE: return overlaps(o->dst, 4, base, size);
    case OP_HOST_FN: return 1;
    case OP_KERNEL:
        switch (o->kernel) {
        case K_SAXPY: return overlaps(o->a[1], o->a[0] * 4, base, size) || overlaps(o->a[2], o->a[0] * 4, base, size);
        case K_SPIN: return overlaps(o->a[0], 4, base, size);
        case K_FILL: return overlaps(o->a[0], o->a[1] * 8, base, size);
        case K_CHECK: return overlaps(o->a[0], o->a[1] * 8, base, size) || overlaps(o->a[3], 4, base, size);
        default: return 1;  /* a chase may go anywhere */
        }
    default: return 0;
    }
}
static int range_idle(const void *arg) {
    const alloc_t *a = arg;
    for (const stream_t *s = g_streams; s; s = s->next)
        for (const op_t *o = s->head; o; o = o->next) if (touches(o, a->base, a->size)) return 0;
    return 1;
}
/* The synchronous behaviour of a call: wait until the stream has nothing pending. */
static CUresult finish(stream_t *s, CUresult rc) {
    int id = s->id, dev = s->dev;
    CUresult waited;
    if (rc) return rc;
    waited = wait_for(stream_idle, &id, s, dev);
    return g_sticky[dev] ? g_sticky[dev] : waited;
}

static op_t *new_op(int kind) { op_t *o = calloc(1, sizeof *o); if (o) o->kind = kind; return o; }

/* -- initialisation, devices --------------------------------------------------------------- */
CUresult cuInit(unsigned int flags) {
    long err = env_long("FAKECUDA_INIT_ERROR", 0);
    if (flags) return E_INVALID_VALUE;
    if (err) return (CUresult)err;
    g_init = 1;
    return OK;
}
CUresult cuDriverGetVersion(int *v) { if (!v) return E_INVALID_VALUE; *v = 12040; return OK; }
CUresult cuDeviceGetCount(int *n) { if (!g_init) return E_NOT_INITIALIZED; if (!n) return E_INVALID_VALUE; *n = cuda_count(); return OK; }
CUresult cuDeviceGet(int *dev, int ordinal) {
    if (!g_init) return E_NOT_INITIALIZED;
    if (!dev) return E_INVALID_VALUE;
    if (!valid_dev(ordinal)) return E_INVALID_DEVICE;
    *dev = ordinal;
    return OK;
}
#define DEVICE_CALL(dev) do { if (!g_init) return E_NOT_INITIALIZED; if (!valid_dev(dev)) return E_INVALID_DEVICE; } while (0)
CUresult cuDeviceGetName(char *name, int len, int dev) {
    DEVICE_CALL(dev);
    if (!name || len <= 0) return E_INVALID_VALUE;
    snprintf(name, (size_t)len, "FAKE CUDA (not a GPU)");
    return OK;
}
CUresult cuDeviceGetPCIBusId(char *bus, int len, int dev) {
    DEVICE_CALL(dev);
    if (!bus || len <= 0) return E_INVALID_VALUE;
    snprintf(bus, (size_t)len, "0000:%02x:00.0", dev + 1);
    return OK;
}
static unsigned long long mem_bytes(void) { long mb = env_long("FAKECUDA_MEM_MB", 81920); return (unsigned long long)(mb > 0 ? mb : 1) * MIB; }
CUresult cuDeviceTotalMem_v2(size_t *bytes, int dev) { DEVICE_CALL(dev); if (!bytes) return E_INVALID_VALUE; *bytes = mem_bytes(); return OK; }
CUresult cuDeviceGetAttribute(int *v, int attrib, int dev) {
    DEVICE_CALL(dev);
    if (!v || attrib <= 0 || attrib > 200) return E_INVALID_VALUE;
    switch (attrib) {
    case 75: *v = 9; break;        /* COMPUTE_CAPABILITY_MAJOR */
    case 33: *v = dev + 1; break;  /* PCI_BUS_ID, as cuDeviceGetPCIBusId says */
    case 19: case 41: *v = 1; break;  /* CAN_MAP_HOST_MEMORY, UNIFIED_ADDRESSING */
    default: *v = 0;               /* 76 COMPUTE_CAPABILITY_MINOR, 34 PCI_DEVICE_ID, 50 PCI_DOMAIN_ID, the rest */
    }
    return OK;
}
CUresult cuDeviceCanAccessPeer(int *can, int dev, int peer) {
    DEVICE_CALL(dev);
    if (!valid_dev(peer)) return E_INVALID_DEVICE;
    if (!can) return E_INVALID_VALUE;
    *can = dev != peer && !env_on("FAKECUDA_NOPEER");
    return OK;
}

/* -- contexts -------------------------------------------------------------------------------- */
static CUresult free_alloc(alloc_t *a);
static void destroy_context(int dev) {
    int d = dev;
    wait_for(dev_idle, &d, NULL, dev);  /* CUDA drains a context's work before destroying it */
    for (stream_t *s = g_streams; s; s = s->next) if (s->dev == dev && !s->is_null) s->destroyed = 1;
    for (event_t *e = g_events, *next; e; e = next) {
        next = e->next;
        if (e->dev == dev) { if (e->pending) e->destroyed = 1; else free_event(e); }
    }
    for (module_t **p = &g_modules; *p;) {
        module_t *m = *p;
        if (m->dev == dev) { *p = m->next; free(m); } else p = &m->next;
    }
    for (alloc_t *a = g_allocs, *next; a; a = next) { next = a->next; if (a->dev == dev) free_alloc(a); }
    for (int i = 0; i < MAXDEV; i++) g_ctx[i].peers &= ~(1u << dev);
    g_ctx[dev].peers = 0;
    g_sticky[dev] = 0;
    progress();
}
CUresult cuDevicePrimaryCtxRetain(void **ctx, int dev) {
    DEVICE_CALL(dev);
    if (!ctx) return E_INVALID_VALUE;
    g_ctx[dev].dev = dev;
    g_ctx[dev].refs++;
    *ctx = &g_ctx[dev];
    return OK;
}
CUresult cuDevicePrimaryCtxRelease_v2(int dev) {
    DEVICE_CALL(dev);
    if (g_ctx[dev].refs <= 0) return E_INVALID_CONTEXT;
    if (--g_ctx[dev].refs == 0) destroy_context(dev);
    return OK;
}
CUresult cuCtxSetCurrent(void *ctx) {
    if (!g_init) return E_NOT_INITIALIZED;
    if (ctx && (!is_ctx(ctx) || ((ctx_t *)ctx)->refs <= 0)) return E_INVALID_CONTEXT;
    g_current = ctx;
    return OK;
}
CUresult cuCtxGetCurrent(void **ctx) { if (!g_init) return E_NOT_INITIALIZED; if (!ctx) return E_INVALID_VALUE; *ctx = g_current; return OK; }
CUresult cuCtxGetDevice(int *dev) {
    ctx_t *c; CUresult rc = current(&c);
    if (rc) return rc;
    if (!dev) return E_INVALID_VALUE;
    *dev = c->dev;
    return OK;
}
CUresult cuCtxSynchronize(void) {
    ctx_t *c; CUresult rc = current(&c), waited;
    int dev;
    if (rc) return rc;
    dev = c->dev;
    waited = wait_for(dev_idle, &dev, NULL, dev);
    return g_sticky[dev] ? g_sticky[dev] : waited;
}
CUresult cuCtxEnablePeerAccess(void *peer, unsigned int flags) {
    ctx_t *c, *p = peer; CUresult rc = current(&c);
    if (rc) return rc;
    if (flags) return E_INVALID_VALUE;
    if (!is_ctx(peer) || p->refs <= 0) return E_INVALID_CONTEXT;
    if (p == c) return E_INVALID_VALUE;
    if (env_on("FAKECUDA_NOPEER")) return E_PEER_UNSUPPORTED;
    if (c->peers >> p->dev & 1u) return E_PEER_ALREADY;
    c->peers |= 1u << p->dev;
    return OK;
}
CUresult cuCtxDisablePeerAccess(void *peer) {
    ctx_t *c, *p = peer; CUresult rc = current(&c);
    if (rc) return rc;
    if (!is_ctx(peer)) return E_INVALID_CONTEXT;
    if (!(c->peers >> p->dev & 1u)) return E_PEER_NOT_ENABLED;
    c->peers &= ~(1u << p->dev);
    return OK;
}

/* -- memory ---------------------------------------------------------------------------------- */
static CUresult add_alloc(void **out, size_t n, int dev, int host, unsigned flags) {
    alloc_t *a = calloc(1, sizeof *a);
    void *p = NULL;
    if (!a || posix_memalign(&p, host ? 4096 : 256, n)) { free(a); return E_OUT_OF_MEMORY; }
    a->base = (uintptr_t)p; a->size = n; a->dev = dev; a->host = host; a->flags = flags;
    a->next = g_allocs; g_allocs = a;
    *out = p;
    return OK;
}
/* Free once no queued operation uses it (waiting as CUDA's implicit synchronisation does). */
static CUresult free_alloc(alloc_t *a) {
    CUresult rc = wait_for(range_idle, a, NULL, a->dev);
    for (alloc_t **p = &g_allocs; *p; p = &(*p)->next) if (*p == a) { *p = a->next; break; }
    if (g_last_hit == a) g_last_hit = NULL;
    if (!a->host) g_used[a->dev] -= a->size;
    free((void *)a->base);
    free(a);
    return rc;
}
static alloc_t *alloc_at(uintptr_t base, int host) {
    for (alloc_t *a = g_allocs; a; a = a->next) if (a->base == base && a->host == host) return a;
    return NULL;
}
CUresult cuMemAlloc_v2(CUdeviceptr *d, size_t n) {
    ctx_t *c; CUresult rc = current(&c);
    void *p;
    if (rc) return rc;
    if (!d || !n) return E_INVALID_VALUE;
    if (g_used[c->dev] > mem_bytes() || n > mem_bytes() - g_used[c->dev]) return E_OUT_OF_MEMORY;
    if ((rc = add_alloc(&p, n, c->dev, 0, 0))) return rc;
    g_used[c->dev] += n;
    *d = (CUdeviceptr)(uintptr_t)p;
    return OK;
}
CUresult cuMemFree_v2(CUdeviceptr d) {
    alloc_t *a;
    if (!g_init) return E_NOT_INITIALIZED;
    if (!(a = alloc_at((uintptr_t)d, 0))) return E_INVALID_VALUE;
    return free_alloc(a);
}
CUresult cuMemGetInfo_v2(size_t *free_bytes, size_t *total) {
    ctx_t *c; CUresult rc = current(&c);
    if (rc) return rc;
    if (!free_bytes || !total) return E_INVALID_VALUE;
    *total = mem_bytes(); *free_bytes = g_used[c->dev] > mem_bytes() ? 0 : mem_bytes() - g_used[c->dev];
    return OK;
}
CUresult cuMemHostAlloc(void **p, size_t n, unsigned int flags) {
    ctx_t *c; CUresult rc = current(&c);
    if (rc) return rc;
    if (!p || !n || (flags & ~7u)) return E_INVALID_VALUE;  /* PORTABLE | DEVICEMAP | WRITECOMBINED */
    return add_alloc(p, n, c->dev, 1, flags);
}
CUresult cuMemAllocHost_v2(void **p, size_t n) { return cuMemHostAlloc(p, n, 0); }
CUresult cuMemFreeHost(void *p) {
    alloc_t *a;
    if (!g_init) return E_NOT_INITIALIZED;
    if (!(a = alloc_at((uintptr_t)p, 1))) return E_INVALID_VALUE;
    return free_alloc(a);
}
#ifndef FAKECUDA_OLD_DRIVER
CUresult cuMemHostGetDevicePointer_v2(CUdeviceptr *d, void *host, unsigned int flags) {
    ctx_t *c; CUresult rc = current(&c);
    alloc_t *a;
    if (rc) return rc;
    if (!d || flags) return E_INVALID_VALUE;
    if (!(a = find_alloc((uintptr_t)host, 1)) || !a->host) return E_INVALID_VALUE;
    *d = (CUdeviceptr)(uintptr_t)host;  /* unified addressing: the same address */
    return OK;
}
#endif

/* Copies. Device-side pointers must lie in an allocation; a host side outside cuMemHostAlloc
 * memory is pageable, and the call then waits for the stream as CUDA's does. */
enum { SIDE_DEV, SIDE_HOST, SIDE_ANY };
static CUresult copy(uintptr_t dst, int dst_side, uintptr_t src, int src_side, size_t n, void *hstream, int peer,
                     int may_flip) {
    stream_t *s; CUresult rc;
    alloc_t *da, *sa;
    int pageable;
    op_t *o;
    if ((rc = lookup_stream(hstream, &s))) return rc;
    if (g_sticky[s->dev]) return g_sticky[s->dev];
    if (!n) return OK;
    da = find_alloc(dst, n); sa = find_alloc(src, n);
    if ((dst_side == SIDE_DEV && !da) || (src_side == SIDE_DEV && !sa) || !dst || !src) return E_INVALID_VALUE;
    pageable = (dst_side != SIDE_DEV && pageable_for(dst, n, s->dev)) || (src_side != SIDE_DEV && pageable_for(src, n, s->dev));
    if (!(o = new_op(OP_COPY))) return E_OUT_OF_MEMORY;
    o->dst = dst; o->src = src; o->n = n;
    if (!may_flip)
        o->flip = FLIP_NONE;  /* the synchronous forms read results back: always exact */
    else if ((peer || (da && sa && !da->host && !sa->host && da->dev != sa->dev)) && env_on("FAKECUDA_P2P_CORRUPT"))
        o->flip = FLIP_P2P;
    else if ((dst_side == SIDE_HOST || (dst_side == SIDE_ANY && (!da || da->host) && sa && !sa->host))
             && env_on("FAKECUDA_CORRUPT"))
        o->flip = FLIP_D2H;
    rc = enqueue(s, o);
    return pageable ? finish(s, rc) : rc;
}
CUresult cuMemcpyHtoDAsync_v2(CUdeviceptr d, const void *h, size_t n, void *st) { return copy((uintptr_t)d, SIDE_DEV, (uintptr_t)h, SIDE_HOST, n, st, 0, 1); }
CUresult cuMemcpyDtoHAsync_v2(void *h, CUdeviceptr d, size_t n, void *st) { return copy((uintptr_t)h, SIDE_HOST, (uintptr_t)d, SIDE_DEV, n, st, 0, 1); }
CUresult cuMemcpyDtoDAsync_v2(CUdeviceptr d, CUdeviceptr s, size_t n, void *st) { return copy((uintptr_t)d, SIDE_DEV, (uintptr_t)s, SIDE_DEV, n, st, 0, 1); }
CUresult cuMemcpyAsync(CUdeviceptr d, CUdeviceptr s, size_t n, void *st) { return copy((uintptr_t)d, SIDE_ANY, (uintptr_t)s, SIDE_ANY, n, st, 0, 1); }
CUresult cuMemcpyPeerAsync(CUdeviceptr d, void *dctx, CUdeviceptr s, void *sctx, size_t n, void *st) {
    if (!g_init) return E_NOT_INITIALIZED;
    if (!is_ctx(dctx) || !is_ctx(sctx) || ((ctx_t *)dctx)->refs <= 0 || ((ctx_t *)sctx)->refs <= 0) return E_INVALID_CONTEXT;
    return copy((uintptr_t)d, SIDE_DEV, (uintptr_t)s, SIDE_DEV, n, st, 1, 1);
}
/* The synchronous (legacy default stream) forms. */
static CUresult sync_copy(uintptr_t dst, int dst_side, uintptr_t src, int src_side, size_t n) {
    stream_t *s; CUresult rc = lookup_stream(NULL, &s);
    return rc ? rc : finish(s, copy(dst, dst_side, src, src_side, n, NULL, 0, 0));
}
CUresult cuMemcpyHtoD_v2(CUdeviceptr d, const void *h, size_t n) { return sync_copy((uintptr_t)d, SIDE_DEV, (uintptr_t)h, SIDE_HOST, n); }
CUresult cuMemcpyDtoH_v2(void *h, CUdeviceptr d, size_t n) { return sync_copy((uintptr_t)h, SIDE_HOST, (uintptr_t)d, SIDE_DEV, n); }
CUresult cuMemcpyDtoD_v2(CUdeviceptr d, CUdeviceptr s, size_t n) { return sync_copy((uintptr_t)d, SIDE_DEV, (uintptr_t)s, SIDE_DEV, n); }
CUresult cuMemcpy(CUdeviceptr d, CUdeviceptr s, size_t n) { return sync_copy((uintptr_t)d, SIDE_ANY, (uintptr_t)s, SIDE_ANY, n); }

static CUresult memset_(CUdeviceptr d, unsigned value, size_t count, int width, void *hstream) {
    stream_t *s; CUresult rc;
    op_t *o;
    if ((rc = lookup_stream(hstream, &s))) return rc;
    if (g_sticky[s->dev]) return g_sticky[s->dev];
    if (!count) return OK;
    if (count > SIZE_MAX / (size_t)width || !find_alloc((uintptr_t)d, count * width) || (d % (CUdeviceptr)width))
        return E_INVALID_VALUE;
    if (!(o = new_op(width == 1 ? OP_SET8 : OP_SET32))) return E_OUT_OF_MEMORY;
    o->dst = (uintptr_t)d; o->n = count; o->u = value;
    return enqueue(s, o);
}
CUresult cuMemsetD8Async(CUdeviceptr d, unsigned char v, size_t n, void *st) { return memset_(d, v, n, 1, st); }
CUresult cuMemsetD32Async(CUdeviceptr d, unsigned int v, size_t n, void *st) { return memset_(d, v, n, 4, st); }
CUresult cuMemsetD8_v2(CUdeviceptr d, unsigned char v, size_t n) {
    stream_t *s; CUresult rc = lookup_stream(NULL, &s);
    return rc ? rc : finish(s, memset_(d, v, n, 1, NULL));
}
CUresult cuMemsetD32_v2(CUdeviceptr d, unsigned int v, size_t n) {
    stream_t *s; CUresult rc = lookup_stream(NULL, &s);
    return rc ? rc : finish(s, memset_(d, v, n, 4, NULL));
}

/* -- streams and events ------------------------------------------------------------------- */
CUresult cuStreamCreate(void **out, unsigned int flags) {
    ctx_t *c; CUresult rc = current(&c);
    stream_t *s;
    if (rc) return rc;
    if (!out || (flags & ~1u)) return E_INVALID_VALUE;
    if (!(s = new_stream(c->dev, !(flags & 1u), 0))) return E_OUT_OF_MEMORY;
    *out = s;
    return OK;
}
CUresult cuStreamDestroy_v2(void *h) {
    stream_t *s; CUresult rc;
    if (!h || h == (void *)0x1 || h == (void *)0x2) return g_init ? E_INVALID_HANDLE : E_NOT_INITIALIZED;
    if ((rc = lookup_stream(h, &s))) return rc;
    s->destroyed = 1;  /* its work still completes, as in CUDA; freed once drained */
    progress();
    return OK;
}
CUresult cuStreamSynchronize(void *h) {
    stream_t *s; CUresult rc = lookup_stream(h, &s);
    return rc ? rc : finish(s, OK);
}
CUresult cuStreamQuery(void *h) {
    stream_t *s; CUresult rc = lookup_stream(h, &s);
    if (rc) return rc;
    progress();
    return g_sticky[s->dev] ? g_sticky[s->dev] : s->head ? E_NOT_READY : OK;
}
static event_t *lookup_event(void *h) {
    for (event_t *e = g_events; e; e = e->next) if (e == h && !e->destroyed) return e;
    return NULL;
}
CUresult cuStreamWaitEvent(void *h, void *ev, unsigned int flags) {
    stream_t *s; event_t *e; CUresult rc = lookup_stream(h, &s);
    op_t *o;
    if (rc) return rc;
    if (!(e = lookup_event(ev))) return E_INVALID_HANDLE;
    if (flags) return E_INVALID_VALUE;
    if (!e->rec_seq) { progress(); return OK; }  /* never recorded: nothing to wait for */
    if (!(o = new_op(OP_WAIT_EVENT))) return E_OUT_OF_MEMORY;
    o->dep_stream = e->rec_stream; o->dep_seq = e->rec_seq;
    return enqueue(s, o);
}
CUresult cuStreamWaitValue32_v2(void *h, CUdeviceptr addr, uint32_t value, unsigned int flags) {
    stream_t *s; CUresult rc = lookup_stream(h, &s);
    op_t *o;
    if (rc) return rc;
    if (!addr || (addr & 3) || (flags & 0xf) > 3) return E_INVALID_VALUE;
    if (!(o = new_op(OP_WAIT_VALUE))) return E_OUT_OF_MEMORY;
    o->dst = (uintptr_t)addr; o->a[0] = value; o->u = (flags & 0xfu) << 28;
    return enqueue(s, o);
}
CUresult cuStreamWaitValue32(void *h, CUdeviceptr addr, uint32_t value, unsigned int flags) { return cuStreamWaitValue32_v2(h, addr, value, flags); }
CUresult cuLaunchHostFunc(void *h, void (*fn)(void *), void *arg) {
    stream_t *s; CUresult rc = lookup_stream(h, &s);
    op_t *o;
    if (rc) return rc;
    if (!fn) return E_INVALID_VALUE;
    if (!(o = new_op(OP_HOST_FN))) return E_OUT_OF_MEMORY;
    o->fn = fn; o->arg = arg;
    return enqueue(s, o);
}

CUresult cuEventCreate(void **out, unsigned int flags) {
    ctx_t *c; CUresult rc = current(&c);
    event_t *e;
    if (rc) return rc;
    if (!out || (flags & ~7u)) return E_INVALID_VALUE;
    if (!(e = calloc(1, sizeof *e))) return E_OUT_OF_MEMORY;
    e->dev = c->dev; e->flags = flags;
    e->next = g_events; g_events = e;
    *out = e;
    return OK;
}
CUresult cuEventDestroy_v2(void *h) {
    event_t *e;
    if (!g_init) return E_NOT_INITIALIZED;
    if (!(e = lookup_event(h))) return E_INVALID_HANDLE;
    if (e->pending) e->destroyed = 1; else free_event(e);
    return OK;
}
CUresult cuEventRecord(void *h, void *hstream) {
    stream_t *s; event_t *e; CUresult rc;
    op_t *o;
    if (!g_init) return E_NOT_INITIALIZED;
    if (!(e = lookup_event(h))) return E_INVALID_HANDLE;
    if ((rc = lookup_stream(hstream, &s))) return rc;
    if (s->dev != e->dev) return E_INVALID_HANDLE;  /* event and stream of different contexts */
    if (g_sticky[s->dev]) return g_sticky[s->dev];
    if (!(o = new_op(OP_EVENT))) return E_OUT_OF_MEMORY;
    o->ev = e;
    e->pending++;
    e->rec_seq = g_seq + 1;  /* the seq enqueue gives it */
    e->rec_stream = s->id;
    return enqueue(s, o);
}
CUresult cuEventQuery(void *h) {
    event_t *e;
    if (!g_init) return E_NOT_INITIALIZED;
    if (!(e = lookup_event(h))) return E_INVALID_HANDLE;
    progress();
    return event_done(e) ? OK : E_NOT_READY;
}
CUresult cuEventSynchronize(void *h) {
    event_t *e; CUresult rc;
    if (!g_init) return E_NOT_INITIALIZED;
    if (!(e = lookup_event(h))) return E_INVALID_HANDLE;
    rc = wait_for(event_done, e, stream_by_id(e->rec_stream), e->dev);
    return g_sticky[e->dev] ? g_sticky[e->dev] : rc;
}
CUresult cuEventElapsedTime(float *ms, void *start, void *stop) {
    event_t *a, *b;
    double t;
    if (!g_init) return E_NOT_INITIALIZED;
    if (!ms) return E_INVALID_VALUE;
    if (!(a = lookup_event(start)) || !(b = lookup_event(stop))) return E_INVALID_HANDLE;
    if ((a->flags | b->flags) & 2u) return E_INVALID_HANDLE;  /* CU_EVENT_DISABLE_TIMING */
    progress();
    if (!a->rec_seq || !b->rec_seq || !event_done(a) || !event_done(b)) return E_NOT_READY;
    if (env_on("FAKECUDA_ZERO_TIME")) { *ms = 0.0f; return OK; }
    t = (b->t - a->t) * 1000.0;
    *ms = (float)(t >= 0 && t < 1e-3 ? 1e-3 : t);
    return OK;
}

/* -- modules and launches ---------------------------------------------------------------------- */
static int names_entry(const char *text, const char *name) {
    size_t len = strlen(name);
    for (const char *p = text; (p = strstr(p, name)); p += len) {
        char before = p == text ? ' ' : p[-1], after = p[len];
        int ident_before = before == '_' || before == '$' || (before >= '0' && before <= '9') ||
                           ((before | 32) >= 'a' && (before | 32) <= 'z');
        int ident_after = after == '_' || after == '$' || (after >= '0' && after <= '9') ||
                          ((after | 32) >= 'a' && (after | 32) <= 'z');
        if (!ident_before && !ident_after) return 1;
    }
    return 0;
}
CUresult cuModuleLoadData(void **out, const void *image) {
    ctx_t *c; CUresult rc = current(&c);
    module_t *m;
    unsigned mask = 0;
    if (rc) return rc;
    if (!out || !image) return E_INVALID_VALUE;
    for (int k = 0; k < NKERN; k++) if (names_entry(image, KERNELS[k])) mask |= 1u << k;
    if (!mask) return E_INVALID_IMAGE;
    if (!(m = calloc(1, sizeof *m))) return E_OUT_OF_MEMORY;
    m->dev = c->dev; m->mask = mask;
    for (int k = 0; k < NKERN; k++) { m->funcs[k].m = m; m->funcs[k].kind = k; }
    m->next = g_modules; g_modules = m;
    *out = m;
    return OK;
}
static module_t *lookup_module(const void *h) {
    for (module_t *m = g_modules; m; m = m->next) if (m == h) return m;
    return NULL;
}
CUresult cuModuleGetFunction(void **f, void *hmod, const char *name) {
    module_t *m;
    if (!g_init) return E_NOT_INITIALIZED;
    if (!(m = lookup_module(hmod))) return E_INVALID_HANDLE;
    if (!f || !name) return E_INVALID_VALUE;
    for (int k = 0; k < NKERN; k++)
        if (!strcmp(name, KERNELS[k]) && (m->mask >> k & 1u)) { *f = &m->funcs[k]; return OK; }
    return E_NOT_FOUND;
}
CUresult cuModuleUnload(void *hmod) {
    if (!g_init) return E_NOT_INITIALIZED;
    for (module_t **p = &g_modules; *p; p = &(*p)->next)
        if (*p == hmod) { module_t *m = *p; *p = m->next; free(m); return OK; }
    return E_INVALID_HANDLE;
}
static const func_t *lookup_func(const void *h) {
    for (module_t *m = g_modules; m; m = m->next)
        for (int k = 0; k < NKERN; k++) if (h == &m->funcs[k] && (m->mask >> k & 1u)) return &m->funcs[k];
    return NULL;
}
CUresult cuLaunchKernel(void *hf, unsigned gx, unsigned gy, unsigned gz, unsigned bx, unsigned by, unsigned bz,
                        unsigned shmem, void *hstream, void **params, void **extra) {
    ctx_t *c; CUresult rc = current(&c);
    const func_t *f;
    stream_t *s;
    op_t *o;
    if (rc) return rc;
    if (!(f = lookup_func(hf))) return E_INVALID_HANDLE;
    if ((rc = lookup_stream(hstream, &s))) return rc;
    if (f->m->dev != c->dev || s->dev != c->dev) return E_INVALID_HANDLE;  /* another context's */
    if (!gx || !gy || !gz || !bx || !by || !bz || bx > 1024 || by > 1024 || bz > 64 ||
        (unsigned long long)bx * by * bz > 1024 || shmem > 48 * 1024 || gy > 65535 || gz > 65535)
        return E_INVALID_VALUE;
    if (!params || extra) return E_INVALID_VALUE;  /* only kernelParams */
    for (int i = 0; i < (int[]){4, 2, 3, 4, 3}[f->kind]; i++) if (!params[i]) return E_INVALID_VALUE;
    if (!(o = new_op(OP_KERNEL))) return E_OUT_OF_MEMORY;
    o->kernel = f->kind;
    switch (f->kind) {
    case K_SAXPY:
        o->a[0] = *(unsigned *)params[0]; o->f = *(float *)params[1];
        o->a[1] = *(uint64_t *)params[2]; o->a[2] = *(uint64_t *)params[3];
        o->a[3] = (unsigned long long)gx * gy * gz * bx * by * bz;
        break;
    case K_SPIN: o->a[0] = *(uint64_t *)params[0]; o->a[1] = *(uint64_t *)params[1]; o->u = (unsigned)s->dev; break;
    case K_FILL: for (int i = 0; i < 3; i++) o->a[i] = *(uint64_t *)params[i]; break;
    case K_CHECK: for (int i = 0; i < 4; i++) o->a[i] = *(uint64_t *)params[i]; break;
    case K_CHASE: o->a[0] = *(uint64_t *)params[0]; o->u = *(unsigned *)params[1]; o->a[2] = *(uint64_t *)params[2]; break;
    }
    return enqueue(s, o);
}

/* -- NVML ------------------------------------------------------------------------------------ */
typedef struct { char busIdLegacy[16]; unsigned domain, bus, device, pciDeviceId, pciSubSystemId; char busId[32]; } nvmlPciInfo_t;
typedef struct { unsigned long long total, free_, used; } nvmlBAR1Memory_t;
static int nvml_init_error(void) { return (int)env_long("FAKENVML_INIT_ERROR", 0); }
/* After a failed nvmlInit the queries say Uninitialized; a handle is its index + 1. */
#define NVML_DEVICE(h) do { if (nvml_init_error()) return 1; \
                            if ((uintptr_t)(h) < 1 || (uintptr_t)(h) > (uintptr_t)nvml_count()) return 2; } while (0)
#define NVML_SYSTEM() do { if (nvml_init_error()) return 1; } while (0)
int nvmlInit_v2(void) { return nvml_init_error(); }
int nvmlInitWithFlags(unsigned flags) { (void)flags; return nvml_init_error(); }
int nvmlShutdown(void) { return nvml_init_error() ? 1 : 0; }
const char *nvmlErrorString(int rc) {
    static const char *const texts[] = {
        "Success", "Uninitialized", "Invalid Argument", "Not Supported", "Insufficient Permissions",
        "Already Initialized", "Not Found", "Insufficient Size", "Insufficient External Power",
        "Driver Not Loaded", "Timeout", "Interrupt request issue", "NVML Shared Library Not Found",
        "Function Not Found", "Corrupted infoROM", "GPU is lost", "GPU requires restart",
        "The operating system has blocked the request.", "RM has detected an NVML/RM version mismatch.",
        "In use by another client", "Insufficient Memory", "No data"};
    if (rc >= 0 && rc < (int)(sizeof texts / sizeof texts[0])) return texts[rc];
    return "Unknown Error";
}
/* "0000:01:00.0" or "00000000:01:00.0", any case -> bus number of a fake device, or -1. */
static int fake_bus_index(const char *bus) {
    unsigned domain, b, d, f;
    char tail;
    if (!bus || sscanf(bus, "%x:%x:%x.%x%c", &domain, &b, &d, &f, &tail) != 4) return -1;
    return domain == 0 && d == 0 && f == 0 && b >= 1 && (int)b <= nvml_count() ? (int)b - 1 : -1;
}
int nvmlDeviceGetHandleByPciBusId_v2(const char *bus, void **h) {
    const char *want = getenv("FAKENVML_BUSID");  /* the GPU's address on the host under test */
    int index;
    NVML_SYSTEM();
    if (!bus || !h) return 2;
    if (want) {
        if (strcasecmp(bus, want) != 0) return 6;  /* NVML_ERROR_NOT_FOUND */
        index = 0;
    } else {
        index = fake_bus_index(bus);
        if (index < 0) index = 0;  /* as before: any address answers as the first GPU */
    }
    *h = (void *)(uintptr_t)(index + 1);
    return 0;
}

/* vGPU scheduler (NVML R525+). The state lives in the file FAKENVML_SCHED ("policy arr timeslice"),
   so that one process sets what the next one reads; without it the API is "not supported". */
typedef struct { unsigned supported[3], maxTs, minTs, arrSupported, maxFreq, minFreq, maxAvg, minAvg; } nvmlVgpuSchedulerCapabilities_t;
typedef struct { unsigned policy, arrMode; unsigned p0, p1; } nvmlVgpuSchedulerGetState_t;
typedef struct { unsigned policy, enableArr; unsigned p0, p1; } nvmlVgpuSchedulerSetState_t;
static int sched_read(unsigned *policy, unsigned *arr, unsigned *ts) {
    const char *path = getenv("FAKENVML_SCHED"); FILE *f; int n;
    if (!path || !(f = fopen(path, "r"))) return 3;
    n = fscanf(f, "%u %u %u", policy, arr, ts); fclose(f); return n == 3 ? 0 : 999;
}
int nvmlDeviceGetVgpuSchedulerCapabilities(void *h, nvmlVgpuSchedulerCapabilities_t *c) {
    unsigned p, a, t; int rc = sched_read(&p, &a, &t); (void)h; if (rc) return rc;
    memset(c, 0, sizeof *c); c->supported[0] = 1; c->supported[1] = 2; c->supported[2] = 3;
    c->maxTs = 30000; c->minTs = 1000; c->arrSupported = 1; return 0;
}
int nvmlDeviceGetVgpuSchedulerState(void *h, nvmlVgpuSchedulerGetState_t *s) {
    unsigned p, a, t; int rc = sched_read(&p, &a, &t); (void)h; if (rc) return rc;
    memset(s, 0, sizeof *s); s->policy = p; s->arrMode = a; s->p0 = t; if (a == 2) { s->p0 = 0; s->p1 = t; } return 0;
}
int nvmlDeviceSetVgpuSchedulerState(void *h, nvmlVgpuSchedulerSetState_t *s) {
    unsigned p, a, t; int rc = sched_read(&p, &a, &t); FILE *f; (void)h; if (rc) return rc;
    if (s->policy < 1 || s->policy > 3) return 2;
    if (getenv("FAKENVML_VM_RUNNING")) return 2;  /* NVML refuses while a vGPU VM runs */
    if (!(f = fopen(getenv("FAKENVML_SCHED"), "w"))) return 999;
    fprintf(f, "%u %u %u\n", s->policy, s->enableArr ? 2u : 1u, s->enableArr ? t : (s->p0 ? s->p0 : t)); fclose(f); return 0;
}
int nvmlSystemGetDriverVersion(char *v, unsigned len) { NVML_SYSTEM(); if (!v || !len) return 2; snprintf(v, len, "0.0-fake"); return 0; }
int nvmlSystemGetCudaDriverVersion_v2(int *v) { NVML_SYSTEM(); if (!v) return 2; *v = 12040; return 0; }
int nvmlDeviceGetCount_v2(unsigned *n) { NVML_SYSTEM(); if (!n) return 2; *n = (unsigned)nvml_count(); return 0; }
int nvmlDeviceGetHandleByIndex_v2(unsigned i, void **h) {
    NVML_SYSTEM();
    if (!h || i >= (unsigned)nvml_count()) return 2;
    *h = (void *)(uintptr_t)(i + 1);
    return 0;
}
int nvmlDeviceGetName(void *h, char *n, unsigned len) { NVML_DEVICE(h); if (!n || !len) return 2; snprintf(n, len, "FAKE CUDA (not a GPU)"); return 0; }
int nvmlDeviceGetPciInfo_v3(void *h, nvmlPciInfo_t *p) {
    unsigned bus = (unsigned)(uintptr_t)h;  /* index + 1 */
    NVML_DEVICE(h);
    if (!p) return 2;
    memset(p, 0, sizeof *p); p->bus = bus; p->pciDeviceId = 0x233010de;
    snprintf(p->busIdLegacy, sizeof p->busIdLegacy, "0000:%02X:00.0", bus);
    snprintf(p->busId, sizeof p->busId, "00000000:%02X:00.0", bus);
    return 0;
}
int nvmlDeviceGetVirtualizationMode(void *h, int *m) { NVML_DEVICE(h); if (!m) return 2; *m = env_on("FAKECUDA_VGPU") ? 2 : 1; return 0; }
int nvmlDeviceGetBAR1MemoryInfo(void *h, nvmlBAR1Memory_t *b) { NVML_DEVICE(h); if (!b) return 2; b->total = 128ULL << 30; b->free_ = b->total; b->used = 0; return 0; }
int nvmlDeviceGetEccMode(void *h, int *c, int *p) { NVML_DEVICE(h); if (!c || !p) return 2; *c = *p = 1; return 0; }
int nvmlDeviceGetMigMode(void *h, unsigned *c, unsigned *p) { NVML_DEVICE(h); if (!c || !p) return 2; *c = *p = env_on("FAKECUDA_MIG") ? 1 : 0; return 0; }
int nvmlDeviceGetCurrPcieLinkGeneration(void *h, unsigned *g) { NVML_DEVICE(h); if (!g) return 2; *g = (unsigned)env_long("FAKECUDA_GEN", 5); return 0; }
int nvmlDeviceGetCurrPcieLinkWidth(void *h, unsigned *w) { NVML_DEVICE(h); if (!w) return 2; *w = (unsigned)env_long("FAKECUDA_WIDTH", 16); return 0; }
int nvmlDeviceGetMaxPcieLinkGeneration(void *h, unsigned *g) { NVML_DEVICE(h); if (!g) return 2; *g = 5; return 0; }
int nvmlDeviceGetMaxPcieLinkWidth(void *h, unsigned *w) { NVML_DEVICE(h); if (!w) return 2; *w = 16; return 0; }
