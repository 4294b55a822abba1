"""Rank tasks for ``test_reshard_after_forward.py``: FSDP2's root clamp, driven by hand."""
import torch


def root_clamp_states(rank, root: "bool | int | None", blocks: "bool | int" = 2):
    """The nano GPT's blocks sharded with ``reshard_after_forward=blocks``, its root with
    ``root``; each unit's memory state after forward and after backward."""
    from minishard.strategies import fsdp
    from minishard.core.comm import Comm
    from minishard.core.model import GPT
    comm = Comm(rank.tracer)
    net = GPT("nano", seed=0)
    fsdp.apply_fsdp(net, comm=comm, blocks=dict(reshard_after_forward=blocks),
                    root=dict(reshard_after_forward=root))
    g = torch.Generator().manual_seed(rank.rank)
    x = torch.randint(0, net.cfg.vocab_size, (2, net.cfg.seq_len), generator=g)
    loss = net(x, x)
    after_forward = {u.name: u.memory_state.value for u in fsdp.units(net)}
    loss.backward()
    after_backward = {u.name: u.memory_state.value for u in fsdp.units(net)}
    return after_forward, after_backward


def k_groups_of_six(rank, k: int):
    """Six ranks, every block ``reshard_after_forward=k``: after forward each rank holds 1/k of
    every block (N/k of the 6 shard blocks); then blocks.0 is resharded fully by hand, as if its
    backward never came, before backward runs. Returns the bytes kept per block, the live
    ledger tags after the step, the gathers' groups in backward, and the gradients."""
    from minishard.strategies import fsdp
    from minishard.core.comm import Comm
    from minishard.core.ledger import LiveLedger
    from minishard.core.model import GPT
    ledger = LiveLedger()
    comm = Comm(rank.tracer, ledger=ledger)
    net = GPT("nano", seed=0)
    fsdp.apply_fsdp(net, comm=comm, ledger=ledger, blocks=dict(reshard_after_forward=k))
    g = torch.Generator().manual_seed(rank.rank)
    x = torch.randint(0, net.cfg.vocab_size, (2, net.cfg.seq_len), generator=g)
    loss = net(x, x)
    kept = {u.name: u._post_forward_chunks.numel() * u._post_forward_chunks.element_size()
            for u in fsdp.units(net) if u._post_forward_chunks is not None}
    full = {u.name: u.layout.N * u.layout.per_rank * 4 for u in fsdp.units(net) if u.name != "root"}
    net.blocks[0]._fsdp_unit.reshard()
    after_reshard = net.blocks[0]._fsdp_unit._post_forward_chunks is None
    loss.backward()
    live = [u for u in ("blocks.0", "blocks.1", "blocks.2") if ledger.is_live(f"{u}:post_forward")]
    grads = {n: p.grad.clone() for n, p in net.named_parameters() if p.grad is not None}
    return {"kept": kept, "full": full, "dropped": after_reshard, "live": live, "grads": grads}


def consecutive_inside_groups(rank):
    """``Comm.consecutive`` on a communicator that is one of several groups: each rank's group of
    one is itself, and of two inside its own shard group."""
    from minishard.core.comm import Comm
    shard, rep = Comm(rank.tracer).split(2)
    return rep.consecutive(1).members, shard.consecutive(1).members
