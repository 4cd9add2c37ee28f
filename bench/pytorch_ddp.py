"""The DDP benchmark's PyTorch side: the same models, batch and loop as examples/bench_ddp.rs.

    tch-dist-run --nproc-per-node 2 -- python3 bench/pytorch_ddp.py --mode ddp [--bucket-cap-mb 25]
    python3 bench/pytorch_ddp.py --mode plain

Reads torchrun's variables (RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT; tch-dist-run sets
them) and prints one `BENCH {json}` line per rank with per-step times (ms), phase medians and
the peak RSS (VmHWM).
"""

import argparse
import json
import os
import resource
import statistics
import time

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F


def widths(model):
    if model == "cpu":
        return [1024, 2048, 2048, 1024, 10], [True, True, True, False]
    if model == "gpu":
        w, relu = [2048], []
        for _ in range(12):
            w += [8192, 2048]
            relu += [True, False]
        return w, relu
    raise SystemExit(f"unknown --model {model}")


class Mlp(nn.Module):
    def __init__(self, model):
        super().__init__()
        w, self.relu_after = widths(model)
        self.layers = nn.ModuleList(nn.Linear(a, b) for a, b in zip(w, w[1:]))

    def forward(self, x):
        for layer, relu in zip(self.layers, self.relu_after):
            x = layer(x)
            if relu:
                x = F.relu(x)
        return x


def rss_mib():
    peak = cur = 0.0
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmHWM:"):
                peak = int(line.split()[1]) / 1024
            elif line.startswith("VmRSS:"):
                cur = int(line.split()[1]) / 1024
    return peak, cur


def machine_busy_ms():
    """Busy CPU time of the whole machine so far (/proc/stat, USER_HZ 100), in ms."""
    with open("/proc/stat") as f:
        t = [int(x) for x in f.readline().split()[1:9]]
    return (sum(t) - t[3] - t[4]) * 10.0


def cpu_ms():
    return time.process_time() * 1e3


def sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--mode", default="ddp", choices=["ddp", "plain"])
    p.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    p.add_argument("--model", default=None)
    p.add_argument("--batch", type=int, default=64)
    p.add_argument("--warmup", type=int, default=5)
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--bucket-cap-mb", type=float, default=25.0)
    p.add_argument("--grad-as-bucket-view", action="store_true")
    p.add_argument("--tag", default="")
    a = p.parse_args()
    model_name = a.model or ("gpu" if a.device == "cuda" else "cpu")
    if a.threads > 0:
        torch.set_num_threads(a.threads)
    device = torch.device("cuda:0" if a.device == "cuda" else "cpu")

    rank, world = 0, 1
    if a.mode == "ddp":
        backend = "nccl" if a.device == "cuda" else "gloo"
        dist.init_process_group(backend)
        rank, world = dist.get_rank(), dist.get_world_size()

    torch.manual_seed(0)
    with device:  # build the weights where they live (403M parameters on the GPU)
        model = Mlp(model_name)
    n_params = sum(t.numel() for t in model.parameters())
    if a.mode == "ddp":
        from torch.nn.parallel import DistributedDataParallel as DDP

        model = DDP(
            model,
            device_ids=[0] if a.device == "cuda" else None,
            bucket_cap_mb=a.bucket_cap_mb,
            gradient_as_bucket_view=a.grad_as_bucket_view,
        )
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    torch.manual_seed(1 + rank)
    w, _ = widths(model_name)
    x = torch.randn(a.batch, w[0], device=device)
    y_class = torch.randint(10, (a.batch,), device=device)
    y_reg = torch.randn(a.batch, w[-1], device=device)

    def loss_of(out):
        if model_name == "cpu":
            return F.cross_entropy(out, y_class)
        return F.mse_loss(out, y_reg)

    steps, fwd, bwd, upd = [], [], [], []
    if a.mode == "ddp":
        dist.barrier()
    sync(device)
    cpu0 = busy0 = wall0 = faults0 = 0.0
    for i in range(a.warmup + a.steps):
        if i == a.warmup:
            cpu0, busy0, wall0 = cpu_ms(), machine_busy_ms(), time.perf_counter()
            faults0 = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
        t0 = time.perf_counter()
        opt.zero_grad()
        loss = loss_of(model(x))
        sync(device)
        t1 = time.perf_counter()
        loss.backward()
        sync(device)
        t2 = time.perf_counter()
        opt.step()
        sync(device)
        t3 = time.perf_counter()
        if i >= a.warmup:
            steps.append((t3 - t0) * 1e3)
            fwd.append((t1 - t0) * 1e3)
            bwd.append((t2 - t1) * 1e3)
            upd.append((t3 - t2) * 1e3)
    window = {
        "wall_ms": (time.perf_counter() - wall0) * 1e3,
        "cpu_ms": cpu_ms() - cpu0,
        "machine_busy_ms": machine_busy_ms() - busy0,
    }
    peak, cur = rss_mib()
    out = {
        "cpu_ms": window["cpu_ms"] / a.steps,
        "page_faults": (resource.getrusage(resource.RUSAGE_SELF).ru_minflt - faults0) / a.steps,
        "window": window,
        "impl": "pytorch",
        "mode": a.mode,
        "tag": a.tag,
        "device": str(device),
        "model": model_name,
        "params": n_params,
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
        "torch": torch.__version__,
    }
    if a.mode == "ddp":
        out["bucket_cap_mb"] = a.bucket_cap_mb
        out["gradient_as_bucket_view"] = a.grad_as_bucket_view
    print("BENCH " + json.dumps(out), flush=True)
    if a.mode == "ddp":
        dist.barrier()
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
