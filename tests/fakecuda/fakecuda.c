/*
 * A stand-in for libcuda.so.1 and libnvidia-ml.so.1 -- NOT a GPU.
 *
 * The unit lane has no NVIDIA hardware, but the in-guest verifier's ctypes code (argument
 * types, call order, event timing, data verification, JSON) must still run somewhere.
 * This library implements the handful of CUDA driver API and NVML entry points the
 * verifier calls, with "device memory" in host RAM, copies as memcpy and events as
 * CLOCK_MONOTONIC stamps. Built by the tests with gcc; never shipped.
 * Knobs (environment): FAKECUDA_CORRUPT=1 flips a byte in D2H copies; FAKECUDA_GEN and
 * FAKECUDA_WIDTH set the reported PCIe link; FAKECUDA_NODEV=1 reports no devices.
 */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <strings.h>
#include <stdio.h>
#include <time.h>

typedef int CUresult;
typedef uint64_t CUdeviceptr;
typedef struct { double t; } event_t;

static double now(void) { struct timespec ts; clock_gettime(CLOCK_MONOTONIC, &ts); return ts.tv_sec + ts.tv_nsec / 1e9; }
static int env_int(const char *name, int dflt) { const char *v = getenv(name); return v ? atoi(v) : dflt; }

CUresult cuInit(unsigned int flags) { (void)flags; return 0; }
CUresult cuDriverGetVersion(int *v) { *v = 12040; return 0; }
CUresult cuDeviceGetCount(int *n) { *n = env_int("FAKECUDA_NODEV", 0) ? 0 : 1; return 0; }
CUresult cuDeviceGet(int *dev, int ordinal) { *dev = ordinal; return ordinal == 0 ? 0 : 101; }
CUresult cuDeviceGetName(char *name, int len, int dev) { (void)dev; snprintf(name, len, "FAKE CUDA (not a GPU)"); return 0; }
CUresult cuDeviceGetPCIBusId(char *bus, int len, int dev) { (void)dev; snprintf(bus, len, "0000:01:00.0"); return 0; }
CUresult cuDeviceTotalMem_v2(size_t *bytes, int dev) { (void)dev; *bytes = (size_t)1 << 30; return 0; }
CUresult cuGetErrorString(CUresult rc, const char **s) { (void)rc; *s = "fake error"; return 0; }
CUresult cuDevicePrimaryCtxRetain(void **ctx, int dev) { (void)dev; *ctx = (void *)0x1; return 0; }
CUresult cuDevicePrimaryCtxRelease_v2(int dev) { (void)dev; return 0; }
CUresult cuCtxSetCurrent(void *ctx) { (void)ctx; return 0; }
CUresult cuStreamCreate(void **s, unsigned int flags) { (void)flags; *s = (void *)0x2; return 0; }
CUresult cuStreamDestroy_v2(void *s) { (void)s; return 0; }
CUresult cuStreamSynchronize(void *s) { (void)s; return 0; }
CUresult cuMemHostAlloc(void **p, size_t n, unsigned int flags) { (void)flags; *p = malloc(n); return *p ? 0 : 2; }
CUresult cuMemFreeHost(void *p) { free(p); return 0; }
CUresult cuMemAlloc_v2(CUdeviceptr *d, size_t n) { void *p = malloc(n); *d = (CUdeviceptr)(uintptr_t)p; return p ? 0 : 2; }
CUresult cuMemFree_v2(CUdeviceptr d) { free((void *)(uintptr_t)d); return 0; }
CUresult cuMemsetD8_v2(CUdeviceptr d, unsigned char v, size_t n) { memset((void *)(uintptr_t)d, v, n); return 0; }
CUresult cuMemcpyHtoDAsync_v2(CUdeviceptr d, const void *s, size_t n, void *st) { (void)st; memcpy((void *)(uintptr_t)d, s, n); return 0; }
CUresult cuMemcpyHtoD_v2(CUdeviceptr d, const void *s, size_t n) { memcpy((void *)(uintptr_t)d, s, n); return 0; }
CUresult cuMemcpyDtoDAsync_v2(CUdeviceptr d, CUdeviceptr s, size_t n, void *st) { (void)st; memcpy((void *)(uintptr_t)d, (void *)(uintptr_t)s, n); return 0; }
CUresult cuMemcpyDtoHAsync_v2(void *d, CUdeviceptr s, size_t n, void *st) {
    (void)st; memcpy(d, (void *)(uintptr_t)s, n);
    if (env_int("FAKECUDA_CORRUPT", 0) && n) ((unsigned char *)d)[n / 2] ^= 0xff;
    return 0;
}
CUresult cuEventCreate(void **e, unsigned int flags) { (void)flags; *e = calloc(1, sizeof(event_t)); return 0; }
CUresult cuEventDestroy_v2(void *e) { free(e); return 0; }
CUresult cuEventRecord(void *e, void *st) { (void)st; ((event_t *)e)->t = now(); return 0; }
CUresult cuEventSynchronize(void *e) { (void)e; return 0; }
CUresult cuEventElapsedTime(float *ms, void *a, void *b) { *ms = (float)((((event_t *)b)->t - ((event_t *)a)->t) * 1000.0); if (*ms <= 0) *ms = 1e-3f; return 0; }

