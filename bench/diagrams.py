"""Draws docs/img's diagrams as SVG: what runs where (README's picture), fully_shard's padded
shards and gather buffer, and a column/row-parallel MLP with every rank's shapes.

    python bench/diagrams.py docs/img

The numbers are those of the diagrams' captions in docs/design/fully-shard.md and
docs/design/tensor-parallel.md; the arithmetic is
runtime/src/fsdp/layout.rs's (torch.chunk rows, every shard padded to the first's rows).
"""

import math
import os
import sys

RANK_COLORS = ["#4e79a7", "#f28e2b", "#59a14f", "#e15759"]
PAD = "#d9d9d9"


def svg(width, height, body):
    return "\n".join(
        [
            f'<svg xmlns="http://www.w3.org/2000/svg" width="{width}" height="{height}" '
            f'viewBox="0 0 {width} {height}" font-family="sans-serif">',
            "<style>.t{font-size:12px;fill:#222}.s{font-size:11px;fill:#444}"
            ".h{font-size:14px;font-weight:bold}.w{font-size:11px;fill:#fff}</style>",
            '<rect width="100%" height="100%" fill="#fff"/>',
            *body,
            "</svg>\n",
        ]
    )


def rect(x, y, w, h, fill, label="", cls="w"):
    out = [f'<rect x="{x}" y="{y}" width="{w}" height="{h}" fill="{fill}" stroke="#fff"/>']
    if label:
        out.append(f'<text x="{x + 4}" y="{y + h / 2 + 4}" class="{cls}">{label}</text>')
    return out


def shard_layout():
    """A group of two parameters, weight [7, 4] and bias [7], over 3 ranks."""
    world, rows = 3, 7
    c = math.ceil(rows / world)  # rows per shard: 3, 3, 1 (+2 padding)
    body = ['<text x="10" y="22" class="h">fully_shard: weight [7, 4] and bias [7] at 3 ranks</text>']
    row_h, x0, y0 = 16, 20, 50
    body.append(f'<text x="{x0}" y="{y0 - 8}" class="t">the full parameters (rows owned by rank)</text>')
    for r in range(rows):
        owner = r // c
        body += rect(x0, y0 + r * row_h, 120, row_h, RANK_COLORS[owner], f"weight row {r}")
        body += rect(x0 + 130, y0 + r * row_h, 60, row_h, RANK_COLORS[owner], f"bias {r}")
    # Each rank's shards between steps: c rows, padded.
    x1 = 300
    body.append(f'<text x="{x1}" y="{y0 - 8}" class="t">between steps: each rank holds {c} rows of each, padded</text>')
    for rank in range(world):
        y = y0 + rank * (c * row_h + 14)
        body.append(f'<text x="{x1}" y="{y + 12}" class="s">rank {rank}</text>')
        for i in range(c):
            r = rank * c + i
            real = r < rows
            fill = RANK_COLORS[rank] if real else PAD
            body += rect(x1 + 50, y + i * row_h, 120, row_h, fill, f"row {r}" if real else "padding", "w" if real else "s")
            body += rect(x1 + 180, y + i * row_h, 60, row_h, fill, f"{r}" if real else "pad", "w" if real else "s")
    # The group's all-gather: each rank's padded shards, concatenated, then all ranks'.
    y2 = y0 + world * (c * row_h + 14) + 30
    body.append(
        f'<text x="{x0}" y="{y2 - 8}" class="t">the group\'s all-gather buffer '
        f"(all_gather_into_tensor): rank 0's [weight shard | bias shard], rank 1's, rank 2's</text>"
    )
    seg_w, bias_w, x = 160, 70, x0
    for rank in range(world):
        real = min(max(rows - rank * c, 0), c)
        label = f"r{rank} weight {real}x4" + (f" +{c - real} pad" if real < c else "")
        body += rect(x, y2, seg_w, 26, RANK_COLORS[rank], label)
        body += rect(x + seg_w, y2, bias_w, 26, RANK_COLORS[rank], f"bias {real}" + ("+pad" if real < c else ""))
        x += seg_w + bias_w + 6
    body.extend([
        f'<text x="{x0}" y="{y2 + 46}" class="s">forward: gather, copy each parameter\'s '
        f"rows out of the buffer (padding dropped), compute, free the full tensors;</text>",
        f'<text x="{x0}" y="{y2 + 62}" class="s">backward: gather again, then '
        f"reduce-scatter the padded gradients into each rank's shard</text>"
    ])
    return svg(760, y2 + 76, body)


