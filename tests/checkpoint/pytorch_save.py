"""Writes checkpoints of tests/checkpoint.rs's Mlp with PyTorch's own writer, for tch-dist to load.

    python pytorch_save.py DIR FULL                    one process, a plain model
    RANK=.. WORLD_SIZE=2 ... pytorch_save.py DIR FULL [PLAIN_DIR PLAIN_FULL]
                                                       fully_shard at 2 ranks (and rank 0
                                                       first the plain model, in one process)

DIR: `dcp.save(model.state_dict(), storage_writer=HuggingFaceStorageWriter(DIR))` (at 2 ranks
with `save_distributed=True`: one file per rank, each with its DCP_SHARDING_INFO). FULL: the same
values as one safetensors file, the reference. The model is fc1 Linear(6, 8), fc2 Linear(8, 5),
seeded with 11. Prints `saved 1` after a one-process save, `saved rank R of N` on each of N
ranks."""

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


def save_plain(out, full):
    torch.manual_seed(11)
    model = Mlp()
    dcp.save(model.state_dict(), storage_writer=HuggingFaceStorageWriter(out), no_dist=True)
    save_file({k: v.contiguous() for k, v in model.state_dict().items()}, full)
    print("saved 1", flush=True)


out, full = sys.argv[1], sys.argv[2]
if "RANK" not in os.environ:
    save_plain(out, full)
    sys.exit(0)
# Rank 0 writes the plain model first, before the job's group exists (one start of torch
# serves both).
if len(sys.argv) == 5 and os.environ["RANK"] == "0":
    save_plain(sys.argv[3], sys.argv[4])

from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard

torch.manual_seed(11)
model = Mlp()
dist.init_process_group("gloo")
fully_shard(model, mesh=init_device_mesh("cpu", (dist.get_world_size(),)))
writer = HuggingFaceStorageWriter(out, save_distributed=True)
dcp.save(model.state_dict(), storage_writer=writer)
whole = {k: v.full_tensor().contiguous() for k, v in model.state_dict().items()}
if dist.get_rank() == 0:
    save_file(whole, full)
dist.barrier()
print(f"saved rank {dist.get_rank()} of {dist.get_world_size()}", flush=True)
sys.stderr.flush()
os._exit(0)
