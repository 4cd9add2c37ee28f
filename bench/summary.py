"""The newest `make bench` figures in one small generated file, and the places that quote them.

`make bench` ends each part by recording its summary line (`model=mlp k=v ...`, `fsdp k=v ...`,
`ckpt_save_vs_pytorch=v`, ...) into docs/bench_latest.json, each part with the commit and
date of the run that measured it, and then rewrites the quoted regions of README.md and
docs/PERFORMANCE.md (between `<!-- bench-latest -->` and `<!-- /bench-latest -->`) from that
file. `make lint` runs `check`, which fails when a quoted region differs from what the file
says, so a figure cannot disagree with its run.

    python3 bench/summary.py record LOG...   # parse runs' output, update the file and quotes
    python3 bench/summary.py record --commit C --date D LOG...   # a run recorded earlier
    python3 bench/summary.py quote           # rewrite the quotes from the file
    python3 bench/summary.py check           # the quotes are the file's (make lint)
"""

import datetime
import json
import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
LATEST = os.path.join(ROOT, "docs", "bench_latest.json")
QUOTES = [os.path.join(ROOT, "README.md"), os.path.join(ROOT, "docs", "PERFORMANCE.md")]
BEGIN, END = "<!-- bench-latest -->", "<!-- /bench-latest -->"

# The parts a summary line names: driver.py's `model=NAME k=v ...` lines are parts named
# after the model; its other parts print `PART k=v ...`; bench/checkpoint.py prints one
# `ckpt_NAME=v  (...)` line per figure, gathered into the part `ckpt`.
PARTS = ("fsdp", "ac", "pp", "two_d", "cp", "moe", "ft", "hosts")

# What README quotes, in order: (part, key, what it is, the goal). A ratio is tch-dist's
# figure over PyTorch's (lower is better) unless the goal says otherwise.
README_ROWS = [
    ("mlp", "tch_dist_vs_pytorch_ddp", "`replicate`, MLP: step time / PyTorch DDP's", "<= 0.75"),
    ("transformer", "tch_dist_vs_best_pytorch", "`replicate`, transformer: / PyTorch's best DDP configuration", "<= 0.92"),
    ("convnet", "tch_dist_vs_best_pytorch", "`replicate`, convnet: / PyTorch's best DDP configuration", "<= 0.92"),
    ("fsdp", "fsdp_vs_pytorch", "`fully_shard`: step time / PyTorch FSDP2's", "<= 0.9"),
    ("fsdp", "fsdp_rss_vs_pytorch", "`fully_shard`: peak RSS per rank / PyTorch's", "<= 1.0"),
    ("two_d", "hsdp_vs_pytorch", "HSDP 2x2 (4 ranks): step time / PyTorch's", "<= 0.9"),
    ("two_d", "fsdp_tp_vs_pytorch", "FSDP x TP 2x2 (4 ranks): step time / PyTorch's", "<= 0.9"),
    ("ac", "ac_step_vs_pytorch", "activation checkpointing: step time / PyTorch's", "<= 0.9"),
    ("pp", "pp_m4_vs_pytorch", "`Schedule1F1B`, 4 microbatches: step time / PyTorch's", "<= 0.9"),
    ("pp", "pp_m8_vs_pytorch", "`Schedule1F1B`, 8 microbatches: step time / PyTorch's", "<= 0.9"),
    ("moe", "moe_vs_pytorch", "MoE, expert parallelism + `fully_shard` (4 ranks): step time / PyTorch's (torchtitan's way)", "<= 0.9"),
    ("moe", "moe_rss_vs_pytorch", "MoE (4 ranks): peak RSS per rank / PyTorch's", "<= 1.0"),
    ("ft", "ft_vs_replicate", "fault tolerance, 2 replica groups: step time / `replicate`'s", "<= 1.03"),
    ("ft", "ft_fault_to_commit_s", "fault tolerance: seconds from a group's death to the survivors' next commit", "<= 2"),
    ("cp", "cp2_kept_vs_unsplit", "context parallelism, 2 ranks: activations kept per rank / one rank's", "<= 0.55"),
    ("cp", "cp4_kept_vs_unsplit", "context parallelism, 4 ranks: activations kept per rank / one rank's", "<= 0.275"),
    ("ckpt", "ckpt_save_vs_pytorch", "checkpoint save (blocking) / PyTorch DCP's", "<= 0.9"),
    ("ckpt", "ckpt_load_vs_pytorch", "checkpoint load at 4 ranks / PyTorch DCP's", "<= 0.9"),
    ("hosts", "replicate_vs_pytorch", "across 2 hosts, `replicate` / PyTorch DDP", "<= 0.9"),
    ("hosts", "fully_shard_vs_pytorch", "across 2 hosts, `fully_shard` / PyTorch FSDP2", "<= 0.9"),
    ("hosts", "hsdp_vs_pytorch", "across 2 hosts, HSDP / PyTorch's", "<= 0.9"),
]


def parse_line(line):
    """(part, {key: value}) of one summary line, or None for any other line."""
    words = line.split()
    if not words:
        return None
    head = words[0]
    if head.startswith("model=") and len(words) > 1:
        part, pairs = head[len("model="):], words[1:]
    elif head in PARTS and len(words) > 1:
        part, pairs = head, words[1:]
    elif head.startswith("ckpt_") and "=" in head:
        part, pairs = "ckpt", [head]
    else:
        return None
    figures = {}
    for pair in pairs:
        key, sep, value = pair.partition("=")
        if not sep:
            return None
        try:
            figures[key] = float(value)
        except ValueError:
            return None
    return part, figures


def parse_log(text):
    """Every part's figures in a run's output; a part named twice keeps its last line's."""
    parts = {}
    for line in text.splitlines():
        parsed = parse_line(line)
        if parsed:
            part, figures = parsed
            parts.setdefault(part, {}).update(figures)
    return parts


