"""The planner widget: which strategy on which cluster — and what would you change?

A widget over :func:`minishard.costmodel.plan`. Pick a model (tiny … llama3-405b), a cluster
(device, GPUs per node, nodes, the link inside a node and between nodes), a strategy and its
knobs (wrapping, prefetch depth, activation recomputation, CPU offload, hybrid sharding), a
micro-batch, a sequence length and a model-FLOPs utilisation (MFU). It draws, for all four
strategies side by side:

* the memory of one GPU by ledger category, against a line at the device's memory;
* the step time, split into compute and the communication that compute does not hide;

and, for the selected strategy, a verdict and a few "what would you change?" hints drawn from
the OOM checklist (wrap granularity, prefetch depth, recomputation, the big logits tensor) when
it does not fit, and from the throughput side (network, simpler strategies, offload,
recomputation you do not need) when it does. Every control is an attribute, so a notebook cell
can drive it and check the result without a browser::

    pw = PlannerWidget(model="llama3-8b", device="h100-80gb", gpus_per_node=8)
    pw.widget                           # the controls, the two charts, the verdict, the hints
    pw.nodes, pw.inter = 2, "ethernet-100g"
    pw.hybrid = True                    # the charts, the verdict and the hints follow
    assert pw.fits and pw.plan.exposed_comm_s < 0.2 * pw.plan.step_s

Memory is in GiB (2^30 bytes), as the planner's verdicts. The planner assumes one FSDP unit per
transformer block (plus the root); ``wrap="model"`` is this widget's own estimate of one unit for
the whole model (see :func:`whole_model_unit`). The planner's assumptions and the source of
every device and link figure are in ``docs/costmodel.md``.
"""
from __future__ import annotations

from dataclasses import replace
from functools import lru_cache

import ipywidgets as W
import plotly.graph_objects as go
from plotly.subplots import make_subplots

from ..costmodel import DEVICES, LINKS, Cluster, Plan, param_counts, plan, ring_time
from ..model import CONFIGS, config
from .calculator import control
from .figures import category_order, color
from .live_figure import LiveFigure

GiB = 2**30
# A plan above this share of the device gets a warning, whether it is the current one or a
# suggestion: the planner does not model the CUDA context, NCCL's buffers, the allocator's
# fragmentation or the temporaries of each kernel (docs/costmodel.md, "What the planner leaves out").
HEADROOM = 0.9
UNMODELLED = "the CUDA context, NCCL's buffers, allocator fragmentation and kernel temporaries"
STRATEGIES = ("ddp", "zero1", "zero2", "fsdp")
LABELS = {"ddp": "DDP", "zero1": "ZeRO-1", "zero2": "ZeRO-2", "fsdp": "ZeRO-3 / FSDP"}
WRAPS = ("block", "model")
_CATEGORIES = category_order(["params", "grads", "master", "exp_avg", "exp_avg_sq", "activations",
                              "unsharded", "comm_buffers"])
TIME_PARTS = (("compute", "#4C78A8"), ("exposed communication", "#E45756"))


@lru_cache(maxsize=4096)
def cached_plan(model: str, cluster: Cluster, strategy: str, micro_batch: int, seq_len: int,
                prefetch: int, recompute: bool, offload: bool, hybrid: bool, mfu: float) -> Plan:
    """:func:`~minishard.costmodel.plan` with bf16-mixed AdamW, memoised: a slider move re-plans
    all four strategies, and moving back should cost nothing."""
    return plan(model, cluster, strategy, micro_batch=micro_batch, seq_len=seq_len,
                prefetch=prefetch, recompute=recompute, offload=offload, hybrid=hybrid, mfu=mfu)


