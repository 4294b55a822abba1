"""What would you change? The planner's advice for one configuration, in words.

When a plan does not fit, the advice walks the OOM checklist in its order — wrap granularity and
prefetch depth (how many full parameters are gathered at once), activation recomputation, the
big logits tensor, sharding more, more nodes, activations that sharding cannot shrink, and
offload as a last resort. When it fits, it asks the throughput questions: does the step wait
for the network (and would hybrid sharding help), would a simpler strategy be as fast, is
offload or recomputation costing time for nothing. Every figure in a sentence is a
:func:`minishard.planner.costmodel.plan` of the changed configuration; nothing is estimated here.

The planner widget (chapter 10) and ``python -m minishard plan`` print the same sentences::

    a = Advice("llama3-8b", Cluster(...), "zero1", micro_batch=1, seq_len=8192)
    a.hints()        # ['Shard more: ZeRO-2 needs 61.3 GiB per GPU.', ...]
"""
from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Callable

from minishard import strategies
from .costmodel import UNMODELLED, Cluster, Plan, logits_bytes, plan, warnings
from minishard.core.model import GPTConfig, config

GiB = 2**30
PLANNED = strategies.PLANNED                     # one per ZeRO stage, from least to most sharded
LABELS = {name: strategies.get(name).label for name in PLANNED}   # the registry's short names


def _gib(b: float) -> str:
    return f"{b / GiB:.1f} GiB"


def _tight(p: Plan) -> str:
    """The same warning for a suggestion as for the current plan (:func:`costmodel.warnings`)."""
    return f" — {p.device_share:.0%} of the device, and the plan leaves out {UNMODELLED}" if p.tight else ""


