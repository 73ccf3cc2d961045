// gpu_bench: a small, independent nvbandwidth-style measurement for the GPU lane
// (tests/lanes/gpu_lane.sh), written apart from gpuvfio's in-guest verifier so the two can be
// compared (tests/lanes/gpu_record.py writes comparison.json; issue 13's goal: within 3 %).
//
// Method (nvbandwidth's copy-engine tests, the verifier's defaults):
//   * pinned host memory (cudaHostAlloc), the CPU affinity set to the GPU's local_cpulist first
//     (where sysfs has one), so the buffers are allocated on the GPU's NUMA node;
//   * per test: --warmups untimed copies, then --samples samples; in each sample a spin kernel
//     holds the stream on a mapped pinned flag while the start event, --copies cudaMemcpyAsync of
//     --size-mib each and the stop event are queued, then the host releases the flag, so launch
//     and queueing costs are not timed; bandwidth = size * copies / (stop - start), GB/s (1e9);
//     the median of the samples is reported;
//   * H2D, D2D, D2H on one stream, then bidirectional: H2D on one stream and D2H on another, both
//     held on the same flag, each direction timed by its own events, total = their sum per sample;
//   * data: a non-repeating 64-bit pattern (word i = (i * K) ^ seed) travels host -> a -> b -> host
//     and is checked whole on the CPU (every mismatching word counted);
//   * latency: one GPU thread follows a chain of pointers stored in mapped pinned host memory with
//     volatile loads, --hops hops per sample, microseconds per hop. Two layouts: the verifier's
//     (2048 nodes a page apart in a shuffled cycle: no hop prefetched or cached) as latency_us, and
//     nvbandwidth's own (a 2 MiB ring, 128-byte stride) as latency_ring128_us.
//
// Output: one line `GPU-BENCH <json>` on stdout (also on a CUDA error: then with "error" and
// whatever was measured before it, exit status 1). Runtime API only; builds with any nvcc that
// has the target: the lane builds it with
//   nvcc -O2 -gencode 'arch=compute_90,code=[sm_90,compute_90]' -o gpu_bench tests/lanes/gpu_bench.cu
// Nothing here changes the card's settings.
#include <cuda_runtime.h>

#include <ctype.h>
#include <sched.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#define MARKER "GPU-BENCH"
#define PATTERN_K 0x9E3779B97F4A7C15ULL
#define HOLD_TIMEOUT_NS (2ULL * 1000 * 1000 * 1000)  // queueing takes < 1 ms; a lost flag cannot hang the GPU
#define MAX_SAMPLES 64

struct Options {
    unsigned long long size_mib = 512, hops = 100000;
    int copies = 16, samples = 3, warmups = 4, device = 0;
    int latency_entries = 2048, latency_stride = 4096;  // the verifier's layout
    int ring_bytes = 2 << 20, ring_stride = 128;         // nvbandwidth's layout
};

struct Series {
    const char *name;
    int count = 0;
    double values[MAX_SAMPLES] = {};
};

// Everything measured so far: printed at the end, or with the error that stopped the run.
static struct {
    Options opt;
    char name[256], bus_id[32], cpu_affinity[256], error[512];
    int driver_version, runtime_version, numa_node, cc_major, cc_minor;
    Series h2d{"h2d"}, d2h{"d2h"}, d2d{"d2d"}, bidir_h2d{"bidir_h2d"}, bidir_d2h{"bidir_d2h"},
        bidir_total{"bidir_total"}, latency{"latency_us"}, ring{"latency_ring128_us"};
    long long mismatches = -1, mismatches_bidir = -1;
    int chain_ok = -1, ring_ok = -1;
    unsigned hold_timeouts;
    double began;
} R;

static double now_s(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return ts.tv_sec + ts.tv_nsec / 1e9;
}

static void json_string(const char *s)
{
    putchar('"');
    for (; *s; s++) {
        unsigned char c = (unsigned char)*s;
        if (c == '"' || c == '\\') printf("\\%c", c);
        else if (c < 0x20 || c >= 0x7f) printf("\\u%04x", c);
        else putchar(c);
    }
    putchar('"');
}

