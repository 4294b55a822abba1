"""Failures planted on purpose: the bugs people hit with sharded training, reproduced on real ranks
(chapter 11, ``demo --fault NAME --fault-rank R``) so that the flight recorder and the doctor
can be seen to catch them.

    skip-collective  rank R skips the gradient reduction of the last step, and every collective
                     after it — a rank-dependent early exit (under FSDP1, a rank whose shard
                     holds only frozen LoRA base weights returning early from the optimizer).
                     The others wait in it until the collective timeout.
    reorder          rank R's forward gathers blocks.1 before blocks.0 (its prefetch list says
                     so; the others gather in order). The two units are the same size, so the
                     gathers pair up across units and nothing hangs: the model is silently wrong.
    unsynced-init    rank R builds its model from another seed, and the strategy does not make
                     the ranks start from rank 0's weights (as FSDP2's ``fully_shard`` does not).
    no-master        the weights are bfloat16 and the optimizer steps them: no fp32 master copy,
                     so an update smaller than half a bf16 step is rounded away.
    local-clip       the gradient norm's all-reduce is skipped on every rank: each clips by the
                     norm of its own gradient shards, not the global norm.
    extra-collective rank R issues one all-reduce of 4 elements the others do not (a branch on its
                     own data), just before the last step's first gradient all-reduce. The others'
                     all-reduce pairs with it; gloo finds the sizes differ and aborts every process
                     in C++, where no Python handler runs: only the flight recorder's ring is left.

The engine knows none of this. ``train(rank, config, hooks=Fault("reorder"))`` hands the run a
:class:`Fault`, a :class:`~minishard.training.hooks.RunHooks`: it wraps the object that would make
the mistake — a communicator subclass that never issues some collectives or never broadcasts
the starting weights, the weights of one rank built again from another seed or cast to bf16,
the prefetch list of one rank's root — and the loop calls it without knowing why.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from minishard import strategies
from minishard.core.comm import Comm
from minishard.strategies.clipping import NORM_TAG
from minishard.training.config import ConfigError
from minishard.training.hooks import RunHooks

FAULTS = {
    "skip-collective": "rank R skips the last step's gradient reduction and every collective after it",
    "reorder": "rank R's forward gathers blocks.1 before blocks.0 (FSDP)",
    "unsynced-init": "rank R starts from other weights and no rank broadcasts rank 0's",
    "no-master": "bf16 weights stepped in bf16: no fp32 master",
    "local-clip": "every rank clips by the norm of its own gradient shards",
    "extra-collective": "rank R issues one all-reduce of 4 elements the others do not",
}
EXTRA_NUMEL = 4
# the gradient collectives a rank with nothing to reduce would skip
REDUCTIONS = ("all_reduce", "reduce_scatter")
GRADIENT_PHASES = ("backward", "sync_gradients")     # (naive DDP reduces after backward)


class FaultyComm(Comm):
    """A communicator that never issues the collectives ``skip(op, tag, step, phase)`` names (no
    flight entry, no event, no bytes: what a rank that skipped them leaves), issues one all-reduce
    of its own before the one ``extra(op, tag, step, phase)`` names, and — ``synced_start`` False —
    never broadcasts rank 0's starting weights. Its subgroups are of its kind, with the same
    predicates: a rank misbehaves in every group at once."""

    skip = None
    extra = None
    synced_start = True

    def _sibling(self, group, name: str, *, alone: bool = False) -> Comm:
        twin = super()._sibling(group, name, alone=alone)
        twin.skip, twin.extra, twin.synced_start = self.skip, self.extra, self.synced_start
        return twin

    def all_reduce(self, tensor, *, async_op: bool = False, tag: str = ""):
        tr = self.tracer
        step, phase = (tr.step, tr.current_phase) if tr is not None else (None, None)
        if self.extra is not None and self.extra("all_reduce", tag, step, phase):
            the_branch_only_this_rank_takes(self)
        return super().all_reduce(tensor, async_op=async_op, tag=tag)


    def _begin(self, op, tensor, nbytes, tag, **extra) -> dict:
        tr = self.tracer
        step, phase = (tr.step, tr.current_phase) if tr is not None else (None, None)
        if self.skip is not None and self.skip(op, tag, step, phase):
            return {"_skipped": True}
        return super()._begin(op, tensor, nbytes, tag, **extra)

    def _record(self, ev: dict) -> None:
        if not ev.get("_skipped"):
            super()._record(ev)

    def _run(self, ev: dict, launch, async_op: bool, finish=None):
        # a skipped collective runs as in a world of one: its local part only (finish), nothing sent
        return super()._run(ev, (lambda: None) if ev.get("_skipped") else launch, async_op, finish)

    def broadcast_from_rank0(self, tensors, ledger=None) -> None:
        tensors = list(tensors)
        if not self.synced_start and self.world_size > 1 and tensors:
            self.flight.facts.setdefault("start_not_replicated", []).append(len(tensors))
            return                                # each rank keeps its own weights
        super().broadcast_from_rank0(tensors, ledger)


def the_branch_only_this_rank_takes(comm: Comm) -> None:
    """``extra-collective``'s call: a line of its own, which the flight recorder names as the
    collective's call site (a communicator's methods never are)."""
    comm.all_reduce(torch.zeros(EXTRA_NUMEL), tag="extra")


@dataclass(frozen=True)
class Fault(RunHooks):
    """One failure of ``FAULTS``, planted on rank ``rank`` (``local-clip``: on every rank)."""

    name: str
    rank: int = 1

    def __post_init__(self):
        if self.name not in FAULTS:
            raise ConfigError("{fault}: unknown fault; expected one of " + ", ".join(FAULTS), fault=self.name)
        if isinstance(self.rank, bool) or not isinstance(self.rank, int) or self.rank < 0:
            raise ConfigError("{fault_rank}: must be a rank (an integer >= 0)", fault_rank=self.rank)

    def comm(self, tracer, ledger, alone: bool) -> Comm:
        comm = FaultyComm(tracer, ledger=ledger, alone=alone)
        comm.synced_start = self.name != "unsynced-init"      # before any strategy broadcasts
        return comm

    def check(self, config, world_size: int | None = None) -> None:
        """Refuse a fault this run cannot have — its strategy, its model, its world — naming why."""
        fault, strategy = self.name, strategies.get(config.strategy)
        if world_size is not None and not 0 <= self.rank < world_size:
            raise ConfigError("{fault_rank}: no such rank in a world of %d" % world_size, fault_rank=self.rank)
        if strategy.single_process:
            raise ConfigError("{fault} needs ranks that disagree: not {strategy}", fault=fault,
                              strategy=strategy.name)
        if fault in ("skip-collective", "local-clip") and not strategy.instrumented:
            raise ConfigError("{fault} is planted in minishard's communicator; {strategy} is PyTorch's "
                              "own and does not use it: choose one of minishard's strategies",
                              fault=fault, strategy=strategy.name)
        if fault == "unsynced-init" and not strategy.instrumented and strategy.stage < 3:
            raise ConfigError("{fault} cannot be planted under {strategy}: PyTorch's DDP broadcasts "
                              "rank 0's weights in its constructor (rank_seeds shows it making them "
                              "equal); FSDP2 (torch_fsdp) does not", fault=fault, strategy=strategy.name)
        if fault == "reorder" and (strategy.stage != 3 or config.wrap != "block"):
            raise ConfigError("{fault} swaps two blocks' all-gathers: it needs an FSDP strategy with "
                              "one unit per block ({wrap})", fault=fault, wrap="block")
        if fault == "reorder" and config.model_config().n_layer < 2:
            raise ConfigError("{fault} swaps blocks.0 and blocks.1: {model}%s has one block"
                              % (" with its model_overrides" if config.model_overrides else ""),
                              fault=fault, model=config.model)
        if fault == "local-clip":
            if config.clip is None:
                raise ConfigError("{fault} plants a wrong gradient clip: set {clip}", fault=fault, clip=...)
            if strategy.stage == 0:
                raise ConfigError("{fault}: under {strategy} every rank holds the whole gradient, so its "
                                  "own norm is the global one; choose a ZeRO or FSDP strategy",
                                  fault=fault, strategy=strategy.name)
        if fault == "extra-collective" and (not strategy.instrumented or strategy.stage != 0):
            raise ConfigError("{fault} pairs its all-reduce with the gradients' all-reduce of DDP: "
                              "choose ddp or ddp_naive, not {strategy}", fault=fault, strategy=strategy.name)
        if fault == "no-master" and config.precision != "fp32":
            raise ConfigError("{fault} trains bf16 weights without a master; {precision} keeps one: "
                              "drop it", fault=fault, precision=config.precision)

    def model(self, net: torch.nn.Module, config, rank: int) -> torch.nn.Module:
        if self.name == "unsynced-init" and rank == self.rank:
            net.reset_parameters(config.seed + 1)      # another seed than every other rank's
        if self.name == "no-master":
            net.to(torch.bfloat16)                     # the weights are the bf16 copy
        return net

    def wrapped(self, built, config, rank: int) -> None:
        if self.name != "reorder" or rank != self.rank:
            return
        blocks = list(built.model.blocks)      # (at least two: check() saw the model)
        if built.strategy.instrumented:
            from minishard.strategies.fsdp import set_modules_to_forward_prefetch
            set_modules_to_forward_prefetch(built.model, [blocks[1], blocks[0]])
        else:                                  # FSDP2: the same list, on its own API
            built.model.set_modules_to_forward_prefetch([blocks[1], blocks[0]])

    def starting(self, comms, config, rank: int, first_step: int, last_step: int) -> None:
        """Arm the communicators for the steps ahead; note the fault where the doctor reads the run."""
        skip, extra = self.skip(rank, last_step), self.extra(rank, last_step)
        for c in comms:
            if isinstance(c, FaultyComm):
                c.skip, c.extra = skip, extra
        for c in comms:
            if "run" in c.flight.facts:
                c.flight.facts["run"].update(fault=self.name, fault_rank=self.rank)

    def skip(self, rank: int, last_step: int):
        """The communicator's ``skip(op, tag, step, phase)`` on ``rank``: which collectives it never
        issues (None: none)."""
        if self.name == "local-clip":
            return lambda op, tag, step, phase: tag == NORM_TAG
        if self.name != "skip-collective" or rank != self.rank:
            return None
        skipping = []

        def skipped(op, tag, step, phase) -> bool:
            if not skipping and step == last_step and phase in GRADIENT_PHASES and op in REDUCTIONS:
                skipping.append((op, tag))
            return bool(skipping)
        return skipped

    def extra(self, rank: int, last_step: int):
        """The communicator's ``extra(op, tag, step, phase)`` on ``rank``: before which collective it
        issues the all-reduce the others do not — the last step's first gradient all-reduce,
        once (None: never)."""
        if self.name != "extra-collective" or rank != self.rank:
            return None
        done = []

        def before(op, tag, step, phase) -> bool:
            if done or step != last_step or phase not in GRADIENT_PHASES or op != "all_reduce":
                return False
            done.append(tag)
            return True
        return before
