"""The `hosts` part of `make bench` (driver.py `--models hosts`; issue 43 item 7): tch-dist
against PyTorch across two hosts joined by a shaped link.

Two "hosts" are network namespaces on this machine, as the multi-host test tier makes them
(tests/common/hosts.rs; ../shared/MULTIHOST.md section 7): namespaces `tdb<pid>x<n>h0` and
`...h1`, each with `lo` up and an `eth0` at 10.78.0.(i+1)/24, joined by a veth pair each to a
bridge in a third namespace (`...sw`), the switch. Each host's `eth0` egress is shaped by a
token bucket, `tc qdisc add dev eth0 root tbf rate 1gbit burst 512kb latency 50ms` (netem is
not built into this kernel, so no delay or loss is added; TBF shapes egress only, so both
hosts are shaped and the link is 1 Gbit/s each way; `burst` is at least rate / HZ, 500 KB at
HZ 250). Ranks on one host reach each other over `lo` (their addresses are local), so `eth0`
carries only what crosses hosts.

Every run is one launcher per host, started together: `tch-dist-run --nnodes 2 --node-rank
i --nproc-per-node 2 --master-addr 10.78.0.1 --master-port P -- bench_ddp ...` for tch-dist,
`python -m torch.distributed.run` (torchrun) with the same arguments and
bench/pytorch_ddp.py or bench/pytorch_two_d.py for PyTorch; `GLOO_SOCKET_IFNAME=eth0` for
both (Gloo would otherwise bind the shared hostname's address, MULTIHOST.md section 4). Ranks
0 and 1 are on host 0, 2 and 3 on host 1 (contiguous per node, as torchrun assigns them).
Each rank reads its namespace's `/proc/net/dev` at the start and the end of its timed steps
and reports `eth0`'s bytes per step (`net_rx_bytes_per_step`, `net_tx_bytes_per_step`).

The namespaces are removed when the part ends, whatever happens (try/finally; processes
still in them are killed first), and a sweep at the start removes those of a killed earlier
run (`tdb<pid>x...` whose pid is gone). Processes are signalled with `os.kill` /
`os.killpg` on checked positive ids only, never with the `kill` program and a negative
argument (`kill -9 -1` would signal every process on the machine).
"""

import os
import shutil
import signal
import subprocess
import tempfile
import time

from runner import ROOT, parse_bench

SUBNET = "10.78.0"
PREFIX = "tdb"
# The link: TBF's rate (tc syntax) and the same in bytes per second (what the wire times use).
RATE = "1gbit"
RATE_BYTES_PER_S = 1e9 / 8


def ip(*args):
    """Runs `ip args`; raises with its error output when it fails."""
    p = subprocess.run(["ip", *args], capture_output=True, text=True)
    if p.returncode != 0:
        raise RuntimeError(f"`ip {' '.join(args)}` failed: {p.stderr.strip()}")
    return p.stdout


def namespaces():
    p = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True)
    return [l.split()[0] for l in p.stdout.splitlines() if l.strip()]


def kill_pid(pid, sig=signal.SIGKILL):
    """Signals one process, by a checked positive id (never 0, 1 or a group)."""
    if pid > 1 and pid != os.getpid():
        try:
            os.kill(pid, sig)
        except ProcessLookupError:
            pass


def kill_group(pgid, sig=signal.SIGKILL):
    """Signals the process group `pgid` (a launcher started with a session of its own):
    os.killpg with a checked id above 1, so never every process on the machine."""
    if pgid > 1 and pgid != os.getpgid(0):
        try:
            os.killpg(pgid, sig)
        except ProcessLookupError:
            pass


def remove_namespace(ns):
    """Kills what runs in namespace `ns`, then removes it (and its /etc/netns folder)."""
    p = subprocess.run(["ip", "netns", "pids", ns], capture_output=True, text=True)
    for pid in p.stdout.split():
        if pid.isdigit():
            kill_pid(int(pid))
    subprocess.run(["ip", "netns", "del", ns], capture_output=True)
    shutil.rmtree(os.path.join("/etc/netns", ns), ignore_errors=True)


def sweep():
    """Removes the namespaces of earlier bench runs that no longer run (`tdb<pid>x...`
    whose pid is gone): a run killed before its finally block could."""
    for ns in namespaces():
        if not ns.startswith(PREFIX):
            continue
        pid, sep, _ = ns[len(PREFIX) :].partition("x")
        if sep and pid.isdigit() and not os.path.exists(f"/proc/{pid}"):
            remove_namespace(ns)


