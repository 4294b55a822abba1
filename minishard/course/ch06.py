"""Chapter 06 (FSDP units): rank tasks and small views.

The tasks run on real ranks (``Ranks(N).run(task, ...)``) and return plain data a notebook can
print and assert on; the views read traces only. Nothing here is a strategy: every byte is
allocated, gathered and reduced by :mod:`minishard.strategies.fsdp` (its units and layouts).

* :func:`lifecycle_by_hand` walks one training step of the nano GPT through every FSDP lifecycle
  call written out (``unshard``, ``reshard``, ``reduce_scatter_grads`` ...) by
  :func:`manual_step`, snapshotting the units' states and the rank's ledger after each call,
  then checks that the hooks give the same bits.
* :func:`layout_views` and :func:`mixed_dtypes` show what the per-parameter (FSDP2) and flat
  (FSDP1) layouts look like to ``model.parameters()``, to a checkpoint and to mixed dtypes;
  :func:`padding_table` computes each layout's padding for any world size without ranks.
* :func:`lifecycle_order` and :func:`unit_state_figure` turn a trace's ``unit`` events into the
  chapter's table and picture (plotly is imported lazily, so the rank processes that import
  this module for its tasks do not pay for it).
* :func:`manual_step` is that by-hand step on its own, watched by nobody (the exercise's
  reference and a test of the hooks).
"""
from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

from minishard.strategies import fsdp
from minishard.core.comm import Comm
from minishard.core.ledger import LiveLedger, track_optimizer_state
from minishard.core.model import GPT, batch, config
from minishard.core.trace import phase_spans, unit_spans


# --------------------------------------------------------------------------- 06: by hand


def _shard_model(net: GPT, comm: Comm, ledger: LiveLedger | None, manual: bool,
                 layout: str = "per_param") -> GPT:
    return fsdp.apply_fsdp(net, comm=comm, ledger=ledger, manual=manual, layout=layout)


def _unobserved(call: str) -> None:
    """A training step watches nothing: :func:`manual_step`'s default observer."""


def _grads_arrived(u) -> None:
    """What the post-accumulate-grad hooks would report: the unit's full gradients are in."""
    for i in range(len(u.layout.grad_leaves())):
        u.on_grad_ready(i)


def manual_step(model: nn.Module, idx: torch.Tensor, targets: torch.Tensor,
                observe=_unobserved) -> torch.Tensor:
    """One training step of a GPT whose units were made with ``fully_shard(..., manual=True)``,
    every lifecycle call written out in the order the hooks make it. Returns the loss (detached).

    The root (embeddings, final norm, head) stays unsharded all step. Each block is unsharded for
    its forward and resharded after it, then unsharded again just before its own backward, its
    gradients reduce-scattered and resharded before the next block's. To run backward one block at
    a time, each block's input is cut from the graph (``detach().requires_grad_()``) and its
    backward fed the gradient the next block produced — the arithmetic is unchanged.
    ``observe(call)`` runs after each call (:func:`lifecycle_by_hand` snapshots there).
    """
    root, blocks = model._fsdp_unit, [b._fsdp_unit for b in model.blocks]
    root.unshard()
    observe("root.unshard()")
    emb = model.tok_emb(idx)                                       # (B, T, C)
    if model.pos_emb is not None:
        emb = emb + model.pos_emb.weight[:idx.shape[1]]
    h, cut = emb, []                                               # cut: (block input, output)
    for b, u in zip(model.blocks, blocks):
        first = u is blocks[0]     # once asynchronously: the split that prefetch is built on
        u.unshard(async_op=first)
        observe(f"{u.name}.unshard(async_op=True)" if first else f"{u.name}.unshard()")
        if first:
            u.wait_for_unshard()
            observe(f"{u.name}.wait_for_unshard()")
        a = h.detach().requires_grad_()
        h = b(a)                   # autograd keeps this block's full weights for backward...
        cut.append((a, h))
        observe(f"{u.name} forward")
        u.reshard()                # ...but their storage is freed now: 1/N stays
        observe(f"{u.name}.reshard()")
    top = h.detach().requires_grad_()
    logits = model.head(model.ln_f(top))                           # (B, T, V)
    loss = F.cross_entropy(logits.flatten(0, 1), targets.flatten())
    observe("root forward: loss")
    loss.backward()
    _grads_arrived(root)
    observe("loss.backward() (head, ln_f)")
    grad = top.grad
    for (a, h), u in reversed(list(zip(cut, blocks))):
        u.unshard()                # just in time, as the pre-backward hook does
        observe(f"{u.name}.unshard()")
        h.backward(grad)
        _grads_arrived(u)
        grad = a.grad
        observe(f"{u.name} backward")
        u.reduce_scatter_grads()   # sum the full gradients, keep this rank's shard
        observe(f"{u.name}.reduce_scatter_grads()")
        u.reshard()
        observe(f"{u.name}.reshard()")
    emb.backward(grad)             # the root's embeddings: the last gradients backward reaches
    _grads_arrived(root)
    observe("embeddings backward")
    root.reduce_scatter_grads()
    observe("root.reduce_scatter_grads()")
    root.reshard()
    observe("root.reshard()")
    return loss.detach()