static int compare_doubles(const void *a, const void *b)
{
    double x = *(const double *)a, y = *(const double *)b;
    return (x > y) - (x < y);
}

static double median(const Series &s)
{
    double sorted[MAX_SAMPLES];
    memcpy(sorted, s.values, s.count * sizeof(double));
    qsort(sorted, s.count, sizeof(double), compare_doubles);
    return s.count % 2 ? sorted[s.count / 2] : (sorted[s.count / 2 - 1] + sorted[s.count / 2]) / 2;
}

static void print_median(const char *key, const Series &s)
{
    printf(", \"%s\": ", key);
    if (s.count) printf("%.6g", median(s));
    else printf("null");
}

static void print_samples(const Series &s, int first)
{
    printf("%s\"%s\": [", first ? "" : ", ", s.name);
    for (int i = 0; i < s.count; i++) printf("%s%.6g", i ? ", " : "", s.values[i]);
    printf("]");
}

static void print_optional_int(const char *key, long long value)
{
    printf(", \"%s\": ", key);
    if (value < 0) printf("null");
    else printf("%lld", value);
}

static void print_result(void)
{
    const Options &o = R.opt;
    printf(MARKER " {\"version\": 1, \"tool\": \"gpu_bench\"");
    printf(", \"device\": {\"index\": %d, \"name\": ", o.device);
    json_string(R.name);
    printf(", \"bus_id\": ");
    json_string(R.bus_id);
    printf(", \"compute_capability\": \"%d.%d\", \"driver_version\": %d, \"runtime_version\": %d}", R.cc_major,
           R.cc_minor, R.driver_version, R.runtime_version);
    printf(", \"method\": {\"size_bytes\": %llu, \"copies\": %d, \"samples\": %d, \"warmups\": %d, \"pinned\": true, "
           "\"hold\": \"spin kernel on a mapped pinned flag until all copies are queued\", "
           "\"api\": \"CUDA runtime: cudaHostAlloc, cudaMemcpyAsync, cudaEventElapsedTime\", "
           "\"statistic\": \"median of samples\", \"latency_hops\": %llu, \"latency_layout\": "
           "\"%d nodes %d bytes apart, shuffled cycle\", \"latency_ring128_layout\": \"%d-byte ring, %d-byte stride\"}",
           o.size_mib << 20, o.copies, o.samples, o.warmups, o.hops, o.latency_entries, o.latency_stride,
           o.ring_bytes, o.ring_stride);
    print_median("h2d_gbps", R.h2d);
    print_median("d2h_gbps", R.d2h);
    print_median("bidir_h2d_gbps", R.bidir_h2d);
    print_median("bidir_d2h_gbps", R.bidir_d2h);
    print_median("bidir_total_gbps", R.bidir_total);
    print_median("d2d_gbps", R.d2d);
    print_median("latency_us", R.latency);
    print_median("latency_ring128_us", R.ring);
    printf(", \"samples\": {");
    const Series *all[] = {&R.h2d, &R.d2h, &R.d2d, &R.bidir_h2d, &R.bidir_d2h, &R.bidir_total, &R.latency, &R.ring};
    for (unsigned i = 0; i < sizeof(all) / sizeof(all[0]); i++) print_samples(*all[i], i == 0);
    printf("}");
    printf(", \"verified\": %s", R.mismatches < 0 || R.mismatches_bidir < 0 ? "null"
                                 : R.mismatches == 0 && R.mismatches_bidir == 0 ? "true" : "false");
    print_optional_int("mismatches", R.mismatches);
    print_optional_int("mismatches_bidir", R.mismatches_bidir);
    printf(", \"latency_chain_verified\": %s", R.chain_ok < 0 ? "null" : R.chain_ok ? "true" : "false");
    printf(", \"latency_ring128_chain_verified\": %s", R.ring_ok < 0 ? "null" : R.ring_ok ? "true" : "false");
    printf(", \"hold_timeouts\": %u", R.hold_timeouts);
    print_optional_int("host_numa_node", R.numa_node);
    printf(", \"cpu_affinity\": ");
    if (R.cpu_affinity[0]) json_string(R.cpu_affinity);
    else printf("null");
    printf(", \"elapsed_s\": %.3f, \"error\": ", now_s() - R.began);
    if (R.error[0]) json_string(R.error);
    else printf("null");
    printf("}\n");
    fflush(stdout);
}