def unavailable():
    """Why the part cannot run here (None when it can): it needs root, `ip` and `tc`, and
    network namespaces."""
    if os.geteuid() != 0:
        return "not root (network namespaces need root)"
    for tool in ("ip", "tc"):
        if not shutil.which(tool):
            return f"no `{tool}` program"
    if subprocess.run(["ip", "netns", "list"], capture_output=True).returncode != 0:
        return "`ip netns` is not available"
    return None


class Hosts:
    """`count` hosts on one switch, each `eth0` shaped to RATE; a context manager that
    removes them on exit."""

    _next = 0

    def __init__(self, count=2, rate=RATE):
        sweep()
        self.prefix = f"{PREFIX}{os.getpid()}x{Hosts._next}"
        Hosts._next += 1
        self.count = count
        self.made = []  # namespaces made so far, removed by close()
        try:
            self._make(rate)
        except BaseException:
            self.close()
            raise

    def _make(self, rate):
        sw = self.prefix + "sw"
        ip("netns", "add", sw)
        self.made.append(sw)
        ip("-n", sw, "link", "add", "br0", "type", "bridge")
        ip("-n", sw, "link", "set", "br0", "up")
        for i in range(self.count):
            ns, veth, port = self.name(i), f"{self.prefix}v{i}", f"{self.prefix}p{i}"
            assert len(veth) <= 15, f"interface name {veth} is too long"
            ip("netns", "add", ns)
            self.made.append(ns)
            ip("link", "add", veth, "type", "veth", "peer", "name", port)
            ip("link", "set", veth, "netns", ns)
            ip("link", "set", port, "netns", sw)
            ip("-n", ns, "link", "set", veth, "name", "eth0")
            ip("-n", ns, "addr", "add", f"{self.addr(i)}/24", "dev", "eth0")
            ip("-n", ns, "link", "set", "eth0", "up")
            ip("-n", ns, "link", "set", "lo", "up")
            ip("-n", sw, "link", "set", port, "master", "br0")
            ip("-n", sw, "link", "set", port, "up")
            self.tc(i, "qdisc", "add", "dev", "eth0", "root", "tbf", "rate", rate, "burst",
                    "512kb", "latency", "50ms")

    def tc(self, i, *args):
        p = subprocess.run(["ip", "netns", "exec", self.name(i), "tc", *args],
                           capture_output=True, text=True)
        if p.returncode != 0:
            raise RuntimeError(f"`tc {' '.join(args)}` on host {i} failed: {p.stderr.strip()}")
        return p.stdout

    def name(self, i):
        return f"{self.prefix}h{i}"

    def addr(self, i):
        return f"{SUBNET}.{i + 1}"

    def close(self):
        for ns in reversed(self.made):
            remove_namespace(ns)
        self.made = []

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def run(self, cmds, env, timeout):
        """Runs `cmds[i]` on host i, all at once, each launcher in a session of its own;
        waits for all (killing every group at `timeout` seconds); returns (status, stdout,
        stderr) per host (status None: killed at the deadline)."""
        procs, files = [], []
        try:
            for i, cmd in enumerate(cmds):
                out, err = tempfile.TemporaryFile("w+"), tempfile.TemporaryFile("w+")
                files.append((out, err))
                procs.append(
                    subprocess.Popen(
                        ["ip", "netns", "exec", self.name(i), *cmd],
                        cwd=ROOT,
                        env=dict(os.environ, **env),
                        stdin=subprocess.DEVNULL,
                        stdout=out,
                        stderr=err,
                        start_new_session=True,
                    )
                )
            deadline = time.time() + timeout
            status = [None] * len(procs)
            while time.time() < deadline and None in status:
                for i, p in enumerate(procs):
                    if status[i] is None:
                        status[i] = p.poll()
                # One host failing ends the run: the other would wait for it.
                if any(s not in (None, 0) for s in status):
                    break
                time.sleep(0.05)
        finally:
            for p in procs:
                if p.poll() is None:
                    kill_group(p.pid)  # start_new_session: the group id is the pid
                    p.wait()
        result = []
        for s, (out, err) in zip(status, files):
            out.seek(0)
            err.seek(0)
            result.append((s, out.read(), err.read()))
            out.close()
            err.close()
        return result


