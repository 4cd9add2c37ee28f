#!/bin/sh
# One rank of examples/weight_sync under `torchrun --no-python` (or with RANK set by hand):
# rank 0 is the PyTorch trainer, the others are tch-dist workers.
#   PYTHON  the Python with torch 2.11.0 (default: the project's .venv)
#   WORKER  the worker binary (default: target/release/examples/weight_sync_worker)
here=$(cd "$(dirname "$0")" && pwd)
root=$(cd "$here/../.." && pwd)
if [ "$RANK" = 0 ]; then
  exec "${PYTHON:-$root/.venv/bin/python}" "$here/trainer.py"
fi
exec "${WORKER:-$root/target/release/examples/weight_sync_worker}"
