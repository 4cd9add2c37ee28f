"""Loads a tch-dist checkpoint with PyTorch's own reader and compares with the reference.

    python pytorch_load.py CKPT FULL            one process (no_dist)
    torchrun --nproc-per-node 3 pytorch_load.py CKPT FULL   fully_shard at 3 ranks

CKPT: a folder written by tch_dist::checkpoint::save; FULL: the unsharded reference
(safetensors). The model is tests/checkpoint.rs's Mlp: fc1 Linear(6, 8), fc2 Linear(8, 5).
Prints `ok 1` in one process, `ok rank R of N` on each of N ranks, when every tensor equals
the reference."""

import os
import sys

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from safetensors.torch import load_file
from torch.distributed.checkpoint import HuggingFaceStorageReader


class Mlp(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1 = torch.nn.Linear(6, 8)
        self.fc2 = torch.nn.Linear(8, 5)


ckpt, full = sys.argv[1], sys.argv[2]
expected = load_file(full)
model = Mlp()
distributed = "RANK" in os.environ
if distributed:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    dist.init_process_group("gloo")
    fully_shard(model, mesh=init_device_mesh("cpu", (dist.get_world_size(),)))
    sd = model.state_dict()
    dcp.load(sd, storage_reader=HuggingFaceStorageReader(ckpt))
    got = {k: v.full_tensor() for k, v in model.state_dict().items()}
else:
    sd = model.state_dict()
    dcp.load(sd, storage_reader=HuggingFaceStorageReader(ckpt), no_dist=True)
    got = model.state_dict()
assert sorted(got) == sorted(expected), (sorted(got), sorted(expected))
for k, v in expected.items():
    assert torch.equal(got[k], v), (k, got[k], v)
if not distributed:
    print("ok 1", flush=True)
else:
    # Every rank prints its own verdict once every rank has checked (the barrier), then leaves
    # without tearing Gloo down: the test judges these lines, never the interpreter's exit
    # (a rank destroying its group while a peer still ran aborted once in Gloo's teardown:
    # "terminate called without an active exception").
    dist.barrier()
    print(f"ok rank {dist.get_rank()} of {dist.get_world_size()}", flush=True)
    sys.stderr.flush()
    os._exit(0)