def theory(params, root_params, powersgd_floats):
    """The bytes each host must send per step, for 2 hosts x 2 ranks, fp32 gradients of
    `params` parameters (B = 4 params bytes); ranks 0, 1 on host 0 and 2, 3 on host 1.

    Gloo's all-reduce and all-gather on CPU are rings over the group's ranks in order (0 ->
    1 -> 2 -> 3 -> 0): an all-gather of S bytes has every rank send (n - 1) / n S to the
    next, an all-reduce (reduce-scatter then all-gather) 2 (n - 1) / n S; ProcessGroupGloo's
    reduce_scatter_tensor sends what an all-reduce of its input does (measured: 1.50 x the
    input per host, against 0.75 x for all_gather_into_tensor, in these namespaces). Only
    the edges 1 -> 2 and 3 -> 0 cross hosts, one leaving each host. So, per host and step:

    - replicate / DDP (all-reduce of B over 4 ranks): 2 * 3/4 B = 1.5 B;
    - fully_shard / FSDP2 over all 4 ranks: the forward all-gather of every group (B) and the
      backward all-gather of every group but the root's (the root keeps its parameters
      unsharded after forward, as FSDP2's does: B - R), 3/4 of each crossing, and the
      gradients' reduce-scatter, 1.5 B: 3/4 (2 B - R) + 1.5 B;
    - HSDP (shard within a host, replicate across): the all-gathers and reduce-scatters stay
      inside the host; the all-reduce of each rank's half (B / 2) over the 2 ranks of its
      replicate group sends B / 2 per rank, both ranks of a host: B;
    - replicate with the fp16 / bf16 hooks: 1.5 B / 2; with PowerSGD (rank 1): the ring
      all-reduces of the uncompressed 1-D tensors and of the P and Q factors,
      1.5 x 4 `powersgd_floats`.

    The lower bound across any schedule is lower than the flat rings': an all-reduce between
    two hosts needs each host to send B (half the partial sums out, half the results back),
    an all-gather or reduce-scatter B / 2; so replicate's bound is B (which HSDP's layout
    reaches), FSDP's 1/2 (3 B - R). Returns {mode: (ring bytes, lower bound bytes)}."""
    b, r = 4.0 * params, 4.0 * root_params
    return {
        "replicate": (1.5 * b, b),
        "fully_shard": (0.75 * (2 * b - r) + 1.5 * b, 0.5 * (3 * b - r)),
        "hsdp": (b, b),
        "fp16": (0.75 * b, 0.5 * b),
        "bf16": (0.75 * b, 0.5 * b),
        "powersgd": (1.5 * 4 * powersgd_floats, 4.0 * powersgd_floats),
    }


# The suite's transformer (examples/bench_ddp/models.rs, bench/pytorch_ddp.py): width,
# blocks, vocabulary, sequence.
T_DIM, T_BLOCKS, T_VOCAB, T_SEQ = 256, 6, 128, 64


def transformer_shapes():
    """The transformer's parameter shapes (fused qkv; two_d's q, k, v have the same count)."""
    d = T_DIM
    shapes = [(T_VOCAB, d), (T_SEQ, d)]
    for _ in range(T_BLOCKS):
        shapes += [(d,), (d,), (3 * d, d), (3 * d,), (d, d), (d,), (d,), (d,)]
        shapes += [(4 * d, d), (4 * d,), (d, 4 * d), (d,)]
    shapes += [(d,), (d,), (T_VOCAB, d), (T_VOCAB,)]
    return shapes


def root_params():
    """Parameters of the root's FSDP group (what no block holds): the embeddings, the final
    LayerNorm and the head."""
    d = T_DIM
    return T_VOCAB * d + T_SEQ * d + 2 * d + T_VOCAB * d + T_VOCAB


def powersgd_floats(rank=1, min_rate=2.0):
    """What PowerSGD all-reduces per step, in floats: each 1-D tensor whole, each matrix
    (viewed as [shape[0], -1]) that compresses by at least `min_rate` as its P (rows x r) and
    Q (cols x r) factors, the others whole (PowerSGDState's `_should_compress`)."""
    n = 0
    for s in transformer_shapes():
        if len(s) <= 1:
            n += s[0]
            continue
        rows, cols = s[0], 1
        for x in s[1:]:
            cols *= x
        compressed = (rows + cols) * rank
        n += compressed if rows * cols >= compressed * min_rate else rows * cols
    return n


