/*
 * A stand-in for libnccl.so.2 -- NOT NCCL, and no GPU: the partner of fakecuda.c.
 *
 * Enough of NCCL's single-process API for the verifier's all-reduce: ncclGetVersion (22304,
 * i.e. 2.23.4), ncclGetErrorString (NCCL's texts), ncclCommInitAll / ncclCommDestroy,
 * ncclGroupStart / ncclGroupEnd, and ncclAllReduce for ncclFloat32 (7) with ncclSum (0); any
 * other datatype or op, an unknown communicator or a NULL buffer is ncclInvalidArgument (4,
 * as in nccl.h), a GroupEnd without a GroupStart ncclInvalidUsage (5).
 *
 * HOW IT MEETS THE STREAMS. It drives the stand-in libcuda.so.1 found next to this file
 * (dlopen of <this directory>/libcuda.so.1: the same instance the caller loaded), through
 * real driver API calls, so an all-reduce is ordered on each rank's stream like any other
 * work. The k-th ncclAllReduce call of every rank of a clique forms one collective. When it
 * is launched (at once outside a group; at the outermost ncclGroupEnd inside one), each rank's
 * stream gets, with the rank's device current: cuLaunchHostFunc(arrive),
 * cuStreamWaitValue32_v2(done >= 1), cuLaunchHostFunc(leave). The last rank to arrive -- that
 * is, once every rank's stream has reached the collective -- computes every rank's recv as the
 * element-wise float sum of all ranks' send buffers (over the smallest count given; in place
 * works) and sets done, which releases the other ranks' streams. So a rank's later work (a
 * copy of recv, a stop event) runs after the sum, the events around it time the host
 * computation, and an all-reduce queued behind a held stream (gpuvfio_spin) waits for the
 * flag like the copies do; synchronising before releasing the flag is
 * CUDA_ERROR_LAUNCH_TIMEOUT from fakecuda, as with copies. Like NCCL (through cudart), it
 * retains each device's primary context once and never releases it. Buffers are not checked.
 *
 * THE TOPOLOGY DUMP. With NCCL_TOPO_DUMP_FILE set, ncclCommInitAll writes a dump there, as NCCL
 * (since 2.6, docs/env.rst) writes the XML it ended up with after detection: one <cpu>, and for
 * each rank's GPU a <pci busid=...> holding a <gpu dev= rank=>. It is a stand-in's dump, not
 * NCCL's detection. Where the NCCL_TOPO_FILE the environment names holds a <pci> of every
 * rank's GPU, the dump is that file's tree with a <gpu> put into each (NCCL keeps the tree and
 * every attribute the file gives, src/graph/xml.cc ncclTopoGetXmlFromFile and
 * ncclTopoGetXmlFromSys). Otherwise each GPU hangs from the one <cpu>, its link attributes
 * from the file's <pci> of its bus id where there is one, else "32.0 GT/s PCIe" and the
 * stand-in's NVML width (FAKECUDA_WIDTH, default 16), what NCCL 2.30.7's NVML rule reads.
 * Only the environment is read: real NCCL also takes NCCL_TOPO_FILE from nccl.conf.
 *
 * KNOBS (environment): FAKENCCL_ERROR=<code> makes ncclCommInitAll fail with that code;
 * FAKENCCL_CORRUPT=1 adds 1.0 to one element (the middle one) of rank 0's result;
 * FAKENCCL_IGNORE_TOPO=1 dumps as if NCCL_TOPO_FILE were not set (a NCCL that never loaded it).
 */
#define _GNU_SOURCE
#include <dlfcn.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <strings.h>
#include <stdio.h>

#define MAXRANKS 16
enum { ncclSuccess = 0, ncclUnhandledCudaError = 1, ncclSystemError = 2, ncclInternalError = 3,
       ncclInvalidArgument = 4, ncclInvalidUsage = 5 };

typedef int CUresult;
static struct {
    void *lib;
    CUresult (*init)(unsigned);
    CUresult (*count)(int *);
    CUresult (*retain)(void **, int);
    CUresult (*get_current)(void **);
    CUresult (*set_current)(void *);
    CUresult (*host_func)(void *, void (*)(void *), void *);
    CUresult (*wait_value)(void *, uint64_t, uint32_t, unsigned);
    CUresult (*bus_id)(char *, int, int);
} cu;

