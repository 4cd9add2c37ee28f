"""torchft's own side of tests/torchft.rs, from the `torchft` wheel (0.2.0) in the venv.

    torchft_peer.py lighthouse MIN_REPLICAS JOIN_TIMEOUT_MS
        starts the wheel's lighthouse on 127.0.0.1 (any port), prints `port N`, and serves
        until stdin closes.
    torchft_peer.py groups LIGHTHOUSE_ADDR RUST_MANAGER_ADDR
        starts a torchft manager for replica group `replica_0:py` (store 127.0.0.1:1111) at
        the lighthouse, then, as rank 0 of both groups at once (torchft's ManagerClient),
        asks its manager and the Rust one for a quorum (step 0, init_sync), votes to commit
        on both, and reads back the checkpoint metadata the Rust manager kept; prints one
        JSON object.
    torchft_peer.py asking LIGHTHOUSE_ADDR
        starts a torchft manager for replica group `replica_0:py` at the lighthouse, prints
        `asking`, and asks it for a quorum (step 5) until one forms or the process is
        killed (the lighthouse dashboard's kill button: the manager ends the process).
    torchft_peer.py train LIGHTHOUSE_ADDR INDEX STEPS [EXIT_AT|-] [STEP_MS] [START_FILE]
        replica group `replica_{INDEX}` of one rank, trained as torchft's README does
        (torchft's Manager, ProcessGroupGloo, DistributedDataParallel and OptimizerWrapper;
        no init_sync): train_ft's MLP (6 -> 16 -> 3, tanh) from its `--init-sin` weights,
        SGD with momentum, train_ft's batches keyed by (step, INDEX). With EXIT_AT it exits
        with status 3 at that step, after its backward (a group that dies); STEP_MS pauses
        each step. With START_FILE it prints `manager up` once its manager heartbeats, and
        asks for its first quorum once that file exists (train_ft's `--start-file`).
        Prints `FINAL {json}` as train_ft does.
    torchft_peer.py reference PHASE...
        the same model in one process; each PHASE is `N:I,J,...`, N steps whose gradient is
        the average of groups I, J, ...'s batches; prints `FINAL {json}`.
"""

import json
import os
import sys
import threading
from datetime import timedelta

import torch

from torchft._torchft import LighthouseServer, ManagerClient, ManagerServer

T = timedelta(seconds=20)


def result(r):
    # The wheel's QuorumResult has no commit_failures (its proto field is read by the
    # manager only).
    return {
        k: getattr(r, k, None)
        for k in (
            "quorum_id",
            "replica_rank",
            "replica_world_size",
            "recover_src_manager_address",
            "recover_src_replica_rank",
            "recover_dst_replica_ranks",
            "store_address",
            "max_step",
            "max_replica_rank",
            "max_world_size",
            "heal",
            "commit_failures",
            "replica_ids",
        )
    }


def lighthouse(min_replicas, join_timeout_ms):
    server = LighthouseServer(
        bind="127.0.0.1:0",
        min_replicas=int(min_replicas),
        join_timeout_ms=int(join_timeout_ms),
    )
    print("port", server.address().rsplit(":", 1)[1], flush=True)
    sys.stdin.read()
    server.shutdown()


def manager(lighthouse_addr):
    """A torchft manager for replica group `replica_0:py` (one rank, store 127.0.0.1:1111)."""
    return ManagerServer(
        replica_id="replica_0:py",
        lighthouse_addr=lighthouse_addr,
        hostname="127.0.0.1",
        bind="127.0.0.1:0",
        store_addr="127.0.0.1:1111",
        world_size=1,
        heartbeat_interval=timedelta(milliseconds=100),
        connect_timeout=timedelta(seconds=10),
        quorum_retries=0,
    )


def groups(lighthouse_addr, rust_manager):
    server = manager(lighthouse_addr)
    clients = {
        "py": ManagerClient(server.address(), connect_timeout=timedelta(seconds=10)),
        "rs": ManagerClient(rust_manager, connect_timeout=timedelta(seconds=10)),
    }
    out = {"py_manager": server.address()}
    errors = []

    def run(name):
        try:
            c = clients[name]
            q = c._quorum(
                group_rank=0,
                step=0,
                checkpoint_metadata=f"{name}-meta",
                shrink_only=False,
                timeout=T,
                commit_failures=0,
                init_sync=True,
            )
            out[name] = result(q)
            out[name + "_commit"] = c.should_commit(0, 0, True, T)
        except Exception as e:  # reported, not raised in a thread
            errors.append(f"{name}: {e!r}")

    threads = [threading.Thread(target=run, args=(n,)) for n in clients]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if not errors:
        out["rs_metadata"] = clients["rs"]._checkpoint_metadata(0, T)
    out["errors"] = errors
    print(json.dumps(out), flush=True)
    server.shutdown()


