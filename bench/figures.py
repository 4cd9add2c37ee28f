"""The figures of driver.py's tables: pooled and paired medians, the table and the
all-reduce floor lines."""

import statistics


def pooled_median(recs):
    return statistics.median([s for r in recs for s in r["steps_ms"]])


def paired_ratio(a, b):
    """Median over rounds of a/b, each tch-dist run against the PyTorch run beside it."""
    return statistics.median(x["median_ms"] / y["median_ms"] for x, y in zip(a, b))


def table(r, keys):
    res = r.results
    med = {k: pooled_median(v) for k, v in res.items() if k != "allreduce"}
    peak = {k: max(x["peak_rss_mib_max"] for x in v) for k, v in res.items()}
    print()
    print(
        f"{'configuration':<20} {'step ms':>8} {'x plain':>8} {'fwd':>6} {'bwd':>6} {'opt':>6} "
        f"{'cpu/rank':>8} {'faults':>7} {'peak RSS MiB':>12} {'foreign':>7}  runs"
    )
    for k in keys:
        if k not in med:
            continue
        plain = med["tch_plain"] if k.startswith("tch") else med["pytorch_plain"]
        if k.endswith("_trim"):
            plain = med["tch_plain_trim"]
        v = res[k]
        ph = {
            p: statistics.median(x.get(p, 0) for x in v)
            for p in ("fwd_ms", "bwd_ms", "opt_ms", "cpu_ms", "page_faults")
        }
        print(
            f"{k:<20} {med[k]:8.2f} {med[k] / plain:8.2f} {ph['fwd_ms']:6.1f} {ph['bwd_ms']:6.1f} "
            f"{ph['opt_ms']:6.1f} {ph['cpu_ms']:8.1f} {ph['page_faults']:7.0f} {peak[k]:12.1f} "
            f"{max(x['foreign'] for x in v):7.0%}  {len(v)}"
        )
    return med, peak


def floor_lines(floor, label):
    print(
        f"raw {label} all_reduce of {floor['bytes'] / 1e6:.1f} MB in one tensor: SUM "
        f"{floor['sum_ms']:.2f} ms ({floor['sum_cpu_ms']:.1f} ms CPU per rank), AVG {floor['avg_ms']:.2f} ms"
    )
    print(
        "the same bytes as tch-dist's collectives: "
        + ", ".join(
            f"{s / 1e6:.2f} MB {m:.2f} ms" for s, m in zip(floor["sizes"], floor["per_size_ms"])
        )
        + f"; all {len(floor['sizes'])} launched back to back: {floor['buckets_ms']:.2f} ms"
    )
