"""PyTorch's side of the pipeline benchmark (driver.py's `pp` part): the suite's transformer
(bench/pytorch_ddp.py) as 2 pipeline stages, one per rank, `Schedule1F1B` on
--microbatches microbatches, split as examples/bench_ddp/pipeline.rs splits tch-dist's:
stage 0 the embeddings and blocks 0-2, stage 1 blocks 3-5, the final LayerNorm and the head
(torchtitan's way: the whole model built, the other stage's layers deleted).

    torchrun --nproc-per-node 2 bench/pytorch_pipeline.py [--microbatches 4] [--steps N] [--warmup N]

Prints one `BENCH {json}` line per rank: per-step times, the median, the median CPU time per
step (`busy_ms`) and the measured bubble (wall - CPU) / CPU, as the tch-dist side."""

import argparse
import json
import os
import statistics
import sys
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.pipelining import (
    PipelineStage,
    Schedule1F1B,
    ScheduleInterleavedZeroBubble,
)

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from pytorch_ddp import T_BLOCKS, T_SEQ, T_VOCAB, Transformer, cpu_ms, machine_busy_ms, rss_mib  # noqa: E402


class StagePart(torch.nn.Module):
    """The transformer with the other stage's layers deleted (None)."""

    def __init__(self, whole, stage):
        super().__init__()
        half = T_BLOCKS // 2
        first, last = stage == 0, stage == 1
        self.tok = whole.tok if first else None
        self.pos = whole.pos if first else None
        self.blocks = torch.nn.ModuleDict(
            {str(i): b for i, b in enumerate(whole.blocks) if (i < half) == first}
        )
        self.ln_f = whole.ln_f if last else None
        self.head = whole.head if last else None
        self.mask, self.positions = whole.mask, whole.positions

    def forward(self, x):
        if self.tok is not None:
            x = self.tok(x) + self.pos(self.positions)
        for b in self.blocks.values():
            x = b(x, self.mask)
        if self.head is not None:
            x = self.head(self.ln_f(x))
        return x


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--mode", default="pipeline", choices=["pipeline"])
    p.add_argument("--model", default="transformer", choices=["transformer"])
    p.add_argument("--microbatches", type=int, default=4)
    p.add_argument("--schedule", default="1f1b", choices=["1f1b", "zb"])
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--tag", default="")
    a = p.parse_args()
    torch.set_num_threads(a.threads)
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    if world != 2:
        raise SystemExit("pytorch_pipeline.py: 2 ranks (one stage each)")
    torch.manual_seed(0)
    part = StagePart(Transformer(), rank)
    n_params = sum(p.numel() for p in part.parameters())
    opt = torch.optim.SGD(part.parameters(), lr=0.01)
    stage = PipelineStage(part, rank, 2, torch.device("cpu"))

    def loss_fn(out, y):
        return F.cross_entropy(out.view(-1, T_VOCAB), y.view(-1))

    if a.schedule == "zb":
        schedule = ScheduleInterleavedZeroBubble([stage], a.microbatches, loss_fn=loss_fn)
    else:
        schedule = Schedule1F1B(stage, a.microbatches, loss_fn=loss_fn)
    torch.manual_seed(1)
    x = torch.randint(T_VOCAB, (a.batch, T_SEQ))
    y = torch.randint(T_VOCAB, (a.batch, T_SEQ))
    steps, busy = [], []
    dist.barrier()
    cpu0 = busy0 = wall0 = 0.0
    for i in range(a.warmup + a.steps):
        if i == a.warmup:
            cpu0, busy0, wall0 = cpu_ms(), machine_busy_ms(), time.perf_counter()
        t0, c0 = time.perf_counter(), cpu_ms()
        opt.zero_grad()
        if rank == 0:
            schedule.step(x)
        else:
            losses = []
            schedule.step(target=y, losses=losses)
        opt.step()
        if i >= a.warmup:
            steps.append((time.perf_counter() - t0) * 1e3)
            busy.append(cpu_ms() - c0)
    window = {
        "wall_ms": (time.perf_counter() - wall0) * 1e3,
        "cpu_ms": cpu_ms() - cpu0,
        "machine_busy_ms": machine_busy_ms() - busy0,
    }
    peak, cur = rss_mib()
    step, cpu = statistics.median(steps), statistics.median(busy)
    out = {
        "cpu_ms": window["cpu_ms"] / a.steps,
        "window": window,
        "impl": "pytorch",
        "mode": "pipeline",
        "tag": a.tag,
        "model": a.model,
        "params": n_params,
        "batch": a.batch,
        "microbatches": a.microbatches,
        "schedule": a.schedule,
        "stages": 2,
        "rank": rank,
        "world": world,
        "threads": torch.get_num_threads(),
        "median_ms": step,
        "busy_ms": cpu,
        "bubble": max(0.0, step - cpu) / cpu,
        "peak_rss_mib": peak,
        "rss_mib": cur,
        "steps_ms": steps,
        "torch": torch.__version__,
    }
    print("BENCH " + json.dumps(out), flush=True)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