/* Modules and launches: the "kernel" is SAXPY run on the host, with the verifier's
 * parameter layout (unsigned n, float a, float *x, float *y). */
CUresult cuModuleLoadData(void **m, const void *image) { *m = strstr((const char *)image, "gpuvfio_saxpy") ? (void *)0x3 : NULL; return *m ? 0 : 200; }
CUresult cuModuleGetFunction(void **f, void *m, const char *name) { (void)m; *f = strcmp(name, "gpuvfio_saxpy") ? NULL : (void *)0x4; return *f ? 0 : 500; }
CUresult cuModuleUnload(void *m) { (void)m; return 0; }
CUresult cuLaunchKernel(void *f, unsigned gx, unsigned gy, unsigned gz, unsigned bx, unsigned by, unsigned bz,
                        unsigned shmem, void *stream, void **params, void **extra) {
    (void)f; (void)gy; (void)gz; (void)by; (void)bz; (void)shmem; (void)stream; (void)extra;
    unsigned n = *(unsigned *)params[0];
    float a = *(float *)params[1];
    float *x = (float *)(uintptr_t)*(uint64_t *)params[2];
    float *y = (float *)(uintptr_t)*(uint64_t *)params[3];
    unsigned long total = (unsigned long)gx * bx;
    for (unsigned long i = 0; i < total && i < n; i++) y[i] = a * x[i] + y[i];
    return 0;
}

/* NVML */
typedef struct { char busIdLegacy[16]; unsigned domain, bus, device, pciDeviceId, pciSubSystemId; char busId[32]; } nvmlPciInfo_t;
typedef struct { unsigned long long total, free_, used; } nvmlBAR1Memory_t;
int nvmlInit_v2(void) { return 0; }
int nvmlInitWithFlags(unsigned flags) { (void)flags; return 0; }
int nvmlShutdown(void) { return 0; }
const char *nvmlErrorString(int rc) { return rc == 3 ? "Not Supported" : rc == 2 ? "Invalid Argument" : "Unknown Error"; }
int nvmlDeviceGetHandleByPciBusId_v2(const char *bus, void **h) {
    const char *want = getenv("FAKENVML_BUSID");  /* the GPU's address on the host under test */
    if (want && strcasecmp(bus, want) != 0) return 6;  /* NVML_ERROR_NOT_FOUND */
    *h = (void *)1; return 0;
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
int nvmlSystemGetDriverVersion(char *v, unsigned len) { snprintf(v, len, "0.0-fake"); return 0; }
int nvmlSystemGetCudaDriverVersion_v2(int *v) { *v = 12040; return 0; }
int nvmlDeviceGetCount_v2(unsigned *n) { *n = env_int("FAKECUDA_NODEV", 0) ? 0 : 1; return 0; }
int nvmlDeviceGetHandleByIndex_v2(unsigned i, void **h) { *h = (void *)(uintptr_t)(i + 1); return 0; }
int nvmlDeviceGetName(void *h, char *n, unsigned len) { (void)h; snprintf(n, len, "FAKE CUDA (not a GPU)"); return 0; }
int nvmlDeviceGetPciInfo_v3(void *h, nvmlPciInfo_t *p) {
    (void)h; memset(p, 0, sizeof *p); p->bus = 1; p->pciDeviceId = 0x233010de;
    snprintf(p->busId, sizeof p->busId, "00000000:01:00.0"); return 0;
}
int nvmlDeviceGetVirtualizationMode(void *h, int *m) { (void)h; *m = 1; return 0; }
int nvmlDeviceGetBAR1MemoryInfo(void *h, nvmlBAR1Memory_t *b) { (void)h; b->total = 128ULL << 30; b->free_ = b->total; b->used = 0; return 0; }
int nvmlDeviceGetEccMode(void *h, int *c, int *p) { (void)h; *c = *p = 1; return 0; }
int nvmlDeviceGetMigMode(void *h, unsigned *c, unsigned *p) { (void)h; *c = *p = 0; return 0; }
int nvmlDeviceGetCurrPcieLinkGeneration(void *h, unsigned *g) { (void)h; *g = env_int("FAKECUDA_GEN", 5); return 0; }
int nvmlDeviceGetCurrPcieLinkWidth(void *h, unsigned *w) { (void)h; *w = env_int("FAKECUDA_WIDTH", 16); return 0; }
int nvmlDeviceGetMaxPcieLinkGeneration(void *h, unsigned *g) { (void)h; *g = 5; return 0; }
int nvmlDeviceGetMaxPcieLinkWidth(void *h, unsigned *w) { (void)h; *w = 16; return 0; }
