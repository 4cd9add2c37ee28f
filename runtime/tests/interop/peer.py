"""A PyTorch rank of a mixed job (runtime/tests/interop.rs): the same calls, in the same order,
as the Rust ranks' `scenario`, on torch.distributed's default group and on subgroups, each
result checked here against the values every rank can compute.

Reads torchrun's variables (RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT) and
TCH_DIST_TIMEOUT_SECS (the group's timeout); INTEROP_SCENARIO picks the calls: "full"
(default group, objects, subgroups), "default_group" (no subgroups) or "detail". Prints
`interop ok rank R` at the end and leaves without Gloo's teardown; any mismatch prints
`interop error: ...` and its trace (exit status 1).
"""

import os
import sys
from datetime import timedelta

import torch
import torch.distributed as dist


def check(what, got, want):
    want = torch.tensor(want, dtype=got.dtype)
    if not torch.equal(got, want.reshape(got.shape)):
        raise AssertionError(f"rank {dist.get_rank()}: {what}: got {got.tolist()}, want {want.tolist()}")


def collectives(group, ranks, me):
    """The calls of Rust's `collectives` on `group` (members `ranks`, sorted; this process is
    `me` in it)."""
    w = len(ranks)
    f = torch.float32

    t = torch.tensor([me + 1.0, 2.0 * (me + 1)], dtype=f)
    dist.all_reduce(t, op=dist.ReduceOp.SUM, group=group)
    s = w * (w + 1) / 2
    check("all_reduce sum", t, [s, 2 * s])

    t = torch.tensor([float(me)], dtype=f)
    dist.all_reduce(t, op=dist.ReduceOp.MAX, group=group)
    check("all_reduce max", t, [w - 1.0])

    t = torch.tensor([float(me)], dtype=f)
    dist.all_reduce(t, op=dist.ReduceOp.MIN, group=group)
    check("all_reduce min", t, [0.0])

    t = torch.tensor([me + 1.0], dtype=f)
    dist.all_reduce(t, op=dist.ReduceOp.PRODUCT, group=group)
    prod = 1.0
    for i in range(w):
        prod *= i + 1
    check("all_reduce product", t, [prod])

    t = torch.tensor([me + 1.0, 4.0], dtype=f)
    dist.all_reduce(t, op=dist.ReduceOp.AVG, group=group)
    check("all_reduce avg", t, [(w + 1) / 2, 4.0])

    t = torch.tensor([10 * me + 3], dtype=torch.int64)
    dist.all_reduce(t, op=dist.ReduceOp.SUM, group=group)
    check("all_reduce sum int64", t, [10 * w * (w - 1) // 2 + 3 * w])

    t = torch.tensor([me * 10.0, 1.0], dtype=f)
    dist.broadcast(t, src=ranks[1 % w], group=group)
    check("broadcast from group rank 1", t, [(1 % w) * 10.0, 1.0])

    outs = [torch.zeros(2, dtype=f) for _ in range(w)]
    dist.all_gather(outs, torch.tensor([me, me + 0.5], dtype=f), group=group)
    for i, o in enumerate(outs):
        check(f"all_gather list [{i}]", o, [i, i + 0.5])

    out = torch.zeros(w, 2, dtype=f)
    dist.all_gather_into_tensor(out, torch.tensor([[me, -me]], dtype=f), group=group)
    check("all_gather_into_tensor", out, [[i, -i] for i in range(w)])

    inp = torch.tensor([100.0 * me + j for j in range(w)], dtype=f)
    out = torch.zeros(1, dtype=f)
    dist.reduce_scatter_tensor(out, inp, op=dist.ReduceOp.SUM, group=group)
    check("reduce_scatter_tensor", out, [100.0 * w * (w - 1) / 2 + w * me])

    inputs = [torch.tensor([me + 10.0 * j, 1.0], dtype=f) for j in range(w)]
    out = torch.zeros(2, dtype=f)
    dist.reduce_scatter(out, inputs, op=dist.ReduceOp.SUM, group=group)
    check("reduce_scatter list", out, [w * (w - 1) / 2 + 10.0 * w * me, float(w)])

    inp = torch.tensor([10.0 * me + j for j in range(w)], dtype=f)
    out = torch.zeros(w, dtype=f)
    dist.all_to_all_single(out, inp, group=group)
    check("all_to_all_single", out, [10.0 * i + me for i in range(w)])

    # A ring with tag 7: group rank 0 sends first, the others receive first.
    nxt, prv = ranks[(me + 1) % w], ranks[(me - 1) % w]
    t = torch.tensor([me + 0.25], dtype=f)
    r = torch.zeros(1, dtype=f)
    if me == 0:
        dist.send(t, nxt, group=group, tag=7)
        dist.recv(r, prv, group=group, tag=7)
    else:
        dist.recv(r, prv, group=group, tag=7)
        dist.send(t, nxt, group=group, tag=7)
    check("recv tag 7", r, [(me - 1) % w + 0.25])

    dist.barrier(group=group)
    dist.monitored_barrier(group=group, timeout=timedelta(seconds=30), wait_all_ranks=True)


def detail(rank, world):
    """TORCH_DISTRIBUTED_DEBUG=DETAIL on every rank: matching calls pass the wrapper's
    checks; then rank 0 broadcasts where the others all-reduce, which must fail here."""
    t = torch.tensor([rank + 1.0])
    dist.all_reduce(t)
    check("detail all_reduce", t, [world * (world + 1) / 2])
    out = torch.zeros(world)
    dist.all_gather_into_tensor(out, torch.tensor([float(rank)]))
    check("detail all_gather_into_tensor", out, list(range(world)))
    dist.barrier()
    t = torch.tensor([float(rank)])
    dist.broadcast(t, src=1)
    check("detail broadcast", t, [1.0])
    # A subgroup's wrapper and helper group (pg_wrapper:1) meet too.
    sub = dist.new_group(list(range(world)))
    t = torch.tensor([rank + 1.0])
    dist.all_reduce(t, group=sub)
    check("detail subgroup all_reduce", t, [world * (world + 1) / 2])
    t = torch.tensor([float(rank)])
    dist.broadcast(t, src=1, group=sub)
    check("detail subgroup broadcast", t, [1.0])
    t = torch.ones(4)
    try:
        if rank == 0:
            dist.broadcast(t, src=0)
        else:
            dist.all_reduce(t)
    except Exception as e:  # the wrapper's mismatch report
        print(f"detail mismatch: {str(e).splitlines()[0]}", flush=True)
        return
    raise AssertionError("the mismatched collective passed the DETAIL check")


def main():
    scenario = os.environ.get("INTEROP_SCENARIO", "full")
    timeout = timedelta(seconds=float(os.environ.get("TCH_DIST_TIMEOUT_SECS", "60")))
    dist.init_process_group("gloo", timeout=timeout)
    rank, world = dist.get_rank(), dist.get_world_size()
    if scenario == "detail":
        detail(rank, world)
        print(f"interop ok rank {rank}", flush=True)
        return
    collectives(None, list(range(world)), rank)
    # Object collectives, str and bytes (what tch-dist reads and writes).
    sent = ["weights-v3", b"\x00\x01\xff", "x" * 300]
    objs = list(sent) if rank == 1 else [None] * 3
    dist.broadcast_object_list(objs, src=1)
    if objs != sent:
        raise AssertionError(f"broadcast_object_list: got {objs!r}")
    mine = f"rank {rank}" if rank % 2 == 0 else bytes([rank] * (rank + 1))
    gathered = [None] * world
    dist.all_gather_object(gathered, mine)
    want = [f"rank {r}" if r % 2 == 0 else bytes([r] * (r + 1)) for r in range(world)]
    if gathered != want:
        raise AssertionError(f"all_gather_object: got {gathered!r}")
    # send_object_list / recv_object_list: rank 0 to rank 1 and back.
    if rank == 0:
        dist.send_object_list(["ping", b"\x07"], dst=1)
        back = [None]
        dist.recv_object_list(back, src=1)
        if back != ["pong 1"]:
            raise AssertionError(f"recv_object_list: got {back!r}")
    elif rank == 1:
        got = [None, None]
        dist.recv_object_list(got, src=0)
        if got != ["ping", b"\x07"]:
            raise AssertionError(f"recv_object_list: got {got!r}")
        dist.send_object_list(["pong 1"], dst=0)
    if scenario == "full":  # "default_group": the calls above only
        # new_group on every rank, members or not; the second list unsorted.
        pair = dist.new_group([0, 1])
        ends = dist.new_group([world - 1, 0])
        if rank in (0, 1):
            collectives(pair, [0, 1], rank)
        if rank in (0, world - 1):
            collectives(ends, sorted([0, world - 1]), sorted([0, world - 1]).index(rank))
        # use_local_synchronization: only the members call it.
        local = [1, world - 1] if world > 2 else [0, 1]
        if rank in local:
            g = dist.new_group(local, use_local_synchronization=True)
            collectives(g, local, local.index(rank))
        dist.barrier()
    print(f"interop ok rank {rank}", flush=True)


if __name__ == "__main__":
    # The verdict line is this rank's result; the process then leaves without tearing Gloo
    # down (os._exit), so that an abort in the interpreter's teardown can never fail a test
    # whose checks all passed (one did: "terminate called without an active exception").
    try:
        main()
    except Exception as e:  # one line on stdout for the Rust test's message, then the trace
        print(f"interop error: {e}", flush=True)
        import traceback

        traceback.print_exc()
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(1)
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)
