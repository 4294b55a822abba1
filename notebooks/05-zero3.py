# ---
# jupyter:
#   jupytext:
#     formats: ipynb,py:percent
#     text_representation:
#       extension: .py
#       format_name: percent
#   kernelspec:
#     display_name: Python 3
#     language: python
#     name: python3
# ---

# %% [markdown]
# # 05 · ZeRO-3: shard the parameters too, gather them just in time
#
# > **Stage 3 stores 1/N of everything. What does that cost — and if it saves the most memory,
# > why not always use it?**
#
# <details><summary>中文</summary>
#
# **Stage 3 对所有东西都只存 1/N。代价是什么？既然它最省显存，为什么不一直用它？**
#
# ZeRO-1 切分了优化器状态，ZeRO-2 切分了梯度。Stage 3 切分最后一样与模型同等大小的东西——参数本身：
# 不用的时候，一个 rank 只保留每个权重的 1/N；一层要计算之前，各 rank 先 all-gather 出它的完整权重，
# 算完立刻释放。推理过程见 [中文版第 05 章](../tutorial/zh/05-zero3.md)；这个 notebook 测量它。
#
# </details>
#
# ZeRO-1 sharded the optimizer state, ZeRO-2 the gradients. Stage 3 shards the last
# model-sized thing, the parameters themselves: between uses a rank keeps only its 1/N slice of
# every weight; just before a layer computes, the ranks all-gather its full weights, and right
# after they free them again. The reasoning is in [tutorial/05-zero3.md](../tutorial/05-zero3.md);
# this notebook measures it.
#
# **The one-line "syntax"** — Ψ parameters, N ranks, fp32 AdamW (or bf16-mixed AdamW: the same
# 16 bytes):
#
# $$\text{memory per rank} = \frac{16\,\Psi}{N} + \text{one unit's full parameters} + \text{activations},
# \qquad \text{sent per rank per step} = \underbrace{3}_{\text{gather fwd, gather bwd, reduce-scatter}}\cdot\frac{N-1}{N}\,\Psi
# \;\;\text{vs DDP's}\;\; 2\cdot\frac{N-1}{N}\,\Psi .$$
#
# (Traffic in parameter *elements*; in fp32 each is 4 bytes. In bytes the 3 : 2 holds only when
# every pass moves the same dtype — §3 measures the mixed-precision case.)
#
# <details><summary>中文</summary>
#
# **一行"语法"**——Ψ 个参数，N 个 rank，fp32 AdamW（bf16 混合精度 AdamW 也是同样的 16 字节）：
# 每个 rank 的显存 = 16Ψ/N + 一个单元的完整参数 + 激活值；每个 rank 每步发送
# 3 · (N−1)/N · Ψ（前向收集、反向收集、reduce-scatter 各一遍），而 DDP 是 2 · (N−1)/N · Ψ。
#
# （通信量按参数*元素*计，fp32 下每个 4 字节。按字节计，3 : 2 只在每一遍传同一种 dtype 时成立——§3
# 测量了混合精度的情况。）
#
# </details>
#
# Terms, in English and Chinese: [glossary · 术语表](../tutorial/glossary.md).

# %%
import statistics

import plotly.graph_objects as go
import plotly.io as pio
import torch
from IPython.display import display

from minishard import GPT, Ranks, estimate, model_config
from minishard.course.ch05 import race, unit_states_at, unsharded_series, with_unit_states
from minishard.course.glue import glue
from minishard.training.loop import TrainConfig, train
from minishard.viz import Player, timeline_figure

pio.renderers.default = "plotly_mimetype+notebook_connected"
MiB = 2**20
TINY = GPT("tiny", device="meta")
PSI = TINY.num_params()                                     # Ψ: parameters
ROOT = sum(p.numel() for n, p in TINY.named_parameters() if not n.startswith("blocks."))
BLOCK = sum(p.numel() for p in TINY.blocks[0].parameters())
print(f"tiny GPT: Ψ = {PSI:,} parameters = {len(TINY.blocks)} blocks x {BLOCK:,} "
      f"+ {ROOT:,} outside the blocks (embeddings, final norm, head)")
R2 = Ranks(2)                                               # one warm pool for the chapter

# %% [markdown]
# ## 1. The ledger: every category divided by N
# First the prediction. `estimate` applies the ZeRO stage as a threshold: optimizer state is
# sharded from stage 1, gradients from stage 2, parameters from stage 3. For the tiny model on
# 2 ranks in fp32, and for Llama-3-8B on 8 GPUs in bf16-mixed precision:

# %%
# NBVAL_CHECK_OUTPUT
STAGES = ("ddp", "zero1", "zero2", "zero3")
for label, model, N, prec, unit, name in [("tiny, N = 2, fp32", TINY, 2, "fp32", MiB, "MiB"),
                                          ("llama3-8b, N = 8, bf16 mixed", GPT("llama3-8b", device="meta"),
                                           8, "bf16_mixed", 1e9, "GB")]:
    print(f"--- {label}: model state per rank ({name})")
    print(f"{'strategy':<8}" + "".join(f"{c:>12}" for c in ("params", "grads", "master", "exp_avg", "exp_avg_sq", "total")))
    for s in STAGES:
        e = estimate(model, world_size=N, strategy=s, precision=prec)
        total = (glue(f"llama3-8b-state-gb-{s}", e.state_bytes / unit, "{:.2f}") if name == "GB"
                 else f"{e.state_bytes / unit:.2f}")
        print(f"{s:<8}" + "".join(f"{e.per_rank.get(c, 0) / unit:>12.2f}"
                                  for c in ("params", "grads", "master", "exp_avg", "exp_avg_sq"))
              + f"{total:>12}")
    z3 = estimate(model, world_size=N, strategy="zero3", precision=prec)
    assert z3.state_bytes == 16 * z3.n_params // N               # 16 Ψ / N (Ψ divisible by N here)

# %% [markdown]
# An 8B model that needs 128.5 GB per rank under DDP needs 16 GB per rank under ZeRO-3 on 8
# GPUs. Now the measurement: the same four strategies on two real ranks, one AdamW step of the
# tiny model each. After the step a rank holds exactly its model state (activations are gone,
# the gathered parameters are freed), so the ledger should equal the prediction to the byte.

# %%
runs = {s: R2.run(train, TrainConfig(strategy=s, steps=1, model="tiny", micro_batch=1, track_activations=False))
        for s in ("ddp", "zero1", "zero2", "fsdp")}

# %%
# NBVAL_CHECK_OUTPUT
print(f"{'strategy':<8}{'predicted':>14}{'rank 0':>14}{'rank 1':>14}{'x 1/Ψ':>8}   (model state after the step, bytes)")
for s, out in runs.items():
    pred = estimate(TINY, world_size=2, strategy=s.replace("fsdp", "zero3"), precision="fp32").state_bytes
    got = [sum(o["ledger"]["final"].values()) for o in out]
    k = s.replace("fsdp", "zero3")
    rank0 = glue("zero3-state-bytes", got[0], "{:,}") if k == "zero3" else f"{got[0]:,}"
    print(f"{s:<8}{pred:>14,}{rank0:>14}{got[1]:>14,}{glue(f'{k}-bytes-per-param', got[0] / PSI, '{:g}'):>8}")
    assert got == [pred, pred]
    assert all(o["ledger"]["final"] == {c: v for c, v in o["ledger"]["estimate"].items()
                                        if c != "activations"} for o in out)
assert sum(runs["fsdp"][0]["ledger"]["final"].values()) == 16 * PSI // 2

# %% [markdown]
# 16, 12, 10 and 8 bytes per parameter: ZeRO-3 on 2 ranks keeps exactly 16Ψ/2. The "/N" is
# real: the same run on 4 ranks (the nano model, 217,664 parameters, two AdamW steps) keeps
# 16Ψ/4.