static void fail(const char *what, const char *why, int line)
{
    snprintf(R.error, sizeof(R.error), "%s: %s (gpu_bench.cu:%d)", what, why, line);
    print_result();
    exit(1);
}

#define CK(call)                                                             \
    do {                                                                     \
        cudaError_t err_ = (call);                                           \
        if (err_ != cudaSuccess) fail(#call, cudaGetErrorString(err_), __LINE__); \
    } while (0)

__global__ void hold_stream(const volatile int *flag, unsigned long long timeout_ns, unsigned *timeouts)
{
    unsigned long long start, now;
    asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(start));
    for (;;) {
        if (*flag) return;
        asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(now));
        if (now - start > timeout_ns) {
            atomicAdd(timeouts, 1u);
            return;
        }
    }
}

// One thread, one dependent load per hop, each across the bus (volatile: never from a cache).
__global__ void chase(unsigned long long start, unsigned long long hops, unsigned long long *sink)
{
    const volatile unsigned long long *p = (const volatile unsigned long long *)start;
    for (unsigned long long i = 0; i < hops; i++) p = (const volatile unsigned long long *)*p;
    *sink = (unsigned long long)p;
}

struct Lane {
    Series *series;
    void *dst;
    const void *src;
    cudaMemcpyKind kind;
    cudaStream_t stream;
    cudaEvent_t start, stop;
};

struct Hold {
    volatile int *flag;  // host view
    int *flag_dev;       // device view
    unsigned *timeouts;  // device counter
};

static void measure(Lane *lanes, int count, size_t size, const Options &o, const Hold &hold, Series *total)
{
    for (int w = 0; w < o.warmups; w++)
        for (int l = 0; l < count; l++)
            CK(cudaMemcpyAsync(lanes[l].dst, lanes[l].src, size, lanes[l].kind, lanes[l].stream));
    for (int l = 0; l < count; l++) CK(cudaStreamSynchronize(lanes[l].stream));
    for (int s = 0; s < o.samples; s++) {
        *hold.flag = 0;
        __sync_synchronize();
        for (int l = 0; l < count; l++) {
            hold_stream<<<1, 1, 0, lanes[l].stream>>>(hold.flag_dev, HOLD_TIMEOUT_NS, hold.timeouts);
            CK(cudaGetLastError());
            CK(cudaEventRecord(lanes[l].start, lanes[l].stream));
        }
        for (int c = 0; c < o.copies; c++)
            for (int l = 0; l < count; l++)
                CK(cudaMemcpyAsync(lanes[l].dst, lanes[l].src, size, lanes[l].kind, lanes[l].stream));
        for (int l = 0; l < count; l++) CK(cudaEventRecord(lanes[l].stop, lanes[l].stream));
        __sync_synchronize();
        *hold.flag = 1;  // release: every copy is queued
        __sync_synchronize();
        double sum = 0;
        for (int l = 0; l < count; l++) {
            float ms = 0;
            CK(cudaEventSynchronize(lanes[l].stop));
            CK(cudaEventElapsedTime(&ms, lanes[l].start, lanes[l].stop));
            if (!(ms > 0)) fail("cudaEventElapsedTime", "zero or negative elapsed time", __LINE__);
            double gbps = (double)size * o.copies / (ms / 1e3) / 1e9;
            lanes[l].series->values[lanes[l].series->count++] = gbps;
            sum += gbps;
        }
        if (total) total->values[total->count++] = sum;
    }
}

