"""Watch a training job in minishard's trace: PyTorch's own DDP, ZeroRedundancyOptimizer and FSDP2,
DeepSpeed's engine — and minishard's own strategies — with two lines in anyone's script, on every
rank::

    with minishard.watch(model, optimizer, trace="traces/mine") as w:
        for x, y in loader:
            loss = model(x, y); loss.backward(); optimizer.step(); optimizer.zero_grad()
            w.step()

``python -m minishard view traces/mine`` then replays it as it replays minishard's own runs.

Supported, on gloo: torch's ``DistributedDataParallel`` (any ``torch.optim`` optimizer, or a
``ZeroRedundancyOptimizer``), FSDP2 ``fully_shard`` (any wrapping, ``reshard_after_forward``
True or False, ``MixedPrecisionPolicy``), DeepSpeed's engine (``deepspeed.initialize``, ZeRO
stages 0–3, ``offload_optimizer``: ``with minishard.watch(engine, optimizer, trace=DIR)``, the
loop ``engine.backward(loss); engine.step()``), and minishard's ``DDP`` / ``ZeroOptimizer`` /
``fully_shard``. Not yet: NCCL timing (times are taken on the host), FSDP2's
``reshard_after_forward=int`` (drawn as ``sharded``), a DDP that already has a comm hook, FSDP2
modules with several parameter groups. Each rank streams ``rank{r}.jsonl`` (``trace.py``), a
line per event as it happens: a rank that dies leaves a trace readable to its last event.

The instruments, measured in docs/watch-spike.md, one file each:

* ``session.py`` — the watch itself: checks first (wrapper, process group, trace file: every
  rank fails together, before anything is patched), then the **phases** (the root's forward
  pre-hook begins ``step`` and ``forward``, its forward hook ``backward``, the optimizer's step
  pre-hook ``optimizer``; ``w.step()`` ends the step) and **memory** by the ledger's categories,
  in storage bytes, each storage once, freed when it dies (``weakref.finalize``). *Exact*:
  ``params`` (FSDP2: the local shards, padding included), ``unsharded`` (the gathered parameters
  a unit holds), ``comm_buffers``, ``exp_avg``/``exp_avg_sq``/``momentum`` (the ``step`` counters
  are left out, as minishard's ledger leaves them). *Approximate* (their tags say ``approx``):
  ``grads`` (DDP: each ``.grad`` storage when autograd accumulates it; FSDP2: the reduce-scatter
  output the sharded gradients are views of — the unsharded gradients before it are missing)
  and ``activations`` (what autograd saves, minishard's rule, minus parameters and gathered
  parameters, freed when autograd lets go).
* ``fsdp2.py`` — FSDP2's collectives through subclasses of its default all-gather and
  reduce-scatter (public setters), tag = the unit's module name, and its units' states from
  its parameter groups' memory-state changes.
* ``ddp.py`` — DDP's buckets through a comm hook around DDP's own ``allreduce_hook``.
* ``deepspeed.py`` — DeepSpeed's engine: its communication backend's collectives, what its ZeRO
  optimizer holds (term by term, as ``planner.deepspeed_estimator.deepspeed_holdings`` counts
  it), stage 3's fetched submodules as units; DeepSpeed's internals in this one adapter.
* ``calls.py`` — everything else (ZeRO's broadcasts, a user's own collectives): wrappers on
  ``torch.distributed``'s Python functions, quiet while a hook above records the same call.
* ``own.py`` — minishard's own strategies record every collective, unit state and byte
  themselves; the watch lends them its tracer.

A collective's ``payload`` follows minishard's convention (the reduced, or the whole
gathered/scattered buffer) and ``wire`` is what this rank sends **by the ring model**
(``comm.ring_wire_bytes``, as minishard's comm layer counts it; gloo runs a reduce-scatter as a
full all-reduce, twice that). What C++ issues alone (DDP's bucket-rebuild broadcasts) is not seen.

What ``watch`` patches it patches on the objects it is given and restores on exit; the
``torch.distributed`` wrappers live only inside the ``with``. DDP's exception: a DDP model keeps
its one comm hook for good, so after exit it stays, doing DDP's default ``allreduce_hook`` and
recording nothing. Engine code: it never imports ``minishard.course`` or ``minishard.viz``.
"""
from __future__ import annotations

import os

import torch

from minishard.core.trace import Tracer
from minishard.instruments.replicas import EVERY
from .session import SUPPORTED, Watch, WatchError

__all__ = ["watch", "Watch", "WatchError", "SUPPORTED"]


def watch(model: torch.nn.Module, optimizer=None, *,
          trace: str | os.PathLike | Tracer | None = None, flight=None,
          built: dict[str, str] | None = None, fingerprint_every: int | None = EVERY) -> Watch:
    """Watch a training job; see this package's docstring.

    ``trace``: a directory (``rank{r}.jsonl`` is streamed into it), a :class:`Tracer` (e.g. a
    ``Ranks`` task's ``rank.tracer``), or None (the events stay in ``w.tracer.events``).
    ``flight``: the :class:`~minishard.core.flight.FlightRecorder` to keep torch's collectives in
    (one of its own if None; a trace directory gets its dump). ``built``: the weights as this
    rank built them, ``minishard.fingerprint(model)`` taken *before* ``fully_shard`` — FSDP2
    broadcasts nothing and then holds shards, different by design, so only this fingerprint lets
    the doctor tell ranks that built different models apart. ``fingerprint_every``: every
    K-th step (``step % K == 0``) and after the last, the watch's own flight recorder notes the
    fingerprints of the parameters each rank holds as a replica, and the optimizer's settings
    and step count (``instruments/replicas.py``); None: after the last step only. The doctor
    names the first step at which a rank's replica differs, and why."""
    return Watch(model, optimizer, trace, flight, built, fingerprint_every)
