"""PyTorch loads a train_ddp checkpoint with its optimizer state.

    python pytorch_load.py STEP_DIR

STEP_DIR: a folder train_ddp wrote (`--checkpoint-dir`). The model and the SGD optimizer
are train_ddp's; `dcp.load` with HuggingFaceStorageReader fills the model's state dict and
`get_optimizer_state_dict`'s `state` (the checkpoint's `optim.state.<fqn>.<name>` tensors),
the sidecar gives `param_groups`; `set_optimizer_state_dict` installs both. Prints `ok`
when every loaded tensor equals the file's."""

import json
import sys

import torch
import torch.distributed.checkpoint as dcp
from safetensors.torch import load_file
from torch.distributed.checkpoint import HuggingFaceStorageReader
from torch.distributed.checkpoint.state_dict import (
    get_optimizer_state_dict,
    set_optimizer_state_dict,
)


class Net(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1 = torch.nn.Linear(64, 128)
        self.fc2 = torch.nn.Linear(128, 10)

    def forward(self, x):
        return self.fc2(self.fc1(x).relu())


ckpt = sys.argv[1]
model = Net()
opt = torch.optim.SGD(model.parameters(), lr=1.0, momentum=0.5)
# A first step, so that the optimizer's state has the momentum buffers to load into.
model(torch.randn(2, 64)).sum().backward()
opt.step()
sd = model.state_dict()
osd = get_optimizer_state_dict(model, opt)
dcp.load(
    {**sd, "optim": {"state": osd["state"]}},
    storage_reader=HuggingFaceStorageReader(ckpt),
    no_dist=True,
)
osd["param_groups"] = json.load(open(f"{ckpt}/optimizer.json"))["param_groups"]
model.load_state_dict(sd)
set_optimizer_state_dict(model, opt, osd)
saved = {}
for name in ("shard-00001-model-00001-of-00001.safetensors",):
    saved.update(load_file(f"{ckpt}/{name}"))
for fqn, p in model.named_parameters():
    assert torch.equal(p.detach(), saved[fqn]), fqn
    buf = opt.state[p]["momentum_buffer"]
    assert torch.equal(buf, saved[f"optim.state.{fqn}.momentum_buffer"]), fqn
group = opt.param_groups[0]
assert (group["lr"], group["momentum"], group["nesterov"]) == (0.05, 0.9, False), group
print("ok", flush=True)