static unsigned long long fill_pattern(void *buffer, size_t size, unsigned long long seed)
{
    unsigned long long *w = (unsigned long long *)buffer;
    for (size_t i = 0; i < size / 8; i++) w[i] = (i * PATTERN_K) ^ seed;
    return seed;
}

static long long count_mismatches(const void *buffer, size_t size, unsigned long long seed)
{
    const unsigned long long *w = (const unsigned long long *)buffer;
    long long bad = 0;
    for (size_t i = 0; i < size / 8; i++) bad += w[i] != ((i * PATTERN_K) ^ seed);
    return bad;
}

// Chase through `order` (node indices `stride` bytes apart, a cycle); returns the median us/hop
// in `series`, and whether the chain ended on the node it must end on.
static int latency(const int *order, int nodes, int stride, const Options &o, cudaStream_t stream,
                   cudaEvent_t start, cudaEvent_t stop, Series *series)
{
    size_t bytes = (size_t)nodes * stride;
    char *host = NULL, *dev = NULL;
    unsigned long long *sink = NULL, end = 0;
    CK(cudaHostAlloc((void **)&host, bytes, cudaHostAllocMapped | cudaHostAllocPortable));
    CK(cudaHostGetDevicePointer((void **)&dev, host, 0));
    CK(cudaMalloc((void **)&sink, sizeof(*sink)));
    memset(host, 0, bytes);
    for (int k = 0; k < nodes; k++)
        *(unsigned long long *)(host + (size_t)order[k] * stride) =
            (unsigned long long)(dev + (size_t)order[(k + 1) % nodes] * stride);
    unsigned long long first = (unsigned long long)(dev + (size_t)order[0] * stride);
    chase<<<1, 1, 0, stream>>>(first, o.hops, sink);  // warm-up: the mapping in place, clocks up
    CK(cudaGetLastError());
    CK(cudaStreamSynchronize(stream));
    for (int s = 0; s < o.samples; s++) {
        float ms = 0;
        CK(cudaEventRecord(start, stream));
        chase<<<1, 1, 0, stream>>>(first, o.hops, sink);
        CK(cudaGetLastError());
        CK(cudaEventRecord(stop, stream));
        CK(cudaEventSynchronize(stop));
        CK(cudaEventElapsedTime(&ms, start, stop));
        if (!(ms > 0)) fail("cudaEventElapsedTime", "zero or negative elapsed time", __LINE__);
        series->values[series->count++] = ms * 1e3 / (double)o.hops;
    }
    CK(cudaMemcpy(&end, sink, sizeof(end), cudaMemcpyDeviceToHost));
    int ok = end == (unsigned long long)(dev + (size_t)order[o.hops % nodes] * stride);
    CK(cudaFree(sink));
    CK(cudaFreeHost(host));
    return ok;
}

// The GPU's NUMA node and CPUs, from sysfs; the process is moved onto those CPUs so that pinned
// memory is first touched (allocated) on the GPU's node, as nvbandwidth does.
static void place_near(const char *bus_id)
{
    char path[128], text[256];
    FILE *f;
    R.numa_node = -1;
    snprintf(path, sizeof(path), "/sys/bus/pci/devices/%s/numa_node", bus_id);
    if ((f = fopen(path, "r"))) {
        if (fscanf(f, "%d", &R.numa_node) != 1) R.numa_node = -1;
        fclose(f);
    }
    if (R.numa_node < 0) R.numa_node = -1;
    snprintf(path, sizeof(path), "/sys/bus/pci/devices/%s/local_cpulist", bus_id);
    if (!(f = fopen(path, "r"))) return;
    if (!fgets(text, sizeof(text), f)) text[0] = 0;
    fclose(f);
    text[strcspn(text, "\n")] = 0;
    cpu_set_t set;
    CPU_ZERO(&set);
    int any = 0;
    for (char *part = strtok(text, ","); part; part = strtok(NULL, ",")) {
        int lo, hi;
        if (sscanf(part, "%d-%d", &lo, &hi) == 2) {
        } else if (sscanf(part, "%d", &lo) == 1) {
            hi = lo;
        } else {
            continue;
        }
        for (int c = lo; c <= hi && c < CPU_SETSIZE; c++) CPU_SET(c, &set), any = 1;
    }
    if (any && sched_setaffinity(0, sizeof(set), &set) == 0) {
        f = fopen(path, "r");
        if (f) {
            if (!fgets(R.cpu_affinity, sizeof(R.cpu_affinity), f)) R.cpu_affinity[0] = 0;
            R.cpu_affinity[strcspn(R.cpu_affinity, "\n")] = 0;
            fclose(f);
        }
    }
}