def lifecycle_by_hand(rank, model: str = "nano", micro_batch: int = 2, seed: int = 0) -> dict:
    """One AdamW step of a GPT whose units were made with ``fully_shard(..., manual=True)``,
    every lifecycle call written out in the order the hooks would make it (:func:`manual_step`,
    watched after each call). The result is compared bitwise with the same step driven by hooks.

    Returns ``{"rows": [...], "loss": float, "matches_hooks": bool}``; each row is a snapshot
    after one call: unit states, the ledger by category, what the module holds as
    ``blocks[0].attn.qkv.weight`` and the bytes of the full tensor autograd saved for it.
    """
    cfg = config(model)
    tracer = rank.tracer
    tracer.step = 0
    ledger = LiveLedger(tracer)
    comm = Comm(tracer, ledger=ledger)
    net = _shard_model(GPT(cfg, seed=seed), comm, ledger, manual=True)
    opt = torch.optim.AdamW(net.parameters(), lr=1e-3, weight_decay=0.01)
    comm.reset_counters()
    snap = _Snapshots(net, tracer, ledger)
    x, y = batch(cfg, 0, micro_batch, rank.rank, rank.world_size)
    snap("(after fully_shard)")
    with ledger.activations():
        loss = manual_step(net, x, y, observe=snap)
    opt.step()
    track_optimizer_state(ledger, opt, net)
    opt.zero_grad(set_to_none=False)
    snap("optimizer.step() on the shards")
    by_hand = fsdp.full_parameters(net)

    # the same step driven by the hooks
    net2 = _shard_model(GPT(cfg, seed=seed), Comm(), None, manual=False)
    opt2 = torch.optim.AdamW(net2.parameters(), lr=1e-3, weight_decay=0.01)
    loss2 = net2(x, y)
    loss2.backward()
    opt2.step()
    by_hooks = fsdp.full_parameters(net2)
    tracer.step = None
    return {"rows": snap.rows, "loss": loss.item(),
            "matches_hooks": loss.item() == loss2.item()
            and all(torch.equal(by_hand[k], by_hooks[k]) for k in by_hooks)}


class _Snapshots:
    """After each lifecycle call, one row: the units' states, the ledger, what the module holds
    as ``blocks[0].attn.qkv.weight`` and the full tensor it computes with, the collectives the
    call issued."""

    def __init__(self, net: GPT, tracer, ledger: LiveLedger):
        self.net, self.tracer, self.ledger = net, tracer, ledger
        self.units = [net._fsdp_unit, *(b._fsdp_unit for b in net.blocks)]
        first = net.blocks[0]._fsdp_unit
        qkv = next(i for i, s in enumerate(first.layout.slots) if s.fqn == "attn.qkv.weight")
        self.qkv_full = first.layout.unsharded[qkv]
        self.rows: list[dict] = []
        self._seen = 0

    def __call__(self, call: str) -> None:
        new = [e for e in self.tracer.events[self._seen:] if e["kind"] == "collective"]
        self._seen = len(self.tracer.events)
        self.rows.append({"call": call,
                          "states": {u.name: u.memory_state.value for u in self.units},
                          "ledger": self.ledger.current(),
                          "qkv_shape": tuple(self.net.blocks[0].attn.qkv.weight.shape),
                          "qkv_full_bytes": self.qkv_full.untyped_storage().nbytes(),
                          "collectives": [f"{e['op']}({e['tag']})" for e in new]})


# --------------------------------------------------------------------------- 06: two layouts


def _padding_on(layout, rank: int) -> int:
    """Elements of padding this rank stores for one unit."""
    if layout.kind == "flat":
        have = max(0, min(layout.numel, (rank + 1) * layout.shard_numel) - rank * layout.shard_numel)
        return layout.shard_numel - have
    pad = 0
    for s, c, inner in zip(layout.slots, layout.rows, layout.inner):
        rows0 = s.shape[0] if len(s.shape) else 1
        have = max(0, min(rows0, (rank + 1) * c) - rank * c)
        pad += (c - have) * max(inner, 1)
    return pad


def layout_views(rank, model: str = "nano") -> dict:
    """For each layout: what ``named_parameters()`` and ``state_dict()`` show on this rank,
    the padding this rank stores, and the names :func:`fsdp.full_parameters` gathers back."""
    cfg = config(model)
    out = {}
    for layout in ("per_param", "flat"):
        net = _shard_model(GPT(cfg), Comm(), None, manual=True, layout=layout)
        us = fsdp.units(net)
        out[layout] = {
            "parameters": [(n, tuple(p.shape), str(p.dtype).replace("torch.", ""))
                           for n, p in net.named_parameters()],
            "state_dict": [(k, tuple(v.shape)) for k, v in net.state_dict().items()],
            "padding": {u.name: _padding_on(u.layout, rank.rank) for u in us},
            "stored": sum(p.numel() for p in net.parameters()),
            "full_names": list(fsdp.full_parameters(net)),
        }
    out["n_params"] = GPT(cfg, device="meta").num_params()
    return out


