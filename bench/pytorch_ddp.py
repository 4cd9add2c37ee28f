"""The DDP and FSDP benchmarks' PyTorch side: the same models, batch and loop as
examples/bench_ddp/ (`--model mlp|transformer|convnet|gpu`; see there for what each is).

    tch-dist-run --nproc-per-node 2 -- python3 bench/pytorch_ddp.py --mode ddp [--model NAME] [--bucket-cap-mb 25]
        [--grad-as-bucket-view] [--no-broadcast-buffers] [--comm-hook allreduce|fp16|bf16|powersgd]
    tch-dist-run --nproc-per-node 2 -- python3 bench/pytorch_ddp.py --mode fsdp [--model NAME] [--optim adamw]
        [--activation-checkpointing]
    python3 bench/pytorch_ddp.py --mode plain

`--mode fsdp`: torch.distributed.fsdp.fully_shard (FSDP2) with its defaults on each block (the
MLP's layers, the transformer's and the convnet's blocks), then on the root, over the default
CPU mesh (Gloo), as bench_ddp's `--mode fully_shard`. `--optim sgd` (default) or `adamw`
(torch.optim.AdamW's defaults; `--lr`, default 0.01 for SGD, 1e-3 for AdamW).
`--activation-checkpointing` (the transformer): the composable
`torch.distributed._composable.checkpoint` on each block before any other API (torchtitan's
order), as bench_ddp's; `forward_kept_bytes` is the median over timed steps of what malloc
holds after the forward beyond what it held before it (`mallinfo2`, as bench_ddp reads it).

`--comm-hook` (ddp): DDP's `register_comm_hook` with `default_hooks.fp16_compress_hook`,
`bf16_compress_hook` or `powerSGD_hook` (`PowerSGDState` defaults but
`start_powerSGD_iter=2`), as bench_ddp's `--comm-hook`; `allreduce` (default) registers none.

In a network namespace with an `eth0` (driver.py's `hosts` part), the record also holds that
interface's received and sent bytes per timed step (`/proc/net/dev`), as bench_ddp's does.

Reads torchrun's variables (RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT; tch-dist-run sets
them) and prints one `BENCH {json}` line per rank with per-step times (ms), phase medians, the
peak RSS (VmHWM) and, after the last step, the bytes of parameters, gradients and optimizer
state the rank holds, counted from the tensors (a DTensor's local shard; the optimizer's
per-parameter tensors but its scalar `step`).
"""

import argparse
import ctypes
import json
import math
import os
import resource
import statistics
import time

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F


def widths(model):
    if model == "mlp":
        return [1024, 2048, 2048, 1024, 10], [True, True, True, False]
    if model == "gpu":
        w, relu = [2048], []
        for _ in range(12):
            w += [8192, 2048]
            relu += [True, False]
        return w, relu
    raise SystemExit(f"{model} is not an MLP")


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


# The transformer's shape (examples/bench_ddp/models.rs: T_DIM, T_BLOCKS, T_HEADS, T_VOCAB, T_SEQ).
T_DIM, T_BLOCKS, T_HEADS, T_VOCAB, T_SEQ = 256, 6, 4, 128, 64


