#!/bin/sh
# GPU lane (issue 13, item 7): gpuvfio's in-guest verifier on a real GPU, beside two independent
# measurements of the same copies. docs/gpu-lane.md says what it needs and how to read it.
#
#   OUT=DIR sh tests/lanes/gpu_lane.sh [extra verifier arguments]
#
# Needs: Linux (bare metal, or a guest the GPU is passed through to), an NVIDIA GPU with its
# driver (libcuda, nvidia-smi), python3, this checkout; optionally nvcc (CUDA toolkit), PyTorch
# and CuPy for python3. POSIX sh and those tools only: it installs nothing, and it never changes
# the card's settings (no -pm/-lgc/-ac/-r/-mig: it only reads). What ran where is in lane.log.
#
# Steps, each bounded by `timeout` and by the whole lane's time budget (GPU_LANE_BUDGET_S, 300 s):
#   1. nvidia-smi -q, and a one-line clock/link/temperature snapshot (again at the end)
#   2. gpu_bench built with nvcc for the GPU's compute capability (GPU_BENCH_ARCH, else
#      nvidia-smi's compute_cap, else 90: sm_XX + compute_XX PTX); if nvcc is missing or fails, a
#      prebuilt build/gpu-lane/gpu_bench (git-ignored; see docs/gpu-lane.md) or $GPU_BENCH_BIN
#   3. GPU_LANE_REPS (3) x (probe.sh + verifier.py), same sizes as below
#   4. gpu_bench, then gpu_torch.py (PyTorch copies, CuPy latency), same sizes
# Sizes (env): GPU_LANE_SIZE_MIB 512, GPU_LANE_COPIES 16, GPU_LANE_SAMPLES 3, GPU_LANE_WARMUPS 4,
# GPU_LANE_HOPS 100000 -- nvbandwidth's and the verifier's defaults. Extra arguments go to the
# verifier only.
#
# Time, estimated for an H200 on PCIe Gen5 x16 (~50-55 GB/s a direction), not yet measured:
#   one sample of one direction = 512 MiB x 16 = 8.6 GB / ~52 GB/s = ~0.17 s; x 3 samples = 0.5 s;
#   H2D + D2H 1 s, bidirectional (both at once) ~0.6 s, D2D 8.6 GB at ~2 TB/s = ~5 ms a sample;
#   warm-ups 4 x 3 copies x ~10 ms = 0.1 s; latency 100000 hops x ~1-2 us = 0.1-0.2 s a sample,
#   x 4 (1 warm-up) = ~0.8 s; copy overhead 2000 x ~15 us = 30 ms; pinned 2 x 512 MiB + CUDA
#   context + NVML ~2-4 s. One verifier rep ~5-8 s, probe.sh (nvidia-smi -q -x) ~1-2 s:
#   3 reps ~20-30 s. nvcc build ~5-20 s. gpu_bench ~5 s (two latency layouts). gpu_torch: import
#   torch and CuPy, NVRTC, ~10-30 s cold. nvidia-smi ~1-3 s. Total ~1-2 min; a slower link scales
#   the copies. The time budget (300 s) stops anything that hangs: the lane ends a few seconds
#   after it at the latest.
#
# Files in $OUT (created if missing), 6 whatever GPU_LANE_REPS is:
#   nvidia-smi-q.txt  probe.txt  verifier.txt  gpu-bench.txt  gpu-torch.txt  lane.log
# probe.txt and verifier.txt hold every repetition between "GPU-LANE-BEGIN <step> rep=<n>" and
# "GPU-LANE-END <step> rep=<n> rc=<exit> seconds=<s>" lines; every step's stderr, the timings
# and the environment go to lane.log. Record the result with
#   .venv/bin/python -m tests.lanes.gpu_record DIR tests/data/gpu-lane-h200
set -u
out=${OUT:?set OUT to the directory the results go to}
case $out in /*) ;; *) out=$PWD/$out ;; esac
mkdir -p "$out" || exit 2
cd "$(dirname "$0")/../.." || exit 2
export PYTHONUNBUFFERED=1
reps=${GPU_LANE_REPS:-3}
size=${GPU_LANE_SIZE_MIB:-512}
copies=${GPU_LANE_COPIES:-16}
samples=${GPU_LANE_SAMPLES:-3}
warmups=${GPU_LANE_WARMUPS:-4}
hops=${GPU_LANE_HOPS:-100000}
arch=${GPU_BENCH_ARCH:-}
py=${GPU_LANE_PYTHON:-python3}
budget=${GPU_LANE_BUDGET_S:-300}
deadline=$(($(date +%s) + budget))
log=$out/lane.log
for f in nvidia-smi-q.txt probe.txt verifier.txt gpu-bench.txt gpu-torch.txt lane.log; do
    : >"$out/$f"
done
tmp=$(mktemp -d "${TMPDIR:-/tmp}/gpu-lane.XXXXXX") || exit 2
trap 'rm -rf "$tmp"' EXIT

stamp() {  # seconds, with a fraction where date has one
    s=$(date +%s.%N 2>/dev/null)
    case $s in *N* | "") date +%s ;; *) echo "$s" ;; esac
}

# limit SECONDS CMD...: CMD for at most SECONDS, never past the deadline; its status in $rc.
limit() {
    want=$1
    shift
    left=$((deadline - $(date +%s)))
    [ "$want" -le "$left" ] || want=$left
    if [ "$want" -lt 5 ]; then
        echo "skipped, the lane's time budget is spent: $*" >>"$log"
        rc=125
        return
    fi
    if command -v timeout >/dev/null 2>&1; then
        timeout -k 5 "$want" "$@"
    else
        "$@"
    fi
    rc=$?
}

# step FILE NAME REP SECONDS CMD...: CMD's stdout into FILE between markers, stderr to the log.
step() {
    s_file=$1 s_name=$2 s_rep=$3 s_secs=$4
    shift 4
    echo "GPU-LANE-BEGIN $s_name rep=$s_rep" >>"$s_file"
    echo "=== $s_name rep=$s_rep: $*" >>"$log"
    t0=$(stamp)
    limit "$s_secs" "$@" >>"$s_file" 2>>"$log"
    took=$(awk "BEGIN { printf \"%.2f\", $(stamp) - $t0 }" 2>/dev/null)
    [ -n "$took" ] || took=0
    echo "GPU-LANE-END $s_name rep=$s_rep rc=$rc seconds=$took" >>"$s_file"
    echo "GPU-LANE-STEP $s_name rep=$s_rep rc=$rc seconds=$took" >>"$log"
}

snapshot() {  # one CSV line of what can drift between runs: clocks, link, temperature, power
    if command -v nvidia-smi >/dev/null 2>&1; then
        echo "GPU-LANE-SMI $1" >>"$log"
        q=name,pci.bus_id,driver_version,pstate,clocks.sm,clocks.mem,clocks.max.sm,temperature.gpu,power.draw
        q=$q,utilization.gpu,pcie.link.gen.current,pcie.link.width.current,pcie.link.gen.max,pcie.link.width.max
        limit 30 nvidia-smi --format=csv --query-gpu="$q" >>"$log" 2>&1
    fi
}

# The GPU's compute capability ("9.0" -> 90), unless GPU_BENCH_ARCH says; 90 when unknown.
if [ -z "$arch" ] && command -v nvidia-smi >/dev/null 2>&1; then
    cap=$(limit 30 nvidia-smi --query-gpu=compute_cap --format=csv,noheader 2>/dev/null | head -n 1 | tr -d ' .\r')
    case $cap in [1-9][0-9] | [1-9][0-9][0-9]) arch=$cap ;; esac
fi
[ -n "$arch" ] || arch=90

{
    echo "GPU-LANE 1 started $(date -u +%Y-%m-%dT%H:%M:%SZ)"
    echo "GPU-LANE-PARAMS reps=$reps size_mib=$size copies=$copies samples=$samples warmups=$warmups hops=$hops arch=sm_$arch budget_s=$budget"
    echo "GPU-LANE-UNAME $(uname -srm)"
    echo "GPU-LANE-CPUS $(getconf _NPROCESSORS_ONLN 2>/dev/null)"
    echo "GPU-LANE-MEM $(grep -m1 MemTotal /proc/meminfo 2>/dev/null)"
    echo "GPU-LANE-PYTHON $(command -v "$py") $("$py" -c 'import sys; print(sys.version.split()[0])' 2>&1)"
    echo "GPU-LANE-COMMIT $(git rev-parse HEAD 2>/dev/null || echo unknown)"
    for f in gpuvfio/guest/payload/verifier.py gpuvfio/guest/payload/probe.sh tests/lanes/gpu_bench.cu \
        tests/lanes/gpu_torch.py; do
        echo "GPU-LANE-SOURCE $(sha256sum "$f" 2>/dev/null || echo "- $f")"
    done
} >>"$log"

# 1. The card as found.
if command -v nvidia-smi >/dev/null 2>&1; then
    limit 60 nvidia-smi -q >"$out/nvidia-smi-q.txt" 2>&1
    [ "$rc" = 0 ] || echo "nvidia-smi -q failed: exit $rc" >>"$out/nvidia-smi-q.txt"
else
    echo "nvidia-smi: not found" >"$out/nvidia-smi-q.txt"
fi
snapshot before

# 2. gpu_bench: built here with nvcc when there is one, else a prebuilt one.
bench=${GPU_BENCH_BIN:-}
if [ -z "$bench" ]; then
    nvcc=$(command -v nvcc 2>/dev/null)
    for candidate in /usr/local/cuda/bin/nvcc /usr/local/cuda-*/bin/nvcc; do
        [ -n "$nvcc" ] || { [ -x "$candidate" ] && nvcc=$candidate; }
    done
    if [ -n "$nvcc" ]; then
        echo "GPU-LANE-NVCC $nvcc $("$nvcc" --version 2>&1 | tail -n 1)" >>"$log"
        step "$out/gpu-bench.txt" build 0 120 "$nvcc" -O2 \
            -gencode "arch=compute_$arch,code=[sm_$arch,compute_$arch]" -o "$tmp/gpu_bench" tests/lanes/gpu_bench.cu
        [ "$rc" = 0 ] && bench=$tmp/gpu_bench
    else
        echo "GPU-LANE-NVCC none (not on PATH, not under /usr/local/cuda*)" >>"$log"
    fi
    if [ -z "$bench" ] && [ -x build/gpu-lane/gpu_bench ]; then
        bench=build/gpu-lane/gpu_bench
        echo "GPU-LANE-BENCH using the prebuilt build/gpu-lane/gpu_bench" >>"$log"
    fi