static unsigned long long number(const char *flag, const char *value, unsigned long long lo, unsigned long long hi)
{
    char *end = NULL;
    if (!value) fail(flag, "needs a value", __LINE__);
    unsigned long long v = strtoull(value, &end, 10);
    if (!*value || *end || v < lo || v > hi) fail(flag, "out of range or not a number", __LINE__);
    return v;
}

static void parse(int argc, char **argv, Options &o)
{
    for (int i = 1; i < argc; i++) {
        const char *a = argv[i], *v = i + 1 < argc ? argv[i + 1] : NULL;
        if (!strcmp(a, "--size-mib")) o.size_mib = number(a, v, 1, 1 << 20);
        else if (!strcmp(a, "--copies")) o.copies = (int)number(a, v, 1, 1000);
        else if (!strcmp(a, "--samples")) o.samples = (int)number(a, v, 1, MAX_SAMPLES);
        else if (!strcmp(a, "--warmups")) o.warmups = (int)number(a, v, 0, 1000);
        else if (!strcmp(a, "--hops")) o.hops = number(a, v, 1, 1ULL << 32);
        else if (!strcmp(a, "--device")) o.device = (int)number(a, v, 0, 1024);
        else if (!strcmp(a, "--latency-entries")) o.latency_entries = (int)number(a, v, 2, 1 << 20);
        else if (!strcmp(a, "--latency-stride")) o.latency_stride = (int)number(a, v, 8, 1 << 20);
        else fail(a, "unknown option (--size-mib --copies --samples --warmups --hops --device "
                     "--latency-entries --latency-stride)", __LINE__);
        i++;
    }
    if (o.latency_stride % 8) fail("--latency-stride", "must be a multiple of 8", __LINE__);
}

