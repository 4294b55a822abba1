"""Rank tasks for ``test_reshard_after_forward.py``: FSDP2's root clamp, driven by hand."""
import torch


def root_clamp_states(rank, root: "bool | int | None", blocks: "bool | int" = 2):
    """The nano GPT's blocks sharded with ``reshard_after_forward=blocks``, its root with
    ``root``; each unit's memory state after forward and after backward."""
    from minishard import fsdp
    from minishard.comm import Comm
    from minishard.model import GPT
    comm = Comm(rank.tracer)
    net = GPT("nano", seed=0)
    for i, block in enumerate(net.blocks):
        fsdp.fully_shard(block, comm=comm, reshard_after_forward=blocks, name=f"blocks.{i}")
    fsdp.fully_shard(net, comm=comm, reshard_after_forward=root, name="root")
    g = torch.Generator().manual_seed(rank.rank)
    x = torch.randint(0, net.cfg.vocab_size, (2, net.cfg.seq_len), generator=g)
    loss = net(x, x)
    after_forward = {u.name: u.state.value for u in fsdp.units(net)}
    loss.backward()
    after_backward = {u.name: u.state.value for u in fsdp.units(net)}
    return after_forward, after_backward
