"""Chapter 06 exercise: a unit's lifecycle, by hand — unshard and reshard in the right order.

The model's units were made with ``fully_shard(..., manual=True)``: no hooks, so nothing is
gathered or freed unless you say so. Write one training step (forward, loss, backward, gradient
reduction) calling the lifecycle methods yourself:
``unit.unshard()`` (all-gather the full parameters), ``unit.reshard()`` (free them, keep the
shard), ``unit.reduce_scatter_grads()`` (sum the full gradients over ranks, keep your shard).

The check runs your step on 1 and 2 real ranks next to minishard's ``course.ch06.manual_step`` on an
identical model and batch, compares the loss and every gradient shard, counts the collectives,
and looks at the units when forward reaches the final norm: every block must already be freed.
minishard's step unshards each block just before that block's own backward, as the hooks do (it
cuts the graph between blocks to run backward one block at a time); unsharding them all before
one ``loss.backward()``, as asked here, is simpler and sends the same collectives for the same
gradients — it only holds every block's full parameters at once in backward.
"""
from __future__ import annotations

import torch

from . import at_world_sizes, attempt, expect, portable, run_on_rank


def manual_step(model, idx: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """One step of a GPT with manual units; return the loss (detached).

    ``root = model._fsdp_unit`` owns the embeddings, the final norm ``model.ln_f`` and the head
    ``model.head``; ``model.blocks[i]._fsdp_unit`` owns block i. The forward is
    ``x = model.tok_emb(idx) + model.pos_emb.weight[:T]``, then each block, then
    ``model.head(model.ln_f(x))`` and the cross-entropy against ``targets``. Keep the root
    gathered for the whole step; gather each block for its forward and free it right after;
    gather the blocks again for backward; after ``loss.backward()`` reduce-scatter every unit's
    gradients (last block first, the root last) and free it.
    """
    raise NotImplementedError("manual_step: your code here")


def _net(comm):
    from minishard.strategies import fsdp
    from minishard.core.model import GPT

    net = GPT("nano", seed=0)
    return fsdp.apply_fsdp(net, comm=comm, manual=True)


def _task(ctx, spec: dict) -> dict:
    from minishard.strategies import fsdp
    from minishard.core.comm import Comm
    from minishard.core.model import batch, config
    from minishard.course.ch06 import manual_step as reference_manual_step

    x, y = batch(config("nano"), 0, 2, ctx.rank, ctx.world_size)
    ref_comm, comm = Comm(None), Comm(None)
    ref = _net(ref_comm)
    ref_comm.reset_counters()
    ref_loss = reference_manual_step(ref, x, y)

    net = _net(comm)
    comm.reset_counters()
    blocks = [b._fsdp_unit for b in net.blocks]
    at_head = {}
    net.ln_f.register_forward_pre_hook(
        lambda mod, args: at_head.update({u.name: u.memory_state.value for u in blocks}))
    loss = run_on_rank(spec, net, x, y)
    grads = lambda m: [p.grad for p in m.parameters()]                       # noqa: E731  (shards)
    gaps = [float("inf") if a is None else (a - b).abs().max().item()
            for a, b in zip(grads(net), grads(ref))]
    return {"rank": ctx.rank, "loss": float(loss), "ref_loss": float(ref_loss), "gap": max(gaps),
            "missing": sum(g is None for g in grads(net)), "at_head": at_head,
            "after": {u.name: u.memory_state.value for u in fsdp.units(net)},
            "by_op": {op: v["calls"] for op, v in comm.by_op.items()},
            "ref_by_op": {op: v["calls"] for op, v in ref_comm.by_op.items()}}


@attempt
def check_manual_step(fn=None, ranks=None) -> None:
    spec = portable(fn or manual_step)
    for n, out in at_world_sizes(_task, spec, ranks, (1, 2)):
        for o in out:
            print(f"N={n} rank {o['rank']}: loss {o['loss']:.6f} (minishard {o['ref_loss']:.6f}), "
                  f"gradient shards within {o['gap']:.1e}; collectives {o['by_op']} "
                  f"(minishard {o['ref_by_op']}); blocks when ln_f runs: {set(o['at_head'].values())}")
            expect(o["loss"] == o["ref_loss"], f"N={n}: loss {o['loss']} != {o['ref_loss']}")
            expect(o["missing"] == 0 and o["gap"] <= 1e-6,
                   f"N={n} rank {o['rank']}: the gradient shards differ from minishard's "
                   f"({o['missing']} missing, largest gap {o['gap']:.2e}) — reduce-scatter "
                   f"every unit after backward")
            expect(set(o["at_head"].values()) == {"sharded"},
                   f"N={n}: when forward reaches the final norm, blocks are {o['at_head']} — "
                   f"free each block (reshard) right after its forward: that is ZeRO-3's saving")
            expect(set(o["after"].values()) == {"sharded"},
                   f"N={n}: after the step units are {o['after']} — reshard every unit")
            expect(o["by_op"] == o["ref_by_op"],
                   f"N={n}: your collectives {o['by_op']} differ from the lifecycle's "
                   f"{o['ref_by_op']}: the root once, every block twice (forward, backward); "
                   f"one reduce-scatter per unit")