def whole_model_unit(per_block: Plan, model: str, cluster: Cluster, *, activations: float,
                     hybrid: bool, offload_s: float) -> Plan:
    """FSDP with one unit for the whole model (``wrap="model"``), from the per-block plan.

    The one unit is the root: gathered whole before the first layer computes, kept gathered
    until backward is done (FSDP never reshards the root after forward), its full gradients
    reduce-scattered after the last one is computed. So a GPU holds the whole model's working
    weights at the peak, and nothing overlaps: compute waits for the whole gather, and the
    reduce-scatter waits for the whole backward. ``activations``: the full forward's (the
    per-block plan may hold fewer at its in-backward peak); ``offload_s``: the PCIe time the
    planner added for offload, if any (it does not depend on the wrapping)."""
    n = param_counts(config(model))[0]
    x = g = 2                                          # bf16 working weights and gradients
    shard_n = cluster.gpus_per_node if hybrid else cluster.world_size
    slow = min(cluster.intra, cluster.inter, key=lambda link: link.bandwidth)
    link = cluster.intra if (cluster.nodes == 1 or hybrid) else slow
    memory = {k: v for k, v in per_block.memory.items()
              if k not in ("unsharded", "comm_buffers", "activations")}
    memory["unsharded"] = x * n
    # the two candidate peaks: end of forward (every activation) or end of backward (the full
    # gradients waiting for their reduce-scatter)
    if activations >= g * n:
        memory["activations"] = activations
    else:
        memory["comm_buffers"] = g * n
    comm = ring_time("all_gather", x * n, shard_n, link) + ring_time("reduce_scatter", g * n, shard_n, link)
    exposed = comm + offload_s
    if hybrid and cluster.nodes > 1:                   # as the planner: gradient shards across nodes
        cross = ring_time("all_reduce", g * n / shard_n, cluster.nodes, cluster.inter)
        comm, exposed = comm + cross, exposed + cross
    notes = [n_ for n_ in per_block.notes if "units" not in n_] + ["1 unit (the whole model), 2 collectives per step"]
    return replace(per_block, memory=memory, comm_s=comm, exposed_comm_s=exposed, notes=notes)