# The part's plan: rounds (each a tch-dist and a PyTorch run of every layout, the order
# flipping every round), timed / warm-up steps, and the replicate hooks run once each per
# side. A tch-dist run takes about 10 s here, a PyTorch one about 20 s (four Pythons
# importing torch on two cores, then torchrun's rendezvous), so the default plan is about
# 5-7 minutes; --hosts-budget (420 s) drops the rounds after the first, then the hooks, when the
# time is short.
HOSTS = dict(rounds=2, steps=10, warmup=3, hooks=("fp16", "bf16", "powersgd"))

# Per layout: tch-dist's bench_ddp arguments, PyTorch's script and arguments, and which
# compute-only run (plain training, 4 processes on the same hosts) it is compared with.
LAYOUTS = {
    "replicate": (
        ["--mode", "replicate", "--model", "transformer"],
        ("pytorch_ddp.py", ["--mode", "ddp", "--model", "transformer"]),
        "sgd",
    ),
    "fully_shard": (
        ["--mode", "fully_shard", "--model", "transformer", "--optim", "adamw"],
        ("pytorch_ddp.py", ["--mode", "fsdp", "--model", "transformer", "--optim", "adamw"]),
        "adamw",
    ),
    "hsdp": (
        ["--mode", "hsdp"],
        ("pytorch_two_d.py", ["--mode", "hsdp"]),
        "adamw",
    ),
}
DESC = {
    "replicate": "replicate / DDP (SGD, 25 MiB buckets): all-reduce over the 4 ranks",
    "fully_shard": "fully_shard / FSDP2 over the 4 ranks, each block then the root (AdamW)",
    "hsdp": "HSDP, mesh 2x2 (dp_replicate across hosts x dp_shard within), each block then "
    "the root (fused AdamW; q, k, v separate, as the two_d part)",
}


class HostRuns:
    """Runs jobs on a Hosts and keeps every run's records, per configuration."""

    def __init__(self, a, hosts, deadline):
        self.a, self.hosts, self.deadline = a, hosts, deadline
        self.results = {}  # name -> list of runs, each {"recs": [...], "seconds": s}
        self.port = 29611
        self.launcher = os.path.join(a.bin_dir, "tch-dist-run")
        self.bench = os.path.join(a.bin_dir, "examples", "bench_ddp")
        self.seconds = {"tch": [], "torch": []}
        self.planned = 0  # runs the part still plans (the caller sets and lowers it)

    def slack(self):
        """Seconds before the deadline that the planned runs leave for waiting for a quiet
        machine (as runner.Runner.slack)."""
        return self.left() - self.planned * (self.pace("tch") + self.pace("torch")) / 2

    def pace(self, side):
        s = self.seconds[side]
        return sum(s) / len(s) if s else {"tch": 12.0, "torch": 25.0}[side]

    def left(self):
        return self.deadline - time.time()

    def common(self):
        return ["--steps", str(self.a.steps_hosts), "--warmup", str(self.a.warmup_hosts)]

    def job(self, name, side, args, distributed=True):
        """One run: `side` "tch" (bench_ddp) or "torch" (a script of bench/), on both hosts."""
        from runner import wait_until_quiet

        self.port += 1
        h = self.hosts
        cmds = []
        for i in range(h.count):
            if side == "tch":
                prog = [self.bench] + args + self.common()
            else:
                script, sargs = args
                prog = [os.path.join(ROOT, "bench", script)] + sargs + self.common()
            if not distributed:
                # Two plain trainings per host, no group: tch-dist-run only starts them.
                if side == "torch":
                    prog = [self.a.python] + prog
                cmds.append([self.launcher, "--nproc-per-node", "2", "--"] + prog)
                continue
            nodes = ["--nnodes", str(h.count), "--node-rank", str(i), "--nproc-per-node", "2",
                     "--master-addr", h.addr(0), "--master-port", str(self.port)]
            if side == "tch":
                cmds.append([self.launcher] + nodes + ["--"] + prog)
            else:
                cmds.append([self.a.python, "-m", "torch.distributed.run"] + nodes + prog)
        # At most 5 s per run: each run here is long, and a machine that other programs keep
        # busy would otherwise spend the budget on waiting.
        wait_until_quiet(min(self.a.quiet_wait, 5.0, max(0.0, self.slack())))
        self.planned = max(0, self.planned - 1)
        t = time.time()
        res = h.run(cmds, {"GLOO_SOCKET_IFNAME": "eth0", "OMP_NUM_THREADS": "1"}, timeout=240)
        seconds = time.time() - t
        recs = []
        for i, (status, out, err) in enumerate(res):
            if status != 0:
                raise SystemExit(
                    f"bench hosts: {name} on host {i} ended with status {status}:\n"
                    + out[-3000:] + err[-3000:]
                )
            for rec in parse_bench(out):
                rec["host"] = i
                recs.append(rec)
        if len(recs) != 2 * h.count:
            raise SystemExit(f"bench hosts: {name}: {len(recs)} BENCH lines, not {2 * h.count}")
        self.seconds[side].append(seconds)
        run = summarize(recs, os.cpu_count() or 1)
        run["seconds"] = seconds
        self.results.setdefault(name, []).append(run)
        if self.a.verbose:
            print(
                f"  hosts {name:<24} {run['median_ms']:8.1f} ms  tx/host "
                f"{run['tx_per_host'] / 1e6:7.2f} MB/step  foreign {run['foreign']:4.0%}  "
                f"({seconds:.1f} s)",
                flush=True,
            )
        return run


