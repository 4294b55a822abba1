"""The planner widget: which strategy on which cluster — and what would you change?

A widget over :func:`minishard.planner.costmodel.plan`. Pick a model (tiny … llama3-405b), a cluster
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

Memory is in GiB (2^30 bytes), as the planner's verdicts. Every figure is the planner's
(:mod:`minishard.planner.costmodel`, ``wrap="model"`` included); the widget only draws them and words
the hints. The planner's assumptions and the source of every device and link figure are in
``docs/costmodel.md``.
"""
from __future__ import annotations

from functools import lru_cache

import ipywidgets as W
import plotly.graph_objects as go
from plotly.subplots import make_subplots

from minishard.planner.advice import LABELS, Advice
from minishard.planner.costmodel import DEVICES, LINKS, Cluster, Plan, plan
from minishard import strategies
from minishard.core.model import CONFIGS
from .calculator import control
from .figures import category_order, color
from .live_figure import LiveFigure

GiB = 2**30
STRATEGIES = strategies.PLANNED                  # one per ZeRO stage
WRAPS = ("block", "model")
_CATEGORIES = category_order(["params", "grads", "master", "exp_avg", "exp_avg_sq", "activations",
                              "unsharded", "comm_buffers"])
TIME_PARTS = (("compute", "#4C78A8"), ("exposed communication", "#E45756"))


@lru_cache(maxsize=4096)
def cached_plan(model: str, cluster: Cluster, strategy: str, **job) -> Plan:
    """:func:`~minishard.planner.costmodel.plan`, memoised: a slider move re-plans all four strategies,
    and moving back should cost nothing."""
    return plan(model, cluster, strategy, **job)


def _host(offload: str | None) -> bool:
    """The offload checkbox's value for a tier the planner models."""
    if offload not in (None, "host"):
        raise ValueError(f"offload: the planner models 'host' or None, got {offload!r}")
    return offload == "host"


def _planner(model, cluster, strategy, **job) -> Plan:
    return cached_plan(model, cluster, strategy, **job)       # (looked up at call time: tests swap it)