static int load_cuda(void) {
    Dl_info info;
    char path[4096];
    const char *slash;
    if (cu.lib) return 0;
    if (dladdr((void *)load_cuda, &info) && info.dli_fname && (slash = strrchr(info.dli_fname, '/'))) {
        snprintf(path, sizeof path, "%.*s/libcuda.so.1", (int)(slash - info.dli_fname), info.dli_fname);
        cu.lib = dlopen(path, RTLD_NOW | RTLD_LOCAL);
    }
    if (!cu.lib) cu.lib = dlopen("libcuda.so.1", RTLD_NOW | RTLD_LOCAL);
    if (!cu.lib) return -1;
#define SYM(field, name) if (!(*(void **)&cu.field = dlsym(cu.lib, name))) { cu.lib = NULL; return -1; }
    SYM(init, "cuInit") SYM(count, "cuDeviceGetCount") SYM(retain, "cuDevicePrimaryCtxRetain")
    SYM(get_current, "cuCtxGetCurrent") SYM(set_current, "cuCtxSetCurrent")
    SYM(host_func, "cuLaunchHostFunc") SYM(wait_value, "cuStreamWaitValue32_v2")
    SYM(bus_id, "cuDeviceGetPCIBusId")
#undef SYM
    return 0;
}

typedef struct coll coll_t;
typedef struct { coll_t *c; int rank; } slot_t;
struct coll {
    coll_t *next;
    uint64_t index;
    int n, registered, arrived, left, corrupt;
    volatile uint32_t done;
    size_t count[MAXRANKS];
    const float *send[MAXRANKS];
    float *recv[MAXRANKS];
    slot_t slots[MAXRANKS];
};
typedef struct {
    int n, alive;
    int devs[MAXRANKS];
    void *ctx[MAXRANKS];
    uint64_t calls[MAXRANKS];
    coll_t *open;  /* collectives some ranks have not called yet */
} clique_t;
typedef struct { unsigned magic; clique_t *clique; int rank; } comm_t;
#define MAGIC 0x6e63636cu

static void *g_retained[MAXRANKS];
static int g_depth;
typedef struct deferred { struct deferred *next; coll_t *c; int rank; void *stream, *ctx; } deferred_t;
static deferred_t *g_deferred, **g_deferred_tail = &g_deferred;

int ncclGetVersion(int *v) { if (!v) return ncclInvalidArgument; *v = 22304; return ncclSuccess; }
const char *ncclGetErrorString(int rc) {
    switch (rc) {
    case 0: return "no error";
    case 1: return "unhandled cuda error (run with NCCL_DEBUG=INFO for details)";
    case 2: return "unhandled system error (run with NCCL_DEBUG=INFO for details)";
    case 3: return "internal error - please report this issue to the NCCL developers";
    case 4: return "invalid argument (run with NCCL_DEBUG=WARN for details)";
    case 5: return "invalid usage (run with NCCL_DEBUG=WARN for details)";
    case 6: return "remote process exited or there was a network error";
    case 7: return "NCCL operation in progress";
    default: return "unknown result code";
    }
}

/* The value of attribute `name` in the tag [tag, end) into out; 0 when the tag has it. */
static int attr_of(const char *tag, const char *end, const char *name, char *out, size_t n) {
    size_t len = strlen(name);
    for (const char *p = tag + 1; p + len + 2 < end; p++) {
        if ((p[-1] == ' ' || p[-1] == '\t' || p[-1] == '\n') && !strncmp(p, name, len) && p[len] == '=' && p[len + 1] == '"') {
            const char *v = p + len + 2, *q = memchr(v, '"', (size_t)(end - v));
            if (!q) return -1;
            snprintf(out, n, "%.*s", (int)(q - v), v);
            return 0;
        }
    }
    return -1;
}

/* The link attributes the topology file gives the <pci> of `busid`; each one it lacks is left. */
static void file_link(const char *xml, const char *busid, char *speed, size_t ns, char *width, size_t nw) {
    for (const char *p = xml; (p = strstr(p, "<pci")) != NULL; p += 4) {
        const char *end = strchr(p, '>');
        char bus[64];
        if (!end) return;
        if (!attr_of(p, end, "busid", bus, sizeof bus) && !strcasecmp(bus, busid)) {
            attr_of(p, end, "link_speed", speed, ns);
            attr_of(p, end, "link_width", width, nw);
            return;
        }
    }
}

static char *read_small(const char *path) {
    FILE *f = fopen(path, "r");
    char *buf;
    size_t got;
    if (!f) return NULL;
    if ((buf = malloc(1 << 20)) != NULL) { got = fread(buf, 1, (1 << 20) - 1, f); buf[got] = '\0'; }
    fclose(f);
    return buf;
}

/* The rank whose GPU the <pci> tag [tag, end) names, or -1. */
static int rank_of(const char *tag, const char *end, char bus[][64], int ndev) {
    char busid[64];
    if (attr_of(tag, end, "busid", busid, sizeof busid)) return -1;
    for (int r = 0; r < ndev; r++) if (bus[r][0] && !strcasecmp(busid, bus[r])) return r;
    return -1;
}

