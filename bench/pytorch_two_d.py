"""The 2-D benchmark's PyTorch side: the suite's transformer on 4 ranks laid out as a 2x2
mesh, as examples/bench_ddp/two_d.rs lays out tch-dist's (see there and docs/PERFORMANCE.md,
"2-D parallelism (HSDP, FSDP x TP)").

    tch-dist-run --nproc-per-node 4 -- python3 bench/pytorch_two_d.py --mode hsdp|fsdp_tp
        [--steps N] [--warmup N] [--batch N] [--lr LR]

- `hsdp`: `fully_shard(block, mesh=init_device_mesh("cpu", (2, 2),
  mesh_dim_names=("dp_replicate", "dp_shard")))` on each block, then on the root; every rank
  trains its own batch;
- `fsdp_tp`: mesh (2, 2) named ("dp", "tp"); `parallelize_module(model, mesh["tp"], plan)`
  with q, k, v and fc1 `ColwiseParallel()`, proj and fc2 `RowwiseParallel()` in every block,
  then `fully_shard(..., mesh=mesh["dp"])` on each block and the root; the tp ranks of a dp
  group train the same batch.

The model is bench/pytorch_ddp.py's transformer with separate q, k and v Linear(dim, dim)
(a fused qkv's column split would not hand a tp rank whole heads) and a forward whose head
count is the local one (q's local output width / the head width). AdamW (lr 1e-3) with
`fused=True`, PyTorch's fastest CPU AdamW. One torch thread per rank, Gloo. Prints one
`BENCH {json}` line per rank, with the fields driver.py reads (as pytorch_ddp.py's).
"""

import argparse
import json
import resource
import statistics
import time

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

from pytorch_ddp import (
    T_BLOCKS,
    T_DIM,
    T_SEQ,
    T_VOCAB,
    Transformer,
    add_net,
    attention,
    cpu_ms,
    eth0_bytes,
    held_bytes,
    machine_busy_ms,
    rss_mib,
)


