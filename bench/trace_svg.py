"""Draws one training step of TCH_DIST_TRACE traces as an SVG picture, one lane group per rank.

    python bench/trace_svg.py --step 5 --title "replicate, train_ddp" OUT.svg DIR/trace-rank*.json

Each rank gets its compute lane (the thread that ran forward, backward, the waits and the
optimizer step; nested spans stacked below their parent) and its collectives lane (each
operation from its launch to the return of its wait, stacked where several are in flight).
The window is one step: from the end of optimizer step N-1 to the end of step N on rank 0
(`--step N`, counted from 1), the same wall-clock window on every rank; `--boundary NAME`
delimits steps by the starts of the span NAME instead (a loop whose optimizer is tch's).
"""

import argparse
import html
import json
import sys

COLORS = {
    "forward": "#4e79a7",
    "backward": "#e15759",
    "wait": "#bab0ac",
    "optimizer": "#59a14f",
    "all_reduce": "#f28e2b",
    "all_gather_into_tensor": "#76b7b2",
    "reduce_scatter_tensor": "#b07aa1",
}
OTHER = "#9c755f"
LANE_H = 18
LEFT = 150
WIDTH = 1100


def load(path):
    with open(path) as f:
        events = json.load(f)
    spans, begun, collectives, rank = [], {}, [], None
    for e in events:
        if e.get("ph") == "M":
            rank = e.get("pid", rank)
            continue
        if e.get("ph") == "X":
            spans.append((e["name"], e["cat"], e["ts"], e["ts"] + e["dur"]))
        elif e.get("ph") == "b":
            begun[e["id"]] = (e["name"], e["ts"])
        elif e.get("ph") == "e" and e["id"] in begun:
            name, start = begun.pop(e["id"])
            collectives.append((name, start, e["ts"]))
    return rank, spans, collectives


def step_window(spans, step, boundary):
    """Rank 0's step `step`: between two optimizer steps' ends, or (with `boundary`, for a
    loop whose optimizer is not traced) from one start of the span named `boundary` to
    the next."""
    if boundary:
        marks = sorted(s for (name, _, s, _) in spans if name == boundary)
    else:
        marks = sorted(end for (_, cat, _, end) in spans if cat == "optimizer")
    if len(marks) < step + 1:
        sys.exit(f"the trace has {len(marks)} step boundaries; --step {step} needs {step + 1}")
    return marks[step - 1], marks[step]


def stack(intervals):
    """Rows for intervals (start, end, ...) so that none overlaps another in its row."""
    rows, placed = [], []
    for iv in sorted(intervals, key=lambda x: (x[1], -x[2])):
        for r, last_end in enumerate(rows):
            if iv[1] >= last_end:
                rows[r] = iv[2]
                placed.append((r, iv))
                break
        else:
            rows.append(iv[2])
            placed.append((len(rows) - 1, iv))
    return max(len(rows), 1), placed


def color(name, cat):
    return COLORS.get(name, COLORS.get(cat, OTHER))


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("out")
    ap.add_argument("traces", nargs="+")
    ap.add_argument("--step", type=int, default=5)
    ap.add_argument("--title", default="")
    ap.add_argument("--boundary", default="", help="a span name whose starts delimit steps")
    args = ap.parse_args()
    ranks = sorted((load(p) for p in args.traces), key=lambda r: r[0])
    t0, t1 = step_window(ranks[0][1], args.step, args.boundary)
    scale = (WIDTH - LEFT - 20) / (t1 - t0)
    x = lambda t: LEFT + (min(max(t, t0), t1) - t0) * scale

    body, y = [], 40
    for rank, spans, collectives in ranks:
        inside = [(n, c, s, e) for (n, c, s, e) in spans if e > t0 and s < t1]
        # Nested spans (a forward inside a forward) go one row lower than their parent.
        depth_rows, placed_compute = stack([(c, s, e, n) for (n, c, s, e) in inside])
        body.append(f'<text x="8" y="{y + 13}" class="lane">rank {rank} compute</text>')
        for row, (cat, s, e, name) in placed_compute:
            w = max(x(e) - x(s), 0.5)
            yy = y + row * LANE_H
            body.append(
                f'<rect x="{x(s):.1f}" y="{yy}" width="{w:.1f}" height="{LANE_H - 3}" '
                f'fill="{color(name, cat)}"><title>{html.escape(name)} '
                f'{(e - s) / 1000:.2f} ms</title></rect>'
            )
            if w > 40:
                body.append(
                    f'<text x="{x(s) + 2:.1f}" y="{yy + 12}" class="in">'
                    f"{html.escape(name[: int(w / 6)])}</text>"
                )
        y += depth_rows * LANE_H + 6
        comm = [(n, s, e) for (n, s, e) in collectives if e > t0 and s < t1]
        rows, placed_comm = stack([(n, s, e) for (n, s, e) in comm])
        body.append(f'<text x="8" y="{y + 13}" class="lane">rank {rank} collectives</text>')
        for row, (name, s, e) in placed_comm:
            w = max(x(e) - x(s), 0.5)
            yy = y + row * LANE_H
            body.append(
                f'<rect x="{x(s):.1f}" y="{yy}" width="{w:.1f}" height="{LANE_H - 3}" '
                f'fill="{color(name, "")}" opacity="0.85"><title>{html.escape(name)} '
                f"launch to wait {(e - s) / 1000:.2f} ms</title></rect>"
            )
        y += rows * LANE_H + 18
    # Time axis.
    span_ms = (t1 - t0) / 1000
    tick = next(t for t in (0.1, 0.2, 0.5, 1, 2, 5, 10, 20, 50, 100, 200, 500, 1000) if span_ms / t <= 12)
    axis = [f'<line x1="{LEFT}" y1="{y}" x2="{WIDTH - 20}" y2="{y}" stroke="#333"/>']
    k = 0
    while k * tick <= span_ms + 1e-9:
        tx = LEFT + k * tick * 1000 * scale
        axis.append(f'<line x1="{tx:.1f}" y1="{y}" x2="{tx:.1f}" y2="{y + 4}" stroke="#333"/>')
        axis.append(f'<text x="{tx:.1f}" y="{y + 16}" class="tick">{k * tick:g} ms</text>')
        k += 1
    y += 30
    legend, lx = [], LEFT
    for name, c in COLORS.items():
        legend.append(f'<rect x="{lx}" y="{y}" width="12" height="12" fill="{c}"/>')
        legend.append(f'<text x="{lx + 16}" y="{y + 10}" class="tick">{name}</text>')
        lx += 16 + 7 * len(name) + 18
    y += 24
    title = html.escape(args.title or "one training step")
    svg = [
        f'<svg xmlns="http://www.w3.org/2000/svg" width="{WIDTH}" height="{y}" '
        f'viewBox="0 0 {WIDTH} {y}" font-family="sans-serif">',
        "<style>.lane{font-size:12px;fill:#222}.in{font-size:10px;fill:#fff}"
        ".tick{font-size:11px;fill:#333}.title{font-size:14px;font-weight:bold}</style>",
        '<rect width="100%" height="100%" fill="#fff"/>',
        f'<text x="8" y="22" class="title">{title} (step {args.step}, {span_ms:.1f} ms)</text>',
        *body,
        *axis,
        *legend,
        "</svg>",
    ]
    with open(args.out, "w") as f:
        f.write("\n".join(svg) + "\n")


if __name__ == "__main__":
    main()