def summarize(recs, ncpu):
    """One run's figures from its ranks' records: rank 0's step times, the bytes each host
    sent and received per step (the mean of its ranks' readings of the same counter), the
    larger host's, and how much other programs loaded the machine."""
    from runner import foreign_fraction

    rank0 = next(r for r in recs if r.get("rank", 0) == 0)
    per_host = {}
    for r in recs:
        if "net_tx_bytes_per_step" in r:
            per_host.setdefault(r["host"], []).append(
                (r["net_tx_bytes_per_step"], r["net_rx_bytes_per_step"])
            )
    tx = [sum(x for x, _ in v) / len(v) for v in per_host.values()]
    rx = [sum(y for _, y in v) / len(v) for v in per_host.values()]
    return {
        "rec": rank0,
        "median_ms": rank0["median_ms"],
        "steps_ms": rank0["steps_ms"],
        "tx_per_host": max(tx) if tx else 0.0,
        "rx_per_host": max(rx) if rx else 0.0,
        "tx_hosts": tx,
        "foreign": foreign_fraction(recs, ncpu),
        "params": rank0.get("params", 0),
        "recs": recs,
    }


def pooled(runs):
    """The median of every timed step of a configuration's runs (rank 0's)."""
    import statistics

    return statistics.median(s for r in runs for s in r["steps_ms"])


def median_of(runs, key):
    import statistics

    return statistics.median(r[key] for r in runs)


