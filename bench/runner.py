"""Running the benchmark's jobs on a shared machine (driver.py's runs): the launcher and the
binaries, `BENCH {json}` lines, how busy the machine is, and repeating a run other programs
disturbed."""

import json
import os
import statistics
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def print_step_check(runs):
    """The always-on step check's cost, rank 0's, measured inside the runtime, per run and
    the median of those over the median step: the time in the check less the wait for the
    last peer's header (time the rank would otherwise wait at the pass's first collective;
    counted where the headers travel through shared memory), and the whole time in the
    check, that wait included (an upper bound)."""
    timed = [x for x in runs if x.get("median_ms")]
    if not timed:
        return
    total = [x.get("step_check_ms", 0.0) for x in timed]
    cost = [t - x.get("step_check_wait_ms", 0.0) for t, x in zip(total, timed)]
    ratio = lambda ms: statistics.median(m / x["median_ms"] for m, x in zip(ms, timed))
    print(
        f"step_check_vs_step={ratio(cost):.4f}  (time in the step check per step less the wait "
        f"for the last peer, {statistics.median(cost):.3f} ms, / the median step; goal <= 0.01)"
    )
    print(
        f"step_check_with_wait_vs_step={ratio(total):.4f}  (the whole time in the check, "
        f"{statistics.median(total):.3f} ms: an upper bound)"
    )


def parse_bench(output):
    """Every `BENCH {json}` record of a run (the launcher prefixes lines with `[rankR]: `).
    Each record is read up to its own end: where two processes' writes met on one line
    (torchrun's ranks share the terminal, unprefixed), what follows it is another record
    or another program's text, not part of it."""
    decoder = json.JSONDecoder()
    out = []
    for line in output.splitlines():
        i = line.find("BENCH {")
        while i >= 0:
            record, end = decoder.raw_decode(line, i + len("BENCH "))
            out.append(record)
            i = line.find("BENCH {", end)
    return out


def machine_idle_fraction(seconds=0.5):
    def sample():
        with open("/proc/stat") as f:
            t = [int(x) for x in f.readline().split()[1:9]]
        return sum(t), t[3] + t[4]

    a = sample()
    time.sleep(seconds)
    b = sample()
    total = b[0] - a[0]
    return (b[1] - a[1]) / total if total else 1.0


def wait_until_quiet(max_seconds, idle=0.9):
    """Waits (at most `max_seconds`) until other programs leave the CPUs mostly idle."""
    deadline = time.time() + max_seconds
    while time.time() < deadline and machine_idle_fraction() < idle:
        pass


def foreign_fraction(recs, ncpu):
    """The share of the machine's CPUs that other programs used during a run's timed window
    (machine busy time minus the ranks' own CPU time, per CPU and wall second)."""
    w = next(r for r in recs if r.get("rank", 0) == 0)["window"]
    own = sum(r["window"]["cpu_ms"] for r in recs)
    return max(0.0, w["machine_busy_ms"] - own) / (ncpu * w["wall_ms"])


class Runner:
    def __init__(self, a):
        self.a = a
        self.launcher = os.path.join(a.bin_dir, "tch-dist-run")
        self.bench = os.path.join(a.bin_dir, "bench_ddp")
        if not os.path.exists(self.bench):
            self.bench = os.path.join(a.bin_dir, "examples", "bench_ddp")
        self.ncpu = os.cpu_count() or 1
        # Ranks per distributed run: --nproc, or what a part of the suite sets (the 2-D part
        # needs a 2x2 mesh).
        self.nproc = a.nproc
        self.results = {}  # configuration -> rank-0 records, one per run
        self.retried = 0
        self.model = a.model  # what --model the runs get (None: the programs' default)
        self.steps, self.warmup = a.steps, a.warmup
        # The time budget (--budget): waiting for a quiet machine, repeating runs and, after
        # two, rounds stop when what is left would not fit the runs still planned at the pace
        # so far.
        # The caller sets, per part of the suite, its deadline and how many runs it plans.
        self.deadline = float("inf")
        self.planned = 0
        self.done = 0  # runs of the current part
        self.total_runs = 0
        self.run_seconds = 0.0
        self.not_repeated = 0
        self.cut_rounds = 0

    def slack(self):
        """Seconds before the deadline that the planned runs leave for waits and repeats."""
        pace = self.run_seconds / self.total_runs if self.total_runs else 8.0
        left = self.deadline - time.time()
        return left - max(0, self.planned - self.done) * pace

    def run(self, name, cmd, distributed, env=None):
        if distributed:
            cmd = [self.launcher, "--nproc-per-node", str(self.nproc), "--"] + cmd
        for attempt in range(self.a.retries + 1):
            wait_until_quiet(min(self.a.quiet_wait, max(0.0, self.slack())))
            t = time.time()
            p = subprocess.run(
                cmd, cwd=ROOT, capture_output=True, text=True, env=dict(os.environ, **(env or {}))
            )
            if p.returncode != 0:
                sys.stderr.write(p.stdout[-4000:] + p.stderr[-4000:])
                raise SystemExit(f"bench: `{' '.join(cmd)}` failed with status {p.returncode}")
            recs = parse_bench(p.stdout)
            if not recs:
                sys.stderr.write(p.stdout[-4000:] + p.stderr[-4000:])
                raise SystemExit(f"bench: `{' '.join(cmd)}` printed no BENCH line")
            rank0 = next(r for r in recs if r.get("rank", 0) == 0)
            foreign = foreign_fraction(recs, self.ncpu)
            rank0["foreign"] = foreign
            rank0["peak_rss_mib_max"] = max(r["peak_rss_mib"] for r in recs)
            rank0["state_bytes_max"] = max(r.get("state_bytes", 0) for r in recs)
            if all("bubble" in r for r in recs):
                # A pipeline's measured bubble, over its stages' ranks.
                rank0["bubble_mean"] = statistics.mean(r["bubble"] for r in recs)
            self.run_seconds += time.time() - t
            self.total_runs += 1
            if foreign <= self.a.max_foreign or attempt == self.a.retries:
                break
            if self.slack() < self.run_seconds / self.total_runs:
                self.not_repeated += 1
                break  # no time left for a repeat
            self.retried += 1
            if self.a.verbose:
                print(
                    f"  {self.model or ''} {name}: other programs used {foreign:.0%} of the CPUs; again",
                    flush=True,
                )
        self.done += 1
        self.results.setdefault(name, []).append(rank0)
        if self.a.verbose:
            print(
                f"  {self.model or ''} {name:<22} "
                f"{rank0.get('median_ms', rank0.get('sum_ms', 0)):8.2f} ms"
                f"  foreign {foreign:4.0%}  ({time.time() - t:.1f} s)",
                flush=True,
            )
        return rank0

    def common(self):
        a = self.a
        out = ["--steps", str(self.steps), "--warmup", str(self.warmup)]
        if a.gpu:
            out += ["--device", a.device, "--threads", "0"]
        if self.model:
            out += ["--model", self.model]
        return out

    def tch(self, name, mode, *extra, launch=None, env=None):
        cmd = [self.bench, "--mode", mode] + self.common() + list(extra)
        return self.run(name, cmd, mode != "plain" if launch is None else launch, env)

    def torch(self, name, mode, *extra, script=None):
        """PyTorch's side: bench/pytorch_ddp.py (--script), or `script`."""
        cmd = [self.a.python, script or self.a.script, "--mode", mode] + self.common() + list(extra)
        return self.run(name, cmd, mode != "plain")
