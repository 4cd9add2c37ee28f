"""Loads a pipelined tch-dist checkpoint into PyTorch's unsplit model, in one process.

    python pytorch_load.py CKPT FULL

CKPT: a folder that the stages of tests/pipelining/composition.rs saved (each stage its
layers' shards, under the whole model's names); FULL: the one-process reference
(safetensors). The model is composition.rs's Chain: `layers` = Linear(5, 8), Linear(8, 6),
Linear(6, 4). Prints `ok` when every tensor equals the reference within 1e-5."""

import sys

import torch
import torch.distributed.checkpoint as dcp
from safetensors.torch import load_file
from torch.distributed.checkpoint import HuggingFaceStorageReader


class Chain(torch.nn.Module):
    def __init__(self):
        super().__init__()
        dims = [5, 8, 6, 4]
        self.layers = torch.nn.ModuleList(
            torch.nn.Linear(a, b) for a, b in zip(dims, dims[1:])
        )


ckpt, full = sys.argv[1], sys.argv[2]
expected = load_file(full)
model = Chain()
sd = model.state_dict()
dcp.load(sd, storage_reader=HuggingFaceStorageReader(ckpt), no_dist=True)
got = model.state_dict()
assert sorted(got) == sorted(expected), (sorted(got), sorted(expected))
for k, v in expected.items():
    assert torch.allclose(got[k], v, atol=1e-5, rtol=0), (k, got[k], v)
print("ok", flush=True)