def hosts_part(a):
    """Runs the part (see the module docs and docs/PERFORMANCE.md, "Across hosts"); prints
    its table and figures and returns the summary ratios, or None when it cannot run here."""
    import statistics

    why = unavailable()
    if why:
        print(f"bench hosts: skipped: {why}", flush=True)
        return None
    rounds = HOSTS["rounds"] if a.hosts_rounds is None else a.hosts_rounds
    a.steps_hosts, a.warmup_hosts = HOSTS["steps"], HOSTS["warmup"]
    start = time.time()
    deadline = start + a.hosts_budget if a.hosts_budget else float("inf")
    print(
        f"bench hosts: 2 hosts (network namespaces) x 2 ranks, each host's eth0 shaped to "
        f"{RATE} (tbf), Gloo over eth0, 1 torch thread/rank; the suite's transformer (4.8M "
        f"parameters, 19.3 MB of fp32 gradients), batch 2 x 64 tokens/rank; {rounds} rounds "
        f"x {a.steps_hosts} timed steps (+{a.warmup_hosts} warm-up); tch-dist by "
        "tch-dist-run, PyTorch 2.11 by torchrun",
        flush=True,
    )
    for layout in LAYOUTS:
        print(f"  {layout}: {DESC[layout]}", flush=True)
    hooks = list(HOSTS["hooks"])
    with Hosts() as hosts:
        hr = HostRuns(a, hosts, deadline)
        hr.planned = 2 * len(LAYOUTS) * rounds + 4 + 2 * len(hooks)
        pair_s = lambda: hr.pace("tch") + hr.pace("torch")
        for i in range(rounds):
            # After the first round, a round goes only where it leaves time for the hooks.
            if i >= 1 and hr.left() < len(LAYOUTS) * pair_s() + len(hooks) * pair_s():
                print(f"  hosts: stopped after {i} of {rounds} rounds for lack of time", flush=True)
                hr.planned -= 2 * len(LAYOUTS) * (rounds - i)
                break
            for layout, (targs, pargs, _) in LAYOUTS.items():
                pair = [
                    lambda: hr.job(f"tch_dist_{layout}", "tch", targs),
                    lambda: hr.job(f"pytorch_{layout}", "torch", pargs),
                ]
                if i % 2:
                    pair.reverse()
                for f in pair:
                    f()
            if i == 0:
                # The compute alone: 2 plain trainings per host at once, no group, the
                # same model, batch and optimizer (the overlap figures' baseline).
                for optim in ("sgd", "adamw"):
                    extra = ["--model", "transformer", "--optim", optim]
                    hr.job(f"tch_plain_{optim}", "tch", ["--mode", "plain"] + extra, False)
                    hr.job(f"pytorch_plain_{optim}", "torch",
                           ("pytorch_ddp.py", ["--mode", "plain"] + extra), False)
        # The replicate hooks, once each per side.
        targs, (script, sargs), _ = LAYOUTS["replicate"]
        for j, hook in enumerate(hooks):
            if hr.left() < pair_s():
                print(f"  hosts: hooks {', '.join(hooks[j:])} left out for lack of time", flush=True)
                break
            pair = [
                lambda: hr.job(f"tch_dist_replicate_{hook}", "tch", targs + ["--comm-hook", hook]),
                lambda: hr.job(f"pytorch_replicate_{hook}", "torch",
                               (script, sargs + ["--comm-hook", hook])),
            ]
            if j % 2:
                pair.reverse()
            for f in pair:
                f()
    res = hr.results
    return report(res, time.time() - start)


