"""Loads an FSDP x TP tch-dist checkpoint with PyTorch's own reader and compares with the reference.

    python pytorch_load_2d.py CKPT FULL                    one process, a plain model
    RANK=.. WORLD_SIZE=4 ... pytorch_load_2d.py CKPT FULL  FSDP x TP on a 2x2 mesh, and rank 0
                                                           first a plain model, in one process

CKPT: a folder that tests/fully_shard/two_d.rs saved from its 2x2 (dp x tp) model; FULL: the
one-process reference (safetensors). The model is two_d.rs's Lm: `tok` Embedding(11, 8), two
`blocks` of fc1 Linear(8, 14) and fc2 Linear(14, 8), `norm` LayerNorm(8), `head`
Linear(8, 11). At 4 ranks it is parallelized as two_d.rs parallelizes it (the tp plan over
the mesh's "tp" dim, then fully_shard per block and on the root over "dp"), so each rank
reads its own 2-D pieces. Prints `ok 1` after the one-process load, `ok rank R of N` on each of N ranks,
when every tensor equals the reference within 1e-5."""

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
        self.fc1 = torch.nn.Linear(8, 14)
        self.fc2 = torch.nn.Linear(14, 8)


class Lm(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.tok = torch.nn.Embedding(11, 8)
        self.blocks = torch.nn.ModuleList(Mlp() for _ in range(2))
        self.norm = torch.nn.LayerNorm(8)
        self.head = torch.nn.Linear(8, 11)


def check(got, expected):
    assert sorted(got) == sorted(expected), (sorted(got), sorted(expected))
    for k, v in expected.items():
        assert torch.allclose(got[k], v, atol=1e-5, rtol=0), (k, got[k], v)


ckpt, full = sys.argv[1], sys.argv[2]
expected = load_file(full)
# In one process: alone, or on rank 0 before the job's group exists (one start of torch
# serves both checks).
if os.environ.get("RANK", "0") == "0":
    model = Lm()
    sd = model.state_dict()
    dcp.load(sd, storage_reader=HuggingFaceStorageReader(ckpt), no_dist=True)
    check(model.state_dict(), expected)
    print("ok 1", flush=True)
if "RANK" in os.environ:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import Replicate
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        RowwiseParallel,
        parallelize_module,
    )

    model = Lm()
    dist.init_process_group("gloo")
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    plan = {"tok": RowwiseParallel(input_layouts=Replicate())}
    for i in range(2):
        plan[f"blocks.{i}.fc1"] = ColwiseParallel()
        plan[f"blocks.{i}.fc2"] = RowwiseParallel()
    plan["head"] = ColwiseParallel(output_layouts=Replicate())
    parallelize_module(model, mesh["tp"], plan)
    for block in model.blocks:
        fully_shard(block, mesh=mesh["dp"])
    fully_shard(model, mesh=mesh["dp"])
    sd = model.state_dict()
    dcp.load(sd, storage_reader=HuggingFaceStorageReader(ckpt))
    check({k: v.full_tensor() for k, v in model.state_dict().items()}, expected)
    print(f"ok rank {dist.get_rank()} of {dist.get_world_size()}", flush=True)
    dist.destroy_process_group()
