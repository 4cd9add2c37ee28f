"""The DDP benchmark driver: tch-dist `replicate` against PyTorch DDP (see docs/PERFORMANCE.md).

CPU (`make bench`): a suite of three models, each defined identically in
examples/bench_ddp/ and bench/pytorch_ddp.py: `mlp` (1024-2048-2048-1024-10, 8.4M
parameters in 8 tensors, batch 64), `transformer` (GPT-2-style, 6 blocks of width 256, 4.8M
parameters in 78 tensors, batch 2 x 64 tokens) and `convnet` (nine conv + BatchNorm2d + ReLU
blocks on 32x32 images, 0.48M parameters in 29 tensors and 18 BatchNorm buffers, batch 8);
SGD, 2 ranks on this machine's cores, Gloo, one torch thread per rank. Per model, PyTorch
DDP (bench/pytorch_ddp.py) and tch-dist (examples/bench_ddp/) run in alternating order for
several rounds, so that machine noise hits both, with and without gradient_as_bucket_view;
plain single-process training (tch and PyTorch), two plain processes at once and the raw
Gloo all-reduce of the same bytes (the floor) are measured beside them. Prints a table per
model, then per model

    model=NAME tch_dist_vs_pytorch_ddp=R tch_dist_vs_best_pytorch=R tch_dist_vs_floor=R

(ratios of median step times: tch-dist default / PyTorch DDP default, / the faster of PyTorch
DDP's two configurations, / the floor = two plain processes at once + the raw all-reduce's
CPU time per rank) and, as its last line, `tch_dist_vs_pytorch_ddp=<ratio>` of the first
model (the MLP; lower is better).

FSDP (`fsdp` in --models, after the DDP suite, with its own time budget, --fsdp-budget): the
transformer of the suite with AdamW, tch-dist `fully_shard` (`bench_ddp --mode fully_shard`)
against PyTorch's `fully_shard` (`pytorch_ddp.py --mode fsdp`), one group per block then the
root, alternating for several rounds, and tch-dist `replicate` with AdamW once. Prints a table
and

    fsdp_vs_pytorch=R          (median step time, tch-dist / PyTorch; goal <= 0.9)
    fsdp_rss_vs_pytorch=R      (peak RSS, the larger rank, tch-dist / PyTorch; goal <= 1.0)
    fsdp_bytes_vs_replicate=R  (bytes of parameters + gradients + AdamW state a rank holds
                                between steps, fully_shard / replicate; goal <= 0.55)

Activation checkpointing (`ac` in --models, last, with its own budget, --ac-budget): the same
transformer, batch 8 x 64 tokens per rank, AdamW, per-block fully_shard, with and without
checkpointing every block, tch-dist `checkpoint_activations` (`bench_ddp
--activation-checkpointing`) against PyTorch's composable `checkpoint`. Prints a table and

    ac_kept_vs_no_ac=R    (bytes the forward leaves allocated for backward, mallinfo2,
                           with / without checkpointing; goal <= 0.15)
    ac_step_vs_no_ac=R    (median step, with / without; goal <= 1.4)
    ac_step_vs_pytorch=R  (median step, tch-dist / PyTorch, both checkpointed; goal <= 0.9)
    ac_rss_vs_pytorch=R   (peak RSS, tch-dist / PyTorch, both checkpointed; goal <= 1.0)

Pipeline (`pp` in --models, last, with its own budget, --pp-budget): the same transformer as
2 stages, one per rank (the embeddings and blocks 0-2, then blocks 3-5, the final norm and
the head), batch 8 x 64 tokens, SGD, `Schedule1F1B` and `ScheduleInterleavedZeroBubble` on
4 and on 8 microbatches: tch-dist's `pipelining` (`bench_ddp --mode pipeline --schedule
1f1b|zb`) against PyTorch's `torch.distributed.pipelining` (bench/pytorch_pipeline.py), the
same schedule, alternating; and tch-dist's `ScheduleZBVZeroBubble` (`--schedule zbv`: 4
stages in the V, 3 blocks per rank), which PyTorch cannot run on Gloo (PP_PYTORCH), against
PyTorch's other two. Prints a table and, per microbatch count M,

    pp_m{M}_vs_pytorch=R     (median step, Schedule1F1B, tch-dist / PyTorch; goal <= 0.9)
    pp_m{M}_bubble=B         (measured bubble, (wall - CPU) / CPU per rank, both ranks'
                              mean; beside it PyTorch's and the schedule's (p - 1) / m)
    pp_zb_m{M}_vs_pytorch=R  (the same for ScheduleInterleavedZeroBubble)
    pp_zb_m{M}_vs_pytorch_1f1b=R  (tch-dist's zero bubble / PyTorch's Schedule1F1B)
    pp_zb_m{M}_bubble=B      (beside it PyTorch's and (p - 1) / (3 m))
    pp_zbv_m{M}_vs_pytorch_1f1b=R, pp_zbv_m{M}_vs_pytorch_zb=R, pp_zbv_m{M}_bubble=B

2-D parallelism (`two_d` in --models, last, with its own budget, --two-d-budget): the same
transformer with separate q, k and v projections (so that a tensor-parallel rank holds whole
heads) on 4 ranks as a 2x2 mesh, AdamW (fused on both sides), in two layouts, each tch-dist
(`bench_ddp --mode hsdp|fsdp_tp`, examples/bench_ddp/two_d.rs) against PyTorch's same layout
(bench/pytorch_two_d.py), alternating: HSDP (`fully_shard` on a `dp_replicate` x `dp_shard`
mesh) and FSDP x TP (`parallelize_module` over `tp`, then `fully_shard` over `dp`). Prints a
table and, per layout L (`hsdp`, `fsdp_tp`),

    L_vs_pytorch=R       (median step, tch-dist / PyTorch; goal <= 0.9)
    L_rss_vs_pytorch=R   (peak RSS of the largest rank, tch-dist / PyTorch; goal <= 1.0)

Context parallelism (`cp` in --models, after the 2-D part, with its own budget, --cp-budget):
a GPT-2-style transformer (2 blocks of width 256, 4 heads) on one sequence of 2048 tokens,
whole on 1 rank and split over 2 and 4 ranks by `context_parallel` (head-tail, ring attention;
examples/bench_ddp/context.rs), alternating. PyTorch's `context_parallel` does not run on CPU
(its ring calls only CUDA's attention kernels): no PyTorch side. Prints a table and, per N,

    cpN_kept_vs_unsplit=R  (activations the forward keeps for backward, per rank, / one
                            rank's on the whole sequence; goal <= 1.1 / N)
    cpN_step_vs_unsplit=R  (median step / the whole sequence's on one rank)

Mixture of experts (`moe` in --models, after the cp part, with its own budget, --moe-budget):
2 MoE layers (dim 128, 8 SwiGLU experts of width 256, top-2, a shared expert) on 1024 tokens
per rank at 4 ranks, the experts split over the ranks (all-to-all dispatch) and fully_shard on
the rest: tch-dist (`bench_ddp --mode moe`, examples/bench_ddp/moe.rs) against PyTorch in
torchtitan's approach (bench/pytorch_moe.py), alternating. Prints a table and

    moe_vs_pytorch=R      (median step, tch-dist / PyTorch; goal <= 0.9)
    moe_rss_vs_pytorch=R  (peak RSS of the largest rank, tch-dist / PyTorch; goal <= 1.0)

Fault tolerance (`ft` in --models, after the moe part, with its own budget, --ft-budget): the
MLP in two replica groups of one rank (`tch-dist-run --replica-groups 2 --lighthouse URL`,
`bench_ddp --mode ft`: a quorum, the fault-tolerant average leaving during backward
(`prepare_for_backward`) and the commit vote per step) against `replicate` over two ranks
(`--mode ft_baseline`) and against the same average after backward (`--mode
ft_after_backward`), the same SGD, in turn; then one
run where group 1 exits mid-training and its launcher restarts it. The lighthouse is
tch-dist-lighthouse with --heartbeat_timeout_ms 1000 (torchft's default is 5000: a group is
dead that much later). Prints a table and

    ft_vs_replicate=R          (median step with fault tolerance / under replicate; goal <= 1.03)
    ft_fault_to_commit_s=S     (the survivor: from the start of the step that met the failure
                                to its next committed step; goal <= 2)
    ft_rejoin_to_commit_s=S    (the restarted group: from its process start to its first
                                committed step, healing included)
    ft_steps_lost=N            (committed steps the survivor lost: none by construction, against
                                the steps since the last checkpoint for a restart of the job)
    ft_overlap_vs_after_backward=R (what the overlap buys: median step with it / without it)

Across hosts (`hosts` in --models, last, with its own budget, --hosts-budget; bench/hosts.py):
2 hosts (network namespaces, root only; skipped with a printed line elsewhere) x 2 ranks, each
host's eth0 shaped to 1 Gbit/s by tc's tbf; the transformer under replicate, fully_shard and
HSDP (shard within a host, replicate across), each against PyTorch's DDP, FSDP2 and HSDP on
the same hosts, alternating, then replicate with each comm hook (fp16, bf16, PowerSGD) on
both sides. Prints a table (step times, eth0's bytes per step and host against the
collectives' minimum) and

    L_vs_pytorch=R        (median step, tch-dist / PyTorch; goal <= 0.9)
    L_wire_vs_min=R       (bytes each host sends per step / the ring collectives' minimum;
                           goal <= 1.05)
    L_SIDE_hidden=H       (1 - (step - compute-only step) / wire time: the share of the
                           link's time the step does not wait for)
    hsdp_vs_fully_shard=R (tch-dist HSDP / fully_shard; goal < 1)
    replicate_HOOK_vs_allreduce=R

GPU (`--gpu`, run by target/gpu-check/run.sh on the GPU machine): world size 1, NCCL, the
403M-parameter MLP (12 blocks 2048-8192-2048), batch 64, SGD; plain tch, tch-dist and PyTorch
DDP. tch-dist runs with the test switch TCH_DIST_NO_SHORTCUTS=1, so that at world size 1 it
communicates every bucket as PyTorch DDP does (otherwise a group of one communicates nothing
and the comparison would measure hook overhead only).

Every run reports its own CPU time and the machine's busy time over its timed window; a run
during which other programs used more than --max-foreign of the CPUs is repeated (this machine
is shared), up to --retries times, and the table shows what remained.

    python3 bench/driver.py [--models mlp,transformer,convnet,fsdp,ac,pp,two_d,cp,moe,hosts] [--rounds N] [--steps N]
                            [--warmup N] [--budget SECONDS] [--fsdp-budget SECONDS] [-v]
    python3 bench/driver.py --gpu --bin-dir DIR --script DIR/pytorch_ddp.py --python python3

Beside it: runner.py runs the jobs (the launcher, `BENCH {json}` lines, the machine's load,
repeats), figures.py makes the tables' figures, charts.py draws the SVG charts.
"""

