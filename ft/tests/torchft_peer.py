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
"""

import json
import sys
import threading
from datetime import timedelta

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


if __name__ == "__main__":
    {"lighthouse": lighthouse, "groups": groups, "asking": asking}[sys.argv[1]](*sys.argv[2:])
