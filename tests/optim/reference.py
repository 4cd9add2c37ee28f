"""torch.optim's SGD and AdamW on the inputs tests/optim.rs wrote, for the parity check.

    python reference.py INPUTS OUTPUTS CASES_JSON

INPUTS (safetensors): `init.<name>` the parameters' first values, `grad.<step>.<name>` the
gradient of a parameter at a step (absent: no gradient at that step, `p.grad = None`).
CASES_JSON: a list of {"opt": "SGD"|"AdamW", "kwargs": {...}, "lr_at": {step: lr}}.
OUTPUTS (safetensors): `<case>.param.<name>` after the last step, and
`<case>.state.<name>.<key>` for every state tensor."""

import json
import sys

import torch
from safetensors.torch import load_file, save_file

inputs = load_file(sys.argv[1])
cases = json.loads(sys.argv[3])
names = sorted(k[len("init."):] for k in inputs if k.startswith("init."))
steps = 1 + max(int(k.split(".")[1]) for k in inputs if k.startswith("grad."))
out = {}
for c, case in enumerate(cases):
    params = {n: torch.nn.Parameter(inputs[f"init.{n}"].clone()) for n in names}
    cls = {"SGD": torch.optim.SGD, "AdamW": torch.optim.AdamW}[case["opt"]]
    opt = cls(list(params.values()), **case["kwargs"])
    for step in range(steps):
        lr = case["lr_at"].get(str(step))
        if lr is not None:
            for g in opt.param_groups:
                g["lr"] = lr
        for n, p in params.items():
            g = inputs.get(f"grad.{step}.{n}")
            p.grad = None if g is None else g.clone()
        opt.step()
    for n, p in params.items():
        out[f"{c}.param.{n}"] = p.detach().clone()
        for k, v in opt.state.get(p, {}).items():
            if torch.is_tensor(v):
                out[f"{c}.state.{n}.{k}"] = v.detach().clone().reshape(v.shape)
save_file(out, sys.argv[2])
print("ok", len(cases))