def this_commit():
    """The checkout's short commit, `-dirty` when tracked files differ from it."""
    def git(*args):
        return subprocess.run(["git", *args], cwd=ROOT, capture_output=True, text=True).stdout.strip()

    commit = git("rev-parse", "--short", "HEAD") or "unknown"
    return commit + ("-dirty" if git("status", "--porcelain", "--untracked-files=no") else "")


def load():
    if not os.path.exists(LATEST):
        return {}
    with open(LATEST) as f:
        return json.load(f)


def record(args):
    """Records the parts found in the logs `args` names (after `--commit C --date D`, which
    stamp a run measured at another commit: a figure copied from docs/PERFORMANCE.md)."""
    stamp = {"commit": this_commit(), "date": datetime.date.today().isoformat()}
    logs = []
    it = iter(args)
    for arg in it:
        if arg in ("--commit", "--date"):
            stamp[arg[2:]] = next(it, "")
        else:
            logs.append(arg)
    latest = load()
    found = {}
    for path in logs:
        with open(path) as f:
            found.update(parse_log(f.read()))
    for part, figures in found.items():
        latest[part] = dict(stamp, figures={k: round(v, 3) for k, v in figures.items()})
    with open(LATEST, "w") as f:
        json.dump(latest, f, indent=1, sort_keys=True)
        f.write("\n")
    print(f"bench summary: {', '.join(sorted(found)) or 'no part'} recorded in {os.path.relpath(LATEST, ROOT)}")
    quote()


def runs(latest, parts):
    """`commit (date)` of the runs that measured `parts`, each once."""
    seen = []
    for p in parts:
        if p in latest:
            s = f"{latest[p]['commit']} ({latest[p]['date']})"
            if s not in seen:
                seen.append(s)
    return ", ".join(seen)


def render_readme(latest):
    rows = [(p, k, what, goal) for p, k, what, goal in README_ROWS if k in latest.get(p, {}).get("figures", {})]
    out = [
        BEGIN,
        "| figure (2-core CPU, Gloo, 2 ranks unless said; lower is faster) | latest | goal | run |",
        "|---|---|---|---|",
    ]
    for p, k, what, goal in rows:
        out.append(f"| {what} | {latest[p]['figures'][k]:.3f} | {goal} | {latest[p]['commit']} |")
    out.append("")
    out.append(
        "Generated by `make bench` (bench/summary.py) from docs/bench_latest.json; "
        "each row names the commit of the run that measured it."
    )
    out.append(END)
    return out


def render_performance(latest):
    out = [
        BEGIN,
        "The newest figure of every part, as `make bench` recorded them in "
        "docs/bench_latest.json (bench/summary.py writes this table; edit neither by hand):",
        "",
        "| part | run | figures |",
        "|---|---|---|",
    ]
    for part in sorted(latest):
        figures = ", ".join(f"`{k}` {v:.3f}" for k, v in sorted(latest[part]["figures"].items()))
        out.append(f"| {part} | {runs(latest, [part])} | {figures} |")
    out.append(END)
    return out


RENDER = {"README.md": render_readme, "PERFORMANCE.md": render_performance}


def quoted(text, lines):
    """`text` with its quoted region replaced by `lines`; None without a region."""
    old = text.split("\n")
    try:
        start, end = old.index(BEGIN), old.index(END)
    except ValueError:
        return None
    if end < start:
        return None
    return "\n".join(old[:start] + lines + old[end + 1 :])


def quote(check=False):
    latest = load()
    stale = []
    for path in QUOTES:
        with open(path) as f:
            text = f.read()
        new = quoted(text, RENDER[os.path.basename(path)](latest))
        name = os.path.relpath(path, ROOT)
        if new is None:
            stale.append(f"{name}: no `{BEGIN}` ... `{END}` region quoting docs/bench_latest.json")
        elif new != text:
            if check:
                stale.append(
                    f"{name}: the figures between `{BEGIN}` and `{END}` differ from "
                    "docs/bench_latest.json: run `python3 bench/summary.py quote`"
                )
            else:
                with open(path, "w") as f:
                    f.write(new)
    return stale


def self_test():
    line = "model=mlp tch_dist_vs_pytorch_ddp=0.814 tch_dist_vs_floor=1.145"
    assert parse_line(line) == ("mlp", {"tch_dist_vs_pytorch_ddp": 0.814, "tch_dist_vs_floor": 1.145})
    assert parse_line("fsdp fsdp_vs_pytorch=0.649") == ("fsdp", {"fsdp_vs_pytorch": 0.649})
    assert parse_line("ckpt_load_vs_pytorch=1.124  (load time at 4 ranks)") == (
        "ckpt",
        {"ckpt_load_vs_pytorch": 1.124},
    )
    # Prose and tables are not summary lines.
    for other in ["fsdp: stopped after 2 of 4 rounds", "model=mlp", "pp_m4_bubble=0.19", "tch_dist 1.0"]:
        assert parse_line(other) is None, other
    assert quoted("a\n" + BEGIN + "\nold\n" + END + "\nb", ["X"]) == "a\nX\nb"
    assert quoted("no region", ["X"]) is None


def main():
    self_test()
    if len(sys.argv) < 2 or sys.argv[1] not in ("record", "quote", "check"):
        raise SystemExit(__doc__)
    if sys.argv[1] == "record":
        record(sys.argv[2:])
    elif sys.argv[1] == "quote":
        for p in quote():
            print(p, file=sys.stderr)
    else:
        problems = quote(check=True)
        for p in problems:
            print(p, file=sys.stderr)
        if problems:
            raise SystemExit(1)


if __name__ == "__main__":
    main()
