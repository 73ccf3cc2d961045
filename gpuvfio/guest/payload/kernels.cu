// gpuvfio's in-guest verifier kernels (gpuvfio/guest/payload/verifier.py carries their PTX; the
// driver JIT-compiles it, so the guest needs no nvcc). Regenerate the PTX with
//   nvcc --ptx -arch=compute_75 kernels.cu   (nvcc 13's oldest target)
// then lower `.version` to 5.0 and `.target` to sm_60: the bodies use nothing newer than PTX ISA
// 5.0 (CUDA 8), so P100/P40 (Pascal), V100 and every later GPU load them.
// tests/unit/test_verifier_fakecuda.py checks that the embedded PTX is this file's and that ptxas
// accepts it. Patterns: word i of a buffer holds (i * K) ^ seed, K odd, so no two words of a
// buffer are equal (a misplaced or repeated block cannot pass the check).
#define PATTERN_K 0x9E3779B97F4A7C15ULL

extern "C" __global__ void gpuvfio_saxpy(unsigned n, float a, const float *x, float *y)
{
    unsigned i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) y[i] = a * x[i] + y[i];
}

// Holds its stream until the host writes a non-zero flag (nvbandwidth's method: every copy is
// queued behind it, so launch overhead is not timed); gives up after timeout_ns.
extern "C" __global__ void gpuvfio_spin(const volatile unsigned *flag, unsigned long long timeout_ns)
{
    unsigned long long start, now;
    asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(start));
    do {
        if (*flag) return;
        asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(now));
    } while (now - start < timeout_ns);
}

extern "C" __global__ void gpuvfio_fill(unsigned long long *buf, unsigned long long words, unsigned long long seed)
{
    unsigned long long i = (unsigned long long)blockIdx.x * blockDim.x + threadIdx.x;
    if (i < words) buf[i] = (i * PATTERN_K) ^ seed;
}

extern "C" __global__ void gpuvfio_check(const unsigned long long *buf, unsigned long long words,
                                         unsigned long long seed, unsigned *errors)
{
    unsigned long long i = (unsigned long long)blockIdx.x * blockDim.x + threadIdx.x;
    if (i < words && buf[i] != ((i * PATTERN_K) ^ seed)) atomicAdd(errors, 1u);
}

// One thread follows a chain of pointers in (mapped, pinned) host memory: each hop is one
// read across PCIe that depends on the previous one. volatile keeps every load uncached.
extern "C" __global__ void gpuvfio_chase(const unsigned long long *start, unsigned hops, unsigned long long *sink)
{
    const volatile unsigned long long *p = start;
    for (unsigned i = 0; i < hops; i++) p = (const volatile unsigned long long *)*p;
    *sink = (unsigned long long)p;
}
