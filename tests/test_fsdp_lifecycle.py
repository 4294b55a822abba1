"""Corners of the FSDP lifecycle that a parity run does not reach: a root whose input carries a
gradient, a recomputation inside backward, the bytes each collective's buffers enter the ledger
at, and the name a checkpoint records for each layout."""
import pytest
import torch

from minishard.strategies import fsdp
from minishard.core.comm import Comm
from minishard.strategies.fsdp import hooks
from minishard.strategies.fsdp.state import MemoryState, TrainingState
from minishard.core.ledger import LiveLedger
from minishard.core.model import GPT, batch, config
from minishard.strategies import layout_name
from minishard.core.trace import Tracer

from chain import Chain


def _at_rest(net) -> set:
    return {(u.training_state, u.memory_state) for u in fsdp.units(net)}


def test_a_root_whose_input_needs_a_gradient_ends_every_backward():
    """Here the root's own post-backward runs from its identity node (its input carries a
    gradient), so the end of backward finds no unit left to reduce: it must still end, and be
    queued again, every step — each unit back to IDLE and SHARDED after each backward."""
    net = fsdp.apply_fsdp(Chain(), comm=Comm())
    for _ in range(3):
        x = torch.ones(2, 8, requires_grad=True)
        net(x).backward()
        assert _at_rest(net) == {(TrainingState.IDLE, MemoryState.SHARDED)}
        assert x.grad is not None


def test_a_recomputation_makes_no_second_post_backward_node(monkeypatch):
    """Activation checkpointing runs each block's forward again inside backward: that forward
    unshards, but registers nothing — one post-backward node per unit per step."""
    made = []
    apply = hooks._RegisterPostBackward.apply
    monkeypatch.setattr(hooks._RegisterPostBackward, "apply",
                        lambda unit, *args: (made.append(unit.name), apply(unit, *args))[1])
    net = fsdp.apply_fsdp(GPT("nano"), comm=Comm())
    net.recompute_activations = True
    x, y = batch(config("nano"), 0, 2, 0, 1)
    for _ in range(2):
        made.clear()
        net(x, y).backward()
        assert sorted(made) == sorted(u.name for u in fsdp.units(net)), made
        assert _at_rest(net) == {(TrainingState.IDLE, MemoryState.SHARDED)}


@pytest.mark.parametrize("layout,dtype", [("per_param", torch.float32), ("per_param", torch.bfloat16),
                                          ("flat", torch.float32), ("flat", torch.bfloat16)])
def test_the_collectives_buffers_enter_the_ledger_at_their_bytes(layout, dtype):
    """Per unit and step: the all-gather's packed buffer (per-parameter layout only: the flat one
    gathers into its full buffer), the reduce-scatter's packed gradients and its output — each
    at elements times the element size of the dtype it travels in."""
    tracer = Tracer()
    ledger = LiveLedger(tracer)
    policy = fsdp.MixedPrecisionPolicy(param_dtype=dtype if dtype is not torch.float32 else None)
    net = fsdp.apply_fsdp(GPT("nano"), comm=Comm(tracer, ledger=ledger), ledger=ledger,
                          layout=layout, mp_policy=policy)
    x, y = batch(config("nano"), 0, 2, 0, 1)
    net(x, y).backward()
    allocs = {e["tag"]: e["bytes"] for e in tracer.events if e["kind"] == "alloc"}
    size = dtype.itemsize
    for u in fsdp.units(net):
        lay = u.layout
        assert allocs[f"{u.name}:rs"] == lay.N * lay.per_rank * size, u.name
        assert allocs[f"{u.name}:rs_out"] == lay.per_rank * size, u.name
        if layout == "per_param":
            assert allocs[f"{u.name}:ag"] == lay.N * lay.per_rank * size, u.name
        else:
            assert f"{u.name}:ag" not in allocs
        for buffer in (":ag", ":rs", ":rs_out"):
            assert not ledger.is_live(u.name + buffer), f"{u.name}{buffer} never freed"


def test_each_layout_is_recorded_by_its_registry_name():
    """What a checkpoint calls each layout: a strategy's name from the registry, one per layout."""
    assert layout_name(0, 1) == "single" and layout_name(0, 4) == "ddp"
    assert layout_name(1, 4) == "zero1" and layout_name(2, 4) == "zero2"
    assert layout_name(3, 4) == "fsdp" and layout_name(3, 4, shard_size=4) == "fsdp"
    assert layout_name(3, 4, flat=True) == "fsdp_flat"
    assert layout_name(3, 4, shard_size=2) == "hsdp"
    assert layout_name(3, 4, flat=True, shard_size=2) == "hsdp"      # shards in groups, either way


def test_an_optimizer_step_while_a_reduction_is_in_flight_is_refused():
    """A step taken from inside backward (a hook on the input's gradient, as optimizer-in-backward
    recipes do) finds the root still REDUCE_SCATTERING: its shards' reduced gradients have not
    landed. Stepping then would update the head with gradients that are not yet the sum over
    ranks; the step must refuse, change nothing, and work once backward is over."""
    torch.manual_seed(0)
    net = fsdp.apply_fsdp(Chain(), comm=Comm())
    opt = fsdp.ShardedOptimizer(net, torch.optim.SGD(net.parameters(), lr=0.1))
    before = {n: p.detach().clone() for n, p in net.named_parameters()}
    refused = []

    def step_in_backward(grad):
        with pytest.raises(RuntimeError, match="root is reduce_scattering") as e:
            opt.step()
        refused.append(str(e.value))

    x = torch.ones(2, 8, requires_grad=True)
    x.register_hook(step_in_backward)
    net(x).backward()
    assert len(refused) == 1, refused
    assert all(torch.equal(p, before[n]) for n, p in net.named_parameters())
    assert _at_rest(net) == {(TrainingState.IDLE, MemoryState.SHARDED)}
    opt.step()                                  # after backward: every unit holds its shard
    assert not any(torch.equal(p, before[n]) for n, p in net.named_parameters())


def test_adam_state_made_ahead_for_offload_starts_at_step_0():
    """With offload, ``ShardedOptimizer`` creates Adam's moments in the tier before the first step.
    They must be exactly what a first step would make — zero moments and a step count of 0 — so
    the first step is Adam's first: bias-corrected, it moves every weight by lr against the sign
    of its gradient (|g| far above eps). A count starting at 1 would shrink that move to ~0.74 lr
    and leave every later bias correction one step off."""
    from minishard.strategies.offload import CPUOffloadPolicy
    LR = 1e-2
    torch.manual_seed(0)
    net = fsdp.apply_fsdp(Chain(), comm=Comm(), offload_policy=CPUOffloadPolicy())
    opt = fsdp.ShardedOptimizer(net, torch.optim.AdamW(net.parameters(), lr=LR, weight_decay=0.0))
    assert all(set(opt.state[p]) == {"step", "exp_avg", "exp_avg_sq"} for p in net.parameters())
    net(torch.ones(2, 8)).backward()
    before = {n: p.detach().clone() for n, p in net.named_parameters()}
    grads = {n: p.grad.detach().clone() for n, p in net.named_parameters()}
    opt.step()
    for n, p in net.named_parameters():
        assert grads[n].abs().min() > 1e-4, n            # eps (1e-8) cannot matter
        moved = before[n] - p.detach()
        # lr * sign(g), to fp32 rounding of the weights (|w| < 1: ulp ~6e-8, far below 1e-3 lr)
        assert (moved - LR * grads[n].sign()).abs().max() <= 1e-3 * LR, n
        assert opt.state[p]["step"] == 1, n
