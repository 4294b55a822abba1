"""One rank of a user's script that makes its own process group and trains with minishard's DDP:
``init_process_group("gloo")``, ``DDP(model)``, ``torch.optim.AdamW``, two steps,
``destroy_process_group()`` — and then the interpreter exits. Run by ``test_clean_exit.py``
(with ``MASTER_ADDR``, ``MASTER_PORT``, ``RANK`` and ``WORLD_SIZE`` in the environment).

``python clean_exit_rank.py before``: ``import minishard`` before ``init_process_group``;
``after``: after it (minishard then finds the group already made).

Before it exits it prints what decides whether the exit can abort, deterministically: the
functions of ``torch.distributed.nn.functional`` that keep the group as a default argument,
the references to the group left once it is destroyed, and the process's threads before the
group and after it (``captured=[] held=0 threads=N,N`` when nothing holds the group).
"""
import os
import sys
import time

import torch
import torch.distributed as dist


def threads() -> int:
    return len(os.listdir("/proc/self/task"))


when = sys.argv[1]
before = threads()
if when == "before":
    import minishard
dist.init_process_group("gloo")
if when == "after":
    import minishard

rank, world_size = dist.get_rank(), dist.get_world_size()
group = dist.group.WORLD
net = minishard.GPT("nano")
model = minishard.DDP(net)
opt = torch.optim.AdamW(model.parameters(), lr=1e-3)   # imports torch._dynamo, with the group alive
for step in range(2):
    x, y = minishard.batch(net.cfg, step, 2, rank, world_size)
    model(x, y).backward()
    opt.step()
    opt.zero_grad()
import torch.distributed.nn.functional as F  # noqa: E402
captured = [f.__name__ for f in vars(F).values() if group in (getattr(f, "__defaults__", None) or ())]
dist.destroy_process_group()
held = sys.getrefcount(group) - 2                 # minus this name and getrefcount's argument
del group
# the store's thread ends on its own a moment after the store is freed (seen 1 run in 4 still
# alive right after): wait for it, a while — a group still held keeps it for good
deadline = time.monotonic() + 10
while threads() > before and time.monotonic() < deadline:
    time.sleep(0.01)
print(f"captured={captured} held={held} threads={before},{threads()}", flush=True)
