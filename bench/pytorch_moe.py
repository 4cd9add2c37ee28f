"""The MoE benchmark's PyTorch side, torchtitan's approach on CPU: a stack of MoE layers
(examples/bench_ddp/moe.rs builds the same with `tch_dist::nn::moe`) on 4 ranks, the routed
experts split over every rank (expert parallelism: each rank holds EXPERTS / world of them;
the counts exchanged first, then the tokens, with `all_to_all_single` of variable split
sizes, differentiable, as torchtitan's `AllToAllTokenDispatcher`), and `fully_shard` on each
layer and the root over every rank with the experts left out (`ignored_params`: with ep equal
to dp, torchtitan's expert mesh `efsdp` has one rank and FSDP does nothing to them).

    tch-dist-run --nproc-per-node 4 -- python3 bench/pytorch_moe.py [--steps N] [--warmup N]

Each layer: `x + moe(x)`; the router scores tokens with a sigmoid over `gate`, adds the
load-balancing bias (zeros: no update is timed) to select the top 2 of 8 experts, weighs
by the unbiased scores; SwiGLU experts of width HIDDEN run per expert over the tokens
grouped by expert (torchtitan's for-loop path, the CPU having no grouped GEMM); a shared
expert of width HIDDEN beside them. The loss is the MSE against a random target; SGD (lr
0.01). The experts' gradients gather every rank's tokens: divided by the ranks, they are the
gradients of the mean of the ranks' losses, as FSDP averages the rest. One torch thread per
rank, Gloo. Prints one `BENCH {json}` line per rank with the fields driver.py reads.
"""

import argparse
import json
import statistics
import time

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed.nn.functional import all_to_all_single

from pytorch_ddp import cpu_ms, machine_busy_ms, rss_mib

# The same sizes as examples/bench_ddp/moe.rs.
DIM, HIDDEN, EXPERTS, TOP_K, LAYERS, TOKENS = 128, 256, 8, 2, 2, 1024


class FeedForward(nn.Module):
    def __init__(self):
        super().__init__()
        self.w1 = nn.Linear(DIM, HIDDEN, bias=False)
        self.w2 = nn.Linear(HIDDEN, DIM, bias=False)
        self.w3 = nn.Linear(DIM, HIDDEN, bias=False)

    def forward(self, x):
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class MoE(nn.Module):
    def __init__(self, world):
        super().__init__()
        self.world, self.local = world, EXPERTS // world
        self.gate = nn.Linear(DIM, EXPERTS, bias=False)
        self.w1 = nn.Parameter(torch.randn(self.local, HIDDEN, DIM) * 0.02)
        self.w2 = nn.Parameter(torch.randn(self.local, DIM, HIDDEN) * 0.02)
        self.w3 = nn.Parameter(torch.randn(self.local, HIDDEN, DIM) * 0.02)
        self.shared = FeedForward()
        self.register_buffer("expert_bias", torch.zeros(EXPERTS))

    def experts(self):
        return [self.w1, self.w2, self.w3]

    def forward(self, x):
        scores = torch.sigmoid(self.gate(x).float())
        _, experts = torch.topk(scores + self.expert_bias, TOP_K, dim=-1)
        weights = scores.gather(1, experts)
        slots = experts.reshape(-1)
        order = torch.argsort(slots, stable=True)
        token = order // TOP_K
        counts = torch.bincount(slots, minlength=EXPERTS)
        rows = x[token]
        # The counts first: each rank learns how many rows of each of its experts come from
        # each rank ([world, local], source-major), then the rows.
        theirs = torch.empty_like(counts)
        dist.all_to_all_single(theirs, counts)
        to_rank = counts.view(self.world, self.local).sum(1).tolist()
        theirs = theirs.view(self.world, self.local)
        from_rank = theirs.sum(1).tolist()
        received = all_to_all_single(
            torch.empty(sum(from_rank), DIM), rows, from_rank, to_rank
        )
        # Source-major to expert-major (torchtitan's permute indices), run, and back.
        starts = [0]
        for n in from_rank[:-1]:
            starts.append(starts[-1] + n)
        perm, per_expert = [], []
        for e in range(self.local):
            for s in range(self.world):
                before = int(theirs[s, :e].sum())
                n = int(theirs[s, e])
                perm.extend(range(starts[s] + before, starts[s] + before + n))
            per_expert.append(int(theirs[:, e].sum()))
        perm = torch.tensor(perm, dtype=torch.long)
        grouped = received[perm]
        outs = []
        for e, chunk in enumerate(torch.split(grouped, per_expert)):
            h = F.silu(chunk @ self.w1[e].t()) * (chunk @ self.w3[e].t())
            outs.append(h @ self.w2[e].t())
        out = torch.cat(outs)[torch.argsort(perm)]
        returned = all_to_all_single(torch.empty(sum(to_rank), DIM), out, to_rank, from_rank)
        weighted = returned * weights.reshape(-1)[order].unsqueeze(1).to(returned.dtype)
        routed = torch.zeros_like(x).index_add(0, token, weighted)
        return routed + self.shared(x)


