"""The checkpoint part of `make bench`: tch-dist's checkpoints against PyTorch's DCP on the
~400 MB fully_shard model of examples/bench_checkpoint.rs (bench/pytorch_checkpoint.py in
PyTorch).

    .venv/bin/python bench/checkpoint.py [--rounds N] [--worlds 2,4]

1. Saves at 2 ranks, each side its own checkpoint: `checkpoint::save` / `dcp.save`, then
   `checkpoint::async_save` / `dcp.async_save`: the time the call blocks training.
2. Loads tch-dist's checkpoint at each world size of --worlds, three ways: tch-dist with each
   rank reading what it needs (`Reads::EachRank`), tch-dist striped (`Reads::Striped`), and
   PyTorch's `dcp.load` with `HuggingFaceStorageReader` (it reads tch-dist's layout). Before
   each load the page cache is dropped where this process may (root), so `read_bytes` is
   what came from storage; otherwise only `rchar` (bytes through read calls) is meaningful,
   and PyTorch's reader, which maps the files, shows none there.

Prints a table and the goal lines (docs/PERFORMANCE.md, "Checkpoints")."""

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def drop_caches():
    """Drops the page cache (root only); whether it could."""
    try:
        subprocess.run(["sync"], check=True)
        with open("/proc/sys/vm/drop_caches", "w") as f:
            f.write("3")
        return True
    except OSError:
        return False


def run(a, nproc, cmd):
    full = [os.path.join(a.bin_dir, "tch-dist-run"), "--nproc-per-node", str(nproc), "--"] + cmd
    p = subprocess.run(full, cwd=ROOT, capture_output=True, text=True)
    if p.returncode != 0:
        sys.stderr.write(p.stdout[-4000:] + p.stderr[-4000:])
        raise SystemExit(f"bench checkpoint: `{' '.join(full)}` failed with status {p.returncode}")
    # The launcher prefixes each rank's lines with "[rankN]: ".
    recs = [
        json.loads(l[l.index("BENCH {") + 6 :]) for l in p.stdout.splitlines() if "BENCH {" in l
    ]
    if len(recs) != nproc:
        sys.stderr.write(p.stdout[-4000:] + p.stderr[-4000:])
        raise SystemExit(f"bench checkpoint: `{' '.join(full)}` printed {len(recs)} BENCH lines")
    return recs


