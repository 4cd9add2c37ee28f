"""Loads tch-dist checkpoints with PyTorch's own reader and compares with the references.

    python pytorch_load.py CKPT FULL [CKPT FULL ...]     one process (no_dist)
    RANK=.. WORLD_SIZE=3 ... pytorch_load.py CKPT FULL [CKPT FULL ...]
                                                       fully_shard at 3 ranks, and rank 0
                                                       first in one process (no_dist)

CKPT: a folder written by tch_dist::checkpoint::save; FULL: the unsharded reference
(safetensors). The model is tests/checkpoint.rs's Mlp: fc1 Linear(6, 8), fc2 Linear(8, 5).
Prints `ok 1 CKPT` after each one-process load, and `ok rank R of N` on each of N ranks when
every checkpoint's every tensor equals its reference there."""

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


def check(got, expected):
    assert sorted(got) == sorted(expected), (sorted(got), sorted(expected))
    for k, v in expected.items():
        assert torch.equal(got[k], v), (k, got[k], v)


pairs = list(zip(sys.argv[1::2], sys.argv[2::2]))
distributed = "RANK" in os.environ
# In one process: alone, or on rank 0 before the job's group exists (one start of torch
# serves both checks).
if not distributed or os.environ["RANK"] == "0":
    for ckpt, full in pairs:
        model = Mlp()
        sd = model.state_dict()
        dcp.load(sd, storage_reader=HuggingFaceStorageReader(ckpt), no_dist=True)
        check(model.state_dict(), load_file(full))
        print(f"ok 1 {ckpt}", flush=True)
if distributed:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    dist.init_process_group("gloo")
    for ckpt, full in pairs:
        model = Mlp()
        fully_shard(model, mesh=init_device_mesh("cpu", (dist.get_world_size(),)))
        sd = model.state_dict()
        dcp.load(sd, storage_reader=HuggingFaceStorageReader(ckpt))
        check({k: v.full_tensor() for k, v in model.state_dict().items()}, load_file(full))
    # Every rank prints its own verdict once every rank has checked (the barrier), then leaves
    # without tearing Gloo down: the test judges these lines, never the interpreter's exit
    # (a rank destroying its group while a peer still ran aborted once in Gloo's teardown:
    # "terminate called without an active exception").
    dist.barrier()
    print(f"ok rank {dist.get_rank()} of {dist.get_world_size()}", flush=True)
    sys.stderr.flush()
    os._exit(0)