def report(res, seconds):
    """The part's table and figures from its runs; returns the summary ratios."""
    import statistics

    params = res["tch_dist_replicate"][0]["params"]
    mins = theory(params, root_params(), powersgd_floats())
    med = {k: pooled(v) for k, v in res.items()}
    tx = {k: median_of(v, "tx_per_host") for k, v in res.items()}
    rx = {k: median_of(v, "rx_per_host") for k, v in res.items()}

    def minimum(k):
        for key in ("fp16", "bf16", "powersgd"):
            if k.endswith("_" + key):
                return mins[key]
        for key in ("fully_shard", "hsdp", "replicate"):
            if k.endswith("_" + key):
                return mins[key]
        return None

    print(f"\n== hosts: 2 hosts x 2 ranks, {RATE} per direction, {params / 1e6:.2f}M parameters\n")
    print(
        f"{'configuration':<28} {'step ms':>8} {'fwd':>6} {'bwd':>6} {'opt':>6} "
        f"{'tx MB/host':>10} {'rx MB/host':>10} {'gloo min':>8} {'x min':>6} {'bound':>6} "
        f"{'foreign':>7}  runs"
    )
    order = [k for k in res if k.startswith("tch_plain") or k.startswith("pytorch_plain")]
    for layout in LAYOUTS:
        order += [f"tch_dist_{layout}", f"pytorch_{layout}"]
    for hook in HOSTS["hooks"]:
        order += [f"tch_dist_replicate_{hook}", f"pytorch_replicate_{hook}"]
    for k in order:
        if k not in res:
            continue
        v = res[k]
        ph = {p: statistics.median(r["rec"].get(p, 0) for r in v) for p in ("fwd_ms", "bwd_ms", "opt_ms")}
        m = minimum(k)
        ring = f"{m[0] / 1e6:8.2f} {tx[k] / m[0]:6.3f} {m[1] / 1e6:6.2f}" if m else f"{'':8} {'':6} {'':6}"
        print(
            f"{k:<28} {med[k]:8.1f} {ph['fwd_ms']:6.1f} {ph['bwd_ms']:6.1f} {ph['opt_ms']:6.1f} "
            f"{tx[k] / 1e6:10.2f} {rx[k] / 1e6:10.2f} {ring} "
            f"{max(r['foreign'] for r in v):7.0%}  {len(v)}"
        )
    print(
        "\n(tx/rx MB/host: eth0's bytes per timed step, /proc/net/dev in each host's namespace, "
        "the larger host's; gloo min: what Gloo's collectives must send per host and "
        "step (see theory()); x min: tx / gloo min; bound: what any schedule across 2 hosts must send)\n"
    )
    out = {}
    wire_ms = lambda k: tx[k] / RATE_BYTES_PER_S * 1e3
    for layout, (_, _, optim) in LAYOUTS.items():
        t, p = f"tch_dist_{layout}", f"pytorch_{layout}"
        if t not in med or p not in med:
            continue
        from figures import paired_ratio

        out[f"{layout}_vs_pytorch"] = med[t] / med[p]
        print(
            f"{layout}_vs_pytorch={med[t] / med[p]:.3f}  (median step, {med[t]:.1f} / {med[p]:.1f} "
            f"ms; paired over rounds {paired_ratio([r['rec'] for r in res[t]], [r['rec'] for r in res[p]]):.3f}; goal <= 0.9)"
        )
        ring, bound = mins[layout]
        out[f"{layout}_wire_vs_min"] = tx[t] / ring
        print(
            f"{layout}_wire_vs_min={tx[t] / ring:.3f}  (tch-dist's bytes sent per host and step "
            f"{tx[t] / 1e6:.2f} MB / Gloo's minimum {ring / 1e6:.2f} MB; PyTorch "
            f"{tx[p] / ring:.3f}; the lower bound of any schedule {bound / 1e6:.2f} MB; "
            "goal <= 1.05)"
        )
        for side, k in (("tch_dist", t), ("pytorch", p)):
            plain = f"{'tch' if side == 'tch_dist' else 'pytorch'}_plain_{optim}"
            if plain not in med:
                continue
            exposed = med[k] - med[plain]
            hidden = 1 - exposed / wire_ms(k)
            out[f"{layout}_{side}_hidden"] = hidden
            print(
                f"{layout}_{side}_hidden={hidden:.3f}  (1 - (step - compute-only step) / wire "
                f"time: 1 - ({med[k]:.1f} - {med[plain]:.1f}) / {wire_ms(k):.1f} ms)"
            )
    t = res.get("tch_dist_replicate")
    if t and "comm_ms" in t[0]["rec"]:
        comm = statistics.median(r["rec"]["comm_ms"] for r in t)
        ov = statistics.median(r["rec"]["overlapped_ms"] for r in t)
        print(
            f"replicate_comm_during_backward={ov / comm:.3f}  (tch-dist's own timing: from the "
            f"first bucket's launch to the last completion {comm:.1f} ms, {ov:.1f} ms of it "
            "before backward's compute ended)"
        )
    if "tch_dist_hsdp" in med and "tch_dist_fully_shard" in med:
        out["hsdp_vs_fully_shard"] = med["tch_dist_hsdp"] / med["tch_dist_fully_shard"]
        print(
            f"hsdp_vs_fully_shard={out['hsdp_vs_fully_shard']:.3f}  (tch-dist HSDP / fully_shard "
            f"across hosts, {med['tch_dist_hsdp']:.1f} / {med['tch_dist_fully_shard']:.1f} ms; "
            f"PyTorch {med['pytorch_hsdp'] / med['pytorch_fully_shard']:.3f}; goal < 1)"
        )
    for hook in HOSTS["hooks"]:
        t, p = f"tch_dist_replicate_{hook}", f"pytorch_replicate_{hook}"
        if t not in med:
            continue
        ring, _ = mins[hook]
        out[f"replicate_{hook}_vs_allreduce"] = med[t] / med["tch_dist_replicate"]
        vs_p = f"; / PyTorch's same hook {med[t] / med[p]:.3f} ({med[p]:.1f} ms)" if p in med else ""
        print(
            f"replicate_{hook}_vs_allreduce={med[t] / med['tch_dist_replicate']:.3f}  (step "
            f"{med[t]:.1f} ms / replicate's without a hook{vs_p}; sent per host {tx[t] / 1e6:.2f} "
            f"MB, {tx[t] / ring:.3f} x Gloo's minimum {ring / 1e6:.2f} MB)"
        )
    print(f"bench hosts took {seconds:.0f} s", flush=True)
    return out
