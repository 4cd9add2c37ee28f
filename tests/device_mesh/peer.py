"""A PyTorch rank of tests/device_mesh.rs's mixed job: builds PyTorch 2.11's own
`init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))` among Rust ranks, then
all-reduces on each dim's group and on the default group, checking every result. Groups
that were created differently on the two sides (another order, other ranks) would not meet:
the collectives would time out instead of printing the verdict.

Prints `mesh ok rank R <dp group name> <tp group name>` and leaves without Gloo's teardown.
"""

import os
import sys
import traceback
from datetime import timedelta

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh


def main():
    timeout = timedelta(seconds=float(os.environ.get("TCH_DIST_TIMEOUT_SECS", "60")))
    dist.init_process_group("gloo", timeout=timeout)
    rank = dist.get_rank()
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    dp, tp = mesh.get_group("dp"), mesh.get_group("tp")
    row, col = divmod(rank, 2)
    t = torch.tensor([rank + 1.0])
    dist.all_reduce(t, group=tp)
    want = sum(r + 1.0 for r in range(4) if r // 2 == row)
    assert t.item() == want, f"tp: got {t.item()}, want {want}"
    t = torch.tensor([10.0 * (rank + 1)])
    dist.all_reduce(t, group=dp)
    want = sum(10.0 * (r + 1) for r in range(4) if r % 2 == col)
    assert t.item() == want, f"dp: got {t.item()}, want {want}"
    assert mesh.get_local_rank("tp") == col and mesh.get_local_rank("dp") == row
    t = torch.tensor([1.0])
    dist.all_reduce(t)
    assert t.item() == 4.0
    print(f"mesh ok rank {rank} {dp.group_name} {tp.group_name}", flush=True)


if __name__ == "__main__":
    try:
        main()
    except BaseException:
        traceback.print_exc()
        sys.stdout.flush()
        os._exit(1)
    sys.stdout.flush()
    os._exit(0)