import argparse
import os
import statistics
import subprocess
import sys
import time

import charts
from figures import floor_lines, paired_ratio, pooled_median, table
from hosts import HOSTS, hosts_part
from runner import ROOT, Runner, parse_bench, print_step_check

# The CPU suite: what each model is, and its rounds / timed steps / warm-up steps (chosen so
# that the whole `make bench` stays under 10 minutes here; --rounds/--steps/--warmup override).
MODELS = {
    "mlp": dict(
        desc="MLP 1024-2048-2048-1024-10 (8.4M parameters in 8 tensors), batch 64/rank",
        rounds=4,
        steps=30,
        warmup=5,
        trim=True,
        detail=True,
    ),
    "transformer": dict(
        desc="GPT-2-style transformer, 6 blocks d=256, 4 heads, vocabulary 128 "
        "(4.8M parameters in 78 tensors), batch 2 x 64 tokens/rank",
        rounds=4,
        steps=30,
        warmup=5,
        trim=False,
        detail=False,
    ),
    "convnet": dict(
        desc="convnet, 9 x (3x3 conv + BatchNorm2d + ReLU) 32-64-128 channels on 3x32x32 "
        "(0.48M parameters in 29 tensors, 18 BatchNorm buffers broadcast per forward), "
        "batch 8/rank",
        rounds=4,
        steps=30,
        warmup=5,
        trim=False,
        detail=False,
    ),
}


# The FSDP part: its model, rounds (each a PyTorch fully_shard and a tch-dist fully_shard run)
# and timed / warm-up steps; about 1.5 minutes on a quiet machine.
FSDP = dict(
    model="transformer",
    desc="GPT-2-style transformer, 6 blocks d=256, 4 heads, vocabulary 128 (4.8M parameters "
    "in 78 tensors), batch 2 x 64 tokens/rank",
    rounds=3,
    steps=15,
    warmup=3,
)