def attention(q, k, v, mask):
    """Scaled dot-product attention of q, k, v ([batch, seq, width]) over heads of
    T_DIM / T_HEADS features (width / head_dim of them: all of a layer's, or a
    tensor-parallel rank's); examples/common/attention_block.rs's `attention`."""
    b, t, width = q.shape
    dh = T_DIM // T_HEADS
    q, k, v = (z.view(b, t, width // dh, dh).transpose(1, 2) for z in (q, k, v))
    att = (q @ k.transpose(-2, -1)) * (1.0 / math.sqrt(dh))
    att = F.softmax(att.masked_fill(mask, float("-inf")), dim=-1)
    return (att @ v).transpose(1, 2).contiguous().view(b, t, width)


class Block(nn.Module):
    """A GPT-2 block: x + proj(attn(ln1(x))), then x + fc2(gelu(fc1(ln2(x))))."""

    def __init__(self):
        super().__init__()
        d = T_DIM
        self.ln1 = nn.LayerNorm(d)
        self.qkv = nn.Linear(d, 3 * d)
        self.proj = nn.Linear(d, d)
        self.ln2 = nn.LayerNorm(d)
        self.fc1 = nn.Linear(d, 4 * d)
        self.fc2 = nn.Linear(4 * d, d)

    def forward(self, x, mask):
        q, k, v = self.qkv(self.ln1(x)).split(x.shape[2], dim=2)
        x = x + self.proj(attention(q, k, v, mask))
        return x + self.fc2(F.gelu(self.fc1(self.ln2(x))))


class Transformer(nn.Module):
    """The suite's transformer, its blocks `block()` (Block; bench/pytorch_two_d.py's TpBlock)."""

    def __init__(self, block=Block):
        super().__init__()
        self.tok = nn.Embedding(T_VOCAB, T_DIM)
        self.pos = nn.Embedding(T_SEQ, T_DIM)
        self.blocks = nn.ModuleList(block() for _ in range(T_BLOCKS))
        self.ln_f = nn.LayerNorm(T_DIM)
        self.head = nn.Linear(T_DIM, T_VOCAB)
        # Plain attributes, not buffers (nothing for DDP to broadcast), as in examples/bench_ddp/models.rs.
        self.mask = torch.ones(T_SEQ, T_SEQ, dtype=torch.bool).triu(1)
        self.positions = torch.arange(T_SEQ)

    def forward(self, idx):
        x = self.tok(idx) + self.pos(self.positions)
        for b in self.blocks:
            x = b(x, self.mask)
        return self.head(self.ln_f(x))


# Output channels and stride of the convnet's nine blocks (examples/bench_ddp/models.rs: CONV).
CONV = [(32, 1), (32, 1), (32, 1), (64, 2), (64, 1), (64, 1), (128, 2), (128, 1), (128, 1)]


class ConvBlock(nn.Module):
    def __init__(self, cin, cout, stride):
        super().__init__()
        self.conv = nn.Conv2d(cin, cout, 3, stride=stride, padding=1, bias=False)
        self.bn = nn.BatchNorm2d(cout)


class Convnet(nn.Module):
    def __init__(self):
        super().__init__()
        blocks, cin = [], 3
        for cout, stride in CONV:
            blocks.append(ConvBlock(cin, cout, stride))
            cin = cout
        self.blocks = nn.ModuleList(blocks)
        self.head = nn.Linear(cin, 10)

    def forward(self, x):
        for b in self.blocks:
            x = F.relu(b.bn(b.conv(x)))
        return self.head(x.mean((2, 3)))


DEFAULT_BATCH = {"mlp": 64, "gpu": 64, "transformer": 2, "convnet": 8}


def build(model):
    if model in ("mlp", "gpu"):
        return Mlp(model)
    if model == "transformer":
        return Transformer()
    if model == "convnet":
        return Convnet()
    raise SystemExit(f"unknown --model {model} (mlp, transformer, convnet or gpu)")


def batch_of(model, batch, device):
    """One fixed batch per rank: inputs, targets and the loss (as examples/bench_ddp/)."""
    if model in ("mlp", "gpu"):
        w, _ = widths(model)
        x = torch.randn(batch, w[0], device=device)
        y_class = torch.randint(10, (batch,), device=device)
        y_reg = torch.randn(batch, w[-1], device=device)
        if model == "mlp":
            return x, y_class, F.cross_entropy
        return x, y_reg, F.mse_loss
    if model == "transformer":
        idx = torch.randint(T_VOCAB, (batch, T_SEQ), device=device)
        nxt = torch.randint(T_VOCAB, (batch, T_SEQ), device=device)
        return idx, nxt, lambda out, y: F.cross_entropy(out.view(-1, T_VOCAB), y.view(-1))
    x = torch.randn(batch, 3, 32, 32, device=device)
    y = torch.randint(10, (batch,), device=device)
    return x, y, F.cross_entropy


def held_bytes(model, opt):
    """What this rank holds between steps (after the last one, before the next zero_grad):
    the bytes of its trainable parameters, their gradients and the optimizer's state (a
    DTensor's local piece)."""
    local = lambda t: t.to_local() if hasattr(t, "to_local") else t
    nbytes = lambda t: local(t).numel() * local(t).element_size()
    params = [p for p in model.parameters() if p.requires_grad]
    param_bytes = sum(nbytes(p) for p in params)
    grad_bytes = sum(nbytes(p.grad) for p in params if p.grad is not None)
    optim_bytes = sum(
        nbytes(v)
        for st in opt.state.values()
        for k, v in st.items()
        if torch.is_tensor(v) and k != "step"
    )
    return param_bytes, grad_bytes, optim_bytes


def rss_mib():
    peak = cur = 0.0
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmHWM:"):
                peak = int(line.split()[1]) / 1024
            elif line.startswith("VmRSS:"):
                cur = int(line.split()[1]) / 1024
    return peak, cur


class _Mallinfo2(ctypes.Structure):
    _fields_ = [
        (n, ctypes.c_size_t)
        for n in ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks",
                  "uordblks", "fordblks", "keepcost")
    ]


_LIBC = ctypes.CDLL("libc.so.6")
_LIBC.mallinfo2.restype = _Mallinfo2


def malloc_in_use():
    """Bytes malloc has handed out and not had back (small blocks in use + mmapped ones)."""
    m = _LIBC.mallinfo2()
    return float(m.uordblks + m.hblkhd)


def eth0_bytes():
    """Bytes this process's network namespace received and sent on `eth0` so far
    (/proc/net/dev), or None without an eth0 (bench_ddp's `eth0_bytes`)."""
    with open("/proc/net/dev") as f:
        for line in f:
            name, _, rest = line.partition(":")
            if name.strip() == "eth0":
                v = [int(x) for x in rest.split()]
                return v[0], v[8]
    return None


def add_net(out, net0, steps):
    """Adds eth0's received and sent bytes per timed step since `net0` to a record."""
    net1 = eth0_bytes()
    if net0 and net1:
        out["net_rx_bytes_per_step"] = (net1[0] - net0[0]) / steps
        out["net_tx_bytes_per_step"] = (net1[1] - net0[1]) / steps


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


def register_hook(model, name):
    """DDP's comm hook `name` (--comm-hook)."""
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks, powerSGD_hook

    if name == "fp16":
        model.register_comm_hook(None, default_hooks.fp16_compress_hook)
    elif name == "bf16":
        model.register_comm_hook(None, default_hooks.bf16_compress_hook)
    elif name == "powersgd":
        state = powerSGD_hook.PowerSGDState(process_group=None, start_powerSGD_iter=2)
        model.register_comm_hook(state, powerSGD_hook.powerSGD_hook)


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--mode", default="ddp", choices=["ddp", "fsdp", "plain"])
    p.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    p.add_argument("--model", default=None)
    p.add_argument("--batch", type=int, default=0, help="default: the model's own")
    p.add_argument("--warmup", type=int, default=5)
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--bucket-cap-mb", type=float, default=25.0)
    p.add_argument("--grad-as-bucket-view", action="store_true")
    p.add_argument("--no-broadcast-buffers", action="store_true")
    p.add_argument("--tag", default="")
    p.add_argument("--optim", default="sgd", choices=["sgd", "adamw"])
    p.add_argument("--activation-checkpointing", action="store_true")
    p.add_argument("--lr", type=float, default=0.0, help="default: 0.01 (SGD), 1e-3 (AdamW)")
    p.add_argument("--comm-hook", default="allreduce", choices=["allreduce", "fp16", "bf16", "powersgd"])
    a = p.parse_args()
    model_name = a.model or ("gpu" if a.device == "cuda" else "mlp")
    if model_name == "cpu":
        model_name = "mlp"  # the old name of the CPU MLP
    if a.threads > 0:
        torch.set_num_threads(a.threads)
    device = torch.device("cuda:0" if a.device == "cuda" else "cpu")

    rank, world = 0, 1
    if a.mode in ("ddp", "fsdp"):
        backend = "nccl" if a.device == "cuda" else "gloo"
        dist.init_process_group(backend)
        rank, world = dist.get_rank(), dist.get_world_size()

    torch.manual_seed(0)
    with device:  # build the weights where they live (403M parameters on the GPU)
        model = build(model_name)
    model.train()
    n_params = sum(t.numel() for t in model.parameters())
    fsdp_groups = 0
    checkpointed = 0
    if a.activation_checkpointing:
        if model_name != "transformer":
            raise SystemExit("--activation-checkpointing: the transformer's blocks only")
        from torch.distributed._composable import checkpoint

        for b in model.blocks:
            checkpoint(b)
        checkpointed = len(model.blocks)
    if a.mode == "fsdp":
        from torch.distributed.fsdp import fully_shard

        blocks = model.layers if model_name in ("mlp", "gpu") else model.blocks
        for b in blocks:
            fully_shard(b)
        fully_shard(model)
        fsdp_groups = len(blocks) + 1
    if a.mode == "ddp":
        from torch.nn.parallel import DistributedDataParallel as DDP

        model = DDP(
            model,
            device_ids=[0] if a.device == "cuda" else None,
            bucket_cap_mb=a.bucket_cap_mb,
            gradient_as_bucket_view=a.grad_as_bucket_view,
            broadcast_buffers=not a.no_broadcast_buffers,
        )
        register_hook(model, a.comm_hook)
    if a.optim == "adamw":
        opt = torch.optim.AdamW(model.parameters(), lr=a.lr or 1e-3)
    else:
        opt = torch.optim.SGD(model.parameters(), lr=a.lr or 0.01)
    torch.manual_seed(1 + rank)
    batch = a.batch or DEFAULT_BATCH.get(model_name, 64)
    x, target, loss_fn = batch_of(model_name, batch, device)

    def loss_of(out):
        return loss_fn(out, target)

    steps, fwd, bwd, upd, kept = [], [], [], [], []
    if a.mode != "plain":
        dist.barrier()
    sync(device)
    cpu0 = busy0 = wall0 = faults0 = 0.0
    net0 = None
    for i in range(a.warmup + a.steps):
        if i == a.warmup:
            cpu0, busy0, wall0 = cpu_ms(), machine_busy_ms(), time.perf_counter()
            faults0 = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
            net0 = eth0_bytes()
        t0 = time.perf_counter()
        opt.zero_grad()
        before = malloc_in_use()
        loss = loss_of(model(x))
        sync(device)
        t1 = time.perf_counter()
        kept_bytes = malloc_in_use() - before
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
            kept.append(kept_bytes)
    net = {}
    add_net(net, net0, a.steps)
    window = {
        "wall_ms": (time.perf_counter() - wall0) * 1e3,
        "cpu_ms": cpu_ms() - cpu0,
        "machine_busy_ms": machine_busy_ms() - busy0,
    }
    peak, cur = rss_mib()
    param_bytes, grad_bytes, optim_bytes = held_bytes(model, opt)
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
        "param_tensors": len(list(model.parameters())),
        "buffers": len(list(model.buffers())),
        "batch": batch,
        "rank": rank,
        "world": world,
        "threads": torch.get_num_threads(),
        "median_ms": statistics.median(steps),
        "fwd_ms": statistics.median(fwd),
        "bwd_ms": statistics.median(bwd),
        "opt_ms": statistics.median(upd),
        "peak_rss_mib": peak,
        "rss_mib": cur,
        "forward_kept_bytes": statistics.median(kept),
        "checkpointed_blocks": checkpointed,
        "steps_ms": steps,
        "torch": torch.__version__,
        "optim": a.optim,
        "param_bytes": param_bytes,
        "grad_bytes": grad_bytes,
        "optim_bytes": optim_bytes,
        "state_bytes": param_bytes + grad_bytes + optim_bytes,
        "fsdp_groups": fsdp_groups,
        "comm_hook": a.comm_hook,
        **net,
    }
    if a.mode == "ddp":
        out["bucket_cap_mb"] = a.bucket_cap_mb
        out["gradient_as_bucket_view"] = a.grad_as_bucket_view
        out["broadcast_buffers"] = not a.no_broadcast_buffers
    print("BENCH " + json.dumps(out), flush=True)
    if a.mode != "plain":
        dist.barrier()
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