# %%
# NBVAL_CHECK_OUTPUT
R4 = Ranks(4)
nano_psi = GPT("nano", device="meta").num_params()
four = R4.run(train, TrainConfig(strategy="fsdp", steps=2, model="nano", micro_batch=1))
state4 = [sum(o["ledger"]["final"].values()) for o in four]
print(f"nano on 4 ranks: {state4} bytes of state per rank = {glue('nano-state-per-psi-n4', state4[0] / nano_psi, '{:g} x Ψ')}")
assert state4 == [16 * nano_psi // 4] * 4

# %% [markdown]
# ## 2. The figure: gathered parameters rise and fall, one unit at a time
# The state is only what a rank keeps *between* uses. While it trains, a unit's full parameters
# appear in the ledger as `unsharded` for as long as the unit computes. Two ranks train the tiny
# model (FSDP-style: each block is a unit, plus a root unit holding the embeddings, the final norm
# and the head) while the player follows; the table under it shows every unit's state at the
# event on the slider.

# %%
live = Player(title="ZeRO-3 (fsdp), 2 ranks, tiny model, 2 steps")
view, states = with_unit_states(live)
display(view)
fsdp_run = R2.run(train, TrainConfig(strategy="fsdp", steps=2, model="tiny"), on_event=live.feed)
live.flush()
events = R2.last_events

# %% [markdown]
# The same run in the offline player (no kernel: it plays on the static site too), with the units'
# states under the bars; "jump to collective" → `all_gather` goes from one unit's gather to the next.

# %%
from minishard.viz import replay_html
replay_html(events, title="ZeRO-3 (fsdp), 2 ranks, tiny model, 2 steps (offline player)")

# %% [markdown]
# The ledger of rank 0, read at each of its unit state changes in step 1. The root is gathered
# first and kept until backward ends (it is needed again at once: the head is the first thing
# backward computes); each block is gathered, used and freed.

# %%
# NBVAL_CHECK_OUTPUT
series = unsharded_series(events, rank=0, step=1)
first = {"root → unsharded": "root-unsharded-mib", "blocks.0 → unsharded": "root-and-block-unsharded-mib"}
for t, b, label in series:
    if label.endswith(("→ unsharded", "→ sharded")):
        mib = glue(first.pop(label), b / MiB, "{:.2f}") if label in first else f"{b / MiB:.2f}"
        print(f"{label:<26} unsharded = {mib:>6} MiB")
levels = {b for _, b, _ in series}
assert max(levels) == 4 * (ROOT + BLOCK)                       # the root and one block, never more
assert levels == {0, 4 * ROOT, 4 * (ROOT + BLOCK)}
assert series[-1][1] == 0                                       # all freed at the end of the step

# %%
t0 = series[0][0]
fig = go.Figure(go.Scatter(x=[(t - t0) * 1e3 for t, _, _ in series], y=[b / MiB for _, b, _ in series],
                           line_shape="hv", mode="lines+markers", text=[s for _, _, s in series],
                           hovertemplate="%{text}<br>%{y:.2f} MiB<extra></extra>"))
fig.add_hline(y=4 * PSI / MiB, line_dash="dash", annotation_text="the whole model (what DDP keeps)")
fig.update_layout(title="rank 0, step 1: gathered (unsharded) parameters over time", height=360,
                  width=900, xaxis_title="ms since the step began", yaxis_title="MiB")
fig.show()

# %% [markdown]
# The player can stop anywhere. At the moment rank 0 has gathered the last block in step 1's
# forward, it holds its shards, the root and that one block in full, and the activations of
# everything computed so far:

# %%
# NBVAL_CHECK_OUTPUT
i = next(i for i, e in enumerate(live.replay.events)
         if e["kind"] == "unit" and e["rank"] == 0 and e.get("step") == 1
         and e["name"] == "blocks.5" and e["state"] == "unsharded")
live.jump(i)
snap = live.snapshot()[0]
print(live.replay.title(i).split(" · event")[0])      # (the event's index depends on the ranks' interleaving)
for c, b in snap.items():
    if b:
        print(f"  {c:<12}{b:>12,}")
print("unit states on rank 0:", unit_states_at(live.replay.events, i)[0])
assert snap["params"] == 4 * PSI // 2 and snap["unsharded"] == 4 * (ROOT + BLOCK)
assert states.value.count(">unsharded<") >= 2          # the panel under the player shows the same

# %% [markdown]
# Against DDP on the same two ranks: the peak of each, measured, by category.

# %%
# NBVAL_CHECK_OUTPUT
ddp_run = R2.run(train, TrainConfig(strategy="ddp", steps=2, model="tiny"))
print(f"{'category':<14}{'ddp':>14}{'zero3 (fsdp)':>14}")
peaks = {s: out[0]["ledger"]["peak_snapshot"] for s, out in [("ddp", ddp_run), ("fsdp", fsdp_run)]}
for c in ("params", "grads", "exp_avg", "exp_avg_sq", "unsharded", "comm_buffers", "activations"):
    d = glue("ddp-activation-bytes", peaks["ddp"][c], "{:,}") if c == "activations" else f"{peaks['ddp'].get(c, 0):,}"
    print(f"{c:<14}{d:>14}{peaks['fsdp'].get(c, 0):>14,}")
print(f"{'peak':<14}{glue('ddp-peak-bytes', ddp_run[0]['ledger']['peak'], '{:,}'):>14}"
      f"{glue('zero3-peak-bytes', fsdp_run[0]['ledger']['peak'], '{:,}'):>14}")
assert fsdp_run[0]["ledger"]["peak"] < ddp_run[0]["ledger"]["peak"]
assert peaks["fsdp"]["params"] == peaks["ddp"]["params"] // 2

# %% [markdown]
# The state halved; the peak fell by less, because on this model the activations (the same under
# every strategy) are the largest single item, and stage 3 adds its own transients: the gathered
# units, the gradients of a unit waiting for their reduce-scatter, and the communication buffers.
#
# ## 3. Bytes: 3 passes of the parameters instead of 2
# Per step a ZeRO-3 rank takes part in an all-gather of every unit in forward, another in
# backward, and a reduce-scatter of every unit's gradients: three collectives of (N−1)/N of the
# model each. DDP's one all-reduce is a reduce-scatter plus an all-gather: two. We measure it with
# the textbook schedule (`reshard_root=True`: the root unit too is freed after forward and
# gathered again in backward) and with FSDP2's default (the root stays gathered).

# %%
kw = dict(steps=1, micro_batch=1, track_activations=False)
wire = {N: {"ddp": R.run(train, TrainConfig(strategy="ddp", model=m, **kw)),
            "textbook": R.run(train, TrainConfig(strategy="fsdp", model=m, reshard_root=True, **kw)),
            "default": R.run(train, TrainConfig(strategy="fsdp", model=m, **kw))}
        for N, R, m in [(2, R2, "tiny"), (4, R4, "nano")]}
# the same on the nano model in bf16 mixed precision (below): FSDP2's usual policy, DDP in bf16
mixed = {N: {"ddp fp32 grads": R.run(train, TrainConfig(strategy="ddp", model="nano", **kw)),
             "ddp bf16 grads": R.run(train, TrainConfig(strategy="ddp", model="nano", precision="bf16_mixed", **kw)),
             "zero3 bf16/fp32": R.run(train, TrainConfig(strategy="fsdp", model="nano", precision="bf16_mixed", reshard_root=True, **kw))}
         for N, R in [(2, R2), (4, R4)]}
R4.close()

# %%
# NBVAL_CHECK_OUTPUT
print(f"{'N':>2} {'model':<6}{'DDP':>13}{'ZeRO-3 textbook':>17}{'ratio':>7}{'FSDP2 default':>15}{'ratio':>7}")
for N, m in [(2, "tiny"), (4, "nano")]:
    g = GPT(m, device="meta")
    psi = g.num_params()
    root = sum(p.numel() for n, p in g.named_parameters() if not n.startswith("blocks."))
    w = {k: out[0]["wire"][0] for k, out in wire[N].items()}
    if m == "tiny":
        cols = (glue("tiny-ddp-bytes", w["ddp"], "{:,}"), glue("tiny-textbook-bytes", w["textbook"], "{:,}"),
                glue("tiny-textbook-ratio", w["textbook"] / w["ddp"], "{:.3f}"), f"{w['default']:,}",
                glue("tiny-fsdp2-ratio", w["default"] / w["ddp"], "{:.3f}"))
    else:
        cols = (f"{w['ddp']:,}", f"{w['textbook']:,}", glue("nano-textbook-ratio", w["textbook"] / w["ddp"], "{:.3f}"),
                f"{w['default']:,}", f"{w['default'] / w['ddp']:.3f}")
    print(f"{N:>2} {m:<6}{cols[0]:>13}{cols[1]:>17}{cols[2]:>7}{cols[3]:>15}{cols[4]:>7}")
    assert w["ddp"] == 2 * (N - 1) * 4 * psi // N                   # 2 (N-1)/N Ψ, 4 bytes each
    assert w["textbook"] == 3 * (N - 1) * 4 * psi // N              # 3 (N-1)/N Ψ
    assert w["default"] == w["textbook"] - (N - 1) * 4 * root // N  # minus one pass of the root
    ops = wire[N]["textbook"][0]["by_op"]
    assert ops["all_gather"]["wire"] == 2 * ops["reduce_scatter"]["wire"]   # two gathers, one scatter
    for o in wire[N]["textbook"]:                                   # the OS counted the same bytes
        assert 0 <= o["wchar"][0] - o["wire"][0] <= 8192 + 0.001 * o["wire"][0]

# %% [markdown]
# Exactly 1.5× DDP when every unit is gathered twice. FSDP2's default measures 1.345× on the tiny
# model: its root unit — here 31% of the parameters, because the embedding table and the head are
# large next to six small blocks — is gathered once per step instead of twice, which removes
# (N−1)/N of the root from the bill. The ratio is therefore $1.5 - \text{root}/(2\Psi)$, which
# depends on the model, and tends to 1.5 as the blocks outgrow the embeddings:

# %%
# NBVAL_CHECK_OUTPUT
for name, cfg in [("tiny", model_config("tiny")), ("tiny, d 512, 12 layers", model_config("tiny", d_model=512, n_layer=12)),
                  ("gpt2-small", model_config("gpt2-small")), ("llama3-8b", model_config("llama3-8b"))]:
    g = GPT(cfg, device="meta")
    psi = g.num_params()
    root = sum(p.numel() for n, p in g.named_parameters() if not n.startswith("blocks."))
    key = {"tiny": "tiny", "gpt2-small": "gpt2-small", "llama3-8b": "llama3-8b"}.get(name)   # rows the chapter quotes
    size = glue("gpt2-small-params", psi, "{:,}") if key == "gpt2-small" else f"{psi:,}"
    share = glue(f"{key}-root-share", root / psi, "{:.1%}") if key in ("tiny", "gpt2-small") else f"{root / psi:.1%}"
    ratio = (glue(f"{key}-fsdp2-ratio-formula", 1.5 - root / (2 * psi), "{:.3f}") if key in ("gpt2-small", "llama3-8b")
             else f"{1.5 - root / (2 * psi):.3f}")
    print(f"{name:<24} Ψ = {size:>13}  root {share:>6}  ->  FSDP2 / DDP = {ratio}")
    if name == "tiny":
        assert abs((1.5 - root / (2 * psi)) - wire[2]["default"][0]["wire"][0] / wire[2]["ddp"][0]["wire"][0]) < 1e-12

# %% [markdown]
# ### "1.5×" assumes one dtype on the wire
# The 1.5 counts passes over the parameters, as if every pass moved the same bytes. With mixed
# precision it need not: FSDP2's usual policy — and torchtitan's default —
# `MixedPrecisionPolicy(param_dtype=bfloat16, reduce_dtype=float32)` gathers bf16 parameters
# (2 bytes each, twice) and reduce-scatters fp32 gradients (4 bytes): 2 + 2 + 4 = 8 bytes per
# parameter per step, times (N−1)/N. A DDP that all-reduces fp32 gradients sends 2 × 4 = 8: the
# *same* bytes, 1.0×. A DDP that all-reduces bf16 gradients sends 2 × 2 = 4: ZeRO-3 is then 2.0×.
# Measured on real ranks (nano model, textbook schedule, bytes one rank sends in one step):

# %%
# NBVAL_CHECK_OUTPUT
nano = GPT("nano", device="meta").num_params()
print(f"{'N':>2} {'case':<16}{'all_gather':>12}{'reduce_scatter':>16}{'all_reduce':>12}{'B/param x N/(N-1)':>19}{'vs zero3':>10}")
QUOTED = {(2, "zero3 bf16/fp32", "all_gather"): "mixed-zero3-all-gather-bytes-n2",   # the cells the chapter quotes
          (2, "ddp fp32 grads", "all_reduce"): "mixed-ddp-fp32-bytes-n2",
          (2, "ddp bf16 grads", "all_reduce"): "mixed-ddp-bf16-bytes-n2"}
for N, cases in mixed.items():
    z3 = cases["zero3 bf16/fp32"][0]["wire"][0]
    for case, out in cases.items():
        ops = out[0]["by_op"]
        sent = out[0]["wire"][0]
        cell = {op: ops.get(op, {}).get("wire", 0) for op in ("all_gather", "reduce_scatter", "all_reduce")}
        cell = {op: glue(QUOTED[N, case, op], v, "{:,}") if (N, case, op) in QUOTED else f"{v:,}"
                for op, v in cell.items()}
        print(f"{N:>2} {case:<16}{cell['all_gather']:>12}{cell['reduce_scatter']:>16}{cell['all_reduce']:>12}"
              + f"{sent * N / ((N - 1) * nano):>19g}{z3 / sent:>9.1f}x")
    ops = cases["zero3 bf16/fp32"][0]["by_op"]
    assert ops["all_gather"]["wire"] == 2 * (N - 1) * 2 * nano // N          # two bf16 gathers
    assert ops["reduce_scatter"]["wire"] == (N - 1) * 4 * nano // N           # one fp32 reduce-scatter
    assert z3 == cases["ddp fp32 grads"][0]["wire"][0] == 2 * cases["ddp bf16 grads"][0]["wire"][0]
z3 = mixed[2]["zero3 bf16/fp32"][0]["wire"][0]
print(f"zero3 bf16/fp32 on 2 ranks sends {glue('mixed-zero3-bytes-n2', z3, '{:,}')} bytes a step in all")

# %% [markdown]
# PyTorch's own FSDP2 on the same ranks, counted by the operating system (it does not go through
# minishard's `comm`, so `wchar` is the only witness): more than 1.5×, because its gradient
# reduce-scatter on gloo runs as a full all-reduce (twice the ring volume; minishard sends each
# slice straight to its owner and sums locally instead, see `docs/architecture.md`).

# %%
# NBVAL_CHECK_OUTPUT
theirs = R2.run(train, TrainConfig(strategy="torch_fsdp", model="tiny", **kw))
print(f"torch FSDP2, 2 ranks: {glue('torch-fsdp2-wire-per-4psi', theirs[0]['wchar'][0] / (4 * PSI), '{:.2f}')} "
      f"x 4Ψ bytes written per rank per step (minishard's FSDP: "
      f"{glue('minishard-fsdp-wire-per-4psi', wire[2]['default'][0]['wire'][0] / (4 * PSI), '{:.2f}')}, DDP: 1.00)")
assert 1.8 < theirs[0]["wchar"][0] / (4 * PSI) < 1.9

# %% [markdown]
# ## 4. Why not always stage 3?
# Memory divided by N for 1.5× the traffic sounds like a bargain. Time it. Timing on a shared
# 2-core machine needs care: other jobs come and go within seconds, so
# [`race`](../minishard/course/ch05.py) builds a DDP model *and* a ZeRO-3 model on the same two
# ranks and alternates them step by step (ddp, fsdp, fsdp, ddp, ...), each step starting from a
# barrier; the slower rank's time counts. Next to the wall-clock time it records the CPU seconds
# each rank process burned per step, which other jobs hardly disturb. The tiny model first, then
# the nano model, where every collective is small and its latency is most of its cost.

# %%
# NBVAL_IGNORE_OUTPUT
# The ranges of fsdp / ddp that seven EARLIER runs gave (before minishard's gloo all-gather became
# point-to-point): the chapter quotes them. They are earlier runs' ranges, not this run's figures.
EARLIER = {("tiny", "wall"): (0.9, 2.1), ("tiny", "cpu"): (1.1, 1.2),
           ("nano", "wall"): (1.9, 2.6), ("nano", "cpu"): (1.8, 3.0)}
ratio = {}
for m, steps in [("tiny", 5), ("nano", 20)]:
    out = R2.run(race, model=m, steps=steps)
    t = {k: [max(a, b) for a, b in zip(out[0][k], out[1][k])] for k in out[0]}   # the slower rank
    for k, what, key in [("", "wall-clock", "wall"), ("cpu:", "CPU", "cpu")]:
        pair = statistics.median(f / d for f, d in zip(t[k + "fsdp"], t[k + "ddp"]))
        ratio[m, key] = round(pair, 2)                                  # as printed
        print(f"{m:<5}{what:>11}: ddp {statistics.median(t[k + 'ddp']) * 1e3:6.1f} ms, "
              f"fsdp {statistics.median(t[k + 'fsdp']) * 1e3:6.1f} ms per step (medians of {steps}); "
              f"fsdp / ddp = {glue(f'{m}-{key}-ratio', pair, '{:.2f}')} (median of the step-by-step ratios)")
print("fsdp / ddp in seven earlier runs (before the point-to-point all-gather), against this run:")
for (m, key), (lo, hi) in EARLIER.items():
    r = ratio[m, key]
    where = "within" if lo <= r <= hi else ("below" if r < lo else "above")
    print(f"{m:<5}{'wall-clock' if key == 'wall' else 'CPU':>11}: earlier runs "
          f"{glue(f'{m}-{key}-range', (lo, hi), '{:.1f}–{:.1f}')}, this run {r:.2f}: {where}")

# %%
# NBVAL_CHECK_OUTPUT
calls = {s: out[0]["calls"][-1] for s, out in [("ddp", ddp_run), ("fsdp", fsdp_run)]}
print(f"tiny, collectives per step: ddp {glue('tiny-ddp-collectives', calls['ddp'])}, "
      f"fsdp {glue('tiny-fsdp-collectives', calls['fsdp'])}")
print(f"tiny, bytes per step:       ddp {ddp_run[0]['wire'][-1]:,}, fsdp {fsdp_run[0]['wire'][-1]:,}")
assert calls["ddp"] == 2 and calls["fsdp"] == 2 * 6 + 1 + 6 + 1   # 13 gathers, 7 reduce-scatters
assert fsdp_run[0]["wire"][-1] > 1.3 * ddp_run[0]["wire"][-1]

# %% [markdown]
# The race above prints one run's ratios; they change from run to run. Single wall-clock figures
# on a shared 2-core machine are noisy: across seven earlier runs (before minishard's gloo
# all-gather became point-to-point) the tiny model's wall-clock ratio ranged from about 0.9 to
# 2.1 — with only a few steps a burst of other load can hide the gap or double it — while its
# CPU-time ratio stayed at 1.1–1.2, and the nano model's ratios were 1.9–2.6 (wall clock) and
# 1.8–3.0 (CPU time); the race's last lines say where this run falls. Stage 3 is slower here, and
# more so the smaller the collectives.
# Where does the time go? The timeline of one step shows it: DDP's two all-reduces run during
# backward, while each of ZeRO-3's forward all-gathers sits on the critical path — a block cannot
# compute before its weights have arrived (prefetch is off: `train(..., TrainConfig(prefetch=0))`, the
# default) — and there are 20 collectives instead of 2, each with its own latency. (Prefetching
# the next unit while the current one computes hides much of this; that is the prefetch
# chapter's subject.)

# %%
timeline_figure([e for e in events if e.get("step") == 1]).update_layout(
    title="ZeRO-3 (fsdp), step 1: all-gathers (teal) before each block, reduce-scatters (purple) in backward").show()

# %%
# NBVAL_IGNORE_OUTPUT
def blocked_in_all_gather(events, rank=0, step=1):
    """Forward time and the part of it this rank spent in all-gathers (it cannot compute then)."""
    f = [e for e in events if e["kind"] == "phase" and e["name"] == "forward" and e["rank"] == rank
         and e.get("step") == step]
    t0, t1 = f[0]["t"], f[1]["t"]
    ag = sum(e["t_end"] - e["t"] for e in events if e["kind"] == "collective" and e["op"] == "all_gather"
             and e["rank"] == rank and t0 <= e["t"] <= t1)
    return t1 - t0, ag

fwd, ag = blocked_in_all_gather(events)
print(f"rank 0, step 1: forward {fwd * 1e3:.0f} ms, of which "
      f"{glue('forward-wait', (ag * 1e3, ag / fwd), '{:.0f} ms ({:.0%})')} waiting in all-gathers")

# %% [markdown]
# And what did the extra time buy? The tiny model under plain DDP needs 168 MiB per rank at its
# peak (§2's table). It fits on any accelerator ever made; dividing its state by N buys nothing
# but a slower step. Stage 3 pays off when the model does *not* fit otherwise — and then the
# comparison is not "slower than DDP" but "runs versus does not run". Even then, take the
# smallest stage that fits: for Llama-3-8B on eight 80 GB GPUs ZeRO-1 already fits the state,
# and stage 3's extra room is worth its traffic only if the activations need it.

# %%
# NBVAL_CHECK_OUTPUT
llama = GPT("llama3-8b", device="meta")
for s in STAGES:
    need = estimate(llama, world_size=8, strategy=s, precision="bf16_mixed").state_bytes / 1e9
    print(f"llama3-8b, 8 x 80 GB, {s:<5}: {need:6.1f} GB of state per rank -> "
          f"{'fits, with ' + format(80 - need, '.0f') + ' GB left for activations' if need < 80 else 'does not fit'}")
fits = {s: estimate(llama, world_size=8, strategy=s, precision="bf16_mixed").state_bytes < 80e9 for s in STAGES}
assert fits == {"ddp": False, "zero1": True, "zero2": True, "zero3": True}

# %% [markdown]
# ### Is stage 3 the first choice? The two source texts disagree
# The book chapter this course grew from calls stage 3's bargain — 1.5× the traffic for memory
# divided by N — the reason it can be the *first choice*. The "FSDP vs ZeRO" article says the opposite:
# stage 3 is strong, but not the answer to reach for first. Both are right about something
# this notebook measured:
#
# * **For:** the state really is divided by N (§1, to the byte), and the traffic grows much less
#   than the memory falls — 1.5× DDP's bytes with one dtype, 1.345× with the root kept, and the
#   *same* bytes as an fp32-gradient DDP under FSDP2's usual bf16/fp32 policy (§3).
# * **Against:** on a model that fits anyway it is slower here (§4's race), it makes ten times as
#   many collectives, its forward gathers sit on the critical path
#   unless prefetched, and every gain depends on the network.
#
# At cluster scale the planner (a model, not a measurement: chapter 10) puts the two sides on the
# same job, Llama-3-8B with recomputation: ZeRO-3 against ZeRO-1 on one NVLink node, and on two
# nodes joined by 100 Gb Ethernet.

# %%
# NBVAL_CHECK_OUTPUT
from minishard.planner.costmodel import DEVICES, LINKS, Cluster, plan

measured = {"state ratio, zero3 / ddp (§1)": sum(runs["fsdp"][0]["ledger"]["final"].values())
            / sum(runs["ddp"][0]["ledger"]["final"].values()),
            "bytes ratio, textbook (§3)": wire[2]["textbook"][0]["wire"][0] / wire[2]["ddp"][0]["wire"][0],
            "bytes ratio, bf16/fp32 policy vs fp32 DDP (§3)":
                mixed[2]["zero3 bf16/fp32"][0]["wire"][0] / mixed[2]["ddp fp32 grads"][0]["wire"][0],
            "collectives per step, zero3 / ddp (§4)": calls["fsdp"] / calls["ddp"]}
NAMES = ["state-ratio", "textbook-bytes-ratio", "mixed-bytes-ratio", "collectives-ratio"]
for (k, v), n in zip(measured.items(), NAMES):
    print(f"measured  {k:<48}{glue(n, v, '{:.2f}'):>6}")
h100 = DEVICES["h100-80gb"]
for label, key, cluster in [("1 node x 8 H100, NVLink", "nvlink", Cluster(h100, 8)),
                            ("2 nodes x 8 H100, 100 Gb Ethernet", "ethernet",
                             Cluster(h100, 8, 2, inter=LINKS["ethernet-100g"]))]:
    z1, z3 = (plan("llama3-8b", cluster, s, recompute=True) for s in ("zero1", "zero3"))
    print(f"modelled  {label:<34} ZeRO-3 / ZeRO-1: "
          f"memory {glue(f'{key}-memory-ratio', z3.total_memory / z1.total_memory, '{:.2f}')}, "
          f"step time {glue(f'{key}-step-ratio', z3.step_s / z1.step_s, '{:.2f}')}")
assert measured["state ratio, zero3 / ddp (§1)"] == 0.5 and measured["collectives per step, zero3 / ddp (§4)"] == 10
assert measured["bytes ratio, textbook (§3)"] == 1.5 and measured["bytes ratio, bf16/fp32 policy vs fp32 DDP (§3)"] == 1.0

# %% [markdown]
# Same memory saving, opposite verdicts on time: on NVLink the planner predicts no slowdown for
# about half the memory, so "first choice" is fair there; over Ethernet it predicts the same job
# about half again slower, and ZeRO-1, which fits, is the better choice. The disagreement is the
# trade-off itself: stage 3 is the first choice only where the network can carry it.

# %% [markdown]
# ## 5. ZeRO++: fewer bits on the wire
# §3 counted passes and dtypes; ZeRO++ (DeepSpeed) attacks the bytes of each pass instead, in
# three parts:
#
# * **qwZ** — the weights' all-gather quantized: in minishard each rank cuts what it sends into
#   blocks of 256 elements and sends one fp32 scale per block (the block's largest magnitude / 127)
#   and every element as the nearest int8 multiple of it (DeepSpeed's groups are far larger, about
#   4,000 to 8,000 elements: the 256 is minishard's, small so that the scales show); every rank
#   dequantizes what arrives, its own block too, so all ranks compute with the same weights. The fp32 master shards stay exact: only the
#   copy a unit computes with is rounded.
# * **qgZ** — the gradient reduction quantized. A reduce-scatter sums as it goes, and summing
#   int8 values would overflow and compound the rounding; so qgZ sends through an **all-to-all**
#   instead: each rank quantizes the slice meant for every other rank, the slices cross once
#   ((N−1)/N of the buffer, as a reduce-scatter), and each rank dequantizes the N contributions to
#   its own slice and sums them in fp32. DeepSpeed does it in two hops — an all-to-all inside the
#   node, a sum, an all-to-all across nodes — in 4 bits on both; minishard does one hop, in 8 or 4
#   bits.
# * **hpZ** — a secondary copy of the weights sharded inside the node, so that backward's
#   all-gather never leaves it: that is `reshard_after_forward=k`, measured on four ranks in
#   chapter 10 §4.3.
#
# Per rank's part of n elements minishard's wire carries 4·⌈n/256⌉ bytes of scales and n·bits/8 of values
# (to whole 4 bytes). On two ranks, one step of the nano model with each dtype on the wire — the
# bytes one rank sends, from the trace, each checked against that formula:
#
# <details><summary>中文</summary>
#
# §3 数的是遍数和 dtype；ZeRO++（DeepSpeed）则削减每一遍的字节数，分三部分：
#
# * **qwZ**——权重的 all-gather 做量化：minishard 里每个 rank 把要发送的数据切成 256 个元素一块，每块发一个
#   fp32 的 scale（块内最大绝对值 / 127），每个元素发成最接近的 int8 倍数（DeepSpeed 的分组大得多，约 4,000 到
#   8,000 个元素；256 是 minishard 为了让 scale 的开销看得见而选的）；每个 rank 把收到的反量化，
#   包括自己那一块，所以所有 rank 用同样的权重计算。fp32 的主权重分片保持精确：被取整的只是单元计算时用的那份副本。
# * **qgZ**——梯度归约做量化。reduce-scatter 边传边加，直接加 int8 会溢出、误差会累积；所以 qgZ 改用
#   **all-to-all**：每个 rank 把发给其他每个 rank 的那一片量化，各片只交换一次（与 reduce-scatter 一样发送缓冲区的
#   (N−1)/N），每个 rank 把收到的 N 份贡献反量化后用 fp32 求和。DeepSpeed 分两跳做——节点内一次
#   all-to-all、求和、再跨节点一次 all-to-all，两跳都量化到 4 位；minishard 只做一跳，8 位或 4 位。
# * **hpZ**——在节点内再切一份权重的副本（secondary copy），让反向的 all-gather 不出节点：这就是
#   `reshard_after_forward=k`，第 10 章 §4.3 在四个 rank 上测过。
#
# 每个 rank 的 n 个元素，minishard 实际发送的是 4·⌈n/256⌉ 字节的 scale 加 n·bits/8 字节的值（凑整到 4 字节）。
# 下面在两个 rank 上用 nano 模型跑一步，分别用各种 dtype 通信——一个 rank 发送的字节数取自 trace，
# 每一项都对照上面的公式检查：
#
# </details>

# %%
# NBVAL_CHECK_OUTPUT
from minishard.core import quantized

one = dict(strategy="fsdp", model="nano", micro_batch=2, steps=1, track_activations=False)
WIRE = {"fp32": dict(), "bf16 (bf16_mixed)": dict(precision="bf16_mixed"),
        "int8 (qwZ + qgZ)": dict(quantized_weights=8, quantized_gradients=8),
        "int4 (qwZ + qgZ, 4 bits)": dict(quantized_weights=4, quantized_gradients=4)}
per_op, parts = {}, {}
for case, kw in WIRE.items():
    out = R2.run(train, TrainConfig(**one, **kw))
    ops = out[0]["by_op"]
    per_op[case] = (ops["all_gather"]["wire"], sum(ops.get(o, {}).get("wire", 0) for o in ("reduce_scatter", "all_to_all")))
    if case == "fp32":                       # each unit's part on a rank (elements), and its gathers a step
        mine = [e for e in R2.last_events if e["kind"] == "collective" and e["op"] == "all_gather" and e["rank"] == 0]
        parts = {e["tag"]: e["payload"] // 4 // 2 for e in mine}
        gathers = {u: sum(e["tag"] == u for e in mine) for u in parts}
print(f"{'on the wire':<26}{'all-gathers':>13}{'gradients':>11}{'total':>11}{'vs fp32':>9}{'vs bf16':>9}")
fp32_total, bf16_total = sum(per_op["fp32"]), sum(per_op["bf16 (bf16_mixed)"])
for case, (gathered, reduced) in per_op.items():
    total = gathered + reduced
    key = {"int8 (qwZ + qgZ)": "int8", "int4 (qwZ + qgZ, 4 bits)": "int4"}.get(case)
    vs32 = glue(f"zeropp-{key}-vs-fp32", total / fp32_total, "{:.3f}") if key else f"{total / fp32_total:.3f}"
    vs16 = glue(f"zeropp-{key}-vs-bf16", total / bf16_total, "{:.3f}") if key else f"{total / bf16_total:.3f}"
    print(f"{case:<26}{gathered:>13,}{reduced:>11,}{total:>11,}{vs32:>9}{vs16:>9}")
for case, bytes_of in [("fp32", lambda n: 4 * n), ("bf16 (bf16_mixed)", lambda n: 2 * n),
                       *[(c, lambda n, b=b: quantized.packed_bytes(n, quantized.Scheme(b)))
                         for c, b in [("int8 (qwZ + qgZ)", 8), ("int4 (qwZ + qgZ, 4 bits)", 4)]]]:
    sent = {u: (2 - 1) * bytes_of(n) for u, n in parts.items()}      # each pass sends (N-1) parts, N = 2
    reduced = sum(sent.values()) if case != "bf16 (bf16_mixed)" else sum(4 * n for n in parts.values())
    assert per_op[case] == (sum(gathers[u] * sent[u] for u in parts), reduced), case   # (bf16_mixed reduces in fp32)

# %% [markdown]
# int8 sends a little over a quarter of fp32's bytes and a little over a third of the bf16
# policy's (its reduce-scatter stays fp32, so bf16 is not half of fp32 here); int4 a little over
# an eighth of fp32's — "a little over" is the scales, 4 bytes per 256 elements. What does the
# rounding cost? The same 20 AdamW steps, unquantized and quantized four ways — the loss at every
# step, and how far each run's model has drifted from the unquantized one, relative to how far
# training moved it (`minishard.training.parity.drift`: 0 is the same model, 1 a drift as large as the
# whole training):
#
# <details><summary>中文</summary>
#
# int8 的字节数略多于 fp32 的四分之一、略多于 bf16 策略的三分之一（它的 reduce-scatter 仍是 fp32，
# 所以这里 bf16 并不是 fp32 的一半）；int4 略多于 fp32 的八分之一——"略多"的是 scale，
# 每 256 个元素 4 字节。取整的代价是什么？同样 20 步 AdamW，不量化和四种量化方式各跑一遍——每一步的
# loss，以及每个 run 的模型相对不量化的那个漂移了多远，以训练本身把模型移动的距离为单位
# （`minishard.training.parity.drift`：0 是同一个模型，1 是与整个训练一样大的漂移）：
#
# </details>

# %%
from minishard.training.parity import drift, params_of

RUNS = {"unquantized": dict(), "int8 weights (qwZ)": dict(quantized_weights=8),
        "int8 gradients (qgZ)": dict(quantized_gradients=8),
        "int8 weights + int4 gradients": dict(quantized_weights=8, quantized_gradients=4),
        "int4 weights": dict(quantized_weights=4)}
twenty = dict(one, steps=20, return_params=True)
curves = {name: R2.run(train, TrainConfig(**twenty, **kw))[0] for name, kw in RUNS.items()}
start = params_of(GPT("nano", seed=0))
drifts = {name: drift(c["params"], curves["unquantized"]["params"], start) for name, c in curves.items()}
fig = go.Figure([go.Scatter(y=c["losses"], name=name, mode="lines") for name, c in curves.items()])
fig.update_layout(title="20 steps, 2 ranks, nano: the loss with each quantization", xaxis_title="step",
                  yaxis_title="loss", height=360)
display(fig)
DRIFT_KEYS = {"int8 weights (qwZ)": "int8-weights", "int8 gradients (qgZ)": "int8-grads",
              "int8 weights + int4 gradients": "int8-weights-int4-grads", "int4 weights": "int4-weights"}
for name, d in list(drifts.items())[1:]:      # the digits vary with the CPU's kernels: not a checked cell
    print(f"{name:<32} drift {glue(f'zeropp-drift-{DRIFT_KEYS[name]}', d.overall, '{:.3f}')}  (most: {d.worst_tensor})")

# %%
# NBVAL_CHECK_OUTPUT
base = curves["unquantized"]["losses"]
for name, c in list(curves.items())[1:]:
    worst = max(abs(a - b) / b for a, b in zip(c["losses"], base))
    print(f"{name:<32} loss within 1% at every step: {worst < 0.01}   drift below 0.35: {drifts[name].overall < 0.35}")
print("int4 weights drift over 3x int8 weights:", drifts["int4 weights"].overall > 3 * drifts["int8 weights (qwZ)"].overall)
print("int8 gradients drift least:", min(drifts, key=lambda k: drifts[k].overall if k != "unquantized" else 9) == "int8 gradients (qgZ)")

# %% [markdown]
# The loss curves lie on top of each other; the drift tells them apart. Quantized gradients cost
# least: each contribution is rounded once, then summed in fp32 and applied to an exact fp32
# master, so the rounding averages out across steps. int8 weights cost more — every forward and
# backward computes with a rounded model — and int4 weights are another matter: a block has only
# 15 levels, so a LayerNorm weight near 1 snaps to steps of 1/7 and the small updates training
# makes to it are invisible to the computation. Which is why ZeRO++'s recipe is int8 weights and
# int4 gradients, not int4 everywhere.
#
# **When is it worth it?** Count the bytes that cross the slow link, per parameter per step.
# ZeRO-3 in fp16 (DeepSpeed's baseline) sends 2 + 2 + 2. ZeRO++ sends the forward gather in int8
# (1 byte), keeps the backward gather inside the node (hpZ: 0 bytes across) and sends the
# gradients in int4 across nodes (½ byte):
#
# <details><summary>中文</summary>
#
# 几条 loss 曲线几乎重合；漂移才把它们区分开。量化梯度代价最小：每份贡献只取整一次，然后用 fp32 求和，
# 更新到精确的 fp32 主权重上，取整误差在多步之间互相抵消。int8 权重代价更大——每次前向和反向都用取整后的模型计算——
# 而 int4 权重就是另一回事了：一个块只有 15 个等级，接近 1 的 LayerNorm 权重被吸附到 1/7 的台阶上，
# 训练对它的微小更新在计算中根本看不到。所以 ZeRO++ 的配方是 int8 权重加 int4 梯度，而不是处处 int4。
#
# 那么什么时候值得？数一数每个参数每一步跨过慢速链路的字节。fp16 的 ZeRO-3（DeepSpeed 的基线）发送
# 2 + 2 + 2。ZeRO++ 前向 all-gather 用 int8（1 字节），反向 all-gather 留在节点内（hpZ：跨节点 0 字节），
# 跨节点的梯度用 int4（½ 字节）：
#
# </details>

# %%
# NBVAL_CHECK_OUTPUT
scale = 4 / quantized.BLOCK                       # the scales' share, bytes per element
across = {"ZeRO-3, fp16": (2, 2, 2), "ZeRO-3 + qwZ": (1 + scale, 1 + scale, 2),
          "ZeRO-3 + qwZ + hpZ": (1 + scale, 0, 2), "ZeRO++ (qwZ + hpZ + qgZ int4)": (1 + scale, 0, 0.5 + scale)}
for name, (fwd, bwd, grads) in across.items():
    total = fwd + bwd + grads
    print(f"{name:<30} forward {fwd:6.4f} + backward {bwd:6.4f} + gradients {grads:6.4f} = {total:6.4f} B"
          f"  ->  {glue('zeropp-across-reduction', 6 / total, '{:.2f}') if name.startswith('ZeRO++') else format(6 / total, '.2f')}x fewer")

# %% [markdown]
# 4× fewer bytes across nodes — DeepSpeed's headline figure, and where it comes from; 3.9× with
# minishard's blocks of 256, whose scales DeepSpeed's far larger groups make negligible. What it costs is not only the drift above: the quantize and dequantize
# kernels run on every pass, the hpZ copy holds 1/k of each unit instead of 1/N between forward
# and backward (chapter 10 §4.3), and the two-hop gradient reduction adds a collective. It pays where
# the slow link is the bottleneck — many nodes on Ethernet or a thin InfiniBand fabric, small
# per-rank batches — and not inside one NVLink node, where the bytes were cheap to begin with and
# the kernels' time is all cost.
#
# <details><summary>中文</summary>
#
# 跨节点的字节少 4 倍——这就是 DeepSpeed 的标题数字，以及它的来历；按 minishard 每 256 个元素一个 scale 算是
# 3.9 倍，DeepSpeed 的分组大得多，scale 的开销可以忽略。代价不只是
# 上面的漂移：每一遍都要跑量化和反量化的 kernel，hpZ 的副本在前向和反向之间让每个单元占 1/k 而不是 1/N
# （第 10 章 §4.3），两跳的梯度归约还多一次集合通信。在慢速链路是瓶颈的地方它才划算——很多节点、走以太网或
# 较窄的 InfiniBand，每个 rank 的 batch 较小；在一个 NVLink 节点内部则不划算，那里字节本来就便宜，
# kernel 的时间全是成本。
#
# </details>

# %% [markdown]
# ## 6. DeepSpeed's stage 3 beside FSDP
# Stage 3 as DeepSpeed 0.19 runs it (`strategy="deepspeed_zero3"`, watched by `minishard.watch`:
# its collectives, what its ZeRO optimizer holds, and each submodule it gathers as a unit) beside
# minishard's FSDP and PyTorch's FSDP2 (one unit per block, the root its own), on the same ranks,
# model and global batch: the nano model on two ranks, two sequences a rank, fp32 AdamW, 0.15 MiB
# buckets, five steps; the tables read the third — DeepSpeed records its module order in the
# second, and from the third on its prefetch and release follow it — and the times are the median
# of the last four. DeepSpeed three times: with its defaults, with the persistence threshold at 0,
# and with the live and reuse bounds at 0 as well
# ([`minishard/course/zero_vs_fsdp.py`](../minishard/course/zero_vs_fsdp.py)).
#
# <details><summary>中文</summary>
#
# DeepSpeed 0.19 所实现的 stage 3（`strategy="deepspeed_zero3"`，由 `minishard.watch` 记录：它的集合通信、
# 它的 ZeRO 优化器持有的一切，以及它作为单元收集的每个子模块），与 minishard 的 FSDP 和 PyTorch 的 FSDP2
# （每个 block 一个单元，root 单独一个）并排，用同样的 rank、模型和全局批次：nano 模型、两个 rank、每个
# rank 两条序列、fp32 AdamW、0.15 MiB 的桶、五步；表格读第三步——DeepSpeed 在第二步记录模块顺序，从第三步
# 起按它预取和释放——耗时取后四步的中位数。DeepSpeed 跑三次：用它的默认值；把常驻阈值设为 0；再把在途
# 上限与复用距离也设为 0。
#
# </details>

# %%
from minishard.course.zero_vs_fsdp import (compare, deepspeed_terms, measured_terms, standing, state_table,
                                           terms_table, wire_table)
from minishard.strategies.deepspeed_native import DS_DEFAULTS
NANO = GPT("nano", device="meta")
PSI_N, N_ROOT = NANO.num_params(), sum(p.numel() for n, p in NANO.named_parameters() if not n.startswith("blocks."))
OWNERS = sum(1 for m in NANO.modules() if any(True for _ in m.parameters(recurse=False)))   # DeepSpeed's units
SIDE = dict(model="nano", micro_batch=2, steps=5, bucket_cap_mb=0.15)
side = {r["name"]: r for r in compare(R2, ["ZeRO-3 / FSDP (minishard)", "FSDP2 (PyTorch)", "ZeRO-3 (DeepSpeed, bounds 0)",
                                           "ZeRO-3 (DeepSpeed, threshold 0)", "ZeRO-3 (DeepSpeed, its defaults)"],
                                      step=2, **SIDE)}
fsdp, bounded = side["ZeRO-3 / FSDP (minishard)"], side["ZeRO-3 (DeepSpeed, bounds 0)"]
threshold0, defaults = side["ZeRO-3 (DeepSpeed, threshold 0)"], side["ZeRO-3 (DeepSpeed, its defaults)"]

# %% [markdown]
# **Memory per rank, by category**, between steps, and DeepSpeed's stage-3 holdings term by term
# as DeepSpeed 0.19's code sizes them, beside the watch's measurement:

# %%
# NBVAL_CHECK_OUTPUT
# claim: Z3d
print(state_table(list(side.values())))
terms = deepspeed_terms(3, world_size=2, bucket_cap_mb=SIDE["bucket_cap_mb"])
print()
print(terms_table(terms, measured_terms(bounded, terms)))
assert measured_terms(bounded, terms) == {t: b for t, (_, b) in terms.items()}     # to the byte
shard = 4 * PSI_N // 2
for r in (fsdp, side["FSDP2 (PyTorch)"]):
    assert r["state"] == {c: shard for c in ("params", "grads", "exp_avg", "exp_avg_sq")}      # 16Ψ/N
assert bounded["state"] == threshold0["state"] == standing(3, terms)                          # 20Ψ/N + bucket
assert max(p.numel() for p in NANO.parameters()) <= DS_DEFAULTS["stage3_param_persistence_threshold"]
assert defaults["state"] == {**standing(3, terms), "unsharded": 4 * PSI_N}                    # every one kept whole
print(f"\nbetween steps: FSDP {glue('fsdp-nano-state', sum(fsdp['state'].values()), '{:,}')} B (16Ψ/N); "
      f"DeepSpeed bounded {glue('ds-zero3-state', sum(bounded['state'].values()), '{:,}')} B (20Ψ/N + its reduce bucket); "
      f"with its defaults {glue('ds-zero3-defaults-state', sum(defaults['state'].values()), '{:,}')} B (+ 4Ψ kept whole)")

# %% [markdown]
# FSDP keeps exactly 16Ψ/N. DeepSpeed keeps a fourth fp32 term, a copy of its partitions: it
# aliases them only when their device equals its device *name*, a comparison of a `torch.device`
# with a string that is never true, so fp32 training pays the copy too; its gradient partitions
# and its reduce bucket live for the whole run. With its defaults it shards nothing of this
# model: `stage3_param_persistence_threshold` keeps every parameter of at most 10⁵ elements whole
# on every rank, and the nano model's largest has 32,768 — 4Ψ more, more than DeepSpeed's own
# stage 2 holds.
#
# **Bytes per step, by collective**, and how many:
#
# <details><summary>中文</summary>
#
# FSDP 恰好保留 16Ψ/N。DeepSpeed 多一项 fp32：它那几片参数的副本——只有当分片所在设备等于它的设备*名字*时它才
# 直接复用，而这是拿 `torch.device` 和字符串比较，永远不相等，所以 fp32 训练也要付出这份副本；它的梯度分片和
# 归约桶整个运行期间都在。用默认值时它对这个模型什么都不切：`stage3_param_persistence_threshold` 让每个不超过
# 10⁵ 个元素的参数在每个 rank 上保持完整，而 nano 模型最大的参数只有 32,768 个元素——多出 4Ψ，比 DeepSpeed
# 自己的 stage 2 还多。下面是每步各集合通信的字节数和次数：
#
# </details>

# %%
# NBVAL_CHECK_OUTPUT
print(wire_table(list(side.values()), baseline="ZeRO-3 / FSDP (minishard)", label="× FSDP"))
DDP_BYTES = 4 * PSI_N                                                   # 2(N-1)/N · 4Ψ on two ranks
ratios = {name: r["wire"] / DDP_BYTES for name, r in side.items()}
assert fsdp["wire"] == side["FSDP2 (PyTorch)"]["wire"] == 2 * (3 * PSI_N - N_ROOT)        # root kept gathered
assert fsdp["ops"]["all_gather"]["calls"] == 2 * 3 + 1 and fsdp["calls"] == 11            # 3 blocks and the root
assert bounded["ops"]["all_gather"]["calls"] == 2 * OWNERS and abs(ratios["ZeRO-3 (DeepSpeed, bounds 0)"] - 1.5) < 1e-3
assert threshold0["ops"]["all_gather"]["calls"] < OWNERS and abs(ratios["ZeRO-3 (DeepSpeed, threshold 0)"] - 1) < 1e-3
assert defaults["ops"]["all_gather"]["calls"] == len(list(NANO.parameters())) and abs(ratios["ZeRO-3 (DeepSpeed, its defaults)"] - 1) < 1e-3
print(f"\n× DDP's bytes: FSDP {glue('fsdp-nano-wire-ratio', ratios['ZeRO-3 / FSDP (minishard)'], '{:.3f}')}, "
      f"DeepSpeed bounded {glue('ds-zero3-bounded-wire-ratio', ratios['ZeRO-3 (DeepSpeed, bounds 0)'], '{:.3f}')} "
      f"in {glue('ds-zero3-bounded-calls', bounded['calls'])} collectives ({OWNERS} submodules gathered twice), "
      f"threshold 0 {ratios['ZeRO-3 (DeepSpeed, threshold 0)']:.3f} "
      f"in {glue('ds-zero3-threshold0-gathers', threshold0['ops']['all_gather']['calls'])} all-gathers, "
      f"its defaults {glue('ds-zero3-defaults-wire-ratio', ratios['ZeRO-3 (DeepSpeed, its defaults)'], '{:.3f}')} "
      f"in {defaults['ops']['all_gather']['calls']} all-gathers (one per parameter, after the step)")

# %% [markdown]
# DeepSpeed's unit is every submodule that owns parameters — 22 on the nano model, against FSDP's
# four — each gathered before it runs, in forward and again in backward, and released after:
# bounded to 0 it is the textbook schedule, 3(N−1)/N·Ψ, exactly 1.5× DDP, in 52 collectives
# against FSDP's 11 (which keeps its root gathered, 1.344×). Left at 10⁹, the live and reuse
# bounds let DeepSpeed's prefetch gather the whole model in a couple of all-gathers once its
# trace is recorded, and keep every parameter until backward has used it: 1.0× DDP, with the whole
# model gathered at once. With its defaults the parameters never leave the ranks whole; the
# 41 all-gathers after each step bring every rank the updated parameters from their owners. What
# each holds gathered at once, and the step times (this machine's, not compared across
# machines):
#
# <details><summary>中文</summary>
#
# DeepSpeed 的单元是每一个自己持有参数的子模块——nano 模型上有 22 个，而 FSDP 只有四个——每个在运行前收集，
# 前向一次、反向再一次，用完释放：上限都设为 0 时就是教科书的调度，3(N−1)/N·Ψ，恰好是 DDP 的 1.5 倍，
# 52 次集合通信，而 FSDP 只要 11 次（它让 root 保持收集，1.344 倍）。上限保持 10⁹ 时，DeepSpeed 一旦记录好
# 模块顺序，预取就用寥寥几次 all-gather 收集整个模型，并让每个参数留到反向用完：DDP 的 1.0 倍，整个模型同时
# 处于收集状态。用默认值时参数始终完整地留在各 rank 上；每步之后的 41 次 all-gather 把更新后的参数从各自的
# 所有者发给每个 rank。下面是各自同时持有的已收集参数，以及单步耗时（本机的数字，不跨机器比较）：
#
# </details>

# %%
# NBVAL_CHECK_OUTPUT
gathered = {name: r["category_peaks"].get("unsharded", 0) for name, r in side.items()}
largest = 4 * max(sum(p.numel() for p in m.parameters(recurse=False)) for m in NANO.modules())
print(f"gathered at once, rank 0: FSDP {gathered['ZeRO-3 / FSDP (minishard)']:,} B and FSDP2 "
      f"{gathered['FSDP2 (PyTorch)']:,} B (the root and one block); DeepSpeed threshold 0 and defaults "
      f"{gathered['ZeRO-3 (DeepSpeed, threshold 0)']:,} B = 4Ψ; DeepSpeed bounded between its largest "
      f"submodule ({largest:,} B) and FSDP's: {largest <= gathered['ZeRO-3 (DeepSpeed, bounds 0)'] < gathered['ZeRO-3 / FSDP (minishard)']}")
assert gathered["ZeRO-3 / FSDP (minishard)"] == gathered["FSDP2 (PyTorch)"] == 4 * (N_ROOT + (PSI_N - N_ROOT) // 3)
assert gathered["ZeRO-3 (DeepSpeed, threshold 0)"] == gathered["ZeRO-3 (DeepSpeed, its defaults)"] == 4 * PSI_N

# %%
# NBVAL_IGNORE_OUTPUT
print(f"DeepSpeed bounded: at most {glue('ds-zero3-bounded-gathered', gathered['ZeRO-3 (DeepSpeed, bounds 0)'], '{:,}')} B gathered at once")
for name, r in side.items():
    print(f"{name:<34}{r['step_s'] * 1e3:8.1f} ms a step (median of the slowest rank)")
step = {name: r["step_s"] / fsdp["step_s"] for name, r in side.items()}
print(f"× FSDP's step: DeepSpeed bounded {glue('ds-zero3-bounded-time-ratio', step['ZeRO-3 (DeepSpeed, bounds 0)'], '{:.1f}')}×, "
      f"threshold 0 {glue('ds-zero3-threshold0-time-ratio', step['ZeRO-3 (DeepSpeed, threshold 0)'], '{:.1f}')}×, "
      f"defaults {glue('ds-zero3-defaults-time-ratio', step['ZeRO-3 (DeepSpeed, its defaults)'], '{:.1f}')}×")

# %%
R2.close()

# %% [markdown]
# > **Takeaway.** ZeRO-3 shards the parameters too: between uses a rank keeps 1/N of every
# > weight, gradient and optimizer moment — 16Ψ/N bytes, measured to the byte — and a unit's full
# > parameters exist only while it computes (the `unsharded` staircase of §2). The price is a third
# > pass of the parameters over the network: 3(N−1)/N·Ψ elements per rank per step, exactly 1.5×
# > DDP when every unit is gathered twice, 1.345× for this model with FSDP2's habit of keeping the
# > root gathered. In bytes that assumes one dtype on the wire: with FSDP2's usual bf16 gathers and
# > fp32 reduce-scatter, ZeRO-3 sends exactly what a DDP with fp32 gradients sends, and twice a
# > DDP with bf16 gradients. Plus 20 collectives instead of 2, the forward ones on the critical
# > path: on a model that fits anyway, stage 3 is simply slower. Use it when memory, not time, is
# > what you lack.
#
# <details><summary>中文</summary>
#
# > **要点。** ZeRO-3 把参数也切开：不用的时候，一个 rank 只保留每个权重、梯度和优化器矩的 1/N——
# > 16Ψ/N 字节，实测精确到字节——一个单元的完整参数只在它计算时存在（§2 里 `unsharded` 的台阶）。
# > 代价是参数在网络上多走一遍：每个 rank 每步 3(N−1)/N·Ψ 个元素，每个单元收集两次时恰好是 DDP
# > 的 1.5×，在 FSDP2 保持 root 收集的做法下，这个模型是 1.345×。按字节计，这假设通信只用一种
# > dtype：用 FSDP2 常用的 bf16 收集加 fp32 reduce-scatter，ZeRO-3 发送的与 fp32 梯度的 DDP 完全
# > 相同，是 bf16 梯度的 DDP 的两倍。再加上 20 次而不是 2 次集合通信，前向那些还在关键路径上：在一个
# > 本来就放得下的模型上，stage 3 就是更慢。缺的是显存而不是时间时，才用它。
#
# </details>
#
# **Questions**
#
# 1. With FSDP2's default, why is the root unit not freed after forward like the blocks?
#
# <details><summary>Answer</summary>
#
# Backward begins with the root: the loss's gradient flows first through the head and the final
# norm, which live in the root. Freeing it at the end of forward only to gather it again a moment
# later would cost one more all-gather of the root (31% of the tiny model) for almost no memory
# saved, since the peak of the step is reached around that moment anyway.
# </details>
#
# 2. On 64 ranks, how many bytes does a ZeRO-3 rank send per step for a 1B-parameter model in
# bf16 (textbook schedule), and how does that compare with DDP?
#
# <details><summary>Answer</summary>
#
# 3 · 63/64 · 1e9 parameters · 2 bytes ≈ 5.9 GB, against DDP's 2 · 63/64 · 2 GB ≈ 3.9 GB: 1.5×.
# Per-rank traffic barely grows with N; the number of collectives and their latency do not
# shrink either.
# </details>
#
# 3. Stage 3 was slower here. Name two conditions under which it is the faster choice.
#
# <details><summary>Answer</summary>
#
# (a) When the alternative does not fit at all, or only with a much smaller micro-batch: the
# memory freed by sharding can hold larger batches or avoid activation recomputation, which
# raises throughput. (b) When the network is fast relative to compute and the gathers are
# prefetched, so that they overlap computation: the extra traffic then costs little wall time.
# </details>

# %% [markdown]
# ## Exercise: gather one parameter from its shards
# Under ZeRO-3 a parameter is cut along dim 0 into N blocks of ceil(rows / N) rows, the last ones
# zero-padded; rank r keeps block r. Write the unshard of one parameter: all-gather the blocks,
# drop the padding, rebuild the full tensor. The check shards the nano GPT on 1, 2 and 3 real
# ranks, runs your function on every shard and compares with minishard's own gather
# (`fsdp.full_parameters`) and the all-gather's bytes. The function is sent to the ranks as
# source: keep it self-contained.
#
# Write it in the cell below (or edit the stub in
# [`minishard/course/exercises/ch05.py`](../minishard/course/exercises/ch05.py)), then run the check. A
# reference solution is in [`solutions/ch05.py`](../solutions/ch05.py): try first.
#
# <details><summary>中文</summary>
#
# **练习：从分片收集出一个参数。** 在 ZeRO-3 下，一个参数沿 dim 0 被切成 N 块，每块 ceil(rows / N)
# 行，最后几块用零填充；rank r 保留第 r 块。写出一个参数的 unshard（收集完整参数）：all-gather 所有块，去掉
# 填充，重建完整张量。检查程序在 1、2、3 个真实 rank 上对 nano GPT 分片，在每个分片上运行你的函数，
# 并与 minishard 自己的收集（`fsdp.full_parameters`）以及 all-gather 的字节数对比。函数以源码形式
# 发送到各个 rank：请让它自包含。
#
# 在下面的单元格里写（或者编辑 [`minishard/course/exercises/ch05.py`](../minishard/course/exercises/ch05.py)
# 里的桩函数），然后运行检查。参考答案在 [`solutions/ch05.py`](../solutions/ch05.py)：先自己试。
#
# </details>

# %%
def unshard_param(comm, shard, shape):
    """The full parameter of shape `shape` from this rank's shard (ceil(shape[0] / N) rows,
    zero-padded). comm.all_gather(out, inp): out (N x inp.numel()) gets every rank's inp in order."""
    raise NotImplementedError("your code here")

# %%
# NBVAL_CHECK_OUTPUT
from minishard.course.exercises import ch05

ch05.check_unshard_param(unshard_param)