def padding_table(model: str, world_size: int) -> dict[str, list[int]]:
    """Padding elements each rank stores (summed over the units: every block and the root),
    per layout, for ``world_size`` ranks — computed by building the layouts on the meta
    device, no ranks needed."""
    from minishard.strategies.fsdp.layout import FlatLayout, PerParamLayout
    from minishard.strategies.fsdp.slots import collect_slots
    out = {}
    for kind in ("per_param", "flat"):
        net = GPT(model, device="meta")
        layouts = []
        for b in net.blocks:
            slots = collect_slots(b, {})
            layouts.append(PerParamLayout(slots, 0, world_size, None) if kind == "per_param"
                           else FlatLayout(slots, 0, world_size, None, b))
        taken = {id(t): "block" for lay in layouts for t in lay.shard_tensors()}
        slots = collect_slots(net, taken)
        layouts.append(PerParamLayout(slots, 0, world_size, None) if kind == "per_param"
                       else FlatLayout(slots, 0, world_size, None, net))
        out[kind] = [sum(_padding_on(lay, r) for lay in layouts) for r in range(world_size)]
    return out


def mixed_dtypes(rank, model: str = "nano") -> dict:
    """A block whose norms stay fp32 while its matmul weights are bf16, sharded both ways.
    Per-parameter: each shard keeps its dtype, and a gather gives back every value exactly.
    Flat: refused (one buffer has one dtype) — the error message is returned."""
    out = {}
    for layout in ("per_param", "flat"):
        net = GPT(config(model))
        b = net.blocks[0]
        for m in b.modules():
            if isinstance(m, nn.Linear):
                m.to(torch.bfloat16)
        before = {n: p.detach().clone() for n, p in b.named_parameters()}
        try:
            fsdp.fully_shard(b, comm=Comm(), manual=True, layout=layout, name="blocks.0")
        except ValueError as e:
            out[layout] = {"error": str(e)}
            continue
        u = b._fsdp_unit
        shards = {s.fqn: (str(t.dtype).replace("torch.", ""), tuple(t.shape))
                  for s, t in zip(u.layout.slots, u.layout.shard_tensors())}
        u.unshard()
        after = dict(zip([s.fqn for s in u.layout.slots], u.layout.full_values()))
        exact = all(after[n].dtype == before[n].dtype and torch.equal(after[n], before[n])
                    for n in before)
        u.reshard()
        out[layout] = {"shards": shards, "gather_exact": exact}
    return out


# --------------------------------------------------------------------------- views of a trace


def lifecycle_order(events: list[dict], rank: int = 0, step: int | None = None) -> list[str]:
    """The unit state changes and collectives of ``rank`` (in ``step``), in the order they
    happened — collectives at the moment they were issued — with ``FORWARD`` / ``BACKWARD`` /
    ``OPTIMIZER`` where those phases begin. Set-up broadcasts are left out."""
    evs = [e for e in events if e["rank"] == rank and (step is None or e.get("step") == step)
           and e["kind"] in ("unit", "collective", "phase")]
    evs.sort(key=lambda e: (e["t"], e["seq"]))       # a collective's event carries its start time
    out = []
    for e in evs:
        if e["kind"] == "unit":
            out.append(f"{e['name']}:{e['state']}")
        elif e["kind"] == "collective" and e["tag"] != "replicate":
            out.append(f"{e['op']}({e['tag']})")
        elif e["kind"] == "phase" and e["name"] in ("forward", "backward", "optimizer") \
                and e["edge"] == "begin" and not e.get("unit"):
            out.append(e["name"].upper())
    return out


def unit_state_figure(events: list[dict], rank: int = 0, step: int | None = None, title: str = ""):
    """One row per unit, time across: when it was gathering, gathered, reduce-scattering
    (blank: sharded). Forward and backward phases are shaded behind."""
    import plotly.graph_objects as go

    from minishard.viz.figures import UNIT_STATE_COLORS
    evs = [e for e in events if e["rank"] == rank and (step is None or e.get("step") == step)]
    order = list(dict.fromkeys(e["name"] for e in evs if e["kind"] == "unit"))
    spans = unit_spans(evs)
    fig = go.Figure()
    for st, col in UNIT_STATE_COLORS.items():
        ss = [s for s in spans if s.state == st]
        fig.add_trace(go.Bar(name=st, orientation="h", y=[s.unit for s in ss],
                             base=[s.t0 * 1e3 for s in ss], x=[(s.t1 - s.t0) * 1e3 for s in ss],
                             marker_color=col, width=0.6))
    for p in phase_spans(evs):
        if p.name in ("forward", "backward"):
            fig.add_vrect(x0=p.t0 * 1e3, x1=p.t1 * 1e3, opacity=0.08, line_width=0,
                          fillcolor="#4C78A8" if p.name == "forward" else "#F58518",
                          annotation_text=p.name, annotation_position="top left")
    fig.update_layout(barmode="overlay", title=title, xaxis_title="time (ms)", height=120 + 40 * len(order),
                      width=900, yaxis=dict(categoryorder="array", categoryarray=order[::-1]),
                      margin=dict(l=90, r=10, t=50, b=40))
    return fig