int main(int argc, char **argv)
{
    R.began = now_s();
    R.numa_node = -1;
    parse(argc, argv, R.opt);
    const Options &o = R.opt;
    size_t size = (size_t)o.size_mib << 20;

    CK(cudaDriverGetVersion(&R.driver_version));
    CK(cudaRuntimeGetVersion(&R.runtime_version));
    CK(cudaSetDevice(o.device));
    cudaDeviceProp prop;
    CK(cudaGetDeviceProperties(&prop, o.device));
    snprintf(R.name, sizeof(R.name), "%s", prop.name);
    R.cc_major = prop.major;
    R.cc_minor = prop.minor;
    CK(cudaDeviceGetPCIBusId(R.bus_id, sizeof(R.bus_id), o.device));
    for (char *c = R.bus_id; *c; c++) *c = (char)tolower((unsigned char)*c);
    if (strlen(R.bus_id) == 16 && !strncmp(R.bus_id, "0000", 4))  // NVML-style 8-digit domain: sysfs has 4
        memmove(R.bus_id, R.bus_id + 4, 13);
    place_near(R.bus_id);

    void *host_src = NULL, *host_dst = NULL, *a = NULL, *b = NULL;
    Hold hold;
    cudaStream_t s1, s2;
    cudaEvent_t ev[4];
    CK(cudaHostAlloc(&host_src, size, cudaHostAllocPortable));
    CK(cudaHostAlloc(&host_dst, size, cudaHostAllocPortable));
    CK(cudaMalloc(&a, size));
    CK(cudaMalloc(&b, size));
    CK(cudaHostAlloc((void **)&hold.flag, sizeof(int), cudaHostAllocMapped | cudaHostAllocPortable));
    CK(cudaHostGetDevicePointer((void **)&hold.flag_dev, (void *)hold.flag, 0));
    CK(cudaMalloc((void **)&hold.timeouts, sizeof(unsigned)));
    CK(cudaMemset(hold.timeouts, 0, sizeof(unsigned)));
    CK(cudaStreamCreateWithFlags(&s1, cudaStreamNonBlocking));
    CK(cudaStreamCreateWithFlags(&s2, cudaStreamNonBlocking));
    for (int i = 0; i < 4; i++) CK(cudaEventCreate(&ev[i]));

    unsigned long long seed = fill_pattern(host_src, size, (unsigned long long)time(NULL) * 2654435761ULL | 1);
    memset(host_dst, 0x5a, size);  // poisoned: stale data cannot pass the check
    CK(cudaMemset(a, 0xa5, size));
    CK(cudaMemset(b, 0xa5, size));
    CK(cudaDeviceSynchronize());

    Lane h2d = {&R.h2d, a, host_src, cudaMemcpyHostToDevice, s1, ev[0], ev[1]};
    Lane d2d = {&R.d2d, b, a, cudaMemcpyDeviceToDevice, s1, ev[0], ev[1]};
    Lane d2h = {&R.d2h, host_dst, b, cudaMemcpyDeviceToHost, s1, ev[0], ev[1]};
    measure(&h2d, 1, size, o, hold, NULL);
    measure(&d2d, 1, size, o, hold, NULL);
    measure(&d2h, 1, size, o, hold, NULL);
    CK(cudaDeviceSynchronize());
    R.mismatches = count_mismatches(host_dst, size, seed);  // host -> a -> b -> host, whole buffer

    memset(host_dst, 0x5a, size);
    Lane both[2] = {{&R.bidir_h2d, a, host_src, cudaMemcpyHostToDevice, s1, ev[0], ev[1]},
                    {&R.bidir_d2h, host_dst, b, cudaMemcpyDeviceToHost, s2, ev[2], ev[3]}};
    measure(both, 2, size, o, hold, &R.bidir_total);
    CK(cudaDeviceSynchronize());
    R.mismatches_bidir = count_mismatches(host_dst, size, seed);

    CK(cudaFreeHost(host_src));
    CK(cudaFreeHost(host_dst));
    CK(cudaFree(a));
    CK(cudaFree(b));

    // Latency, the verifier's layout: a shuffled cycle (fixed xorshift seed) of page-apart nodes.
    int nodes = o.latency_entries, *order = (int *)malloc(sizeof(int) * (nodes > 16384 ? nodes : 16384));
    if (!order) fail("malloc", "out of memory", __LINE__);
    unsigned long long x = 88172645463325252ULL;
    for (int i = 0; i < nodes; i++) order[i] = i;
    for (int i = nodes - 1; i > 0; i--) {
        x ^= x << 13, x ^= x >> 7, x ^= x << 17;
        int j = (int)(x % (unsigned long long)(i + 1)), t = order[i];
        order[i] = order[j], order[j] = t;
    }
    R.chain_ok = latency(order, nodes, o.latency_stride, o, s1, ev[0], ev[1], &R.latency);
    // nvbandwidth's layout: node i -> node i + 1 in a 2 MiB ring of 128-byte steps.
    int ring = o.ring_bytes / o.ring_stride;
    for (int i = 0; i < ring; i++) order[i] = i;
    R.ring_ok = latency(order, ring, o.ring_stride, o, s1, ev[0], ev[1], &R.ring);
    free(order);

    CK(cudaMemcpy(&R.hold_timeouts, hold.timeouts, sizeof(unsigned), cudaMemcpyDeviceToHost));
    CK(cudaFree(hold.timeouts));
    CK(cudaFreeHost((void *)hold.flag));
    for (int i = 0; i < 4; i++) CK(cudaEventDestroy(ev[i]));
    CK(cudaStreamDestroy(s1));
    CK(cudaStreamDestroy(s2));
    print_result();
    return 0;
}
