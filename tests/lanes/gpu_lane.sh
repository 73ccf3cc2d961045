#!/bin/sh
# GPU lane: run on the device tool's machine (one H200 passed through to a VM: itself a
# "passthrough" variant measured from inside its guest). Stdlib and POSIX sh only -- that
# machine has none of gpuvfio's dependencies. Raw outputs go to $OUT (at most 8 files
# come back); convert them here with
#   .venv/bin/python -m tests.lanes.gpu_record FETCHED_DIR tests/data/gpu-lane-h200
# and commit tests/data/gpu-lane-h200 (tests/test_gpu_record.py then reports from it).
# Extra arguments go to the verifier (e.g. --size-mib 1024). Leaves the card's settings alone.
set -eu
out=${OUT:?set OUT to the directory the results go to}
reps=${GPU_LANE_REPS:-3}
nvidia-smi -q >"$out/nvidia-smi-q.txt" 2>&1 || echo "nvidia-smi failed: $?" >>"$out/nvidia-smi-q.txt"
rep=0
while [ "$rep" -lt "$reps" ]; do
    sh gpuvfio/guest/payload/probe.sh >"$out/probe-$rep.txt"
    python3 gpuvfio/guest/payload/verifier.py "$@" >"$out/verifier-$rep.txt"
    rep=$((rep + 1))
done
printf 'gpu lane: %s repetitions in %s\n' "$reps" "$out"