def sys_ms():
    """System CPU time (all threads) so far, in ms (two_d.rs's sys_ms)."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_stime * 1e3


class TpBlock(nn.Module):
    """bench/pytorch_ddp.py's Block with separate q, k and v (two_d.rs's TpBlock)."""

    def __init__(self):
        super().__init__()
        d = T_DIM
        self.ln1 = nn.LayerNorm(d)
        self.q = nn.Linear(d, d)
        self.k = nn.Linear(d, d)
        self.v = nn.Linear(d, d)
        self.proj = nn.Linear(d, d)
        self.ln2 = nn.LayerNorm(d)
        self.fc1 = nn.Linear(d, 4 * d)
        self.fc2 = nn.Linear(4 * d, d)

    def forward(self, x, mask):
        h = self.ln1(x)
        # Over q's width: T_DIM whole, T_DIM / tp under ColwiseParallel (a local tensor).
        x = x + self.proj(attention(self.q(h), self.k(h), self.v(h), mask))
        return x + self.fc2(F.gelu(self.fc1(self.ln2(x))))


def lay_out(mode, model):
    """Applies the layout; returns which data-parallel replica this rank is (its batch)."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    if mode == "hsdp":
        mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp_replicate", "dp_shard"))
        for b in model.blocks:
            fully_shard(b, mesh=mesh)
        fully_shard(model, mesh=mesh)
        return dist.get_rank()  # all four ranks are data-parallel
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        RowwiseParallel,
        parallelize_module,
    )

    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    plan = {}
    for i in range(T_BLOCKS):
        for l in ("q", "k", "v", "fc1"):
            plan[f"blocks.{i}.{l}"] = ColwiseParallel()
        for l in ("proj", "fc2"):
            plan[f"blocks.{i}.{l}"] = RowwiseParallel()
    parallelize_module(model, mesh["tp"], plan)
    for b in model.blocks:
        fully_shard(b, mesh=mesh["dp"])
    fully_shard(model, mesh=mesh["dp"])
    return mesh["dp"].get_local_rank()  # the tp ranks of a dp group share its batch


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--mode", required=True, choices=["hsdp", "fsdp_tp"])
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--steps", type=int, default=15)
    p.add_argument("--batch", type=int, default=2)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--model", default=None, help="ignored (driver.py's common arguments)")
    a = p.parse_args()
    if a.threads > 0:
        torch.set_num_threads(a.threads)
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    if world != 4:
        raise SystemExit(f"--mode {a.mode}: 4 ranks (a 2x2 mesh), not {world}")
    torch.manual_seed(0)
    model = Transformer(block=TpBlock)
    model.train()
    n_params = sum(t.numel() for t in model.parameters())
    n_tensors = len(list(model.parameters()))
    replica = lay_out(a.mode, model)
    opt = torch.optim.AdamW(model.parameters(), lr=a.lr, fused=True)
    torch.manual_seed(1 + replica)
    # Drawn as bench/pytorch_ddp.py's transformer batch (ids, then next-token targets).
    idx = torch.randint(T_VOCAB, (a.batch, T_SEQ))
    nxt = torch.randint(T_VOCAB, (a.batch, T_SEQ))

    steps, fwd, bwd, upd = [], [], [], []
    losses = []  # the first and last steps' (two_d.rs's `losses`)
    dist.barrier()
    cpu0 = busy0 = wall0 = sys0 = 0.0
    net0 = None
    for i in range(a.warmup + a.steps):
        if i == a.warmup:
            cpu0, busy0, wall0 = cpu_ms(), machine_busy_ms(), time.perf_counter()
            sys0 = sys_ms()
            net0 = eth0_bytes()
        t0 = time.perf_counter()
        opt.zero_grad()
        loss = F.cross_entropy(model(idx).view(-1, T_VOCAB), nxt.view(-1))
        t1 = time.perf_counter()
        loss.backward()
        t2 = time.perf_counter()
        opt.step()
        t3 = time.perf_counter()
        if i == 0 or i + 1 == a.warmup + a.steps:
            losses.append(loss.detach())
        if i >= a.warmup:
            steps.append((t3 - t0) * 1e3)
            fwd.append((t1 - t0) * 1e3)
            bwd.append((t2 - t1) * 1e3)
            upd.append((t3 - t2) * 1e3)
    net = {}
    add_net(net, net0, a.steps)
    window = {
        "wall_ms": (time.perf_counter() - wall0) * 1e3,
        "cpu_ms": cpu_ms() - cpu0,
        "machine_busy_ms": machine_busy_ms() - busy0,
    }
    sys_per_step = (sys_ms() - sys0) / a.steps
    peak, cur = rss_mib()
    param_bytes, grad_bytes, optim_bytes = held_bytes(model, opt)
    out = {
        "cpu_ms": window["cpu_ms"] / a.steps,
        "sys_ms": sys_per_step,
        "window": window,
        "impl": "pytorch",
        "mode": a.mode,
        "model": "transformer_tp",
        "params": n_params,
        "param_tensors": n_tensors,
        "batch": a.batch,
        "replica": replica,
        "rank": rank,
        "world": world,
        "threads": torch.get_num_threads(),
        "median_ms": statistics.median(steps),
        "fwd_ms": statistics.median(fwd),
        "bwd_ms": statistics.median(bwd),
        "opt_ms": statistics.median(upd),
        "peak_rss_mib": peak,
        "rss_mib": cur,
        "steps_ms": steps,
        "losses": [l.item() for l in losses],
        "torch": torch.__version__,
        "optim": "adamw_fused",
        "param_bytes": param_bytes,
        "grad_bytes": grad_bytes,
        "optim_bytes": optim_bytes,
        "state_bytes": param_bytes + grad_bytes + optim_bytes,
        **net,
    }
    print("BENCH " + json.dumps(out), flush=True)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