def cpu_model(a, r, model):
    """One model of the CPU suite: its runs, table and figures; returns its summary ratios."""
    m = MODELS[model]
    pick = lambda k: m[k] if getattr(a, k) is None else getattr(a, k)
    rounds = pick("rounds")
    r.model, r.steps, r.warmup = model, pick("steps"), pick("warmup")
    r.results = {}
    cap = ["--bucket-cap-mb", a.bucket_cap_mb]
    view = cap + ["--grad-as-bucket-view"]
    print(
        f"bench {model}: {m['desc']}, SGD, {a.nproc} ranks, Gloo, 1 torch thread/rank; "
        f"{rounds} rounds x {r.steps} timed steps (+{r.warmup} warm-up)",
        flush=True,
    )
    view_rounds = min(rounds, max(1, (rounds + 1) // 2))  # rounds with views and plains too
    for i in range(rounds):
        if i >= max(2, view_rounds) and r.slack() < 0:
            # Out of time (a busy machine makes every run slower): the rounds so far hold
            # every configuration; the runs not made leave the plan.
            r.planned -= 2 * (rounds - i)
            print(f"  {model}: stopped after {i} of {rounds} rounds for lack of time", flush=True)
            r.cut_rounds += rounds - i
            break
        pair = [
            lambda: r.torch("pytorch_ddp", "ddp", *cap),
            lambda: r.tch("tch_dist", "replicate", *cap),
        ]
        views = [
            lambda: r.torch("pytorch_ddp_view", "ddp", *view),
            lambda: r.tch("tch_dist_view", "replicate", *view),
        ]
        plains = [
            lambda: r.tch("tch_plain", "plain"),
            lambda: r.torch("pytorch_plain", "plain"),
            # Two independent plain trainings at once: the compute of two ranks sharing the
            # cores and memory, without communication.
            lambda: r.tch("tch_plain_2proc", "plain", launch=True),
        ]
        if i % 2:
            for x in (pair, views, plains):
                x.reverse()
        for f in pair:
            f()
        if i < view_rounds:
            for f in views + plains:
                f()
    keys = [
        "tch_plain",
        "pytorch_plain",
        "tch_plain_2proc",
        "tch_dist",
        "pytorch_ddp",
        "tch_dist_view",
        "pytorch_ddp_view",
    ]
    if m["trim"]:
        # Peak memory with glibc returning every freed block of 1 MiB or more to the system,
        # so that RSS follows the live tensors rather than what the allocator keeps.
        trim = {"MALLOC_MMAP_THRESHOLD_": str(1 << 20)}
        r.tch("tch_plain_trim", "plain", env=trim)
        r.tch("tch_dist_view_trim", "replicate", *view, env=trim)
        keys += ["tch_plain_trim", "tch_dist_view_trim"]
    if m["detail"]:
        # TCH_DIST_DEBUG=DETAIL's cost: one run beside the default one of the last round.
        r.tch("tch_dist_detail", "replicate", *cap, env={"TCH_DIST_DEBUG": "DETAIL"})
        keys.append("tch_dist_detail")
    sizes = r.results["tch_dist"][-1].get("collective_bytes", [])
    floor = r.tch("allreduce", "allreduce", "--sizes", ",".join(map(str, sizes)))

    t0 = r.results["tch_plain"][-1]
    print(
        f"\n== {model}: {t0['params'] / 1e6:.2f}M parameters in {t0['param_tensors']} tensors, "
        f"{t0['buffers']} buffers, batch {t0['batch']}"
    )
    med, peak = table(r, keys)
    t = r.results["tch_dist"]
    comm = statistics.median(x["comm_ms"] for x in t)
    overlapped = statistics.median(x["overlapped_ms"] for x in t)
    print()
    floor_lines(floor, "Gloo")
    print(
        f"tch-dist: {t[-1]['buckets']} buckets ({', '.join(f'{b / 1e6:.2f}' for b in t[-1]['bucket_bytes'])} MB) "
        f"as {len(t[-1]['collective_bytes'])} collectives; from the first launch to the last "
        f"completion {comm:.2f} ms, {overlapped:.2f} ms of it during backward"
    )
    exposed = med["tch_dist"] - med["tch_plain"]
    exposed_torch = med["pytorch_ddp"] - med["pytorch_plain"]
    comm_cost = med["tch_dist"] - med["tch_plain_2proc"]
    floor_ms = med["tch_plain_2proc"] + floor["sum_cpu_ms"]
    print(
        f"step time over plain: tch-dist {exposed:.2f} ms, PyTorch DDP {exposed_torch:.2f} ms; "
        f"tch-dist over two plain processes at once {comm_cost:.2f} ms; "
        f"raw all_reduce of the same bytes {floor['sum_ms']:.2f} ms "
        f"({floor['sum_cpu_ms']:.2f} ms CPU per rank); floor {floor_ms:.2f} ms "
        "(two plain processes at once + that CPU time)"
    )
    after = statistics.median(x["comm_ms"] - x["overlapped_ms"] for x in t)
    print()
    print(
        f"comm_vs_raw_allreduce={exposed / floor['sum_ms']:.3f}  (what replicate adds to a step, "
        f"tch-dist over plain, / raw all_reduce of the same bytes; PyTorch DDP: "
        f"{exposed_torch / floor['sum_ms']:.3f})"
    )
    print(
        f"comm_after_backward_vs_raw_allreduce={after / floor['sum_ms']:.3f}  (communication left "
        "when backward's compute ends / the same floor)"
    )
    print(
        f"comm_vs_raw_allreduce_2proc={comm_cost / floor['sum_ms']:.3f}  (tch-dist over two plain "
        "trainings sharing the machine / the same floor)"
    )
    print(
        f"peak_rss_view_vs_plain={peak['tch_dist_view'] / peak['tch_plain']:.3f}  "
        f"({peak['tch_dist_view']:.1f} / {peak['tch_plain']:.1f} MiB, gradient_as_bucket_view)"
    )
    print(
        f"peak_rss_default_vs_plain={peak['tch_dist'] / peak['tch_plain']:.3f}  "
        f"({peak['tch_dist']:.1f} / {peak['tch_plain']:.1f} MiB)"
    )
    if m["trim"]:
        print(
            "peak_rss_view_vs_plain_trim="
            f"{peak['tch_dist_view_trim'] / peak['tch_plain_trim']:.3f}  "
            f"({peak['tch_dist_view_trim']:.1f} / {peak['tch_plain_trim']:.1f} MiB, both with "
            "MALLOC_MMAP_THRESHOLD_=1048576: the live memory)"
        )
    print(
        f"tch_dist_vs_pytorch_ddp_view={med['tch_dist_view'] / med['pytorch_ddp_view']:.3f}  "
        "(both with gradient_as_bucket_view)"
    )
    if m["detail"]:
        d = r.results["tch_dist_detail"][-1]["median_ms"] / r.results["tch_dist"][-1]["median_ms"]
        print(
            f"detail_vs_default={d:.3f}  (TCH_DIST_DEBUG=DETAIL, which checks every collective "
            "across the ranks first, against the default run beside it)"
        )
    print(
        f"paired_ratio={paired_ratio(r.results['tch_dist'], r.results['pytorch_ddp']):.3f}  "
        "(median over rounds of each tch-dist run / the PyTorch DDP run beside it)"
    )
    print_step_check(r.results["tch_dist"])
    print(flush=True)
    return {
        "tch_dist_vs_pytorch_ddp": med["tch_dist"] / med["pytorch_ddp"],
        "tch_dist_vs_best_pytorch": med["tch_dist"]
        / min(med["pytorch_ddp"], med["pytorch_ddp_view"]),
        "tch_dist_vs_floor": med["tch_dist"] / floor_ms,
    }


def fsdp_part(a, r):
    """tch-dist fully_shard against PyTorch's fully_shard (AdamW, per-block groups); returns
    the summary ratios."""
    rounds = FSDP["rounds"] if a.fsdp_rounds is None else a.fsdp_rounds
    pick = lambda k: FSDP[k] if getattr(a, k) is None else getattr(a, k)
    r.model, r.steps, r.warmup = FSDP["model"], pick("steps"), pick("warmup")
    r.results = {}
    adamw = ["--optim", "adamw"]
    print(
        f"bench fsdp: {FSDP['desc']}, AdamW (lr 1e-3), fully_shard on each block then the root, "
        f"{a.nproc} ranks, Gloo, 1 torch thread/rank; {rounds} rounds x {r.steps} timed steps "
        f"(+{r.warmup} warm-up)",
        flush=True,
    )
    for i in range(rounds):
        if i >= 1 and r.slack() < 0:
            r.planned -= 2 * (rounds - i)
            print(f"  fsdp: stopped after {i} of {rounds} rounds for lack of time", flush=True)
            r.cut_rounds += rounds - i
            break
        pair = [
            lambda: r.torch("pytorch_fsdp", "fsdp", *adamw),
            lambda: r.tch("tch_dist_fsdp", "fully_shard", *adamw),
        ]
        if i % 2:
            pair.reverse()
        for f in pair:
            f()
    r.tch("tch_dist_replicate", "replicate", *adamw)
    res = r.results
    med = {k: pooled_median(v) for k, v in res.items()}
    peak = {k: max(x["peak_rss_mib_max"] for x in v) for k, v in res.items()}
    state = {k: max(x["state_bytes_max"] for x in v) for k, v in res.items()}
    t0 = res["tch_dist_fsdp"][-1]
    print(
        f"\n== fsdp: {t0['params'] / 1e6:.2f}M parameters in {t0['param_tensors']} tensors, "
        f"{t0['fsdp_groups']} fully_shard groups, batch {t0['batch']}, AdamW\n"
    )
    print(
        f"{'configuration':<20} {'step ms':>8} {'fwd':>6} {'bwd':>6} {'opt':>6} {'cpu/rank':>8} "
        f"{'peak RSS MiB':>12} {'state MB/rank':>13} {'foreign':>7}  runs"
    )
    for k in ("tch_dist_fsdp", "pytorch_fsdp", "tch_dist_replicate"):
        v = res[k]
        ph = {
            p: statistics.median(x.get(p, 0) for x in v)
            for p in ("fwd_ms", "bwd_ms", "opt_ms", "cpu_ms")
        }
        print(
            f"{k:<20} {med[k]:8.2f} {ph['fwd_ms']:6.1f} {ph['bwd_ms']:6.1f} {ph['opt_ms']:6.1f} "
            f"{ph['cpu_ms']:8.1f} {peak[k]:12.1f} {state[k] / 1e6:13.2f} "
            f"{max(x['foreign'] for x in v):7.0%}  {len(v)}"
        )
    for k in ("tch_dist_fsdp", "pytorch_fsdp", "tch_dist_replicate"):
        x = res[k][-1]
        print(
            f"{k}: parameters {x['param_bytes'] / 1e6:.2f} MB + gradients "
            f"{x['grad_bytes'] / 1e6:.2f} MB + AdamW state {x['optim_bytes'] / 1e6:.2f} MB on rank 0"
        )
    out = {
        "fsdp_vs_pytorch": med["tch_dist_fsdp"] / med["pytorch_fsdp"],
        "fsdp_rss_vs_pytorch": peak["tch_dist_fsdp"] / peak["pytorch_fsdp"],
        "fsdp_bytes_vs_replicate": state["tch_dist_fsdp"] / state["tch_dist_replicate"],
    }
    print()
    print(
        f"fsdp_vs_pytorch={out['fsdp_vs_pytorch']:.3f}  (median step, tch-dist fully_shard "
        f"{med['tch_dist_fsdp']:.2f} ms / PyTorch fully_shard {med['pytorch_fsdp']:.2f} ms; "
        "goal <= 0.9)"
    )
    print(
        f"fsdp_rss_vs_pytorch={out['fsdp_rss_vs_pytorch']:.3f}  (peak RSS of the larger rank, "
        f"{peak['tch_dist_fsdp']:.1f} / {peak['pytorch_fsdp']:.1f} MiB; goal <= 1.0)"
    )
    print(
        f"fsdp_bytes_vs_replicate={out['fsdp_bytes_vs_replicate']:.3f}  (parameters + gradients "
        f"+ AdamW state per rank between steps, {state['tch_dist_fsdp'] / 1e6:.2f} / "
        f"{state['tch_dist_replicate'] / 1e6:.2f} MB; goal <= 0.55; PyTorch fully_shard: "
        f"{state['pytorch_fsdp'] / state['tch_dist_replicate']:.3f})"
    )
    print(
        f"fsdp_vs_replicate={med['tch_dist_fsdp'] / med['tch_dist_replicate']:.3f}  (tch-dist "
        "step time, fully_shard / replicate, both AdamW)"
    )
    print_step_check(res["tch_dist_fsdp"])
    print(flush=True)
    return out


# The activation-checkpointing part: the suite's transformer under per-block fully_shard (2
# ranks, AdamW) with and without checkpointing every block, tch-dist and PyTorch's composable
# `checkpoint`; a larger batch than the FSDP part's, so that activations weigh.
AC = dict(model="transformer", batch=8, rounds=2, steps=8, warmup=2)


def ac_part(a, r):
    """Activation checkpointing, tch-dist against PyTorch's composable checkpoint; returns the
    summary ratios."""
    rounds = AC["rounds"] if a.ac_rounds is None else a.ac_rounds
    r.model, r.steps, r.warmup = AC["model"], AC["steps"], AC["warmup"]
    r.results = {}
    common = ["--optim", "adamw", "--batch", str(AC["batch"])]
    ac = ["--activation-checkpointing"]
    print(
        f"bench ac: {FSDP['desc'].replace('batch 2', 'batch ' + str(AC['batch']))}, AdamW, "
        f"fully_shard on each block then the root, checkpoint on each block (or not), "
        f"{a.nproc} ranks, Gloo; {rounds} rounds x {r.steps} timed steps (+{r.warmup} warm-up)",
        flush=True,
    )
    for i in range(rounds):
        if i >= 1 and r.slack() < 0:
            r.planned -= 4 * (rounds - i)
            print(f"  ac: stopped after {i} of {rounds} rounds for lack of time", flush=True)
            r.cut_rounds += rounds - i
            break
        runs = [
            lambda: r.tch("tch_dist_ac", "fully_shard", *common, *ac),
            lambda: r.torch("pytorch_ac", "fsdp", *common, *ac),
            lambda: r.tch("tch_dist_no_ac", "fully_shard", *common),
            lambda: r.torch("pytorch_no_ac", "fsdp", *common),
        ]
        if i % 2:
            runs.reverse()
        for f in runs:
            f()
    res = r.results
    med = {k: pooled_median(v) for k, v in res.items()}
    peak = {k: max(x["peak_rss_mib_max"] for x in v) for k, v in res.items()}
    kept = {k: statistics.median(x["forward_kept_bytes"] for x in v) for k, v in res.items()}
    print(f"\n== ac: batch {AC['batch']} x 64 tokens per rank, 6 blocks\n")
    print(
        f"{'configuration':<16} {'step ms':>8} {'fwd':>6} {'bwd':>6} {'peak RSS MiB':>12} "
        f"{'kept by forward MB':>18} {'foreign':>7}  runs"
    )
    for k in ("tch_dist_ac", "pytorch_ac", "tch_dist_no_ac", "pytorch_no_ac"):
        v = res[k]
        ph = {p: statistics.median(x.get(p, 0) for x in v) for p in ("fwd_ms", "bwd_ms")}
        print(
            f"{k:<16} {med[k]:8.2f} {ph['fwd_ms']:6.1f} {ph['bwd_ms']:6.1f} {peak[k]:12.1f} "
            f"{kept[k] / 1e6:18.2f} {max(x['foreign'] for x in v):7.0%}  {len(v)}"
        )
    out = {
        "ac_kept_vs_no_ac": kept["tch_dist_ac"] / kept["tch_dist_no_ac"],
        "ac_step_vs_no_ac": med["tch_dist_ac"] / med["tch_dist_no_ac"],
        "ac_step_vs_pytorch": med["tch_dist_ac"] / med["pytorch_ac"],
        "ac_rss_vs_pytorch": peak["tch_dist_ac"] / peak["pytorch_ac"],
        "ac_kept_vs_pytorch": kept["tch_dist_ac"] / kept["pytorch_ac"],
    }
    print()
    print(
        f"ac_kept_vs_no_ac={out['ac_kept_vs_no_ac']:.3f}  (bytes the forward leaves for backward, "
        f"the whole model: an upper bound of the blocks' own ratio; goal <= 0.15; PyTorch: "
        f"{kept['pytorch_ac'] / kept['pytorch_no_ac']:.3f})"
    )
    print(
        f"ac_step_vs_no_ac={out['ac_step_vs_no_ac']:.3f}  (median step, {med['tch_dist_ac']:.1f} / "
        f"{med['tch_dist_no_ac']:.1f} ms; goal <= 1.4; PyTorch: "
        f"{med['pytorch_ac'] / med['pytorch_no_ac']:.3f})"
    )
    print(
        f"ac_step_vs_pytorch={out['ac_step_vs_pytorch']:.3f}  (tch-dist / PyTorch, both "
        "checkpointed; goal <= 0.9)"
    )
    print(
        f"ac_rss_vs_pytorch={out['ac_rss_vs_pytorch']:.3f}  (peak RSS of the larger rank, "
        f"{peak['tch_dist_ac']:.1f} / {peak['pytorch_ac']:.1f} MiB; goal <= 1.0)"
    )
    print(f"ac_kept_vs_pytorch={out['ac_kept_vs_pytorch']:.3f}  (goal <= 1.0)")
    print(flush=True)
    return out


# The pipeline part: the suite's transformer as 2 stages on 2 ranks, each schedule with each
# of MICROBATCHES; rounds (each a tch-dist and a PyTorch run per schedule and count) and timed
# / warm-up steps.
PP = dict(
    model="transformer",
    batch=8,
    microbatches=(4, 8),
    schedules=("1f1b", "zb", "zbv"),
    rounds=2,
    steps=10,
    warmup=2,
)
# The schedules' names, and their theoretical bubble for p stages and m microbatches:
# 1F1B's (p - 1) / m; zero bubble's (ZB1P) (p - 1) / (3 m) where a forward, an input backward
# and a weight backward cost the same.
# ZB-V's (4 stages in the V, two per rank) is none where they cost the same (PyTorch's
# docstring: "zero bubble" only if forward == backward input == backward weights).
PP_SCHEDULES = {
    "1f1b": ("Schedule1F1B", lambda p, m: (p - 1) / m),
    "zb": ("ScheduleInterleavedZeroBubble", lambda p, m: (p - 1) / (3 * m)),
    "zbv": ("ScheduleZBVZeroBubble", lambda p, m: 0.0),
}
# The schedules PyTorch runs on Gloo. Its ScheduleZBVZeroBubble fails at the first step
# there: `_initialize_stages` posts a message between the two middle stages, which are on
# one rank, and Gloo refuses a send to itself ("Pair is not connected"); tch-dist's is
# compared with PyTorch's Schedule1F1B and zero bubble on the 2-stage split instead.
PP_PYTORCH = ("1f1b", "zb")
# Which of PyTorch's schedules each of tch-dist's is compared with: its own first (the
# `pp_..._vs_pytorch` line), then the others (`pp_..._vs_pytorch_<other>`).
PP_AGAINST = {"1f1b": ("1f1b",), "zb": ("zb", "1f1b"), "zbv": ("1f1b", "zb")}


def pp_runs_per_round():
    """The runs of one round of the pipeline part."""
    return len(PP["microbatches"]) * sum(2 if s in PP_PYTORCH else 1 for s in PP["schedules"])


def pp_key(impl, schedule, m):
    """A configuration's name: `tch_dist_m4` (1F1B), `pytorch_zb_m8`, ..."""
    return f"{impl}_m{m}" if schedule == "1f1b" else f"{impl}_{schedule}_m{m}"


def pp_part(a, r):
    """tch-dist's schedules against PyTorch's same schedules on the same 2-stage split;
    returns the summary ratios."""
    rounds = PP["rounds"] if a.pp_rounds is None else a.pp_rounds
    r.model, r.steps, r.warmup = PP["model"], PP["steps"], PP["warmup"]
    r.results = {}
    script = os.path.join(ROOT, "bench", "pytorch_pipeline.py")
    names = " and ".join(PP_SCHEDULES[s][0] for s in PP["schedules"])
    print(
        f"bench pp: {FSDP['desc'].replace('batch 2', 'batch ' + str(PP['batch']))}, as 2 "
        f"pipeline stages (one per rank; 4 in the V for ScheduleZBVZeroBubble), SGD, {names} on "
        f"{' and '.join(map(str, PP['microbatches']))} microbatches, Gloo; {rounds} rounds x "
        f"{r.steps} timed steps (+{r.warmup} warm-up)",
        flush=True,
    )
    runs_per_round = pp_runs_per_round()
    for i in range(rounds):
        if i >= 1 and r.slack() < 0:
            r.planned -= runs_per_round * (rounds - i)
            print(f"  pp: stopped after {i} of {rounds} rounds for lack of time", flush=True)
            r.cut_rounds += rounds - i
            break
        for sched in PP["schedules"]:
            for m in PP["microbatches"]:
                args = ["--batch", str(PP["batch"]), "--microbatches", str(m)]
                args += ["--schedule", sched]
                pair = [lambda: r.tch(pp_key("tch_dist", sched, m), "pipeline", *args)]
                if sched in PP_PYTORCH:
                    pair.append(
                        lambda: r.torch(
                            pp_key("pytorch", sched, m), "pipeline", *args, script=script
                        )
                    )
                if i % 2:
                    pair.reverse()
                for f in pair:
                    f()
    res = r.results
    med = {k: pooled_median(v) for k, v in res.items()}
    peak = {k: max(x["peak_rss_mib_max"] for x in v) for k, v in res.items()}
    bubble = {k: statistics.median(x["bubble_mean"] for x in v) for k, v in res.items()}
    print(f"\n== pp: 2 ranks (zbv: 4 stages in the V), batch {PP['batch']} x 64 tokens\n")
    print(
        f"{'configuration':<19} {'step ms':>8} {'bubble':>7} {'theory':>7} "
        f"{'peak RSS MiB':>12} {'foreign':>7}  runs"
    )
    for sched in PP["schedules"]:
        for m in PP["microbatches"]:
            for impl in ("tch_dist", "pytorch") if sched in PP_PYTORCH else ("tch_dist",):
                k = pp_key(impl, sched, m)
                v = res[k]
                print(
                    f"{k:<19} {med[k]:8.2f} {bubble[k]:7.3f} {PP_SCHEDULES[sched][1](2, m):7.3f} "
                    f"{peak[k]:12.1f} {max(x['foreign'] for x in v):7.0%}  {len(v)}"
                )
    out = {}
    print()
    for sched in PP["schedules"]:
        name, theory = PP_SCHEDULES[sched]
        for m in PP["microbatches"]:
            t = pp_key("tch_dist", sched, m)
            tag = f"pp_m{m}" if sched == "1f1b" else f"pp_{sched}_m{m}"
            out[f"{tag}_bubble"] = bubble[t]
            for other in PP_AGAINST[sched]:
                if other not in PP["schedules"]:
                    continue
                p = pp_key("pytorch", other, m)
                key = f"{tag}_vs_pytorch" + ("" if other == sched else f"_{other}")
                out[key] = med[t] / med[p]
                what = (
                    name
                    if other == sched
                    else f"tch-dist's {name} / PyTorch's {PP_SCHEDULES[other][0]}"
                )
                goal = "; goal <= 0.9" if sched == other == "1f1b" else ""
                print(
                    f"{key}={out[key]:.3f}  (median step, {what}, {med[t]:.1f} / "
                    f"{med[p]:.1f} ms{goal})"
                )
            own = pp_key("pytorch", sched, m)
            pytorch_bubble = f"PyTorch {bubble[own]:.3f}; " if own in bubble else ""
            print(
                f"{tag}_bubble={bubble[t]:.3f}  (measured, (wall - CPU) / CPU per rank; "
                f"{pytorch_bubble}the schedule's theoretical {theory(2, m):.3f})"
            )
    print(flush=True)
    return out


# The 2-D part: the suite's transformer (with separate q, k, v) on 4 ranks as a 2x2 mesh, in
# two layouts (HSDP; FSDP x TP), each against PyTorch's same layout; rounds (each a tch-dist
# and a PyTorch run per layout, order flipping) and timed / warm-up steps. Four ranks share
# this machine's cores, so a run takes 6-8 s (tch-dist) or 17-18 s (PyTorch, most of it
# starting 4 Pythons) on a quiet machine: about 2.5 minutes for 3 rounds; a busy machine gets
# fewer rounds (--two-d-budget).
TWO_D = dict(layouts=("hsdp", "fsdp_tp"), ranks=4, rounds=3, steps=15, warmup=3)
TWO_D_DESC = {
    "hsdp": "HSDP, mesh 2x2 (dp_replicate x dp_shard), fully_shard on each block then the root",
    "fsdp_tp": "FSDP x TP, mesh 2x2 (dp x tp): q/k/v/fc1 column-, proj/fc2 row-parallel over "
    "tp, then fully_shard on each block and the root over dp",
}


# The parts that follow the model suite, in the order they run.
PARTS = ("fsdp", "ac", "pp", "two_d", "cp", "moe", "ft", "hosts")

MOE = dict(ranks=4, rounds=3, steps=8, warmup=2)


def moe_part(a, r):
    """tch-dist's expert parallelism with fully_shard against PyTorch's, torchtitan's way, 4
    ranks; returns the summary ratios."""
    rounds = MOE["rounds"] if a.moe_rounds is None else a.moe_rounds
    r.model, r.steps, r.warmup = None, MOE["steps"], MOE["warmup"]
    r.results = {}
    nproc, r.nproc = r.nproc, MOE["ranks"]
    script = os.path.join(ROOT, "bench", "pytorch_moe.py")
    print(
        f"bench moe: 2 MoE layers (dim 128, 8 SwiGLU experts of width 256, top-2 by sigmoid "
        f"scores, a shared expert of width 256) on 1024 tokens per rank, the experts split over "
        f"the {MOE['ranks']} ranks (all-to-all dispatch), fully_shard on the rest, SGD; tch-dist "
        f"(bench_ddp --mode moe) against PyTorch in torchtitan's approach (bench/pytorch_moe.py), "
        f"Gloo, 1 torch thread/rank; {rounds} rounds x {r.steps} timed steps (+{r.warmup} warm-up)",
        flush=True,
    )
    for i in range(rounds):
        if i >= 1 and r.slack() < 0:
            r.planned -= 2 * (rounds - i)
            print(f"  moe: stopped after {i} of {rounds} rounds for lack of time", flush=True)
            r.cut_rounds += rounds - i
            break
        pair = [
            lambda: r.tch("tch_dist_moe", "moe"),
            lambda: r.torch("pytorch_moe", "moe", script=script),
        ]
        if i % 2:
            pair.reverse()
        for f in pair:
            f()
    r.nproc = nproc
    res = r.results
    med = {k: pooled_median(v) for k, v in res.items()}
    peak = {k: max(x["peak_rss_mib_max"] for x in v) for k, v in res.items()}
    print("\n== moe: 4 ranks, expert parallelism + fully_shard\n")
    print(f"{'configuration':<14} {'step ms':>8} {'fwd':>7} {'bwd':>7} {'peak RSS MiB':>12}  runs")
    for k in ("tch_dist_moe", "pytorch_moe"):
        v = res[k]
        fwd = statistics.median(x["fwd_ms"] for x in v)
        bwd = statistics.median(x["bwd_ms"] for x in v)
        print(f"{k:<14} {med[k]:8.1f} {fwd:7.1f} {bwd:7.1f} {peak[k]:12.1f}  {len(v)}")
    t, p = "tch_dist_moe", "pytorch_moe"
    print_step_check(res[t])
    out = {"moe_vs_pytorch": med[t] / med[p], "moe_rss_vs_pytorch": peak[t] / peak[p]}
    # loss_parallel against the gathered head, 2 ranks, one run (bytes, not time).
    r.nproc = 2
    lp = r.tch("loss_parallel", "loss_parallel")
    r.nproc = nproc
    out["loss_parallel_kept_vs_gathered"] = lp["kept_local_bytes"] / lp["kept_gathered_bytes"]
    print()
    print(
        f"moe_vs_pytorch={out['moe_vs_pytorch']:.3f}  (median step, {med[t]:.1f} / {med[p]:.1f} "
        f"ms; paired over rounds {paired_ratio(res[t], res[p]):.3f}; goal <= 0.9)"
    )
    print(
        f"moe_rss_vs_pytorch={out['moe_rss_vs_pytorch']:.3f}  (peak RSS of the largest rank, "
        f"{peak[t]:.1f} / {peak[p]:.1f} MiB; goal <= 1.0)"
    )
    print(
        f"loss_parallel_kept_vs_gathered={out['loss_parallel_kept_vs_gathered']:.3f}  (what the "
        f"loss keeps for backward at 2 ranks from a column-parallel head's logits, local with "
        f"loss_parallel / gathered with cross_entropy, {lp['kept_local_bytes'] / 1e6:.1f} / "
        f"{lp['kept_gathered_bytes'] / 1e6:.1f} MB; goal <= 0.5, 1/tp)"
    )
    print(flush=True)
    return out


CP = dict(ranks=(1, 2, 4), rounds=3, steps=5, warmup=2, seq_len=2048)


FT = dict(rounds=3, steps=10, warmup=3, exit_at=6)


def ft_part(a, r):
    """Fault tolerance's cost without faults against replicate, and one fault's; returns the
    summary figures."""
    rounds = FT["rounds"] if a.ft_rounds is None else a.ft_rounds
    r.model, r.steps, r.warmup = "mlp", FT["steps"], FT["warmup"]
    r.results = {}
    nproc = r.nproc
    lighthouse_bin = os.path.join(a.bin_dir, "tch-dist-lighthouse")
    lighthouse = subprocess.Popen(
        [lighthouse_bin, "--min_replicas", "1", "--bind", "127.0.0.1:0",
         "--heartbeat_timeout_ms", "1000"],
        stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True,
    )
    try:
        line = lighthouse.stdout.readline().strip()
        url = "http://127.0.0.1:" + line.rsplit(":", 1)[1]
        groups = [r.launcher, "--replica-groups", "2", "--lighthouse", url, "--nproc-per-node", "1"]
        print(
            f"bench ft: the MLP, two replica groups of one rank (a quorum, the fault-tolerant "
            f"average and the commit vote per step) against replicate over two ranks, the same "
            f"SGD, Gloo; {rounds} rounds x {r.steps} timed steps (+{r.warmup} warm-up), then one "
            f"run where group 1 exits at step {FT['exit_at']} and is restarted",
            flush=True,
        )
        for i in range(rounds):
            if i >= 1 and r.slack() < 0:
                print(f"  ft: stopped after {i} of {rounds} rounds for lack of time", flush=True)
                r.cut_rounds += rounds - i
                break
            r.nproc = 2
            trio = [
                lambda: r.tch("ft_baseline", "ft_baseline"),
                lambda: r.run(
                    "ft", groups + ["--", r.bench, "--mode", "ft"] + r.common(), False
                ),
                lambda: r.run(
                    "ft_after_backward",
                    groups + ["--", r.bench, "--mode", "ft_after_backward"] + r.common(),
                    False,
                ),
            ]
            # Each configuration first, second and third in turn.
            for f in trio[i % 3:] + trio[: i % 3]:
                f()
        # One fault: group 1 exits, its launcher restarts it; both groups' records.
        cmd = groups + ["--max-restarts", "1", "--", r.bench, "--mode", "ft"] + r.common()
        cmd += ["--exit-at", str(FT["exit_at"])]
        p = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True)
        if p.returncode != 0:
            sys.stderr.write(p.stdout[-4000:] + p.stderr[-4000:])
            raise SystemExit(f"bench: `{' '.join(cmd)}` failed with status {p.returncode}")
        recs = parse_bench(p.stdout)
    finally:
        lighthouse.kill()
        lighthouse.wait()
        r.nproc = nproc
    survivor = next(x for x in recs if x["replica_group"] == "0")
    restarted = next(x for x in recs if x["replica_group"] == "1" and x["restarted"])
    res = r.results
    med = {k: pooled_median(v) for k, v in res.items()}
    print("\n== ft: two replica groups against replicate, the MLP\n")
    print(f"{'configuration':<17} {'step ms':>8} {'quorum':>7} {'average':>8} {'commit':>7}  runs")
    for k in ("ft_baseline", "ft", "ft_after_backward"):
        part = {
            f: statistics.median(x.get(f, 0.0) for x in res[k])
            for f in ("quorum_ms", "average_ms", "commit_ms")
        }
        print(
            f"{k:<17} {med[k]:8.1f} {part['quorum_ms']:7.1f} {part['average_ms']:8.1f} "
            f"{part['commit_ms']:7.1f}  {len(res[k])}"
        )
    out = {
        "ft_vs_replicate": med["ft"] / med["ft_baseline"],
        "ft_fault_to_commit_s": (survivor["fault_to_commit_ms"] or 0.0) / 1e3,
        "ft_rejoin_to_commit_s": (restarted["rejoin_to_commit_ms"] or 0.0) / 1e3,
        "ft_steps_lost": 0.0,
    }
    print()
    print(
        f"ft_vs_replicate={out['ft_vs_replicate']:.3f}  (median step, {med['ft']:.1f} / "
        f"{med['ft_baseline']:.1f} ms; paired over rounds "
        f"{paired_ratio(res['ft'], res['ft_baseline']):.3f}; goal <= 1.03)"
    )
    print(
        f"ft_fault_to_commit_s={out['ft_fault_to_commit_s']:.3f}  (the survivor, from the start "
        f"of the step that met the failure to its next committed step; goal <= 2)"
    )
    print(
        f"ft_rejoin_to_commit_s={out['ft_rejoin_to_commit_s']:.3f}  (the restarted group, from "
        f"its process start to its first committed step, healing included)"
    )
    print("ft_steps_lost=0  (committed steps the survivor lost: its failed step is retried)")
    print(
        f"ft_overlap_vs_after_backward={med['ft'] / med['ft_after_backward']:.3f}  (the "
        f"average's chunks leaving during backward, prepare_for_backward, against the whole "
        f"average after it; paired {paired_ratio(res['ft'], res['ft_after_backward']):.3f})"
    )
    print(flush=True)
    return out


def cp_part(a, r):
    """Context parallelism: one long sequence whole on 1 rank, split over 2 and 4 ranks (ring
    attention); returns the summary ratios."""
    rounds = CP["rounds"] if a.cp_rounds is None else a.cp_rounds
    r.model, r.steps, r.warmup = None, CP["steps"], CP["warmup"]
    r.results = {}
    nproc = r.nproc
    print(
        f"bench cp: GPT-2-style transformer, 2 blocks d=256, 4 heads, one sequence of "
        f"{CP['seq_len']} tokens, causal attention through tch_dist::nn (ring attention over the "
        f"ranks, head-tail load balancing), SGD, replicate over the ranks; whole on 1 rank, "
        f"split over 2 and 4 (4 ranks share this machine's {r.ncpu} cores); {rounds} rounds x "
        f"{r.steps} timed steps (+{r.warmup} warm-up). PyTorch's context_parallel is not run: "
        f"its ring dispatches only CUDA's flash, efficient and cuDNN attention kernels, none of "
        f"which runs on a CPU",
        flush=True,
    )
    for i in range(rounds):
        if i >= 1 and r.slack() < 0:
            r.planned -= len(CP["ranks"]) * (rounds - i)
            print(f"  cp: stopped after {i} of {rounds} rounds for lack of time", flush=True)
            r.cut_rounds += rounds - i
            break
        order = list(CP["ranks"]) if i % 2 == 0 else list(reversed(CP["ranks"]))
        for n in order:
            r.nproc = n
            r.tch(f"cp{n}", "cp", "--seq-len", str(CP["seq_len"]), launch=True)
    r.nproc = nproc
    res = r.results
    med = {k: pooled_median(v) for k, v in res.items()}
    kept = {k: statistics.median(x["forward_kept_bytes"] for x in v) for k, v in res.items()}
    peak = {k: max(x["peak_rss_mib_max"] for x in v) for k, v in res.items()}
    print(f"\n== cp: one sequence of {CP['seq_len']} tokens\n")
    print(f"{'ranks':<6} {'step ms':>8} {'fwd':>7} {'bwd':>7} {'kept MB/rank':>12} {'peak RSS MiB':>12}  runs")
    for n in CP["ranks"]:
        k = f"cp{n}"
        v = res[k]
        fwd = statistics.median(x["fwd_ms"] for x in v)
        bwd = statistics.median(x["bwd_ms"] for x in v)
        print(f"{n:<6} {med[k]:8.1f} {fwd:7.1f} {bwd:7.1f} {kept[k] / 1e6:12.2f} {peak[k]:12.1f}  {len(v)}")
    out = {}
    print()
    for n in CP["ranks"][1:]:
        k = f"cp{n}"
        out[f"cp{n}_kept_vs_unsplit"] = kept[k] / kept["cp1"]
        out[f"cp{n}_step_vs_unsplit"] = med[k] / med["cp1"]
        print(
            f"cp{n}_kept_vs_unsplit={out[f'cp{n}_kept_vs_unsplit']:.3f}  (activations the "
            f"forward keeps for backward per rank, {kept[k] / 1e6:.1f} / {kept['cp1'] / 1e6:.1f} MB; "
            f"goal <= {1.1 / n:.3f}, 1/{n} + 10%)"
        )
        print(
            f"cp{n}_step_vs_unsplit={out[f'cp{n}_step_vs_unsplit']:.3f}  (median step, "
            f"{med[k]:.1f} / {med['cp1']:.1f} ms; paired over rounds "
            f"{paired_ratio(res[k], res['cp1']):.3f}; {n} ranks on {r.ncpu} cores)"
        )
    print(flush=True)
    return out


def two_d_part(a, r):
    """tch-dist HSDP and FSDP x TP against PyTorch's, 4 ranks; returns the summary ratios."""
    rounds = TWO_D["rounds"] if a.two_d_rounds is None else a.two_d_rounds
    pick = lambda k: TWO_D[k] if getattr(a, k) is None else getattr(a, k)
    # No --model: the part has its own (both programs build it).
    r.model, r.steps, r.warmup = None, pick("steps"), pick("warmup")
    r.results = {}
    nproc, r.nproc = r.nproc, TWO_D["ranks"]
    script = os.path.join(ROOT, "bench", "pytorch_two_d.py")
    print(
        f"bench two_d: GPT-2-style transformer, 6 blocks d=256, 4 heads (separate q, k, v), "
        f"vocabulary 128 (4.8M parameters in 102 tensors), batch 2 x 64 tokens per data-parallel "
        f"replica, AdamW (fused on both sides), {TWO_D['ranks']} ranks, Gloo, 1 torch "
        f"thread/rank; {rounds} rounds x {r.steps} timed steps (+{r.warmup} warm-up)",
        flush=True,
    )
    for layout in TWO_D["layouts"]:
        print(f"  {layout}: {TWO_D_DESC[layout]}", flush=True)
    for i in range(rounds):
        if i >= 1 and r.slack() < 0:
            r.planned -= 2 * len(TWO_D["layouts"]) * (rounds - i)
            print(f"  two_d: stopped after {i} of {rounds} rounds for lack of time", flush=True)
            r.cut_rounds += rounds - i
            break
        for layout in TWO_D["layouts"]:
            pair = [
                lambda: r.tch(f"tch_dist_{layout}", layout),
                lambda: r.torch(f"pytorch_{layout}", layout, script=script),
            ]
            if i % 2:
                pair.reverse()
            for f in pair:
                f()
    r.nproc = nproc
    res = r.results
    med = {k: pooled_median(v) for k, v in res.items()}
    peak = {k: max(x["peak_rss_mib_max"] for x in v) for k, v in res.items()}
    state = {k: max(x["state_bytes_max"] for x in v) for k, v in res.items()}
    print("\n== two_d: 4 ranks, 2x2 mesh, AdamW\n")
    print(
        f"{'configuration':<18} {'step ms':>8} {'fwd':>6} {'bwd':>6} {'opt':>6} {'cpu/rank':>8} "
        f"{'sys':>6} {'peak RSS MiB':>12} {'state MB/rank':>13} {'foreign':>7}  runs"
    )
    for layout in TWO_D["layouts"]:
        for k in (f"tch_dist_{layout}", f"pytorch_{layout}"):
            v = res[k]
            ph = {
                p: statistics.median(x.get(p, 0) for x in v)
                for p in ("fwd_ms", "bwd_ms", "opt_ms", "cpu_ms", "sys_ms")
            }
            print(
                f"{k:<18} {med[k]:8.2f} {ph['fwd_ms']:6.1f} {ph['bwd_ms']:6.1f} "
                f"{ph['opt_ms']:6.1f} {ph['cpu_ms']:8.1f} {ph['sys_ms']:6.1f} {peak[k]:12.1f} "
                f"{state[k] / 1e6:13.2f} {max(x['foreign'] for x in v):7.0%}  {len(v)}"
            )
    out = {}
    print()
    for layout in TWO_D["layouts"]:
        t, p = f"tch_dist_{layout}", f"pytorch_{layout}"
        out[f"{layout}_vs_pytorch"] = med[t] / med[p]
        out[f"{layout}_rss_vs_pytorch"] = peak[t] / peak[p]
        print(
            f"{layout}_vs_pytorch={out[f'{layout}_vs_pytorch']:.3f}  (median step, "
            f"{med[t]:.1f} / {med[p]:.1f} ms; paired over rounds "
            f"{paired_ratio(res[t], res[p]):.3f}; goal <= 0.9)"
        )
        print(
            f"{layout}_rss_vs_pytorch={out[f'{layout}_rss_vs_pytorch']:.3f}  (peak RSS of the "
            f"largest rank, {peak[t]:.1f} / {peak[p]:.1f} MiB; goal <= 1.0)"
        )
    print(flush=True)
    return out


def planned_runs(a, m):
    """How many runs cpu_model makes for model settings `m`."""
    rounds = m["rounds"] if a.rounds is None else a.rounds
    view_rounds = min(rounds, max(1, (rounds + 1) // 2))
    return 2 * rounds + 5 * view_rounds + 2 * m["trim"] + m["detail"] + 1


def cpu_bench(a, r):
    models = [m for m in a.models.split(",") if m]
    for m in models:
        if m not in MODELS and m not in PARTS:
            raise SystemExit(
                f"bench: unknown model {m} ({', '.join(MODELS)}, {', '.join(PARTS[:-1])} or "
                f"{PARTS[-1]})"
            )
    fsdp = "fsdp" in models
    ac = "ac" in models
    pp = "pp" in models
    two_d = "two_d" in models
    cp = "cp" in models
    moe = "moe" in models
    requested = set(models)
    hosts = "hosts" in models
    models = [m for m in models if m not in PARTS]
    # Each model gets the share of what is left of the budget that its runs are of the runs
    # still to come.
    end = time.time() + a.budget if a.budget else float("inf")
    planned = [planned_runs(a, MODELS[m]) for m in models]
    summary = {}
    for i, m in enumerate(models):
        start = time.time()
        r.planned, r.done = planned[i], 0
        r.deadline = start + (end - start) * planned[i] / sum(planned[i:])
        summary[m] = cpu_model(a, r, m)
        print(f"bench {m} took {time.time() - start:.0f} s", flush=True)
    fsdp_summary = None
    if fsdp:
        start = time.time()
        rounds = FSDP["rounds"] if a.fsdp_rounds is None else a.fsdp_rounds
        r.planned, r.done = 2 * rounds + 1, 0
        r.deadline = start + a.fsdp_budget if a.fsdp_budget else float("inf")
        fsdp_summary = fsdp_part(a, r)
        print(f"bench fsdp took {time.time() - start:.0f} s", flush=True)
    ac_summary = None
    if ac:
        start = time.time()
        rounds = AC["rounds"] if a.ac_rounds is None else a.ac_rounds
        r.planned, r.done = 4 * rounds, 0
        r.deadline = start + a.ac_budget if a.ac_budget else float("inf")
        ac_summary = ac_part(a, r)
        print(f"bench ac took {time.time() - start:.0f} s", flush=True)
    pp_summary = None
    if pp:
        start = time.time()
        rounds = PP["rounds"] if a.pp_rounds is None else a.pp_rounds
        r.planned, r.done = pp_runs_per_round() * rounds, 0
        r.deadline = start + a.pp_budget if a.pp_budget else float("inf")
        pp_summary = pp_part(a, r)
        print(f"bench pp took {time.time() - start:.0f} s", flush=True)
    two_d_summary = None
    if two_d:
        start = time.time()
        rounds = TWO_D["rounds"] if a.two_d_rounds is None else a.two_d_rounds
        r.planned, r.done = 2 * len(TWO_D["layouts"]) * rounds, 0
        r.deadline = start + a.two_d_budget if a.two_d_budget else float("inf")
        two_d_summary = two_d_part(a, r)
        print(f"bench two_d took {time.time() - start:.0f} s", flush=True)
    cp_summary = None
    if cp:
        start = time.time()
        rounds = CP["rounds"] if a.cp_rounds is None else a.cp_rounds
        r.planned, r.done = len(CP["ranks"]) * rounds, 0
        r.deadline = start + a.cp_budget if a.cp_budget else float("inf")
        cp_summary = cp_part(a, r)
        print(f"bench cp took {time.time() - start:.0f} s", flush=True)
    moe_summary = None
    if moe:
        start = time.time()
        rounds = MOE["rounds"] if a.moe_rounds is None else a.moe_rounds
        r.planned, r.done = 2 * rounds + 1, 0
        r.deadline = start + a.moe_budget if a.moe_budget else float("inf")
        moe_summary = moe_part(a, r)
        print(f"bench moe took {time.time() - start:.0f} s", flush=True)
    ft_summary = None
    if "ft" in requested:
        start = time.time()
        rounds = FT["rounds"] if a.ft_rounds is None else a.ft_rounds
        r.planned, r.done = 2 * rounds + 1, 0
        r.deadline = start + a.ft_budget if a.ft_budget else float("inf")
        ft_summary = ft_part(a, r)
        print(f"bench ft took {time.time() - start:.0f} s", flush=True)
    hosts_summary = None
    if hosts:
        hosts_summary = hosts_part(a)
    for m, s in summary.items():
        print(f"model={m} " + " ".join(f"{k}={v:.3f}" for k, v in s.items()))
    if fsdp_summary:
        print("fsdp " + " ".join(f"{k}={v:.3f}" for k, v in fsdp_summary.items()))
    if ac_summary:
        print("ac " + " ".join(f"{k}={v:.3f}" for k, v in ac_summary.items()))
    if pp_summary:
        print("pp " + " ".join(f"{k}={v:.3f}" for k, v in pp_summary.items()))
    if two_d_summary:
        print("two_d " + " ".join(f"{k}={v:.3f}" for k, v in two_d_summary.items()))
    if cp_summary:
        print("cp " + " ".join(f"{k}={v:.3f}" for k, v in cp_summary.items()))
    if moe_summary:
        print("moe " + " ".join(f"{k}={v:.3f}" for k, v in moe_summary.items()))
    if ft_summary:
        print("ft " + " ".join(f"{k}={v:.3f}" for k, v in ft_summary.items()))
    if hosts_summary:
        print("hosts " + " ".join(f"{k}={v:.3f}" for k, v in hosts_summary.items()))
    # The same figures as pictures (docs/PERFORMANCE.md shows a run's charts).
    per_model = {m: s["tch_dist_vs_pytorch_ddp"] for m, s in summary.items()}
    for path in charts.write_charts(
        os.path.join(ROOT, "target", "bench"),
        per_model,
        fsdp_summary,
        caption=f"make bench, {a.nproc} ranks, Gloo, {time.strftime('%Y-%m-%d')}",
    ):
        print(f"chart: {path}")
    if not models:
        return None
    return summary[models[0]]["tch_dist_vs_pytorch_ddp"]


def gpu_bench(a, r):
    print(
        f"bench: MLP 12 x (2048-8192-2048) (403M parameters), batch 64, SGD, CUDA, "
        f"world size {a.nproc}, NCCL; {a.rounds} rounds x {a.steps} timed steps (+{a.warmup} warm-up)",
        flush=True,
    )
    for i in range(a.rounds):
        runs = [
            lambda: r.torch("pytorch_ddp", "ddp"),
            lambda: r.tch("tch_dist", "replicate", env={"TCH_DIST_NO_SHORTCUTS": "1"}),
            lambda: r.tch("tch_plain", "plain"),
            lambda: r.torch("pytorch_plain", "plain"),
        ]
        if i % 2:
            runs.reverse()
        for f in runs:
            f()
    floor = r.tch("allreduce", "allreduce")
    med, _ = table(r, ["tch_plain", "pytorch_plain", "tch_dist", "pytorch_ddp"])
    print()
    floor_lines(floor, "NCCL")
    over = med["tch_dist"] / med["tch_plain"] - 1
    over_torch = med["pytorch_ddp"] / med["pytorch_plain"] - 1
    skipped = any(rec.get("skips_communication", True) for rec in r.results["tch_dist"])
    print(f"tch_dist_communicates={0 if skipped else 1}  (TCH_DIST_NO_SHORTCUTS=1: every bucket all-reduced)")
    print(f"tch_dist_over_plain_pct={100 * over:.1f}  (goal: <= 3)")
    print(f"pytorch_ddp_over_plain_pct={100 * over_torch:.1f}")
    return med["tch_dist"] / med["pytorch_ddp"]


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--gpu", action="store_true", help="the GPU benchmark (CUDA, NCCL)")
    p.add_argument("--rounds", type=int, default=None)
    p.add_argument("--steps", type=int, default=None)
    p.add_argument("--warmup", type=int, default=None)
    p.add_argument("--nproc", type=int, default=None)
    p.add_argument("--bucket-cap-mb", default="25")
    p.add_argument("--device", default="cuda", help="with --gpu (cpu: a smoke test of the flow)")
    p.add_argument(
        "--model",
        default=None,
        help="with --gpu: the MLP to run (cpu or gpu, default gpu); on CPU: one model of the suite",
    )
    p.add_argument(
        "--models",
        default=",".join(list(MODELS) + list(PARTS)),
        help="the CPU suite's models, in order, `fsdp` for the FSDP part, `ac` for the "
        "activation-checkpointing part, `pp` for the pipeline part, `two_d` for the 2-D "
        "part (HSDP, FSDP x TP; 4 ranks), `cp` for the context-parallel part (1, 2, 4 ranks), `moe` for the mixture-of-experts part (4 ranks), `ft` for the fault-tolerance part (2 replica groups) and `hosts` for the across-hosts part (2 network "
        "namespaces x 2 ranks, a 1 Gbit/s link; root), which run after them (default: %(default)s); the "
        "last line is the first model's tch_dist_vs_pytorch_ddp",
    )
    p.add_argument("--hosts-rounds", type=int, default=None, help=f"default {HOSTS['rounds']}")
    p.add_argument(
        "--hosts-budget",
        type=float,
        default=420.0,
        help="seconds for the across-hosts part (0: none; default %(default)s)",
    )
    p.add_argument("--ft-rounds", type=int, default=None, help=f"default {FT['rounds']}")
    p.add_argument(
        "--ft-budget",
        type=float,
        default=90.0,
        help="seconds for the fault-tolerance part (0: none; default %(default)s)",
    )
    p.add_argument("--moe-rounds", type=int, default=None, help=f"default {MOE['rounds']}")
    p.add_argument(
        "--moe-budget",
        type=float,
        default=90.0,
        help="seconds for the mixture-of-experts part (0: none; default %(default)s)",
    )
    p.add_argument("--cp-rounds", type=int, default=None, help=f"default {CP['rounds']}")
    p.add_argument(
        "--cp-budget",
        type=float,
        default=90.0,
        help="seconds for the context-parallel part (0: none; default %(default)s)",
    )
    p.add_argument("--two-d-rounds", type=int, default=None, help=f"default {TWO_D['rounds']}")
    p.add_argument(
        "--two-d-budget",
        type=float,
        default=170.0,
        help="seconds for the 2-D part (0: none; default %(default)s)",
    )
    p.add_argument("--pp-rounds", type=int, default=None, help=f"default {PP['rounds']}")
    p.add_argument(
        "--pp-budget",
        type=float,
        default=120.0,
        help="seconds for the pipeline part (0: none; default %(default)s)",
    )
    p.add_argument("--ac-rounds", type=int, default=None, help=f"default {AC['rounds']}")
    p.add_argument(
        "--ac-budget",
        type=float,
        default=150.0,
        help="seconds for the activation-checkpointing part (0: none; default %(default)s)",
    )
    p.add_argument("--fsdp-rounds", type=int, default=None, help=f"default {FSDP['rounds']}")
    p.add_argument(
        "--fsdp-budget",
        type=float,
        default=150.0,
        help="seconds for the FSDP part (0: none; default %(default)s)",
    )
    p.add_argument("--bin-dir", default=os.path.join(ROOT, "target", "release"))
    p.add_argument("--script", default=os.path.join(ROOT, "bench", "pytorch_ddp.py"))
    p.add_argument("--python", default=os.path.join(ROOT, ".venv", "bin", "python"))
    p.add_argument("--max-foreign", type=float, default=0.08)
    p.add_argument("--retries", type=int, default=3)
    p.add_argument("--quiet-wait", type=float, default=20.0)
    p.add_argument(
        "--budget",
        type=float,
        default=None,
        help="seconds for the whole CPU suite (default 510; 0: none): waits for a quiet "
        "machine, repeated runs and, after two, rounds are left out when the remaining runs "
        "would not fit",
    )
    p.add_argument("-v", "--verbose", action="store_true")
    a = p.parse_args()
    # On CPU, rounds/steps/warm-up default per model (MODELS); --rounds etc. override them.
    defaults = (2, 30, 5, 1) if a.gpu else (None, None, None, 2)
    for k, d in zip(("rounds", "steps", "warmup", "nproc"), defaults):
        if getattr(a, k) is None:
            setattr(a, k, d)
    if a.budget is None:
        a.budget = 0.0 if a.gpu else 510.0
    if a.gpu:
        a.quiet_wait = 0.0
    elif a.model:
        a.models, a.model = ("mlp" if a.model == "cpu" else a.model), None
    start = time.time()
    r = Runner(a)
    ratio = gpu_bench(a, r) if a.gpu else cpu_bench(a, r)
    print(
        f"bench took {time.time() - start:.0f} s ({r.retried} runs repeated for foreign load"
        + (f"; {r.not_repeated} not repeated for lack of time" if r.not_repeated else "")
        + (f"; {r.cut_rounds} rounds left out for lack of time" if r.cut_rounds else "")
        + ")"
    )
    if ratio is not None:
        print(f"tch_dist_vs_pytorch_ddp={ratio:.3f}")


if __name__ == "__main__":
    main()
