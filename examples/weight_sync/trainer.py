"""Rank 0 of examples/weight_sync: a PyTorch trainer that sends its policy's weights to
tch-dist workers (ranks 1..N, weight_sync_worker) after every step, and checks the actions
they send back against its own.

Each step, on the default Gloo group (README.md has the whole protocol):
  1. one SGD step of the policy on a toy regression;
  2. dist.broadcast of every state_dict tensor, in state_dict order;
  3. dist.recv of each worker's actions for its observations (tag = the step), compared with
     the trainer's own forward pass of the same observations.
Before the first step, broadcast_object_list sends the state_dict's names (comma-separated)
and the step count, so that a worker whose model has other names stops with a message.

Started by torchrun (rank.sh) or by hand with RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT.
"""

import os
import sys
from datetime import timedelta

import torch
import torch.distributed as dist
from torch import nn


class Policy(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1 = nn.Linear(4, 16)
        self.fc2 = nn.Linear(16, 2)

    def forward(self, x):
        return self.fc2(torch.tanh(self.fc1(x)))


def observations(rank, step):
    """What worker `rank` observes at `step` (worker.rs computes the same)."""
    return torch.arange(12, dtype=torch.float32).reshape(3, 4) / 12.0 + rank + 0.01 * step


def main():
    steps = int(os.environ.get("WEIGHT_SYNC_STEPS", "5"))
    timeout = timedelta(seconds=float(os.environ.get("TCH_DIST_TIMEOUT_SECS", "60")))
    dist.init_process_group("gloo", timeout=timeout)
    if dist.get_rank() != 0:
        raise SystemExit("trainer.py is rank 0; start weight_sync_worker as ranks 1..N")
    world = dist.get_world_size()
    torch.manual_seed(0)
    policy = Policy()
    opt = torch.optim.SGD(policy.parameters(), lr=0.1)
    names = list(policy.state_dict().keys())
    dist.broadcast_object_list([",".join(names), str(steps)], src=0)

    x = torch.randn(64, 4)
    target = torch.stack([x.sum(1), x[:, 0] - x[:, 1]], dim=1)
    for step in range(steps):
        loss = nn.functional.mse_loss(policy(x), target)
        opt.zero_grad()
        loss.backward()
        opt.step()
        state = policy.state_dict()
        for name in names:
            dist.broadcast(state[name].contiguous(), src=0)
        worst = 0.0
        with torch.no_grad():
            for r in range(1, world):
                actions = torch.zeros(3, 2)
                dist.recv(actions, src=r, tag=step)
                mine = policy(observations(r, step))
                worst = max(worst, (actions - mine).abs().max().item())
        if worst > 1e-5:
            raise SystemExit(f"step {step}: a worker's actions differ by {worst:g}")
        print(f"step {step} loss={loss.item():.4f} max_action_diff={worst:.2g}", flush=True)
    print(f"weights in sync on {world - 1} workers after {steps} steps", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    try:
        main()
    except Exception as e:
        print(f"error: {e}", file=sys.stderr, flush=True)
        sys.exit(1)
