"""Loads a tch-dist checkpoint with PyTorch's own reader and compares with the reference.

    python pytorch_load.py CKPT FULL            one process (no_dist)
    torchrun --nproc-per-node 3 pytorch_load.py CKPT FULL   fully_shard at 3 ranks

CKPT: a folder written by tch_dist::checkpoint::save; FULL: the unsharded reference
(safetensors). The model is tests/checkpoint.rs's Mlp: fc1 Linear(6, 8), fc2 Linear(8, 5).
Prints `ok N` (N: the world size) when every tensor equals the reference."""

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
n = dist.get_world_size() if distributed else 1
if not distributed or dist.get_rank() == 0:
    print(f"ok {n}", flush=True)
if distributed:
    # Every rank done before any tears Gloo down (one rank destroying its group while a
    # peer still checks aborted it once: "terminate called without an active exception").
    dist.barrier()
    dist.destroy_process_group()