class Stack(nn.Module):
    def __init__(self, world):
        super().__init__()
        self.layers = nn.ModuleList(MoE(world) for _ in range(LAYERS))

    def forward(self, x):
        for layer in self.layers:
            x = x + layer(x)
        return x


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--model", default=None, help="ignored (driver.py's common arguments)")
    p.add_argument("--mode", default="moe", help="ignored (driver.py's common arguments)")
    a = p.parse_args()
    if a.threads > 0:
        torch.set_num_threads(a.threads)
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    from torch.distributed.fsdp import fully_shard

    torch.manual_seed(0)
    model = Stack(world)
    n_params = sum(t.numel() for t in model.parameters())
    experts = [p for layer in model.layers for p in layer.experts()]
    for layer in model.layers:
        fully_shard(layer, ignored_params=set(layer.experts()))
    fully_shard(model, ignored_params=set(experts))
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    torch.manual_seed(1 + rank)
    x = torch.randn(TOKENS, DIM)
    target = torch.randn(TOKENS, DIM)

    steps, fwd, bwd = [], [], []
    dist.barrier()
    cpu0 = busy0 = wall0 = 0.0
    for i in range(a.warmup + a.steps):
        if i == a.warmup:
            cpu0, busy0, wall0 = cpu_ms(), machine_busy_ms(), time.perf_counter()
        t0 = time.perf_counter()
        opt.zero_grad()
        loss = F.mse_loss(model(x), target)
        t1 = time.perf_counter()
        loss.backward()
        for p_ in experts:
            p_.grad.div_(world)
        t2 = time.perf_counter()
        opt.step()
        t3 = time.perf_counter()
        if i >= a.warmup:
            steps.append((t3 - t0) * 1e3)
            fwd.append((t1 - t0) * 1e3)
            bwd.append((t2 - t1) * 1e3)
    window = {
        "wall_ms": (time.perf_counter() - wall0) * 1e3,
        "cpu_ms": cpu_ms() - cpu0,
        "machine_busy_ms": machine_busy_ms() - busy0,
    }
    peak, current = rss_mib()
    out = {
        "cpu_ms": window["cpu_ms"] / a.steps,
        "window": window,
        "impl": "pytorch",
        "mode": "moe",
        "params": n_params,
        "rank": rank,
        "world": world,
        "threads": torch.get_num_threads(),
        "median_ms": statistics.median(steps),
        "fwd_ms": statistics.median(fwd),
        "bwd_ms": statistics.median(bwd),
        "peak_rss_mib": peak,
        "rss_mib": current,
        "steps_ms": steps,
        "loss": float(loss),
    }
    print("BENCH " + json.dumps(out), flush=True)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