def folder_bytes(d):
    return sum(
        os.path.getsize(os.path.join(d, f)) for f in os.listdir(d) if f.endswith(".safetensors")
    )


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rounds", type=int, default=1)
    p.add_argument("--worlds", default="2,4")
    p.add_argument("--bin-dir", default=os.path.join(ROOT, "target", "release"))
    p.add_argument("--python", default=os.path.join(ROOT, ".venv", "bin", "python"))
    p.add_argument("--dir", default=os.path.join(ROOT, "target", "bench", "checkpoint"))
    a = p.parse_args()
    tch = [os.path.join(a.bin_dir, "examples", "bench_checkpoint")]
    torch = [a.python, os.path.join(ROOT, "bench", "pytorch_checkpoint.py")]
    worlds = [int(w) for w in a.worlds.split(",") if w]
    print(
        "bench checkpoint: 12 Linear layers 2048<->4096 (100.7M parameters, 403 MB float32), "
        f"fully_shard per layer and root, Gloo, 1 torch thread/rank; {a.rounds} round(s)",
        flush=True,
    )
    saves = {"tch_dist": [], "pytorch": []}
    loads = {}
    cold = None
    for i in range(a.rounds):
        for side, cmd in (("tch_dist", tch), ("pytorch", torch)):
            d = os.path.join(a.dir, side)
            shutil.rmtree(d, ignore_errors=True)
            os.makedirs(d)
            saves[side].append(run(a, 2, cmd + ["--mode", "save", "--dir", d]))
        ckpt = os.path.join(a.dir, "tch_dist", "sync")
        for world in worlds:
            for how, cmd in (
                ("each", tch + ["--reads", "each"]),
                ("striped", tch + ["--reads", "striped"]),
                ("pytorch", torch),
            ):
                cold = drop_caches()
                loads.setdefault((world, how), []).append(
                    run(a, world, cmd + ["--mode", "load", "--dir", ckpt])
                )
    size = folder_bytes(os.path.join(a.dir, "tch_dist", "sync"))
    med = lambda runs, k: statistics.median(max(r[k] for r in recs) for recs in runs)
    print(f"\n== save at 2 ranks (the slower rank's time, median of {a.rounds})")
    print(f"{'side':<10} {'save ms':>9} {'async blocked ms':>17} {'async total ms':>15}")
    for side, runs in saves.items():
        print(
            f"{side:<10} {med(runs, 'save_ms'):9.0f} {med(runs, 'async_blocked_ms'):17.0f} "
            f"{med(runs, 'async_total_ms'):15.0f}"
        )
    print(
        f"\n== load of tch-dist's {size / 1e6:.0f} MB checkpoint (page cache "
        f"{'dropped before each' if cold else 'NOT dropped: not root'})"
    )
    print(
        f"{'world':>5} {'reads':<8} {'load ms':>8} {'read_bytes/size':>15} {'rchar/size':>10} "
        f"{'peak over start MB':>18} {'shard MB':>8} {'largest MB':>10}"
    )
    summary = {}
    for (world, how), runs in loads.items():
        last = runs[-1]
        disk = sum(r["read_bytes"] for r in last) / size
        rchar = sum(r["rchar"] for r in last) / size
        peak = max(r["peak_rss_over_start"] for r in last)
        shard = max(r["shard_bytes"] for r in last)
        largest = max(r["largest_tensor_bytes"] for r in last)
        summary[(world, how)] = (med(runs, "load_ms"), disk, rchar, peak, shard, largest)
        print(
            f"{world:5d} {how:<8} {med(runs, 'load_ms'):8.0f} {disk:15.2f} {rchar:10.2f} "
            f"{peak / 1e6:18.0f} {shard / 1e6:8.0f} {largest / 1e6:10.0f}"
        )
    print()
    top = max(worlds)
    t_each, disk_each, rchar_each, peak_each, shard, largest = summary[(top, "each")]
    t_str = summary[(top, "striped")][0]
    t_py, disk_py = summary[(top, "pytorch")][0], summary[(top, "pytorch")][1]
    measure = disk_each if cold else rchar_each
    print(
        f"ckpt_bytes_read_vs_size={measure:.3f}  (at {top} ranks, all ranks' "
        f"{'read_bytes' if cold else 'rchar'} / the checkpoint's files; goal <= 1.1; "
        f"PyTorch dcp.load: {disk_py:.3f}{'' if cold else ' (mapped reads not counted)'})"
    )
    print(
        f"ckpt_load_peak_vs_goal={peak_each / (1.2 * shard + largest):.3f}  (peak RSS over the "
        f"start during the load / (1.2 x shard + largest tensor), {peak_each / 1e6:.0f} / "
        f"{(1.2 * shard + largest) / 1e6:.0f} MB; goal <= 1.0)"
    )
    print(
        f"ckpt_striped_vs_each={t_str / t_each:.3f}  (load time at {top} ranks, striped / each "
        f"rank its own: the default is the faster)"
    )
    print(f"ckpt_load_vs_pytorch={t_each / t_py:.3f}  (load time at {top} ranks)")
    blocked = med(saves["tch_dist"], "async_blocked_ms") / med(saves["pytorch"], "async_blocked_ms")
    print(
        f"ckpt_async_blocked_vs_pytorch={blocked:.3f}  (time async_save blocks the caller; "
        "goal <= 0.5)"
    )
    print(
        f"ckpt_save_vs_pytorch={med(saves['tch_dist'], 'save_ms') / med(saves['pytorch'], 'save_ms'):.3f}"
        "  (blocking save, the slower rank)"
    )


main()
