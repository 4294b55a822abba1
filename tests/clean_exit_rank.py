"""One rank of a user's script that makes its own process group and trains with minishard's DDP:
``init_process_group("gloo")``, ``DDP(model)``, ``torch.optim.AdamW``, two steps,
``destroy_process_group()`` — and then the interpreter exits. Run by ``test_clean_exit.py``
(with ``MASTER_ADDR``, ``MASTER_PORT``, ``RANK`` and ``WORLD_SIZE`` in the environment).

``python clean_exit_rank.py before``: ``import minishard`` before ``init_process_group``;
``after``: after it (minishard then finds the group already made).
"""
import sys

import torch
import torch.distributed as dist

when = sys.argv[1]
if when == "before":
    import minishard
dist.init_process_group("gloo")
if when == "after":
    import minishard

rank, world_size = dist.get_rank(), dist.get_world_size()
net = minishard.GPT("nano")
model = minishard.DDP(net)
opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
for step in range(2):
    x, y = minishard.batch(net.cfg, step, 2, rank, world_size)
    model(x, y).backward()
    opt.step()
    opt.zero_grad()
dist.destroy_process_group()
