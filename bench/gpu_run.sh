#!/bin/bash
# The GPU machine's half of `make gpu-check` (staged as target/gpu-check/run.sh): that machine
# has torch 2.11.0+cu130 in its python3 but no cargo, so everything here was built elsewhere.
#
#   bash target/gpu-check/run.sh        # one device call: at most 5 + 4 minutes, ~3 expected
#
# 1. gpu_check (at most 5 minutes, one GPU): NCCL's eager init and the reducer at world size
#    1, every replicate case in a group of one without shortcuts (TCH_DIST_NO_SHORTCUTS), the
#    CPU time of waiting on a 256 MiB NCCL all_reduce, 2 ranks on cuda:0 through Gloo
#    (TCH_DIST_CUDA_VIA_GLOO) against one process, the duplicate-GPU error, shutdown;
# 2. the benchmark: 403M-parameter MLP, batch 64, SGD: plain tch vs tch-dist (communicating
#    every bucket: TCH_DIST_NO_SHORTCUTS=1) vs PyTorch DDP, world size 1 (GPU_CHECK_BENCH=0
#    skips it).
# Exits 2 (with a message) where there is no CUDA device. docs/PERFORMANCE.md ("GPU") lists
# the expected output.
set -uo pipefail
here=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
PY=${PYTHON:-python3}

torch_dir=$("$PY" -c 'import torch, os; print(os.path.dirname(torch.__file__))' 2>/dev/null) || {
    echo "run.sh: $PY cannot import torch; this script is for the GPU machine" >&2
    exit 2
}
export LD_LIBRARY_PATH="$torch_dir/lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
if ! "$PY" -c 'import sys, torch; sys.exit(0 if torch.cuda.is_available() else 1)'; then
    echo "run.sh: no CUDA device here (torch.cuda.is_available() is False); nothing to run" >&2
    exit 2
fi
"$PY" -c 'import torch; print("torch", torch.__version__, "| cuda", torch.version.cuda, "| nccl", ".".join(map(str, torch.cuda.nccl.version())), "|", torch.cuda.get_device_name(0))'

echo "== 1/2 gpu_check: NCCL on cuda:0, every bucket path, the wait probe, 2 ranks on one GPU"
timeout 300 "$here/gpu_check"
check=$?

bench=0
if [ "${GPU_CHECK_BENCH:-1}" != 0 ]; then
    echo "== 2/2 benchmark: 403M-parameter MLP, batch 64, SGD, world size 1, communicating"
    timeout 240 "$PY" "$here/driver.py" --gpu --bin-dir "$here" --script "$here/pytorch_ddp.py" \
        --python "$PY" -v
    bench=$?
fi

echo "gpu_check_status=$check bench_status=$bench"
[ "$check" -eq 0 ] && [ "$bench" -eq 0 ]
