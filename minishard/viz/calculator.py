"""The ledger calculator: will this training job fit on one device?

A widget over :func:`minishard.planner.analytic.estimate`. Pick a model (or a bare parameter count), a world
size, a strategy, a precision policy, an optimizer and a micro-batch; it draws one stacked bar per
rank (what that rank must hold, by ledger category) against a line at the device's memory, and
says whether it fits. Every control is also an attribute, so a notebook cell can drive it and
check the result without a browser::

    calc = LedgerCalculator(model="llama3-8b", world_size=8, strategy="ddp")
    calc.widget                       # the controls, the bars, the verdict
    calc.strategy = "zero3"           # the bars and the verdict follow
    assert calc.fits and calc.per_rank_bytes < 80e9

The figures are in decimal gigabytes (1 GB = 10^9 bytes), the unit device memory is sold in.
Activations come from :func:`minishard.planner.analytic.gpt_activation_bytes` for minishard's GPT, which
computes attention explicitly (no fused kernel) and saves its T x T softmax: at long sequence
lengths that term is far above what a FlashAttention-style kernel keeps.
"""
from __future__ import annotations

import ipywidgets as W
import plotly.graph_objects as go

from minishard.planner.analytic import OPTIMIZERS, PRECISIONS, Estimate, estimate, gpt_activation_bytes
from minishard import strategies
from minishard.strategies.registry import STAGES
from minishard.planner.costmodel import param_counts
from minishard.core.model import CONFIGS, config
from .figures import category_order, color, fmt_bytes
from .live_figure import LiveFigure

GB = 1e9
CUSTOM = "custom"
DEVICES_GB = {"24 GB": 24, "40 GB (A100-40G)": 40, "80 GB (A100/H100)": 80,
              "141 GB (H200)": 141, "192 GB (B200)": 192}
# every category the analytic ledger can return, bottom of the stack first
_CATEGORIES = category_order(["params", "grads", "main_grads", "master", "exp_avg", "exp_avg_sq",
                              "momentum", "activations"])


def control(name: str, doc: str) -> property:
    """An attribute that reads and writes one control's value (so code and UI stay in sync);
    the planner widget (chapter 10) uses it too."""
    return property(lambda self: self._controls[name].value,
                    lambda self, v: setattr(self._controls[name], "value", v), doc=doc)