/* The file's tree with a <gpu> in each rank's <pci>, as NCCL keeps the tree NCCL_TOPO_FILE gives
 * (ncclTopoFillGpu finds the GPU's node by bus id); -1, nothing written, unless the file holds
 * every rank's GPU. */
static int dump_file_tree(FILE *out, const char *xml, char bus[][64], const int *devs, int ndev) {
    int seen[MAXRANKS] = {0}, found = 0;
    for (const char *p = xml; (p = strstr(p, "<pci")) != NULL; p += 4) {
        const char *end = strchr(p, '>');
        int r = end ? rank_of(p, end, bus, ndev) : -1;
        if (r >= 0 && seen[r]++) return -1;  /* one <pci> a GPU: NCCL's bus ids are unique */
        found += r >= 0;
    }
    if (found != ndev) return -1;
    for (const char *p = xml;;) {
        const char *tag = strstr(p, "<pci"), *end = tag ? strchr(tag, '>') : NULL;
        int r = end ? rank_of(tag, end, bus, ndev) : -1;
        if (!end) { fputs(p, out); return 0; }
        if (r < 0) { fwrite(p, 1, (size_t)(end + 1 - p), out); p = end + 1; continue; }
        int single = end[-1] == '/';
        fwrite(p, 1, (size_t)(end - (single ? 1 : 0) - p), out);
        fprintf(out, ">\n<gpu dev=\"%d\" sm=\"90\" rank=\"%d\" gdr=\"0\"/>%s", devs[r], r, single ? "\n</pci>" : "");
        p = end + 1;
    }
}

static void dump_topology(int ndev, const int *devs) {
    const char *path = getenv("NCCL_TOPO_DUMP_FILE"), *topo = getenv("NCCL_TOPO_FILE");
    const char *ignore = getenv("FAKENCCL_IGNORE_TOPO");
    char *xml = NULL, bus[MAXRANKS][64];
    FILE *out;
    if (!path || !*path || !(out = fopen(path, "w"))) return;  /* NCCL: "Unable to open %s, not dumping" */
    if (topo && *topo && !(ignore && atoi(ignore))) xml = read_small(topo);
    for (int r = 0; r < ndev; r++) {
        bus[r][0] = '\0';
        if (cu.bus_id(bus[r], sizeof bus[r], devs[r])) bus[r][0] = '\0';  /* no bus id: matches no <pci> */
        for (char *c = bus[r]; *c; c++) if (*c >= 'A' && *c <= 'F') *c += 'a' - 'A';  /* NCCL's busids are lower case */
    }
    if (xml && !dump_file_tree(out, xml, bus, devs, ndev)) { fclose(out); free(xml); return; }
    fprintf(out, "<system version=\"1\">\n  <cpu numaid=\"0\" arch=\"x86_64\" vendor=\"GenuineIntel\">\n");
    for (int r = 0; r < ndev; r++) {
        char speed[64] = "32.0 GT/s PCIe", width[16];
        const char *w = getenv("FAKECUDA_WIDTH");
        snprintf(width, sizeof width, "%d", w && *w ? atoi(w) : 16);
        if (xml) file_link(xml, bus[r], speed, sizeof speed, width, sizeof width);
        fprintf(out, "    <pci busid=\"%s\" class=\"0x030200\" vendor=\"0x10de\" device=\"0x2330\" link_speed=\"%s\" "
                "link_width=\"%s\">\n      <gpu dev=\"%d\" sm=\"90\" rank=\"%d\" gdr=\"0\"/>\n    </pci>\n",
                bus[r], speed, width, devs[r], r);
    }
    fprintf(out, "  </cpu>\n</system>\n");
    fclose(out);
    free(xml);
}

int ncclCommInitAll(void **comms, int ndev, const int *devlist) {
    const char *err = getenv("FAKENCCL_ERROR");
    clique_t *q;
    int count;
    if (err && *err && atoi(err)) return atoi(err);
    if (!comms || ndev <= 0 || ndev > MAXRANKS) return ncclInvalidArgument;
    if (load_cuda()) return ncclSystemError;
    if (cu.init(0) || cu.count(&count)) return ncclUnhandledCudaError;
    for (int r = 0; r < ndev; r++) {
        int dev = devlist ? devlist[r] : r;
        if (dev < 0 || dev >= count) return ncclInvalidArgument;
        for (int s = 0; s < r; s++) if ((devlist ? devlist[s] : s) == dev) return ncclInvalidUsage;  /* duplicate GPU */
    }
    if (!(q = calloc(1, sizeof *q))) return ncclSystemError;
    q->n = q->alive = ndev;
    for (int r = 0; r < ndev; r++) {
        int dev = devlist ? devlist[r] : r;
        comm_t *c = calloc(1, sizeof *c);
        if (!g_retained[dev] && cu.retain(&g_retained[dev], dev)) { free(c); c = NULL; }
        if (!c) {
            for (int s = 0; s < r; s++) { ((comm_t *)comms[s])->magic = 0; free(comms[s]); comms[s] = NULL; }
            free(q);
            return ncclUnhandledCudaError;
        }
        q->devs[r] = dev; q->ctx[r] = g_retained[dev];
        c->magic = MAGIC; c->clique = q; c->rank = r;
        comms[r] = c;
    }
    dump_topology(ndev, q->devs);
    return ncclSuccess;
}

