"""The reshard map: which saved files each new rank reads, and how many bytes.

A pure function of a :class:`minishard.checkpoint.ReshardPlan` (computed from the metadata alone,
no ranks): a heatmap of new ranks (rows) against saved ranks (columns). Loading 64 ranks' shards
on 32 is a band two files wide; loading under a strategy that replicates the parameters (DDP,
ZeRO) fills whole rows — every new rank reads every file.
"""
from __future__ import annotations

import plotly.graph_objects as go

from .figures import MiB, fmt_bytes


def reshard_figure(plan, title: str | None = None) -> go.Figure:
    """Heatmap of ``plan.bytes_matrix()``: bytes new rank *i* reads from saved rank *j*'s file,
    with the total each new rank reads (and how much of it it needed) on hover."""
    m = plan.bytes_matrix()
    totals = plan.bytes_read()
    hover = [[f"new rank {i} reads {fmt_bytes(b)} from rank{j}.safetensors" if b else
              f"new rank {i}: nothing from rank{j}.safetensors"
              for j, b in enumerate(row)] for i, row in enumerate(m)]
    fig = go.Figure(go.Heatmap(
        z=[[b / MiB for b in row] for row in m], x=list(range(plan.saved_world_size)),
        y=list(range(plan.world_size)), colorscale="Blues", colorbar=dict(title="MiB read"),
        hovertext=hover, hoverinfo="text", xgap=1, ygap=1))
    read, needed = sum(totals), sum(plan.needed_bytes)
    fig.update_layout(
        title=title or (f"resharding {plan.saved_world_size} → {plan.world_size} ranks: "
                        f"{fmt_bytes(read)} read for {fmt_bytes(needed)} needed"),
        xaxis=dict(title="saved rank (file rank{j}.safetensors)", constrain="domain"),
        yaxis=dict(title="new rank", autorange="reversed"),
        height=420, width=640, margin=dict(l=60, r=20, t=60, b=50))
    return fig