def tp_mlp():
    """fc1 = ColwiseLinear(6 -> 8), fc2 = RowwiseLinear(8 -> 5), 2 ranks, batch 4."""
    body = [
        '<text x="10" y="22" class="h">tensor parallelism at 2 ranks: MegatronPlanner\'s plan, '
        "fc1 ColwiseLinear (local output), fc2 RowwiseLinear</text>"
    ]
    stages = [
        ("x", "[4, 6]", "the same on every rank", None),
        ("fc1.weight", "[4, 6] of [8, 6]", "rows 4r..4r+4 (ColwiseLinear)", "rank"),
        ("h = relu(x W1ᵀ + b1)", "[4, 4]", "this rank's 4 of 8 features", "rank"),
        ("fc2.weight", "[5, 4] of [5, 8]", "columns 4r..4r+4 (RowwiseLinear)", "rank"),
        ("partial = h W2ᵀ", "[4, 5]", "a partial sum", "rank"),
        ("all_reduce(SUM) + b2", "[4, 5]", "the full output on every rank", None),
    ]
    y, body_w = 50, []
    for rank in range(2):
        x = 20 + rank * 350
        body.append(f'<text x="{x}" y="{y - 10}" class="t">rank {rank}</text>')
        for i, (name, shape, note, kind) in enumerate(stages):
            fill = RANK_COLORS[rank] if kind == "rank" else "#7f7f7f"
            yy = y + i * 52
            body += rect(x, yy, 320, 34, fill)
            body.append(f'<text x="{x + 6}" y="{yy + 15}" class="w">{name}: {shape}</text>')
            note_r = note.replace("4r..4r+4", f"{4 * rank}..{4 * rank + 4}")
            body.append(f'<text x="{x + 6}" y="{yy + 29}" class="w">{note_r}</text>')
            if i + 1 < len(stages):
                body.append(f'<line x1="{x + 160}" y1="{yy + 34}" x2="{x + 160}" y2="{yy + 52}" stroke="#333"/>')
    body.append(
        f'<text x="20" y="{y + len(stages) * 52 + 8}" class="s">no collective between fc1 and '
        "fc2: the column split leaves each rank the features its row split needs;</text>"
    )
    body.append(
        f'<text x="20" y="{y + len(stages) * 52 + 24}" class="s">one all-reduce at the end '
        "(in backward, the input gradient's all-reduce at fc1's copy_to_ranks)</text>"
    )
    return svg(720, y + len(stages) * 52 + 36, body + body_w)


def what_runs_where():
    """README's picture: two hosts, a launcher each, ranks as processes, and what each holds."""
    hosts, per_host, w_rank, gap = 2, 2, 250, 14
    w_host = per_host * w_rank + (per_host + 1) * gap
    body = [
        '<text x="10" y="22" class="h">what runs where: 2 hosts x 2 ranks, one process per rank</text>'
    ]
    y_host, h_host = 40, 300
    for h in range(hosts):
        x = 10 + h * (w_host + 20)
        body.append(f'<rect x="{x}" y="{y_host}" width="{w_host}" height="{h_host}" fill="#f4f4f4" stroke="#999"/>')
        body.append(f'<text x="{x + 8}" y="{y_host + 18}" class="t">host {h} (--node-rank {h})</text>')
        body += rect(x + gap, y_host + 28, w_host - 2 * gap, 26, "#7f7f7f",
                     "tch-dist-run (or torchrun / srun): starts, watches, stops the ranks")
        for l in range(per_host):
            rank = h * per_host + l
            rx, ry = x + gap + l * (w_rank + gap), y_host + 66
            color = RANK_COLORS[rank]
            body.append(f'<rect x="{rx}" y="{ry}" width="{w_rank}" height="176" fill="#fff" stroke="{color}" stroke-width="2"/>')
            body.append(f'<text x="{rx + 6}" y="{ry + 16}" class="t">rank {rank} (LOCAL_RANK {l}): a process</text>')
            body += rect(rx + 6, ry + 24, w_rank - 12, 40, color)
            body.append(f'<text x="{rx + 12}" y="{ry + 40}" class="w">your program: a tch model</text>')
            body.append(f'<text x="{rx + 12}" y="{ry + 56}" class="w">and an ordinary training loop</text>')
            body += rect(rx + 6, ry + 68, w_rank - 12, 40, color)
            body.append(f'<text x="{rx + 12}" y="{ry + 84}" class="w">tch-dist: replicate, fully_shard,</text>')
            body.append(f'<text x="{rx + 12}" y="{ry + 100}" class="w">TP, pipelining, checkpoints</text>')
            body += rect(rx + 6, ry + 112, w_rank - 12, 40, "#555")
            body.append(f'<text x="{rx + 12}" y="{ry + 128}" class="w">libtorch: autograd, kernels,</text>')
            body.append(f'<text x="{rx + 12}" y="{ry + 144}" class="w">c10d (Gloo: CPU, NCCL: GPU)</text>')
            body.append(f'<text x="{rx + 6}" y="{ry + 168}" class="s">{"CPU cores or GPU " + str(l)}</text>')
        if h == 0:
            body.append(f'<text x="{x + 8}" y="{y_host + h_host - 30}" class="s">rank 0 also hosts the store '
                        "(MASTER_ADDR:MASTER_PORT):</text>")
            body.append(f'<text x="{x + 8}" y="{y_host + h_host - 14}" class="s">rendezvous, heartbeats, '
                        "agreement checks</text>")
    y_net = y_host + h_host + 20
    total_w = hosts * w_host + (hosts - 1) * 20
    body += rect(10, y_net, total_w, 28, "#4e4e4e",
                 "collectives between all ranks: Gloo over TCP, NCCL over NVLink / the network")
    body.append(f'<text x="10" y="{y_net + 50}" class="s">every rank runs the same binary; '
                "a checkpoint is one folder every rank writes its own pieces into, "
                "in PyTorch's distributed layout</text>")
    return svg(total_w + 20, y_net + 64, body)


def main():
    out = sys.argv[1] if len(sys.argv) > 1 else "docs/img"
    os.makedirs(out, exist_ok=True)
    with open(os.path.join(out, "what_runs_where.svg"), "w") as f:
        f.write(what_runs_where())
    with open(os.path.join(out, "fsdp_shard_layout.svg"), "w") as f:
        f.write(shard_layout())
    with open(os.path.join(out, "tp_mlp.svg"), "w") as f:
        f.write(tp_mlp())


if __name__ == "__main__":
    main()
