"""SVG bar charts of benchmark ratios: what `make bench` measured, drawn as it prints them.

driver.py calls `write_charts` with the figures of the run it just made (target/bench/*.svg);
the command line draws the same charts from figures given by hand, for docs/img:

    python bench/charts.py OUT_DIR --ddp mlp=0.774,transformer=1.122,convnet=0.867 \\
        --fsdp fsdp_vs_pytorch=0.707,fsdp_rss_vs_pytorch=0.649,fsdp_bytes_vs_replicate=0.5 \\
        --caption "make bench, 2 ranks, Gloo, quiet machine (docs/PERFORMANCE.md)"

A ratio below 1 is better for tch-dist (less time, less memory); the dashed line is 1 (level
with PyTorch), the red tick on a bar its goal.
"""

import argparse
import html
import os

BAR = "#4e79a7"
MISSED = "#e15759"

# Goals of docs/PERFORMANCE.md, per figure (a ratio at or under its goal meets it).
GOALS = {
    "tch_dist_vs_pytorch_ddp": 0.75,
    "fsdp_vs_pytorch": 0.9,
    "fsdp_rss_vs_pytorch": 1.0,
    "fsdp_bytes_vs_replicate": 0.55,
}


def ratio_chart(title, rows, caption=""):
    """rows: (label, ratio, goal or None). Horizontal bars on a 0..max(1.3, ratios) axis."""
    width, left, bar_h, top = 720, 230, 22, 44
    top_value = max([1.3] + [v * 1.1 for _, v, _ in rows])
    scale = (width - left - 40) / top_value
    height = top + len(rows) * (bar_h + 10) + 64
    out = [
        f'<svg xmlns="http://www.w3.org/2000/svg" width="{width}" height="{height}" '
        f'viewBox="0 0 {width} {height}" font-family="sans-serif">',
        "<style>.t{font-size:12px;fill:#222}.s{font-size:11px;fill:#555}"
        ".h{font-size:14px;font-weight:bold}</style>",
        '<rect width="100%" height="100%" fill="#fff"/>',
        f'<text x="10" y="22" class="h">{html.escape(title)}</text>',
    ]
    for i, (label, value, goal) in enumerate(rows):
        y = top + i * (bar_h + 10)
        met = value <= (1.0 if goal is None else goal)
        out.append(f'<text x="{left - 8}" y="{y + 15}" class="t" text-anchor="end">{html.escape(label)}</text>')
        out.append(
            f'<rect x="{left}" y="{y}" width="{value * scale:.1f}" height="{bar_h}" '
            f'fill="{BAR if met else MISSED}"/>'
        )
        out.append(f'<text x="{left + value * scale + 4:.1f}" y="{y + 15}" class="t">{value:.3f}</text>')
        if goal is not None:
            gx = left + goal * scale
            out.append(f'<line x1="{gx:.1f}" y1="{y - 2}" x2="{gx:.1f}" y2="{y + bar_h + 2}" stroke="#c00" stroke-width="2"/>')
    axis_y = top + len(rows) * (bar_h + 10)
    one = left + scale
    out.append(f'<line x1="{one:.1f}" y1="{top - 6}" x2="{one:.1f}" y2="{axis_y}" stroke="#333" stroke-dasharray="4 3"/>')
    out.append(f'<line x1="{left}" y1="{axis_y}" x2="{width - 40}" y2="{axis_y}" stroke="#333"/>')
    tick = 0.0
    while tick <= top_value + 1e-9:
        tx = left + tick * scale
        out.append(f'<text x="{tx:.1f}" y="{axis_y + 14}" class="s" text-anchor="middle">{tick:.1f}</text>')
        tick += 0.25
    out.append(
        f'<text x="10" y="{axis_y + 34}" class="s">tch-dist / PyTorch: under 1 is better '
        "(dashed: level); red tick: the goal; a red bar misses it (or 1 where none is set).</text>"
    )
    out.append(f'<text x="10" y="{axis_y + 50}" class="s">{html.escape(caption)}</text>')
    out.append("</svg>\n")
    return "\n".join(out)


def ddp_rows(per_model, key="tch_dist_vs_pytorch_ddp"):
    return [(f"replicate, {m}", v, GOALS.get(key) if m == "mlp" else None) for m, v in per_model.items()]


def fsdp_rows(fsdp):
    labels = {
        "fsdp_vs_pytorch": "fully_shard step time",
        "fsdp_rss_vs_pytorch": "fully_shard peak RSS",
        "fsdp_bytes_vs_replicate": "bytes per rank vs replicate",
    }
    return [(labels.get(k, k), v, GOALS.get(k)) for k, v in fsdp.items() if k in labels]


def write_charts(out_dir, per_model=None, fsdp=None, caption=""):
    """Writes ddp.svg (each model's tch_dist_vs_pytorch_ddp) and fsdp.svg; returns the paths."""
    os.makedirs(out_dir, exist_ok=True)
    paths = []
    if per_model:
        p = os.path.join(out_dir, "ddp.svg")
        with open(p, "w") as f:
            f.write(ratio_chart("replicate vs PyTorch DDP: step time", ddp_rows(per_model), caption))
        paths.append(p)
    if fsdp:
        p = os.path.join(out_dir, "fsdp.svg")
        with open(p, "w") as f:
            f.write(ratio_chart("fully_shard vs PyTorch's fully_shard", fsdp_rows(fsdp), caption))
        paths.append(p)
    return paths


def parse_pairs(text):
    return {k: float(v) for k, v in (item.split("=") for item in text.split(",") if item)}


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("out_dir")
    ap.add_argument("--ddp", default="", help="model=ratio,... (tch_dist_vs_pytorch_ddp)")
    ap.add_argument("--fsdp", default="", help="figure=ratio,...")
    ap.add_argument("--caption", default="")
    a = ap.parse_args()
    for p in write_charts(a.out_dir, parse_pairs(a.ddp), parse_pairs(a.fsdp), a.caption):
        print(p)


if __name__ == "__main__":
    main()
