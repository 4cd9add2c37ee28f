"""The MoE layer as torchtitan computes it, written token by token (no grouping, no sort):
the oracle of tests/moe/main.rs. Reads the layer's tensors, the input `x` and the upstream
gradient `g` from a safetensors file, writes the output, the auxiliary loss and every
gradient to another.

    python reference.py IN.safetensors OUT.safetensors CONFIG_JSON
"""

import json
import sys

import torch
import torch.nn.functional as F
from safetensors.torch import load_file, save_file

t = load_file(sys.argv[1])
cfg = json.loads(sys.argv[3])
names = [n for n in t if n not in ("x", "g", "bias")]
for n in names + ["x"]:
    t[n].requires_grad_(True)
x, E, K = t["x"].reshape(-1, cfg["dim"]), cfg["experts"], cfg["top_k"]
logits = x @ t["gate"].T
scores = torch.softmax(logits, dim=-1) if cfg["softmax"] else torch.sigmoid(logits)
selecting = scores + t["bias"] if cfg["load_balance"] else scores
# Ties toward the lower expert, as tch-dist documents (torch.topk's order is unspecified).
idx = torch.sort(selecting.detach(), dim=-1, descending=True, stable=True).indices[:, :K]
weights = scores.gather(1, idx)
if cfg["route_norm"]:
    weights = weights / (weights.sum(-1, keepdim=True) + 1e-20)
weights = weights * cfg["route_scale"]
rows = []
for tok in range(x.shape[0]):
    acc = torch.zeros_like(x[tok])
    for j in range(K):
        e = idx[tok, j]
        h = F.silu(x[tok] @ t["w1"][e].T) * (x[tok] @ t["w3"][e].T)
        acc = acc + weights[tok, j] * (h @ t["w2"][e].T)
    rows.append(acc)
out = torch.stack(rows)
if "s1" in t:
    out = out + (F.silu(x @ t["s1"].T) * (x @ t["s3"].T)) @ t["s2"].T
counts = torch.bincount(idx.flatten(), minlength=E).to(scores.dtype)
share = counts * (E / (K * x.shape[0]))
mean_score = (scores / (scores.sum(-1, keepdim=True) + 1e-20)).mean(0)
aux = (share * mean_score).sum() * cfg["aux_alpha"]
(((out.reshape(t["g"].shape)) * t["g"]).sum() + aux).backward()
result = {"out": out.detach().reshape(t["g"].shape), "aux": aux.detach().reshape(1), "counts": counts}
result.update({"grad_" + n: t[n].grad for n in names + ["x"]})
save_file({k: v.contiguous() for k, v in result.items()}, sys.argv[2])