def asking(lighthouse_addr):
    server = manager(lighthouse_addr)
    client = ManagerClient(server.address(), connect_timeout=timedelta(seconds=10))
    print("asking", flush=True)
    client._quorum(
        group_rank=0,
        step=5,
        checkpoint_metadata="",
        shrink_only=False,
        timeout=timedelta(seconds=60),
        commit_failures=0,
        init_sync=True,
    )
    server.shutdown()


class Mlp(torch.nn.Module):
    """train_ft's model: parameters fc1.weight, fc1.bias, fc2.weight, fc2.bias."""

    def __init__(self):
        super().__init__()
        self.fc1 = torch.nn.Linear(6, 16)
        self.fc2 = torch.nn.Linear(16, 3)

    def forward(self, x):
        return self.fc2(torch.tanh(self.fc1(x)))


def sin_init(model):
    """train_ft's `--init-sin`: the k-th parameter by name is 0.3 sin(0.7 i + k)."""
    with torch.no_grad():
        for k, (_, p) in enumerate(sorted(model.named_parameters())):
            i = torch.arange(p.numel(), dtype=torch.float32)
            p.copy_(((i * 0.7 + k).sin() * 0.3).reshape(p.shape))


def batch(step, index):
    """train_ft's batch of rank 0 of group `index` at `step`."""
    torch.manual_seed(1000 * step + 10 * index)
    return torch.randn(32, 6), torch.randn(32, 3)


def final(model, opt, step, extra):
    params, momentum = {}, {}
    for name, p in sorted(model.named_parameters()):
        params[name] = p.detach().double().flatten().tolist()
        buf = opt.state.get(p, {}).get("momentum_buffer")
        if buf is not None:
            momentum[name] = buf.double().flatten().tolist()
    out = {"step": step, "params": params, "momentum": momentum, **extra}
    print("FINAL " + json.dumps(out), flush=True)


def train(lighthouse_addr, index, steps, exit_at="-", step_ms="0", start_file=None):
    import time

    import torchft
    from torch.distributed import TCPStore

    index, steps = int(index), int(steps)
    exit_at = None if exit_at == "-" else int(exit_at)
    model = Mlp()
    sin_init(model)
    sgd = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    store = TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    manager = torchft.Manager(
        pg=torchft.ProcessGroupGloo(timeout=timedelta(seconds=5)),
        load_state_dict=lambda sd: (model.load_state_dict(sd["model"]), sgd.load_state_dict(sd["optim"])),
        state_dict=lambda: {"model": model.state_dict(), "optim": sgd.state_dict()},
        min_replica_size=1,
        timeout=timedelta(seconds=5),
        quorum_timeout=timedelta(seconds=60),
        connect_timeout=timedelta(seconds=30),
        rank=0,
        world_size=1,
        store_addr="127.0.0.1",
        store_port=store.port,
        lighthouse_addr=lighthouse_addr,
        replica_id=f"replica_{index}",
        hostname="127.0.0.1",
        init_sync=False,
    )
    ddp = torchft.DistributedDataParallel(manager, model)
    if start_file is not None:
        print("manager up", flush=True)
        while not os.path.exists(start_file):
            time.sleep(0.01)
    opt = torchft.Optimizer(manager, sgd)
    while manager.current_step() < steps:
        opt.zero_grad()
        x, y = batch(manager.current_step(), index)
        torch.nn.functional.mse_loss(ddp(x), y).backward()
        if exit_at == manager.current_step():
            print(f"exiting at step {exit_at} (injected)", file=sys.stderr, flush=True)
            os._exit(3)
        opt.step()
        time.sleep(int(step_ms) / 1000)
    final(model, sgd, manager.current_step(), {"replica_id": f"replica_{index}"})
    manager.shutdown(wait=False)


def reference(*phases):
    model = Mlp()
    sin_init(model)
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    plan = []
    for phase in phases:
        n, indices = phase.split(":")
        plan += [indices.split(",")] * int(n)
    for step, indices in enumerate(plan):
        grads = []
        for index in indices:
            model.zero_grad()
            x, y = batch(step, int(index))
            torch.nn.functional.mse_loss(model(x), y).backward()
            grads.append([p.grad.clone() for p in model.parameters()])
        for p, *gs in zip(model.parameters(), *grads):
            p.grad = sum(gs) / len(gs)
        opt.step()
    final(model, opt, len(plan), {})


if __name__ == "__main__":
    {
        "lighthouse": lighthouse,
        "groups": groups,
        "asking": asking,
        "train": train,
        "reference": reference,
    }[sys.argv[1]](*sys.argv[2:])
