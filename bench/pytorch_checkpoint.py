"""The checkpoint benchmark's PyTorch side: the model of examples/bench_checkpoint.rs
(12 Linear layers alternating 2048 -> 4096 and 4096 -> 2048, fully_shard on each, then the
root), saved and loaded with DCP's safetensors storage (HuggingFaceStorageWriter/Reader).

    torchrun --nproc-per-node 2 pytorch_checkpoint.py --mode save --dir DIR
    torchrun --nproc-per-node 4 pytorch_checkpoint.py --mode load --dir DIR/sync

save: `dcp.save` into DIR/sync, then `dcp.async_save` (a Gloo group of its own for the
background thread, as its docs advise) into DIR/async: the time the call blocked, and to the
end of the write. load: the same measurements as the Rust side (time, rchar, read_bytes, peak
RSS over the start after resetting VmHWM, this rank's shard bytes). Every rank prints one
`BENCH {json}` line, then leaves without tearing Gloo down."""

import argparse
import json
import os
import sys
import time

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import HuggingFaceStorageReader, HuggingFaceStorageWriter
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard


class Big(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.layers = torch.nn.ModuleList(
            torch.nn.Linear(2048, 4096) if i % 2 == 0 else torch.nn.Linear(4096, 2048)
            for i in range(12)
        )


def status_bytes(field):
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field):
                return int(line.split()[1]) * 1024
    return 0


def io(field):
    with open("/proc/self/io") as f:
        for line in f:
            if line.startswith(field):
                return int(line.split()[1])
    return 0


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--mode", required=True, choices=["save", "load"])
    p.add_argument("--dir", required=True)
    a = p.parse_args()
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(1 if a.mode == "save" else 2)
    model = Big()
    mesh = init_device_mesh("cpu", (world,))
    for layer in model.layers:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    if a.mode == "save":
        dist.barrier()
        t = time.perf_counter()
        dcp.save(
            model.state_dict(),
            storage_writer=HuggingFaceStorageWriter(os.path.join(a.dir, "sync"), save_distributed=True),
        )
        save_ms = (time.perf_counter() - t) * 1e3
        background = dist.new_group(backend="gloo")
        dist.barrier()
        t = time.perf_counter()
        future = dcp.async_save(
            model.state_dict(),
            storage_writer=HuggingFaceStorageWriter(os.path.join(a.dir, "async"), save_distributed=True),
            process_group=background,
        )
        blocked_ms = (time.perf_counter() - t) * 1e3
        (future.upload_completion if hasattr(future, "upload_completion") else future).result()
        total_ms = (time.perf_counter() - t) * 1e3
        out = {"mode": "save", "rank": rank, "world": world, "save_ms": save_ms,
               "async_blocked_ms": blocked_ms, "async_total_ms": total_ms}
    else:
        local = [p.to_local() for p in model.parameters()]
        shard_bytes = sum(t.numel() * t.element_size() for t in local)
        largest = max(t.numel() * t.element_size() for t in local)
        sd = model.state_dict()
        dist.barrier()
        try:
            with open("/proc/self/clear_refs", "w") as f:
                f.write("5")
        except OSError:
            pass
        rss0, rchar0, disk0 = status_bytes("VmRSS:"), io("rchar:"), io("read_bytes:")
        t = time.perf_counter()
        dcp.load(sd, storage_reader=HuggingFaceStorageReader(a.dir))
        load_ms = (time.perf_counter() - t) * 1e3
        out = {"mode": "load", "rank": rank, "world": world, "reads": "pytorch", "load_ms": load_ms,
               "rchar": io("rchar:") - rchar0, "read_bytes": io("read_bytes:") - disk0,
               "peak_rss_over_start": max(0, status_bytes("VmHWM:") - rss0),
               "shard_bytes": shard_bytes, "largest_tensor_bytes": largest}
    dist.barrier()
    print("BENCH " + json.dumps(out), flush=True)
    sys.stderr.flush()
    os._exit(0)


main()