@dataclass(frozen=True)
class Advice:
    """One configuration of the planner (the arguments of :func:`costmodel.plan`) and the
    advice for it. ``planner`` computes a plan from the same arguments; the widget passes a
    memoised one, so a slider move that comes back costs nothing."""
    model: str | GPTConfig
    cluster: Cluster
    strategy: str
    micro_batch: int = 1
    seq_len: int | None = None
    prefetch: int = 1
    recompute: bool = True
    offload: str | None = None           # the tier, as costmodel.plan names it: "host" or None
    hybrid: bool = False
    mfu: float = 0.4
    wrap: str = "block"
    precision: str | None = None
    planner: Callable[..., Plan] = field(default=plan, repr=False, compare=False)

    def plan_for(self, strategy: str, **changes) -> Plan:
        """The plan of ``strategy`` with this configuration, some of it changed (e.g.
        ``recompute=False``). Raises ValueError for a configuration the planner refuses."""
        s = dict(micro_batch=self.micro_batch, seq_len=self.seq_len, prefetch=self.prefetch,
                 recompute=self.recompute, offload=self.offload, hybrid=self.hybrid,
                 mfu=round(self.mfu, 4), wrap=self.wrap, precision=self.precision)
        s.update(changes)
        cluster = s.pop("cluster", self.cluster)
        if strategies.get(strategy).stage < 3:         # only FSDP has units
            s["prefetch"], s["wrap"] = 0, "block"
        return self.planner(self.model, cluster, strategy, **s)

    def _gain(self, strategy: str, **changes) -> Plan | None:
        try:
            return self.plan_for(strategy, **changes)
        except ValueError:
            return None

    def hints(self) -> list[str]:
        """Short suggestions: the OOM checklist, in its order, when the plan does not fit; the
        throughput questions, then :func:`costmodel.warnings`, when it does."""
        try:
            p = self.plan_for(self.strategy)
        except ValueError:
            return ["Fewer GPUs, or a bigger model: the planner refuses this shape."]
        if not p.fits:
            out = [h for h in (self._hint_units(p), self._hint_recompute(p), self._hint_logits(p),
                               self._hint_shard_more(p), self._hint_more_nodes(p),
                               self._hint_activations(p), self._hint_offload(p)) if h]
            return out or ["Nothing here is left to shard: more GPUs, or a smaller configuration."]
        out = [h for h in (self._hint_network(p), self._hint_simpler(p), self._hint_no_offload(p),
                           self._hint_no_recompute(p)) if h] + warnings(p)
        return out or ["Nothing to change: it fits and the network is hidden behind compute."]

    # ---- the OOM checklist, in its order
    def _hint_units(self, p: Plan) -> str | None:
        """Wrap granularity, then prefetch depth: how many full parameters are gathered at once."""
        if strategies.get(self.strategy).stage < 3:
            return None
        if self.wrap == "model":
            alt = self._gain(self.strategy, wrap="block")
            if alt is not None:
                return (f"Wrap granularity: one unit gathers the whole model "
                        f"({_gib(p.memory['unsharded'])}); one unit per block needs "
                        f"{_gib(alt.total_memory)} per GPU.")
        elif self.prefetch > 1:
            alt = self._gain(self.strategy, prefetch=1)
            if alt is not None:
                return (f"Prefetch depth {self.prefetch} keeps {self.prefetch} blocks gathered "
                        f"ahead; depth 1 needs {_gib(alt.total_memory)}.")
        return None

    def _hint_recompute(self, p: Plan) -> str | None:
        alt = None if self.recompute else self._gain(self.strategy, recompute=True)
        if alt is None:
            return None
        return (f"Activations are {_gib(p.memory.get('activations', 0))}: recomputation "
                f"needs {_gib(alt.total_memory)}, for one more forward pass "
                f"({alt.step_s / p.step_s - 1:+.0%} step time).")

    def _hint_logits(self, p: Plan) -> str | None:
        cfg = config(self.model) if isinstance(self.model, str) else self.model
        logits = logits_bytes(cfg, self.micro_batch, self.seq_len or cfg.seq_len)
        if logits < 0.03 * p.device_memory:
            return None
        return (f"The [batch, seq, vocab] logits the loss keeps are {_gib(logits)}: a "
                f"chunked loss (loss_chunk_tokens) keeps one chunk at a time.")

    def _hint_shard_more(self, p: Plan) -> str | None:
        for bigger in PLANNED[PLANNED.index(self._planned) + 1:]:
            alt = self._gain(bigger)
            if alt is not None and alt.fits:
                return f"Shard more: {LABELS[bigger]} needs {_gib(alt.total_memory)} per GPU{_tight(alt)}."
        return None

    def _hint_more_nodes(self, p: Plan) -> str | None:
        c = self.cluster
        more = self._gain(self.strategy, cluster=replace(c, nodes=2 * c.nodes))
        if more is None or not more.fits:
            return None
        return f"Twice the nodes ({2 * c.world_size} GPUs): {_gib(more.total_memory)} per GPU{_tight(more)}."

    def _hint_activations(self, p: Plan) -> str | None:
        acts = p.memory.get("activations", 0)
        if acts <= 0.25 * p.device_memory:
            return None
        return (f"Activations ({_gib(acts)}) do not shrink with more data-parallel GPUs: "
                f"a shorter micro-batch or sequence, or tensor/sequence parallelism, "
                f"which splits each layer's activations.")

    def _hint_offload(self, p: Plan) -> str | None:
        alt = None if self.offload else self._gain(self.strategy, offload="host")
        if alt is None or not alt.fits:
            return None
        return (f"CPU offload fits ({_gib(alt.total_memory)}{_tight(alt)}) but adds "
                f"{alt.offload_pcie_s + alt.offload_cpu_s:.2f} s per step ({alt.offload_pcie_s:.2f} s "
                f"of PCIe, {alt.offload_cpu_s:.2f} s of CPU Adam on the host's shared memory): a last resort.")

    # ---- the throughput questions
    def _hint_network(self, p: Plan) -> str | None:
        if p.exposed_share <= 0.15:
            return None
        msg = f"{p.exposed_share:.0%} of the step waits for the network."
        alt = (self._gain(self.strategy, hybrid=True)
               if self.cluster.nodes > 1 and not self.hybrid else None)
        if alt is not None and alt.fits:
            msg += (f" Hybrid sharding keeps the sharding collectives inside a node: "
                    f"{alt.exposed_share:.0%} waiting, {_gib(alt.total_memory)} per GPU{_tight(alt)}.")
        return msg

    def _hint_simpler(self, p: Plan) -> str | None:
        for simpler in PLANNED[:PLANNED.index(self._planned)]:
            alt = self._gain(simpler)
            if alt is not None and alt.fits and alt.step_s <= 1.03 * p.step_s:
                speed = "faster" if alt.step_s < 0.97 * p.step_s else "about as fast"
                return (f"{LABELS[simpler]} fits too ({_gib(alt.total_memory)}{_tight(alt)}) and is {speed} "
                        f"({alt.step_s:.2f} s a step against {p.step_s:.2f} s): a simpler system.")
        return None

    def _hint_no_offload(self, p: Plan) -> str | None:
        alt = self._gain(self.strategy, offload=None) if self.offload else None
        if alt is None or not alt.fits:
            return None
        return (f"Offload is not needed: without it {_gib(alt.total_memory)} fit{_tight(alt)} and the "
                f"step is {p.step_s - alt.step_s:.2f} s shorter.")

    def _hint_no_recompute(self, p: Plan) -> str | None:
        alt = self._gain(self.strategy, recompute=False) if self.recompute else None
        if alt is None or not alt.fits or alt.step_s >= 0.97 * p.step_s:
            return None
        return (f"It fits without recomputation too ({_gib(alt.total_memory)}{_tight(alt)}): "
                f"{1 - alt.step_s / p.step_s:.0%} less time per step.")

    @property
    def _planned(self) -> str:
        """The strategy's place among the planned ones (its ZeRO stage: ``zero3`` is ``fsdp``)."""
        return PLANNED[strategies.get(self.strategy).stage]