int ncclCommDestroy(void *h) {
    comm_t *c = h;
    if (!c || c->magic != MAGIC) return ncclInvalidArgument;
    c->magic = 0;
    if (--c->clique->alive == 0) free(c->clique);  /* collectives still open stay (their ranks wait, as NCCL's would) */
    free(c);
    return ncclSuccess;
}

/* On the streams (fakecuda runs these when each stream gets there). */
static void arrive(void *arg) {
    slot_t *s = arg;
    coll_t *c = s->c;
    if (++c->arrived < c->n) return;
    size_t count = c->count[0];
    for (int r = 1; r < c->n; r++) if (c->count[r] < count) count = c->count[r];
    for (size_t i = 0; i < count; i++) {
        float sum = 0.0f;
        for (int r = 0; r < c->n; r++) sum += c->send[r][i];
        for (int r = 0; r < c->n; r++) c->recv[r][i] = sum;
    }
    if (c->corrupt && count) c->recv[0][count / 2] += 1.0f;
    c->done = 1;
}
static void leave(void *arg) {
    coll_t *c = ((slot_t *)arg)->c;
    if (++c->left == c->n) free(c);
}

static int launch(coll_t *c, int rank, void *stream, void *ctx) {
    void *saved = NULL;
    int rc = ncclSuccess;
    if (cu.get_current(&saved) || cu.set_current(ctx)) return ncclUnhandledCudaError;
    if (cu.host_func(stream, arrive, &c->slots[rank]) ||
        cu.wait_value(stream, (uint64_t)(uintptr_t)&c->done, 1, 0 /* CU_STREAM_WAIT_VALUE_GEQ */) ||
        cu.host_func(stream, leave, &c->slots[rank]))
        rc = ncclUnhandledCudaError;
    cu.set_current(saved);
    return rc;
}

int ncclAllReduce(const void *send, void *recv, size_t count, int datatype, int op, void *h, void *stream) {
    comm_t *comm = h;
    clique_t *q;
    coll_t *c, **p;
    uint64_t index;
    if (!comm || comm->magic != MAGIC || datatype != 7 || op != 0) return ncclInvalidArgument;
    if (count && (!send || !recv)) return ncclInvalidArgument;
    q = comm->clique;
    index = q->calls[comm->rank]++;
    for (p = &q->open; *p && (*p)->index != index; p = &(*p)->next) {}
    if (!(c = *p)) {
        if (!(c = calloc(1, sizeof *c))) { q->calls[comm->rank]--; return ncclSystemError; }
        c->index = index; c->n = q->n;
        for (int r = 0; r < q->n; r++) { c->slots[r].c = c; c->slots[r].rank = r; }
        c->next = q->open; q->open = c; p = &q->open;
    }
    c->send[comm->rank] = send; c->recv[comm->rank] = recv; c->count[comm->rank] = count;
    if (++c->registered == c->n) {  /* every rank has called: no longer open */
        *p = c->next;
        c->corrupt = getenv("FAKENCCL_CORRUPT") && atoi(getenv("FAKENCCL_CORRUPT"));
    }
    if (g_depth > 0) {
        deferred_t *d = calloc(1, sizeof *d);
        if (!d) return ncclSystemError;
        d->c = c; d->rank = comm->rank; d->stream = stream; d->ctx = q->ctx[comm->rank];
        *g_deferred_tail = d; g_deferred_tail = &d->next;
        return ncclSuccess;
    }
    return launch(c, comm->rank, stream, q->ctx[comm->rank]);
}

int ncclGroupStart(void) { g_depth++; return ncclSuccess; }
int ncclGroupEnd(void) {
    int rc = ncclSuccess;
    if (g_depth <= 0) return ncclInvalidUsage;
    if (--g_depth > 0) return ncclSuccess;
    while (g_deferred) {
        deferred_t *d = g_deferred;
        int r = launch(d->c, d->rank, d->stream, d->ctx);
        if (r && !rc) rc = r;
        g_deferred = d->next;
        free(d);
    }
    g_deferred_tail = &g_deferred;
    return rc;
}
