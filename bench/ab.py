"""A/B comparisons of replicate variants on this machine (the profiling harness behind
docs/PERFORMANCE.md; `make bench` is the benchmark).

    python3 bench/ab.py ROUNDS 'NAME|ENV=VALUE ...|ARGS' ...

Each configuration is a name, environment variables and arguments; ARGS `plain ...` runs
examples/bench_ddp --mode plain, `plain2 ...` two of them at once, `torch ...` runs
bench/pytorch_ddp.py on 2 ranks (`torch --mode plain ...`: two plain PyTorch processes),
anything else runs `bench_ddp --mode replicate ARGS` on 2 ranks. `BIN_ROOT=DIR` in a
configuration's environment takes the binaries from DIR/target/release (another checkout,
e.g. the commit before a change). Configurations run in alternating order for ROUNDS rounds, each after the
machine is idle and again when other programs used more than 8% of the CPUs during it; prints
medians and, per configuration, the median over rounds of its step time divided by the first
configuration's in the same round. On a machine that other programs keep busy, the
environment variables AB_MAX_FOREIGN (default 0.08), AB_QUIET_WAIT (seconds, default 60) and
AB_TRIES (default 8) relax that, and the paired ratios carry the comparison.
"""

import os
import statistics
import subprocess
import sys

from runner import foreign_fraction, parse_bench, wait_until_quiet

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def main():
    rounds = int(sys.argv[1])
    cfgs = []
    for c in sys.argv[2:]:
        name, env, args = c.split("|")
        e = dict(os.environ)
        for kv in env.split():
            k, v = kv.split("=", 1)
            e[k] = v
        cfgs.append((name, e, args.split()))
    ncpu = os.cpu_count() or 1
    max_foreign = float(os.environ.get("AB_MAX_FOREIGN", "0.08"))
    quiet_wait = float(os.environ.get("AB_QUIET_WAIT", "60"))
    tries = int(os.environ.get("AB_TRIES", "8"))
    res = {n: [] for n, _, _ in cfgs}
    for r in range(rounds):
        for n, e, a in cfgs if r % 2 == 0 else cfgs[::-1]:
            root = e.get("BIN_ROOT", ROOT)
            bench = f"{root}/target/release/examples/bench_ddp"
            launch = [f"{root}/target/release/tch-dist-run", "--nproc-per-node", "2", "--"]
            if a and a[0] == "plain":
                cmd = [bench, "--mode", "plain"] + a[1:]
            elif a and a[0] == "plain2":
                cmd = launch + [bench, "--mode", "plain"] + a[1:]
            elif a and a[0] == "torch":
                cmd = launch + [f"{ROOT}/.venv/bin/python", f"{ROOT}/bench/pytorch_ddp.py"] + a[1:]
            else:
                cmd = launch + [bench, "--mode", "replicate"] + a
            for _ in range(tries):
                wait_until_quiet(quiet_wait)
                p = subprocess.run(cmd, env=e, capture_output=True, text=True)
                recs = parse_bench(p.stdout)
                if not recs:
                    sys.exit(f"{n} failed:\n{p.stdout[-2000:]}\n{p.stderr[-2000:]}")
                if foreign_fraction(recs, ncpu) < max_foreign:
                    break
            res[n].append(next(x for x in recs if x.get("rank", 0) == 0))
            print(f"round {r} {n}: {res[n][-1]['median_ms']:.1f} ms", file=sys.stderr, flush=True)
    base = cfgs[0][0]
    for n, _, _ in cfgs:
        d = res[n]
        med = lambda k: statistics.median(x.get(k, 0) for x in d)
        ratio = statistics.median(x["median_ms"] / y["median_ms"] for x, y in zip(d, res[base]))
        print(
            f"{n:<14} median {med('median_ms'):7.1f} ms  vs {base} {ratio:.3f}  fwd {med('fwd_ms'):5.1f} "
            f"bwd {med('bwd_ms'):6.1f} opt {med('opt_ms'):5.1f} comm {med('comm_ms'):6.1f} "
            f"overlap {med('overlapped_ms'):5.1f} cpu {med('cpu_ms'):6.1f} faults {med('page_faults'):5.0f} "
            f"rss {med('peak_rss_mib'):6.1f}  "
            f"runs {[round(x['median_ms']) for x in d]}"
        )


if __name__ == "__main__":
    main()