fi

# 3. The verifier as gpuvfio runs it in a guest (probe first), GPU_LANE_REPS times; after the
# first repetition, 4. the independent measurements with the same sizes: a verifier that hangs
# cannot starve them, and they are measured amid the verifier's repetitions.
verifier_rep() {  # verifier_rep REP [extra verifier arguments]
    v_rep=$1
    shift
    step "$out/probe.txt" probe "$v_rep" 60 sh gpuvfio/guest/payload/probe.sh
    step "$out/verifier.txt" verifier "$v_rep" 120 "$py" gpuvfio/guest/payload/verifier.py --size-mib "$size" \
        --copies "$copies" --samples "$samples" --warmups "$warmups" --hops "$hops" "$@"
}
rep=0
while [ "$rep" -lt "$reps" ]; do
    verifier_rep "$rep" "$@"
    if [ "$rep" = 0 ]; then
        if [ -n "$bench" ]; then
            step "$out/gpu-bench.txt" gpu_bench 0 90 "$bench" --size-mib "$size" --copies "$copies" \
                --samples "$samples" --warmups "$warmups" --hops "$hops"
        else
            echo "GPU-BENCH-SKIPPED no nvcc and no prebuilt build/gpu-lane/gpu_bench" >>"$out/gpu-bench.txt"
        fi
        step "$out/gpu-torch.txt" gpu_torch 0 150 "$py" tests/lanes/gpu_torch.py --size-mib "$size" \
            --copies "$copies" --samples "$samples" --warmups "$warmups" --hops "$hops"
    fi
    rep=$((rep + 1))
done

snapshot after
echo "GPU-LANE 1 finished $(date -u +%Y-%m-%dT%H:%M:%SZ)" >>"$log"
printf 'gpu lane: %s repetitions, %s files in %s\n' "$reps" "$(ls "$out" | wc -l)" "$out"
grep -h '^GPU-LANE-STEP' "$log"
