#!/bin/bash
# `make gpu-check`: stages into one folder (default target/gpu-check) what the GPU machine
# needs, from the release build: the launcher, the benchmark and the correctness binaries
# (stripped), the PyTorch side, the driver and run.sh. Then runs here what a CPU machine can.
set -euo pipefail
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
dest=${1:-target/gpu-check}
rel=$root/target/release

rm -rf "$dest"
mkdir -p "$dest"
for bin in "$rel/tch-dist-run" "$rel/examples/bench_ddp" "$rel/examples/gpu_check"; do
    cp "$bin" "$dest/"
    strip "$dest/$(basename "$bin")"
done
cp "$root/bench/pytorch_ddp.py" "$root/bench/driver.py" "$root/bench/runner.py" \
    "$root/bench/figures.py" "$root/bench/charts.py" "$dest/"
cp "$root/bench/gpu_run.sh" "$dest/run.sh"
chmod +x "$dest/run.sh"

# The shim must have been compiled with NCCL (runtime/build.rs finds the venv's headers).
if ! nm -D --undefined-only "$dest/bench_ddp" | grep ProcessGroupNCCL >/dev/null; then
    echo "stage_gpu: the binaries were built without NCCL (run \`make setup\`, then rebuild)" >&2
    exit 1
fi
bytes=$(du -sb "$dest" | cut -f1)
limit=$((64 * 1024 * 1024))
if [ "$bytes" -gt "$limit" ]; then
    echo "stage_gpu: $dest is $bytes bytes, over the 64 MiB the device call carries" >&2
    exit 1
fi

# What can run here: the whole check on CPU with Gloo (its NCCL-only parts skipped)...
if ! timeout 300 "$dest/gpu_check" --cpu >"$dest/.cpu-smoke.log" 2>&1; then
    cat "$dest/.cpu-smoke.log" >&2
    echo "stage_gpu: gpu_check --cpu failed (above); fix it before spending device time" >&2
    exit 1
fi
grep -E '^(ok|skip|FAILED|gpu_check)' "$dest/.cpu-smoke.log"
rm "$dest/.cpu-smoke.log"
# ...and both entry points must refuse cleanly without CUDA.
set +e
"$dest/gpu_check" >/dev/null 2>&1
check=$?
PYTHON="$root/.venv/bin/python" bash "$dest/run.sh" >/dev/null 2>&1
run=$?
set -e
if [ "$check" -ne 2 ] || [ "$run" -ne 2 ]; then
    if "$root/.venv/bin/python" -c 'import sys, torch; sys.exit(0 if torch.cuda.is_available() else 1)'; then
        echo "stage_gpu: this machine has CUDA; run \`bash $dest/run.sh\` here"
    else
        echo "stage_gpu: without CUDA, gpu_check exited $check and run.sh $run (expected 2 and 2)" >&2
        exit 1
    fi
fi

ls -l "$dest"
echo "staged $dest ($((bytes / 1024)) KiB); on the GPU machine: bash $dest/run.sh"
echo "(device call: command \`bash $dest/run.sh\`, carry [\"$dest\"])"