class LedgerCalculator:
    """Per-rank training memory of a configuration, against a device's memory (module doc)."""

    model = control("model", "a name from minishard.core.model.CONFIGS, or 'custom' (use n_params)")
    n_params_b = control("n_params_b", "parameters in billions, used when model == 'custom'")
    world_size = control("world_size", "number of ranks N")
    strategy = control("strategy", "'ddp', 'zero1', 'zero2' or 'zero3'")
    precision = control("precision", "a key of minishard.planner.analytic.PRECISIONS")
    optimizer = control("optimizer", "a key of minishard.planner.analytic.OPTIMIZERS")
    micro_batch = control("micro_batch", "sequences per rank per forward; 0 leaves activations out")
    seq_len = control("seq_len", "tokens per sequence (for the activations)")
    device_gb = control("device_gb", "memory of one device, in GB")

    def __init__(self, model: str = "llama3-8b", *, n_params_b: float = 8.0, world_size: int = 8,
                 strategy: str = "ddp", precision: str = "bf16_mixed", optimizer: str = "adamw",
                 micro_batch: int = 0, seq_len: int = 4096, device_gb: float = 80,
                 max_bars: int = 16):
        self.max_bars = max_bars
        self._updating = False
        style = {"description_width": "90px"}
        lay = W.Layout(width="330px")
        self._controls = {
            "model": W.Dropdown(options=[*CONFIGS, CUSTOM], value=model, description="model",
                                style=style, layout=lay),
            "n_params_b": W.FloatLogSlider(value=n_params_b, base=10, min=-3, max=3, step=0.01,
                                           description="params (B)", style=style, layout=lay),
            "world_size": W.IntSlider(value=world_size, min=1, max=1024, description="world size",
                                      style=style, layout=lay),
            "strategy": W.ToggleButtons(options=list(STAGES), value=strategy,
                                        description="strategy", style={**style, "button_width": "60px"}),
            "precision": W.Dropdown(options=list(PRECISIONS), value=precision,
                                    description="precision", style=style, layout=lay),
            "optimizer": W.Dropdown(options=list(OPTIMIZERS), value=optimizer,
                                    description="optimizer", style=style, layout=lay),
            "micro_batch": W.IntSlider(value=micro_batch, min=0, max=32, description="micro-batch",
                                       style=style, layout=lay),
            "seq_len": W.IntSlider(value=seq_len, min=128, max=32768, step=128,
                                   description="seq len", style=style, layout=lay),
            "device_gb": W.Dropdown(options=list(DEVICES_GB.items()), value=device_gb,
                                    description="device", style=style, layout=lay),
        }
        self.figure = LiveFigure(
            [go.Bar(name=c, x=[], y=[], marker_color=color(c)) for c in _CATEGORIES],
            layout=dict(barmode="stack", width=620, height=380, yaxis=dict(title="GB per rank"),
                        legend=dict(traceorder="reversed"), margin=dict(l=50, r=10, t=50, b=30),
                        title=dict(font=dict(size=13))))
        self.verdict_html = W.HTML()
        c = self._controls
        self.widget = W.VBox([
            W.HBox([W.VBox([c["model"], c["n_params_b"], c["world_size"], c["precision"]]),
                    W.VBox([c["optimizer"], c["micro_batch"], c["seq_len"], c["device_gb"]])]),
            c["strategy"], self.figure, self.verdict_html])
        for w in c.values():
            w.observe(self._on_change, names="value")
        self.update()

    # ---- what the controls describe
    @property
    def n_params(self) -> int:
        if self.model == CUSTOM:
            return max(1, round(self.n_params_b * 1e9))
        return param_counts(config(self.model))[0]   # meta device, cached

    @property
    def activation_bytes(self) -> int:
        """Per rank: each rank runs its own micro-batch, so no strategy here shards these."""
        if self.model == CUSTOM or self.micro_batch == 0:
            return 0
        x = PRECISIONS[self.precision].params            # compute dtype = working-weight dtype
        return gpt_activation_bytes(CONFIGS[self.model], self.micro_batch, self.seq_len, x)

    @property
    def estimate(self) -> Estimate:
        return estimate(n_params=self.n_params, world_size=self.world_size,
                        strategy=self.strategy, precision=self.precision,
                        optimizer=self.optimizer, activation_bytes=self.activation_bytes)

    @property
    def per_rank_bytes(self) -> int:
        return self.estimate.total

    @property
    def fits(self) -> bool:
        return self.per_rank_bytes <= self.device_gb * GB

    @property
    def verdict(self) -> str:
        """One line, plain text: fits or not, and by how much."""
        need, have = self.per_rank_bytes, self.device_gb
        n = self.n_params
        params = f"{n / 1e9:.2f} B" if n >= 1e9 else f"{n / 1e6:.2f} M"
        per_rank = f"{need / GB:.1f} GB" if need >= GB else fmt_bytes(need)
        head = f"{params} params, {self.strategy} on {self.world_size} ranks: {per_rank} per rank"
        if self.fits:
            return f"fits: {head}, {need / (have * GB):.0%} of {have:g} GB"
        return f"does not fit: {head}, {need / (have * GB):.2f}x the {have:g} GB device"

    def smallest_world_size(self, limit: int = 4096) -> int | None:
        """The fewest ranks with which the current settings fit (None: not even with ``limit``).

        Under DDP adding ranks never helps: each one holds the same full copy."""
        e = self.estimate
        for n in range(1, limit + 1):
            if estimate(n_params=e.n_params, world_size=n, strategy=e.strategy,
                        precision=e.precision, optimizer=e.optimizer,
                        activation_bytes=self.activation_bytes).total <= self.device_gb * GB:
                return n
            if strategies.get(e.strategy).stage == 0:     # replicas: more ranks never help
                return None
        return None

    # ---- drawing
    def _on_change(self, _change) -> None:
        if not self._updating:                    # ignore the changes update() itself makes
            self.update()

    def update(self) -> None:
        """Redraw the bars and the verdict from the controls' current values."""
        custom = self.model == CUSTOM
        self._updating = True
        try:
            self._controls["n_params_b"].disabled = not custom
            self._controls["seq_len"].disabled = custom or self.micro_batch == 0
            if not custom:                        # the slider shows the config's count
                self._controls["n_params_b"].value = self.n_params / 1e9
        finally:
            self._updating = False
        e = self.estimate
        shown = min(self.world_size, self.max_bars)
        x = [f"rank {r}" for r in range(shown)]
        top = max(e.total / GB, self.device_gb)
        with self.figure.batch_update():
            for tr in self.figure.data:
                b = e.per_rank.get(tr.name, 0) / GB
                tr.x, tr.y = x, [b] * shown
            more = f" (first {shown} of {self.world_size}, all alike)" if shown < self.world_size else ""
            self.figure.layout.title.text = f"{self.strategy}: memory of each rank{more}"
            self.figure.layout.yaxis.range = [0, 1.12 * top]
            self.figure.layout.shapes = [dict(type="line", xref="paper", x0=0, x1=1, yref="y",
                                              y0=self.device_gb, y1=self.device_gb,
                                              line=dict(color="black", dash="dash", width=2))]
            self.figure.layout.annotations = [dict(xref="paper", x=1, yref="y", y=self.device_gb,
                                                   text=f"device {self.device_gb:g} GB",
                                                   showarrow=False, xanchor="right", yanchor="bottom")]
        colour = "#2e7d32" if self.fits else "#c62828"
        copies = ""
        if self.world_size > 1:
            redundant = sum(v * (self.world_size - 1) for k, v in e.per_rank.items()
                            if k != "activations" and not e.sharded.get(k))
            copies = (f"<br>Across the {self.world_size} ranks, {redundant / GB:,.1f} GB are "
                      f"copies of state another rank also holds.")
        self.verdict_html.value = f'<b style="color:{colour}">{self.verdict}</b>{copies}'