class PlannerWidget:
    """Per-GPU memory and step time of all four strategies on a cluster (see the module doc)."""

    model = control("model", "a name from minishard.model.CONFIGS")
    device = control("device", "a key of minishard.costmodel.DEVICES")
    gpus_per_node = control("gpus_per_node", "GPUs in one node (they share the intra-node link)")
    nodes = control("nodes", "number of nodes")
    intra = control("intra", "the link between GPUs of a node: a key of minishard.costmodel.LINKS")
    inter = control("inter", "the link between nodes: a key of minishard.costmodel.LINKS")
    wrap = control("wrap", "FSDP units: 'block' (one per transformer block) or 'model' (one)")
    prefetch = control("prefetch", "FSDP prefetch depth: blocks gathered ahead of the one computing")
    recompute = control("recompute", "activation recomputation (keep only each block's input)")
    offload = control("offload", "the sharded state lives in host memory (PCIe traffic per step)")
    hybrid = control("hybrid", "shard inside a node, replicate across nodes (HSDP)")
    micro_batch = control("micro_batch", "sequences per GPU per forward")
    seq_len = control("seq_len", "tokens per sequence")
    mfu = control("mfu", "model FLOPs utilisation: achieved / peak FLOP/s")

    def __init__(self, model: str = "llama3-8b", *, device: str = "h100-80gb", gpus_per_node: int = 8,
                 nodes: int = 1, intra: str = "nvlink4", inter: str = "ib-ndr-400",
                 strategy: str = "fsdp", wrap: str = "block", prefetch: int = 1,
                 recompute: bool = True, offload: bool = False, hybrid: bool = False,
                 micro_batch: int = 1, seq_len: int = 8192, mfu: float = 0.4):
        self._updating = False
        self.redraws = 0                               # how many times update() drew (tests)
        style = {"description_width": "95px"}
        lay = W.Layout(width="330px")
        link_options = [(f"{k}: {v.name}", k) for k, v in LINKS.items()]
        self._controls = {
            "model": W.Dropdown(options=list(CONFIGS), value=model, description="model",
                                style=style, layout=lay),
            "device": W.Dropdown(options=[(f"{k}: {v.name}", k) for k, v in DEVICES.items()],
                                 value=device, description="device", style=style, layout=lay),
            "gpus_per_node": W.IntSlider(value=gpus_per_node, min=1, max=16, description="GPUs/node",
                                         style=style, layout=lay),
            "nodes": W.IntSlider(value=nodes, min=1, max=256, description="nodes", style=style,
                                 layout=lay),
            "intra": W.Dropdown(options=link_options, value=intra, description="in a node",
                                style=style, layout=lay),
            "inter": W.Dropdown(options=link_options, value=inter, description="between nodes",
                                style=style, layout=lay),
            "strategy": W.ToggleButtons(options=[(LABELS[s], s) for s in STRATEGIES],
                                        value=self._strategy_name(strategy), description="strategy",
                                        style={**style, "button_width": "105px"}),
            "wrap": W.ToggleButtons(options=list(WRAPS), value=wrap, description="FSDP wrap",
                                    style={**style, "button_width": "70px"}),
            "prefetch": W.IntSlider(value=prefetch, min=0, max=4, description="prefetch",
                                    style=style, layout=lay),
            "recompute": W.Checkbox(value=recompute, description="recompute activations",
                                    indent=False),
            "offload": W.Checkbox(value=offload, description="CPU offload", indent=False),
            "hybrid": W.Checkbox(value=hybrid, description="hybrid sharding (HSDP)", indent=False),
            "micro_batch": W.IntSlider(value=micro_batch, min=1, max=32, description="micro-batch",
                                       style=style, layout=lay),
            "seq_len": W.IntSlider(value=seq_len, min=128, max=131072, step=128,
                                   description="seq len", style=style, layout=lay),
            "mfu": W.FloatSlider(value=mfu, min=0.05, max=1.0, step=0.01, description="MFU",
                                 style=style, layout=lay),
        }
        fig = make_subplots(rows=1, cols=2, column_widths=[0.58, 0.42], horizontal_spacing=0.12,
                            subplot_titles=("memory of one GPU (GiB)", "one step (s)"))
        for c in _CATEGORIES:
            fig.add_trace(go.Bar(name=c, x=[], y=[], marker_color=color(c), legendgroup="memory"),
                          row=1, col=1)
        for name, colour in TIME_PARTS:
            fig.add_trace(go.Bar(name=name, x=[], y=[], marker_color=colour, legendgroup="time"),
                          row=1, col=2)
        fig.update_layout(barmode="stack", width=980, height=420, margin=dict(l=50, r=10, t=70, b=40),
                          legend=dict(traceorder="grouped"), title=dict(font=dict(size=13)))
        self.figure = LiveFigure(fig)
        self.verdict_html = W.HTML()
        self.hints_html = W.HTML()
        c = self._controls
        self.widget = W.VBox([
            W.HBox([W.VBox([c["model"], c["device"], c["gpus_per_node"], c["nodes"], c["intra"]]),
                    W.VBox([c["inter"], c["micro_batch"], c["seq_len"], c["mfu"], c["prefetch"]])]),
            c["strategy"], W.HBox([c["wrap"], c["recompute"], c["offload"], c["hybrid"]]),
            self.figure, self.verdict_html, self.hints_html])
        for w in c.values():
            w.observe(self._on_change, names="value")
        self.update()

    # ---- the strategy control accepts the planner's names too
    @staticmethod
    def _strategy_name(s: str) -> str:
        s = "fsdp" if s == "zero3" else s
        if s not in STRATEGIES:
            raise ValueError(f"unknown strategy {s!r}; expected one of {STRATEGIES} (or 'zero3')")
        return s

    @property
    def strategy(self) -> str:
        """'ddp', 'zero1', 'zero2' or 'fsdp' ('zero3' is accepted and means 'fsdp')."""
        return self._controls["strategy"].value

    @strategy.setter
    def strategy(self, value: str) -> None:
        self._controls["strategy"].value = self._strategy_name(value)

    def set(self, **values) -> None:
        """Change several controls with one redraw, e.g. ``pw.set(nodes=2, inter="ethernet-100g")``."""
        unknown = set(values) - set(self._controls)
        if unknown:
            raise AttributeError(f"no such control(s): {sorted(unknown)}")
        self._updating = True
        try:
            for k, v in values.items():
                setattr(self, k, v)
        finally:
            self._updating = False
        self.update()

    # ---- what the controls describe
    @property
    def cluster(self) -> Cluster:
        return Cluster(DEVICES[self.device], self.gpus_per_node, self.nodes, LINKS[self.intra],
                       LINKS[self.inter])

    def plan_for(self, strategy: str, **changes) -> Plan:
        """The plan of ``strategy`` with the current controls, some of them changed (e.g.
        ``recompute=False``): what the hints compare against. Raises ValueError for a
        configuration the planner refuses."""
        s = dict(model=self.model, cluster=self.cluster, micro_batch=self.micro_batch,
                 seq_len=self.seq_len, prefetch=self.prefetch, recompute=self.recompute,
                 offload=self.offload, hybrid=self.hybrid, mfu=round(self.mfu, 4), wrap=self.wrap)
        s.update(changes)
        wrap = s.pop("wrap")
        if strategy != "fsdp":
            s["prefetch"] = 0                          # only FSDP prefetches; keep the cache small
        p = cached_plan(s["model"], s["cluster"], strategy, s["micro_batch"], s["seq_len"],
                        s["prefetch"], s["recompute"], s["offload"], s["hybrid"], s["mfu"])
        if strategy == "fsdp" and wrap == "model":
            full = cached_plan(s["model"], s["cluster"], "zero2", s["micro_batch"], s["seq_len"], 0,
                               s["recompute"], False, s["hybrid"], s["mfu"])
            offload_s = 0.0
            if s["offload"]:
                on_device = cached_plan(s["model"], s["cluster"], "fsdp", s["micro_batch"], s["seq_len"],
                                        s["prefetch"], s["recompute"], False, s["hybrid"], s["mfu"])
                offload_s = p.exposed_comm_s - on_device.exposed_comm_s
            p = whole_model_unit(p, s["model"], s["cluster"], activations=full.memory["activations"],
                                 hybrid=s["hybrid"], offload_s=offload_s)
        return p

    @property
    def plans(self) -> dict[str, Plan | str]:
        """Every strategy's plan with the current controls, or the planner's refusal (a string)."""
        out: dict[str, Plan | str] = {}
        for s in STRATEGIES:
            try:
                out[s] = self.plan_for(s)
            except ValueError as e:
                out[s] = str(e)
        return out

    @property
    def plan(self) -> Plan:
        """The selected strategy's plan (raises ValueError if the planner refuses it)."""
        return self.plan_for(self.strategy)

    @property
    def fits(self) -> bool:
        p = self.plans[self.strategy]
        return isinstance(p, Plan) and p.fits

    @property
    def verdict(self) -> str:
        p = self.plans[self.strategy]
        if not isinstance(p, Plan):
            return f"impossible: {p}"
        return f"{LABELS[self.strategy]}, {self.cluster.world_size} GPUs: {p.verdict()}"

    # ---- what would you change?
    def _gain(self, strategy: str, **changes) -> Plan | None:
        try:
            return self.plan_for(strategy, **changes)
        except ValueError:
            return None

    @property
    def hints(self) -> list[str]:
        """Short suggestions for the selected strategy: the OOM checklist, in its order, when it
        does not fit; the throughput questions when it does. Each names its measured chapter."""
        p = self.plans[self.strategy]
        if not isinstance(p, Plan):
            return ["Fewer GPUs, or a bigger model: the planner refuses this shape."]
        s, out = self.strategy, []
        gib = lambda b: f"{b / GiB:.1f} GiB"                                     # noqa: E731

        def tight(plan: Plan) -> str:     # the same warning for a suggestion as for the current plan
            if plan.total_memory <= HEADROOM * plan.device_memory:
                return ""
            return (f" — {plan.total_memory / plan.device_memory:.0%} of the device, and the plan "
                    f"leaves out {UNMODELLED}")
        cfg = CONFIGS[self.model]
        logits = self.micro_batch * self.seq_len * cfg.vocab_size * 2            # bf16 log-probs
        if not p.fits:
            if s == "fsdp" and self.wrap == "model":
                alt = self._gain(s, wrap="block")
                out.append(f"Wrap granularity: one unit gathers the whole model "
                           f"({gib(p.memory['unsharded'])}); one unit per block needs "
                           f"{gib(alt.total_memory)} per GPU.")
            elif s == "fsdp" and self.prefetch > 1:
                alt = self._gain(s, prefetch=1)
                out.append(f"Prefetch depth {self.prefetch} keeps {self.prefetch} blocks gathered "
                           f"ahead; depth 1 needs {gib(alt.total_memory)}.")
            if not self.recompute:
                alt = self._gain(s, recompute=True)
                out.append(f"Activations are {gib(p.memory.get('activations', 0))}: recomputation "
                           f"needs {gib(alt.total_memory)}, for one more forward pass "
                           f"({alt.step_s / p.step_s - 1:+.0%} step time).")
            if logits >= 0.03 * p.device_memory:
                out.append(f"The [batch, seq, vocab] logits the loss keeps are {gib(logits)}: a "
                           f"chunked loss (loss_chunk_tokens) keeps one chunk at a time.")
            for bigger in STRATEGIES[STRATEGIES.index(s) + 1:]:
                alt = self._gain(bigger)
                if alt is not None and alt.fits:
                    out.append(f"Shard more: {LABELS[bigger]} needs {gib(alt.total_memory)} per GPU{tight(alt)}.")
                    break
            c = self.cluster
            more = self._gain(s, cluster=replace(c, nodes=2 * c.nodes))
            if more is not None and more.fits:
                out.append(f"Twice the nodes ({2 * c.world_size} GPUs): {gib(more.total_memory)} "
                           f"per GPU{tight(more)}.")
            acts = p.memory.get("activations", 0)
            if acts > 0.25 * p.device_memory:
                out.append(f"Activations ({gib(acts)}) do not shrink with more data-parallel GPUs: "
                           f"a shorter micro-batch or sequence, or tensor/sequence parallelism, "
                           f"which splits each layer's activations.")
            if not self.offload:
                alt = self._gain(s, offload=True)
                if alt is not None and alt.fits:
                    out.append(f"CPU offload fits ({gib(alt.total_memory)}{tight(alt)}) but adds "
                               f"{alt.exposed_comm_s - p.exposed_comm_s:.2f} s of PCIe per step: "
                               f"a last resort.")
            if not out:
                out.append("Nothing here is left to shard: more GPUs, or a smaller configuration.")
            return out
        share = p.exposed_comm_s / p.step_s
        if share > 0.15:
            msg = f"{share:.0%} of the step waits for the network."
            if self.nodes > 1 and not self.hybrid:
                alt = self._gain(s, hybrid=True)
                if alt is not None and alt.fits:
                    msg += (f" Hybrid sharding keeps the sharding collectives inside a node: "
                            f"{alt.exposed_comm_s / alt.step_s:.0%} waiting, "
                            f"{gib(alt.total_memory)} per GPU{tight(alt)}.")
            out.append(msg)
        for simpler in STRATEGIES[:STRATEGIES.index(s)]:
            alt = self._gain(simpler)
            if alt is not None and alt.fits and alt.step_s <= 1.03 * p.step_s:
                out.append(f"{LABELS[simpler]} fits too ({gib(alt.total_memory)}{tight(alt)}) and is about as "
                           f"fast ({alt.step_s:.2f} s against {p.step_s:.2f} s): a simpler system.")
                break
        if self.offload:
            alt = self._gain(s, offload=False)
            if alt is not None and alt.fits:
                out.append(f"Offload is not needed: without it {gib(alt.total_memory)} fit{tight(alt)} and the "
                           f"step is {p.step_s - alt.step_s:.2f} s shorter.")
        if self.recompute:
            alt = self._gain(s, recompute=False)
            if alt is not None and alt.fits and alt.step_s < 0.97 * p.step_s:
                out.append(f"It fits without recomputation too ({gib(alt.total_memory)}{tight(alt)}): "
                           f"{1 - alt.step_s / p.step_s:.0%} less time per step.")
        if p.total_memory > HEADROOM * p.device_memory:
            out.append(f"{p.total_memory / p.device_memory:.0%} of the device, and the plan leaves "
                       f"out {UNMODELLED}: they can tip it over.")
        if not out:
            out.append("Nothing to change: it fits and the network is hidden behind compute.")
        return out

    # ---- drawing
    def _on_change(self, _change) -> None:
        if not self._updating:                         # ignore the changes update() makes itself
            self.update()

    def update(self) -> None:
        """Redraw both charts, the verdict and the hints from the controls' current values."""
        self.redraws += 1
        self._updating = True
        try:
            fsdp = self.strategy == "fsdp"
            self._controls["wrap"].disabled = not fsdp
            self._controls["prefetch"].disabled = not fsdp or self.wrap == "model"
            self._controls["hybrid"].disabled = self.nodes == 1
            self._controls["inter"].disabled = self.nodes == 1
        finally:
            self._updating = False
        plans = self.plans
        ok = {s: p for s, p in plans.items() if isinstance(p, Plan)}
        names = [LABELS[s] for s in STRATEGIES]
        ticks = [f"<b>{LABELS[s]}</b>" if s == self.strategy else LABELS[s] for s in STRATEGIES]
        cap = self.cluster.device.memory / GiB
        totals = {s: p.total_memory / GiB for s, p in ok.items()}
        # a DDP bar of a 405B model is 60x the device: clip the axis at 3x, label every total
        top = max([cap] + [min(t, 3 * cap) for t in totals.values()])
        with self.figure.batch_update():
            for tr in self.figure.data:
                if tr.legendgroup == "memory":
                    tr.x = names
                    tr.y = [ok[s].memory.get(tr.name, 0) / GiB if s in ok else 0 for s in STRATEGIES]
                elif tr.name == "compute":
                    tr.x, tr.y = names, [ok[s].compute_s if s in ok else 0 for s in STRATEGIES]
                else:
                    tr.x, tr.y = names, [ok[s].exposed_comm_s if s in ok else 0 for s in STRATEGIES]
                tr.marker.line = dict(width=[2.5 if s == self.strategy else 0 for s in STRATEGIES],
                                      color="black")
            for axis in ("xaxis", "xaxis2"):
                self.figure.layout[axis].update(tickmode="array", tickvals=names, ticktext=ticks)
            self.figure.layout.yaxis.range = [0, 1.15 * top]
            self.figure.layout.shapes = [dict(type="line", xref="x domain", x0=0, x1=1, yref="y",
                                              y0=cap, y1=cap,
                                              line=dict(color="black", dash="dash", width=2))]
            self.figure.layout.annotations = [
                *[a for a in self.figure.layout.annotations if a.text in
                  ("memory of one GPU (GiB)", "one step (s)")],
                dict(xref="x domain", x=1, yref="y", y=cap, text=f"{self.cluster.device.name}",
                     showarrow=False, xanchor="right", yanchor="bottom"),
                *[dict(xref="x", x=LABELS[s], yref="y", y=min(totals.get(s, 0), 1.08 * top),
                       text=(f"{totals[s]:,.1f}" + (" ↑" if totals[s] > 1.08 * top else ""))
                       if s in totals else "refused",
                       showarrow=False, yanchor="bottom", font=dict(size=11))
                  for s in STRATEGIES]]
            c = self.cluster
            where = (f"{c.nodes} × {c.gpus_per_node} GPUs, {LINKS[self.intra].name} inside"
                     + (f", {LINKS[self.inter].name} between nodes" if c.nodes > 1 else ""))
            self.figure.layout.title.text = (f"{self.model}, micro-batch {self.micro_batch} × "
                                             f"{self.seq_len} tokens on {where}")
        colour = "#2e7d32" if self.fits else "#c62828"
        self.verdict_html.value = f'<b style="color:{colour}">{self.verdict}</b>'
        items = "".join(f"<li>{h}</li>" for h in self.hints)
        self.hints_html.value = f"<b>What would you change?</b><ul>{items}</ul>"
