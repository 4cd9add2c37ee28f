"""Writes a checkpoint of tests/checkpoint.rs's Mlp with PyTorch's own writer, for tch-dist to load.

    python pytorch_save.py DIR FULL                         one process, a plain model
    torchrun --nproc-per-node 2 pytorch_save.py DIR FULL    fully_shard at 2 ranks

DIR: `dcp.save(model.state_dict(), storage_writer=HuggingFaceStorageWriter(DIR))` (at 2 ranks
with `save_distributed=True`: one file per rank, each with its DCP_SHARDING_INFO). FULL: the same
values as one safetensors file, the reference. The model is fc1 Linear(6, 8), fc2 Linear(8, 5),
seeded with 11. Prints `saved 1` in one process, `saved rank R of N` on each of N ranks."""

import os
import sys

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from safetensors.torch import save_file
from torch.distributed.checkpoint import HuggingFaceStorageWriter


class Mlp(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1 = torch.nn.Linear(6, 8)
        self.fc2 = torch.nn.Linear(8, 5)


out, full = sys.argv[1], sys.argv[2]
torch.manual_seed(11)
model = Mlp()
if "RANK" in os.environ:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    dist.init_process_group("gloo")
    fully_shard(model, mesh=init_device_mesh("cpu", (dist.get_world_size(),)))
    writer = HuggingFaceStorageWriter(out, save_distributed=True)
    dcp.save(model.state_dict(), storage_writer=writer)
    whole = {k: v.full_tensor().contiguous() for k, v in model.state_dict().items()}
    if dist.get_rank() == 0:
        save_file(whole, full)
    # As pytorch_load.py: every rank's verdict once all are done, no Gloo teardown.
    dist.barrier()
    print(f"saved rank {dist.get_rank()} of {dist.get_world_size()}", flush=True)
    sys.stderr.flush()
    os._exit(0)
else:
    dcp.save(model.state_dict(), storage_writer=HuggingFaceStorageWriter(out), no_dist=True)
    save_file({k: v.contiguous() for k, v in model.state_dict().items()}, full)
    print("saved 1", flush=True)