class PlannerWidget:
    """Per-GPU memory and step time of all four strategies on a cluster (see the module doc)."""

    model = control("model", "a name from minishard.core.model.CONFIGS")
    device = control("device", "a key of minishard.planner.costmodel.DEVICES")
    gpus_per_node = control("gpus_per_node", "GPUs in one node (they share the intra-node link)")
    nodes = control("nodes", "number of nodes")
    intra = control("intra", "the link between GPUs of a node: a key of minishard.planner.costmodel.LINKS")
    inter = control("inter", "the link between nodes: a key of minishard.planner.costmodel.LINKS")
    wrap = control("wrap", "FSDP units: 'block' (one per transformer block) or 'model' (one)")
    prefetch = control("prefetch", "FSDP prefetch depth: blocks gathered ahead of the one computing")
    recompute = control("recompute", "activation recomputation (keep only each block's input)")
    offload = property(lambda self: "host" if self._controls["offload"].value else None,
                       lambda self, v: setattr(self._controls["offload"], "value", _host(v)),
                       doc="the tier the sharded state lives in, as the planner names it: 'host' "
                           "(PCIe traffic per step; the control is a checkbox) or None")
    hybrid = control("hybrid", "shard inside a node, replicate across nodes (HSDP)")
    micro_batch = control("micro_batch", "sequences per GPU per forward")
    seq_len = control("seq_len", "tokens per sequence")
    mfu = control("mfu", "model FLOPs utilisation: achieved / peak FLOP/s")

    def __init__(self, model: str = "llama3-8b", *, device: str = "h100-80gb", gpus_per_node: int = 8,
                 nodes: int = 1, intra: str = "nvlink4", inter: str = "ib-ndr-400",
                 strategy: str = "fsdp", wrap: str = "block", prefetch: int = 1,
                 recompute: bool = True, offload: str | None = None, hybrid: bool = False,
                 micro_batch: int = 1, seq_len: int = 8192, mfu: float = 0.4):
        self._updating = False
        self.redraws = 0                               # how many times update() drew (tests)
        self._controls = self._make_controls(
            model=model, device=device, gpus_per_node=gpus_per_node, nodes=nodes, intra=intra,
            inter=inter, strategy=self._strategy_name(strategy), wrap=wrap, prefetch=prefetch,
            recompute=recompute, offload=_host(offload), hybrid=hybrid, micro_batch=micro_batch,
            seq_len=seq_len, mfu=mfu)
        self.figure = self._make_figure()
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

    @staticmethod
    def _make_controls(**v) -> dict[str, W.ValueWidget]:
        style = {"description_width": "95px"}
        lay = W.Layout(width="330px")
        link_options = [(f"{k}: {link.name}", k) for k, link in LINKS.items()]

        def widget(kind, name, label, **kw):
            return kind(value=v[name], description=label, style=style, layout=lay, **kw)

        def check(name, label):
            return W.Checkbox(value=v[name], description=label, indent=False)

        return {
            "model": widget(W.Dropdown, "model", "model", options=list(CONFIGS)),
            "device": widget(W.Dropdown, "device", "device",
                             options=[(f"{k}: {d.name}", k) for k, d in DEVICES.items()]),
            "gpus_per_node": widget(W.IntSlider, "gpus_per_node", "GPUs/node", min=1, max=16),
            "nodes": widget(W.IntSlider, "nodes", "nodes", min=1, max=256),
            "intra": widget(W.Dropdown, "intra", "in a node", options=link_options),
            "inter": widget(W.Dropdown, "inter", "between nodes", options=link_options),
            "strategy": W.ToggleButtons(options=[(LABELS[s], s) for s in STRATEGIES],
                                        value=v["strategy"], description="strategy",
                                        style={**style, "button_width": "105px"}),
            "wrap": W.ToggleButtons(options=list(WRAPS), value=v["wrap"], description="FSDP wrap",
                                    style={**style, "button_width": "70px"}),
            "prefetch": widget(W.IntSlider, "prefetch", "prefetch", min=0, max=4),
            "recompute": check("recompute", "recompute activations"),
            "offload": check("offload", "offload to host memory"),
            "hybrid": check("hybrid", "hybrid sharding (HSDP)"),
            "micro_batch": widget(W.IntSlider, "micro_batch", "micro-batch", min=1, max=32),
            "seq_len": widget(W.IntSlider, "seq_len", "seq len", min=128, max=131072, step=128),
            "mfu": widget(W.FloatSlider, "mfu", "MFU", min=0.05, max=1.0, step=0.01),
        }

    @staticmethod
    def _make_figure() -> LiveFigure:
        """Memory by category (left) and the step's compute and exposed communication (right),
        one bar per strategy; :meth:`update` fills them."""
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
        return LiveFigure(fig)

    # ---- the strategy control accepts the planner's names too
    @staticmethod
    def _strategy_name(s: str) -> str:
        name = strategies.get(s).name                   # (zero3 is fsdp's alias)
        if name not in STRATEGIES:
            raise ValueError(f"unknown strategy {s!r}; expected one of {STRATEGIES} (or 'zero3')")
        return name

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

    @property
    def advice(self) -> Advice:
        """The current controls as a planner configuration, and what it would change."""
        return Advice(self.model, self.cluster, self.strategy, micro_batch=self.micro_batch,
                      seq_len=self.seq_len, prefetch=self.prefetch, recompute=self.recompute,
                      offload=self.offload, hybrid=self.hybrid, mfu=self.mfu, wrap=self.wrap,
                      planner=_planner)

    def plan_for(self, strategy: str, **changes) -> Plan:
        """The plan of ``strategy`` with the current controls, some of them changed (e.g.
        ``recompute=False``). Raises ValueError for a configuration the planner refuses."""
        return self.advice.plan_for(strategy, **changes)

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

    @property
    def hints(self) -> list[str]:
        """What would you change? :meth:`minishard.planner.advice.Advice.hints` for the current controls
        (the same sentences ``python -m minishard plan`` prints)."""
        return self.advice.hints()

    # ---- drawing
    def _on_change(self, _change) -> None:
        if not self._updating:                         # ignore the changes update() makes itself
            self.update()

    def update(self) -> None:
        """Redraw both charts, the verdict and the hints from the controls' current values."""
        self.redraws += 1
        self._updating = True
        try:
            fsdp = strategies.get(self.strategy).stage == 3
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
