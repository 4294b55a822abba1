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
# # 10 · Choosing and debugging: memory or throughput?
#
# > **Which strategy for this model on this cluster — and when FSDP is on and it still runs out of
# > memory, what do you check first?**
#
# Every strategy in this course trades communication for memory; none saves memory for free.
# So the first question is never "which is the most advanced?" but **"am I short of memory, or
# of throughput?"** — and the second, "can my network carry the heavier parameter traffic?".
# This chapter answers both with the planner on real cluster shapes, then debugs an FSDP
# out-of-memory on real ranks, contrasts FSDP with tensor parallelism, measures the eight
# classic pitfalls and the profiling checklist, and collects the course's answers. The reasoning
# is in [tutorial/10-choosing-and-debugging.md](../tutorial/10-choosing-and-debugging.md).
#
# <details><summary>中文</summary>
#
# > **这个模型、这个集群，该用哪种策略？开了 FSDP 还是 OOM，先查什么？**
#
# 本课程的每种策略都是用通信换显存，没有哪一种是白白省显存。所以第一个问题从来不是"哪个最先进"，
# 而是"**我缺的是显存，还是吞吐？**"；第二个问题是"我的网络扛得住更重的参数通信吗？"。
# 本章先用规划器在真实的集群形态上回答这两个问题，再在真实的 rank 上排查一次 FSDP 的 OOM，对比 FSDP
# 与张量并行，实测八个常见坑和 profiling 清单，最后汇总课程的答案。中文讲解见
# [tutorial/zh/10-choosing-and-debugging.md](../tutorial/zh/10-choosing-and-debugging.md)。
#
# </details>
#
# **The one-line "syntax"** — per GPU, per step:
#
# $$\text{memory} = \frac{\text{sharded state}}{N_\text{shard}} + \text{replicated state} + \text{gathered units} + \text{activations},
# \qquad t_\text{step} = t_\text{compute} + t_\text{comm, not hidden}$$
#
# and, when FSDP is on and it still OOMs, check **in this order**: wrap granularity (too coarse?)
# → prefetch depth (too deep?) → activation recomputation (off?) → one large tensor (the
# `[batch, seq, vocab]` logits).
#
# <details><summary>中文</summary>
#
# **一行"语法"**：每张 GPU、每一步，显存 = 分片状态 / $N_\text{shard}$ + 复制的状态 + 已收集的单元 +
# 激活值；单步时间 = 计算时间 + 没藏住的通信时间。开了 FSDP 还是 OOM 时，**按这个顺序**查：
# 包裹粒度（太粗？）→ 预取深度（太深？）→ 激活重计算（没开？）→ 某个大张量（`[batch, seq, vocab]` 的
# logits）。
#
# </details>
#
# Terms, in English and Chinese: [glossary · 术语表](../tutorial/glossary.md).

# %%
import statistics

import plotly.graph_objects as go
import plotly.io as pio
import torch

from minishard import GPT, Ranks
from minishard.planner.costmodel import DEVICES, LINKS, Cluster, plan
from minishard.planner.analytic import gpt_activation_bytes
from minishard.course.ch10 import percentile, phase_seconds, profile, straggler, under_budget
from minishard.core.model import config
from minishard.course.ch10 import compare_with_fsdp
from minishard.course.glue import glue
from minishard.training.loop import TrainConfig, train
from minishard.viz import PlannerWidget

pio.renderers.default = "plotly_mimetype+notebook_connected"
MiB, GiB = 2**20, 2**30
cfg = config("tiny")
TINY = GPT(cfg, device="meta")
PSI = TINY.num_params()
BLOCK = sum(p.numel() for p in TINY.blocks[0].parameters())
ROOT = PSI - len(TINY.blocks) * BLOCK
print(f"tiny GPT: Ψ = {PSI:,} parameters; root unit {ROOT:,}, each of 6 blocks {BLOCK:,}")
R2 = Ranks(2)                                        # one warm pool for the chapter

# %% [markdown]
# ## 1. The decision framework, on real cluster shapes
# The [`PlannerWidget`](../minishard/viz/planner.py) draws what
# [`minishard.planner.costmodel.plan`](../minishard/planner/costmodel.py) says for all four strategies at once:
# the memory of one GPU by ledger category against the device (left), and one step split into
# compute and the communication compute cannot hide (right). The selected strategy gets a
# verdict and "what would you change?" hints. Its memory terms are the live ledger's formulas;
# its times are an alpha-beta ring model with published peak bandwidths and FLOP/s (sources and
# the tolerance reached against published runs: [docs/costmodel.md](../docs/costmodel.md)).
#
# **Llama-3-8B on one node of 8 H100s with NVLink**, bf16-mixed AdamW, one sequence of 8,192
# tokens per GPU, full activation recomputation, 40% MFU:

# %%
pw = PlannerWidget(model="llama3-8b", device="h100-80gb", gpus_per_node=8, nodes=1,
                   intra="nvlink4", strategy="ddp", micro_batch=1, seq_len=8192, recompute=True)
pw.widget

# %%
# NBVAL_CHECK_OUTPUT
def strategy_table(widget, tag="", quote=()):
    """The four plans side by side; the (strategy, column) cells in ``quote`` (the chapter's
    figures) are recorded as f"{tag}-{strategy}-{column}", column "gib", "step" or "waiting"."""
    def cell(s, column, value, fmt):
        return glue(f"{tag}-{s}-{column}", value, fmt) if (s, column) in quote else fmt.format(value)

    print(f"{'':<15}{'GiB/GPU':>9}{'fits':>6}{'s/step':>8}{'tokens/s/GPU':>14}{'waiting':>9}")
    for s, p in widget.plans.items():
        print(f"{s:<15}{cell(s, 'gib', p.total_memory / GiB, '{:.1f}'):>9}{'yes' if p.fits else 'no':>6}"
              f"{cell(s, 'step', p.step_s, '{:.2f}'):>8}{p.tokens_per_s_per_rank:>14,.0f}"
              f"{cell(s, 'waiting', p.exposed_comm_s / p.step_s, '{:.0%}'):>9}")

strategy_table(pw, "one-node", [("ddp", "gib"), ("zero1", "gib"), ("zero2", "gib"), ("fsdp", "gib"),
                                ("zero1", "step"), ("fsdp", "step")])
print(pw.verdict)
for h in pw.hints:
    print(" -", h)
p8 = pw.plans
assert not pw.fits and p8["ddp"].total_memory > 16 * 8.03e9            # 16 bytes/param: no
assert all(p8[s].fits for s in ("zero1", "zero2", "fsdp"))
assert max(p8[s].step_s for s in ("zero1", "zero2", "fsdp")) < 1.03 * min(p8[s].step_s for s in ("zero1", "zero2", "fsdp"))
assert "Shard more: ZeRO-1" in pw.hints[0]

# %% [markdown]
# **Am I short of memory?** Under DDP, yes: 16 bytes per parameter is 120 GiB before a single
# activation. From ZeRO-1 on, no — and the three sharded strategies take about the same time here
# (within 3%: ZeRO-1's 1.45 s against 1.42 s), because NVLink hides their traffic behind compute.
# So the smallest step that fits is the answer: ZeRO-1 (or ZeRO-2), not full sharding. Setting the
# widget to FSDP says the same in its hints:

# %%
# NBVAL_CHECK_OUTPUT
pw.strategy = "fsdp"
print(pw.verdict)
lean = pw.plan_for("fsdp", recompute=False)                  # the plan the second hint describes
lean_text = f"({lean.total_memory / GiB:.1f} GiB — {lean.device_share:.0%} of the device"
for h in pw.hints:
    if lean_text in h:
        h = h.replace(lean_text, f"({glue('no-recompute-gib', lean.total_memory / GiB, '{:.1f}')} GiB — "
                                 f"{glue('no-recompute-share', lean.device_share, '{:.0%}')} of the device")
    print(" -", h)
assert pw.fits and any(h.startswith("ZeRO-1 fits too") for h in pw.hints)

# %% [markdown]
# The second hint comes with the planner's warning for any plan above 90% of the device: without
# recomputation the job needs 97% of the 80 GiB, and the plan leaves out the CUDA context, NCCL's
# buffers, allocator fragmentation and kernel temporaries. Such a plan is one to measure on the
# hardware, not to adopt from the table.
#
# **Can my network carry it?** The same job on **two nodes joined by 100 Gb Ethernet**. A ring
# is as fast as its slowest link, so every collective now runs at Ethernet speed — and FSDP's
# third pass over the parameters shows:

# %%
# NBVAL_CHECK_OUTPUT
pw.set(nodes=2, inter="ethernet-100g")
strategy_table(pw, "ethernet", [("zero1", "waiting"), ("fsdp", "waiting"), ("fsdp", "gib")])
print(pw.verdict)
for h in pw.hints:
    print(" -", glue("planner-hint", h) if h.startswith("ZeRO-1 fits too") else h)
eth = pw.plans
assert eth["fsdp"].exposed_comm_s > eth["zero2"].exposed_comm_s > 0.5 * eth["zero2"].step_s
assert any("Hybrid sharding" in h for h in pw.hints)

# %% [markdown]
# **Hybrid sharding** (HSDP) answers "NVLink inside a node, a slow network between nodes":
# shard inside each node (the all-gathers and reduce-scatters stay on NVLink) and replicate
# across nodes (only the gradient shards cross the slow link, once per step). Memory is sharded
# 8 ways instead of 16 — the price:

# %%
# NBVAL_CHECK_OUTPUT
pw.hybrid = True
strategy_table(pw, "hybrid", [("fsdp", "waiting"), ("fsdp", "gib")])
print(pw.verdict)
hy = pw.plans
assert hy["fsdp"].exposed_comm_s < min(0.25 * hy["fsdp"].step_s, eth["fsdp"].exposed_comm_s / 3)
assert hy["fsdp"].total_memory > eth["fsdp"].total_memory           # 1/8, not 1/16, of the state
assert hy["fsdp"].total_memory == p8["fsdp"].total_memory           # exactly one node's sharding

# %% [markdown]
# **When is full sharding the answer?** When nothing less fits. **Llama-3-70B on four nodes
# (32 H100s) with InfiniBand NDR**: 16 bytes per parameter is over 1,000 GiB; only ZeRO-3 / FSDP
# divides all of it.

# %%
# NBVAL_CHECK_OUTPUT
pw.set(model="llama3-70b", nodes=4, inter="ib-ndr-400", hybrid=False)
strategy_table(pw, "llama70b", [("fsdp", "gib")])
print(pw.verdict)
p70 = pw.plans
assert [s for s, p in p70.items() if p.fits] == ["fsdp"]

# %% [markdown]
# The framework in four questions, and where the evidence is:
#
# | question | what decides it | evidence |
# |---|---|---|
# | short of memory or of throughput? | does the *simplest* strategy fit? | the tables above: 8B fits from ZeRO-1, 70B only with FSDP |
# | can the network carry heavier parameter sync? | exposed communication on *your* links | NVLink hides all three; Ethernet does not; hybrid sharding gets it back |
# | how much system complexity can the team carry? | units, hooks, sharded checkpoints, prefetch tuning | [chapter 06](06-fsdp-units.ipynb), [chapter 09](09-checkpoints.ipynb) |
# | existing stack; incremental or fully sharded? | PyTorch-native `fully_shard` vs a DeepSpeed config; ZeRO-1 → 2 is a small step from DDP, stage 3 a new runtime | [chapter 03](03-zero1.ipynb), [04](04-zero2.ipynb), [05](05-zero3.ipynb) |
#
# **Why trust the planner's memory?** Its terms are the ledger's, which earlier chapters matched
# to the byte against live runs, and they reproduce published tables. One of them is DeepSpeed's
# own memory estimator: its documented output for a 2,851 M-parameter model (t5-3b) with a 32 M
# largest layer on 8 GPUs, rebuilt from `analytic.estimate` plus the two terms DeepSpeed's
# accounting adds by convention (ZeRO-2 counts the whole model's 16-bit gradients as resident;
# ZeRO-3 adds the largest layer gathered with its gradients). Every row must agree with the
# published figure to its printed precision:

# %%
# NBVAL_CHECK_OUTPUT
from minishard.planner.deepspeed_estimator import deepspeed_estimate

published = {   # DeepSpeed docs, "Memory Requirements": (per CPU GB, per GPU GB), GB = 2**30 bytes
    (2, "offload_optimizer=cpu"): (127.45, 5.31), (2, "offload_optimizer=none"): (127.45, 15.93),
    (3, "offload_param=cpu , offload_optimizer=cpu , zero_init=1"): (71.69, 0.12),
    (3, "offload_param=cpu , offload_optimizer=cpu , zero_init=0"): (127.45, 0.12),
    (3, "offload_param=none, offload_optimizer=cpu , zero_init=1"): (63.72, 0.78),
    (3, "offload_param=none, offload_optimizer=cpu , zero_init=0"): (127.45, 0.78),
    (3, "offload_param=none, offload_optimizer=none, zero_init=1"): (1.43, 6.09),
    (3, "offload_param=none, offload_optimizer=none, zero_init=0"): (127.45, 6.09)}
print(f"{'ZeRO':<5}{'options':<56}{'CPU GB':>8}{'GPU GB':>8}   GPU terms (GB)")
for stage in (2, 3):
    for r in deepspeed_estimate(2_851_000_000, 32_000_000, stage, gpus_per_node=8):
        got = (round(r.per_cpu / 2**30, 2), round(r.per_gpu / 2**30, 2))
        assert got == published[stage, r.options], (stage, r.options, got)
        terms = ", ".join(f"{k} {v / 2**30:.2f}" for k, v in r.terms.items())
        print(f"{stage:<5}{r.options:<56}{got[0]:>8.2f}{got[1]:>8.2f}   {terms}")

# %% [markdown]
# Two of those terms are conventions, not what an engine must hold: minishard's ZeRO-2
# (chapter 04) keeps only the gradient buckets in flight, not the whole model's 16-bit
# gradients, and the CPU column's factor 1.5 is DeepSpeed's safety margin. The other published
# checks (the ZeRO paper's table, torchtitan's Llama 3.1 8B run) and the tolerance reached for
# each are in [docs/costmodel.md](../docs/costmodel.md); `benchmarks/bench_planner.py` checks
# the step-time side against this machine's own runs.
#
# ## 2. FSDP is on and it still OOMs: the checklist, live
# Two real ranks, the tiny model with FSDP (per-parameter, as FSDP2), AdamW, four sequences of
# 128 tokens per rank, two steps (the second has Adam's moments), and a **device budget of
# 126 MiB per rank**: the ledger raises `DeviceOutOfMemory` when an allocation would cross it,
# as CUDA would. [`under_budget`](../minishard/course/ch10.py) turns the exception into data, so
# the pool survives. We start from a job that makes all four mistakes and walk the checklist in
# its order, one fix at a time.

# %%
BUDGET = 126 * MiB
COMMON = dict(strategy="fsdp", model="tiny", micro_batch=4, steps=2)
WALK = [("all four mistakes", dict(wrap="model", prefetch=3, recompute=False, loss_chunk_tokens=None)),
        ("1. wrap per block", dict(wrap="block", prefetch=3, recompute=False, loss_chunk_tokens=None)),
        ("2. prefetch depth 1", dict(wrap="block", prefetch=1, recompute=False, loss_chunk_tokens=None)),
        ("3. recompute", dict(wrap="block", prefetch=1, recompute=True, loss_chunk_tokens=None)),
        ("4. or: chunked loss", dict(wrap="block", prefetch=1, recompute=False, loss_chunk_tokens=128))]
walk, traces = {}, {}
for name, kw in WALK:
    walk[name] = R2.run(under_budget, BUDGET, **COMMON, **kw)
    traces[name] = R2.last_events                 # the fitting runs' traces: §4.6 reads them

# %%
# NBVAL_CHECK_OUTPUT
CATS = ("unsharded", "comm_buffers", "activations", "grads")
print(f"budget {BUDGET / MiB:.0f} MiB per rank; rank 0's live run, and the peak it reaches without a budget (MiB)")
print(f"{'':<21}{'live run under the budget':<35}{'coll./step':>11}{'peak':>7}" + "".join(f"{c:>13}" for c in CATS))
QUOTED = {("1. wrap per block", "alloc"): "wrap-fix-oom-alloc",          # the chapter's figures
          ("1. wrap per block", "activations"): "wrap-fix-activations",
          ("2. prefetch depth 1", "peak"): "prefetch-fix-peak",
          ("2. prefetch depth 1", "activations"): "prefetch-fix-activations",
          ("3. recompute", "activations"): "recompute-activations",
          ("4. or: chunked loss", "peak"): "chunked-loss-peak"}


def mib(row, column, value):
    """``value`` MiB as the table prints it, recorded if the chapter quotes it."""
    name = QUOTED.get((row, column))
    return glue(name, value, "{:.1f}") if name else f"{value:.1f}"


for name, (r0, r1) in walk.items():
    assert r0["fits"] == r1["fits"] and r0["peak"] == r1["peak"]    # the ranks fail at the same allocation
    live = "fits" if r0["fits"] else f"OOM allocating {mib(name, 'alloc', r0['alloc_mib'])} of {r0['allocating']}"
    print(f"{name:<21}{live:<35}{r0['calls']:>11}{mib(name, 'peak', r0['peak'] / MiB):>7}"
          + "".join(f"{mib(name, c, r0['peak_snapshot'].get(c, 0) / MiB):>13}" for c in CATS))
w = {name: r[0] for name, r in walk.items()}
peak = {name: r["peak_snapshot"] for name, r in w.items()}
assert [r["fits"] for r in w.values()] == [False, False, False, True, True]
assert all((r["peak"] <= BUDGET) == r["fits"] for r in w.values())    # OOM exactly when the peak is over
assert peak["all four mistakes"]["unsharded"] == 4 * PSI                  # the whole model, gathered
assert peak["1. wrap per block"]["unsharded"] == 4 * ROOT                 # the root only
assert peak["1. wrap per block"]["comm_buffers"] == 3 * 4 * BLOCK         # 3 blocks prefetched
assert peak["2. prefetch depth 1"]["comm_buffers"] == 4 * BLOCK           # 1 block prefetched
assert peak["3. recompute"]["activations"] < 0.05 * peak["2. prefetch depth 1"]["activations"]
logits = 4 * cfg.seq_len * cfg.vocab_size * 4                            # [4, 128, 4096] fp32
assert w["2. prefetch depth 1"]["peak"] - w["4. or: chunked loss"]["peak"] < logits   # the peak moved
assert w["2. prefetch depth 1"]["error"] == w["1. wrap per block"]["error"]           # same report
assert w["all four mistakes"]["calls"] == 2 and w["1. wrap per block"]["calls"] == 20  # 1 unit vs 7

# %% [markdown]
# Read it the way you read a real out-of-memory report: *what* failed to allocate, and which
# category is out of proportion.
#
# * **Wrap granularity.** With one unit for the whole model, `unsharded` is 26.2 MiB — all of Ψ,
#   gathered at once: at that moment sharding saves nothing. One unit per block: the root only.
#   ([Chapter 11 §5](11-when-it-breaks.ipynb) plants it on four ranks, PyTorch's FSDP2 too, and
#   `minishard doctor` names the unit from the trace — with the other memory cause the checklist
#   leaves out: full gradients kept across micro-batches by accumulation without sync.)
# * **Prefetch depth.** Depth 3 keeps three blocks' full parameters in flight (`comm_buffers`,
#   3 × 3.0 MiB: the per-parameter layout holds a prefetched unit in its packed all-gather
#   buffer until it is used); depth 1, one block. Still over: `activations` is the giant.
# * **Activation recomputation** keeps only each block's input and recomputes the rest during
#   backward: activations fall from 63 MiB to 2.5 MiB, and it fits with room to spare.
# * **The one large tensor.** The loss keeps the log-probabilities of every token over the whole
#   vocabulary, `[4, 128, 4096]` fp32 = 8 MiB. A chunked loss computes head and loss 128 tokens at
#   a time and recomputes each chunk in backward: without recomputing the blocks, that alone
#   brings the job under the budget — by 1.3 MiB here, because once the logits are gone the peak
#   moves into backward (the `grads` column: a block's full gradients waiting to be
#   reduce-scattered).
#
# The last two rows are two different fixes for the same symptom, and they cost differently:
# recomputation redoes a forward pass of every block (§4.6), chunking only the head's. Which one
# is "the" fix depends on which term dominates — and the ledger tells you.
#
# One caveat, measured in the numbers: the ledger counts what autograd saves during forward. With
# recomputation, the block being recomputed holds its activations again for the moment of its
# backward — one block's worth, which the ledger does not see. The budget leaves room for it:

# %%
# NBVAL_CHECK_OUTPUT
one_block = gpt_activation_bytes(cfg, 4) - gpt_activation_bytes(config("tiny", n_layer=5), 4)
print(f"one block recomputed: {glue('one-block-recomputed', one_block / MiB, '{:.1f}')} MiB; recompute peak + that = "
      f"{glue('recompute-peak-with-block', (w['3. recompute']['peak'] + one_block) / MiB, '{:.1f}')} MiB of {BUDGET / MiB:.0f}")
assert w["3. recompute"]["peak"] + one_block < BUDGET

# %% [markdown]
# ## 3. FSDP versus tensor parallelism
# Both split a layer's weights over the ranks, but only one of them splits the *work*. FSDP
# stores 1/N of each matrix and gathers it whole before computing; tensor parallelism splits
# the matrix multiply itself (columns of the first MLP matrix W in Y = XW, rows of the second —
# Megatron's names; in `nn.Linear`, which stores Wᵀ, rows of `fc.weight` and columns of
# `proj.weight`), so no rank ever holds the full matrix and activations, not weights, cross the
# wire.
# [`compare_with_fsdp`](../minishard/course/ch10.py) runs one MLP forward and backward both ways on two
# ranks:

# %%
# NBVAL_CHECK_OUTPUT
tp = R2.run(compare_with_fsdp)[0]
full, acts = tp["full_weight_bytes"], tp["activation_bytes"]
print(f"MLP weights {glue('mlp-weight-bytes', full, '{:,}')} bytes; its input activations {acts:,} bytes (2 x 128 x 256 fp32)")
print(f"{'':<20}{'weight bytes at peak':>22}{'bytes sent':>13}{'collectives':>13}{'same result':>13}")
print(f"{'tensor parallel':<20}{glue('tp-peak-weight-bytes', tp['tp']['peak_weight_bytes'], '{:,}'):>22}{tp['tp']['wire']:>13,}{tp['tp']['calls']:>13}"
      f"{str(tp['tp']['output_matches'] and tp['tp']['grad_x_matches']):>13}")
print(f"{'FSDP':<20}{tp['fsdp']['peak_weight_bytes']:>22,}{tp['fsdp']['wire']:>13,}{tp['fsdp']['calls']:>13}"
      f"{str(tp['fsdp']['output_matches']):>13}")
assert tp["tp"]["peak_weight_bytes"] < full / 2 + 4 * 256 + 4096          # half, never all
assert tp["fsdp"]["gathered_full_weights"] == full                          # the whole matrix
assert tp["tp"]["calls"] == 2 and tp["tp"]["wire"] == 2 * acts              # 2 all-reduces of activations

# %% [markdown]
# FSDP is data parallelism with sharded *storage*: each rank still computes whole layers on its
# own micro-batch, so a layer must fit on one device while it computes, and the traffic is
# proportional to the weights. Tensor parallelism splits the *compute*: two all-reduces of
# activations inside every layer, on the critical path (it wants NVLink), but no full matrix
# anywhere — and the activations of a layer are split too. That is why the largest models use
# both: tensor parallelism inside a node, FSDP (or hybrid sharding) across.
#
# ## 4. The eight pitfalls, measured
# ### 4.1 "It runs" is not "it scales"
# The tiny model, one sequence per rank, FSDP per block with prefetch depth 1, on 1, 2 and 4
# ranks (weak scaling: every rank keeps its micro-batch). One process is the baseline; 2 ranks
# are the chapter's pool; 4 ranks get a pool of their own for this cell.

# %%
# NBVAL_IGNORE_OUTPUT
MB_SCALE, STEPS = 1, 3
tokens_per_rank = MB_SCALE * cfg.seq_len
threads = torch.get_num_threads()
torch.set_num_threads(1)
single = train(None, TrainConfig(strategy="single", model="tiny", micro_batch=MB_SCALE, steps=STEPS))
torch.set_num_threads(threads)
single_tps = tokens_per_rank / statistics.median(single["step_times"][1:])
scaling = {1: {"world_size": 1, "step_s": statistics.median(single["step_times"][1:]),
               "tokens_per_s": single_tps, "scaling_efficiency": 1.0,
               "peak_bytes": single["ledger"]["peak"]}}
kw = dict(strategy="fsdp", model="tiny", micro_batch=MB_SCALE, steps=STEPS, prefetch=1)
scaling[2] = profile(R2.run(train, TrainConfig(**kw)), R2.last_events, tokens_per_rank, single_tps)
with Ranks(4) as R4:
    scaling[4] = profile(R4.run(train, TrainConfig(**kw)), R4.last_events, tokens_per_rank, single_tps)
print(f"{'ranks':>5}{'step (s)':>10}{'tokens/s':>10}{'scaling efficiency':>20}")
for n, m in scaling.items():
    tps = glue(f"tokens-per-s-{n}-ranks", m["tokens_per_s"], "{:,.0f}") if n in (1, 4) else f"{m['tokens_per_s']:,.0f}"
    print(f"{n:>5}{m['step_s']:>10.3f}{tps:>10}{m['scaling_efficiency']:>20.0%}")
assert scaling[4]["scaling_efficiency"] < 0.9            # 4 ranks on 2 cores cannot scale linearly

# %% [markdown]
# Every configuration "runs". The 4-rank run even has the smallest memory per rank. But its
# throughput is far from 4× one process: here the four ranks share two CPU cores, so at best two
# compute at once — on a cluster the same symptom (efficiency falling as ranks are added) points
# at the network, at stragglers, or at collectives too small to be efficient. Report **step time,
# tokens/s and scaling efficiency** next to "it no longer OOMs".
#
# ### 4.2 The mean hides the tail
# Synchronous training waits for the slowest rank at every collective. One rank of two is made
# slow on every tenth step — it sleeps 0.25 s, standing in for a slow node, a garbage-collection
# pause or a noisy neighbour ([`straggler`](../minishard/course/ch10.py), the nano model, DDP).
# The *healthy* rank's 30 step times, summarised three ways, and split by whether rank 1 stalled:

# %%
# NBVAL_IGNORE_OUTPUT
DELAY, EVERY = 0.25, 10
slow = R2.run(straggler, delay=DELAY, every=EVERY, steps=30)[0]
t = slow["step_times"]
stalled = [t[i] for i in slow["slow_steps"]]
others = [x for i, x in enumerate(t) if i not in slow["slow_steps"]]
print(f"rank 0 (healthy): mean {glue('healthy-mean-ms', statistics.mean(t) * 1e3, '{:.0f}')} ms, "
      f"p50 {glue('healthy-p50-ms', percentile(t, 50) * 1e3, '{:.0f}')} ms, "
      f"p99 {glue('healthy-p99-ms', percentile(t, 99) * 1e3, '{:.0f}')} ms")
print(f"  median on the {len(stalled)} steps rank 1 stalled: {statistics.median(stalled) * 1e3:.0f} ms; "
      f"on the other {len(others)}: {statistics.median(others) * 1e3:.0f} ms")
assert len(stalled) == 3 and min(stalled) >= DELAY          # rank 0 waited every time rank 1 slept
assert statistics.median(others) < DELAY <= percentile(t, 99)

# %% [markdown]
# The healthy rank never slept, yet on every tenth step it is as slow as the straggler: it waited
# in the all-reduce. Its median does not notice; its mean rises by about DELAY / 10 = 25 ms, easily
# lost in the noise of a shared machine; its p99 carries the whole delay. With thousands of ranks, *some*
# rank is slow at almost every step: watch p99 (and max), per rank, not the mean.
#
# ### 4.3 Ignoring the network topology
# The same FSDP job (Llama-3-8B, 2 nodes × 8 H100s) on each link between the nodes, from the
# planner — flat FSDP over all 16 GPUs, and hybrid sharding:

# %%
# NBVAL_CHECK_OUTPUT
print(f"{'between nodes':<34}{'flat FSDP: waiting':>20}{'tok/s/GPU':>11}{'hybrid: waiting':>17}{'tok/s/GPU':>11}")
topo = {}
TOPO_QUOTED = {("ib-ndr-400", "hybrid"), ("ib-hdr-200", "flat"), ("ethernet-100g", "flat"), ("ethernet-100g", "hybrid")}
for link in ("nvlink4", "ib-ndr-400", "ib-hdr-200", "ethernet-100g"):
    c = Cluster(DEVICES["h100-80gb"], 8, nodes=2, inter=LINKS[link])
    flat, hyb = (plan("llama3-8b", c, "fsdp", seq_len=8192, recompute=True, hybrid=h) for h in (False, True))
    topo[link] = (flat, hyb)
    waits = [f"{x.exposed_comm_s / x.step_s:.0%}" for x in (flat, hyb)]
    for i, layout in enumerate(("flat", "hybrid")):
        if (link, layout) in TOPO_QUOTED:                 # the chapter's figures
            waits[i] = glue(f"{link}-{layout}-waiting", flat.exposed_comm_s / flat.step_s if i == 0
                            else hyb.exposed_comm_s / hyb.step_s, "{:.0%}")
    print(f"{LINKS[link].name:<34}{waits[0]:>20}{flat.tokens_per_s_per_rank:>11,.0f}"
          f"{waits[1]:>17}{hyb.tokens_per_s_per_rank:>11,.0f}")
assert topo["ethernet-100g"][0].tokens_per_s_per_rank < 0.5 * topo["nvlink4"][0].tokens_per_s_per_rank
assert topo["ethernet-100g"][1].tokens_per_s_per_rank > 2 * topo["ethernet-100g"][0].tokens_per_s_per_rank

# %% [markdown]
# Same model, same GPUs, same code: the link between the nodes decides whether FSDP costs
# nothing or most of the step. Hybrid sharding is not free either: on InfiniBand NDR, where flat
# FSDP hides everything, its extra all-reduce across nodes costs a few percent.
#
# A smaller lever keeps only backward's gathers inside a node: `reshard_after_forward=k` (FSDP2's
# int form; ZeRO++ calls the idea hpZ). After forward each unit keeps not its 1/N shard alone but
# 1/k of its full parameters — its part of an all-gather over k consecutive ranks — and backward
# gathers over those k. Four real ranks here, read as two nodes of two; every byte each rank sent
# is sorted by the link it takes on the ring (`minishard.planner.links`), and the memory is the ledger's
# gathered parameters when forward ends:

# %%
# NBVAL_CHECK_OUTPUT
from collections import Counter

from minishard.course.ch06 import unit_state_figure
from minishard.course.ch10 import held_after_forward
from minishard.planner.links import link_bytes

RAF = dict(strategy="fsdp", model="nano", micro_batch=2, steps=2)
raf = {}
with Ranks(4) as R4:                                  # two "nodes": ranks 0-1 and 2-3
    for k in (1, 2, 4):
        out = R4.run(train, TrainConfig(reshard_after_forward=k, **RAF))
        raf[k] = {"events": R4.last_events, "links": link_bytes(R4.last_events, node_size=2, world_size=4),
                  "held": held_after_forward(R4.last_events), "losses": out[0]["losses"]}
print(f"{'k':>2}  {'all-gathers of a step, by group size':<38}{'bytes inside nodes':>19}"
      f"{'across nodes':>13}{'kept after forward':>19}")
for k, r in raf.items():
    sizes = Counter(e["group"] for e in r["events"] if e["kind"] == "collective"
                    and e["op"] == "all_gather" and e["rank"] == 0 and e.get("step") == 0)
    by = ", ".join(f"{n} x over {g} ranks" for g, n in sorted(sizes.items(), reverse=True))
    inside = glue(f"raf-{k}-inside", r["links"]["inside"], "{:,}")
    across = glue(f"raf-{k}-across", r["links"]["across"], "{:,}")
    held = glue(f"raf-{k}-held", r["held"], "{:,}")
    print(f"{k:>2}  {by:<38}{inside:>19}{across:>13}{held:>19}")
blocks = sum(e["payload"] for e in raf[1]["events"] if e["kind"] == "collective" and e["op"] == "all_gather"
             and e["rank"] == 0 and e.get("step") == 0 and e["tag"] != "root")
assert raf[2]["links"]["across"] == raf[1]["links"]["across"]                 # nothing more across
assert raf[2]["links"]["inside"] - raf[1]["links"]["inside"] == 2 * 4 * blocks // 2    # 2 steps, 4 ranks, S/2
assert raf[4]["links"]["across"] - raf[1]["links"]["across"] == 2 * 2 * (3 * blocks // 4)
assert raf[1]["held"] - raf[4]["held"] == blocks and raf[2]["held"] - raf[4]["held"] == blocks // 2
print("k = 2 trains bit-identically to k = 4:", raf[2]["losses"] == raf[4]["losses"])

# %% [markdown]
# k = 1 keeps every block gathered (`False`: no backward gathers at all), k = 4 reshards to the
# shard (`True`: backward gathers over all four, half of whose sends cross nodes). k = 2 sits
# between: the same bytes across nodes as k = 1, backward's gathers on the node's own links, and
# half the blocks' bytes kept instead of all of them. The root is not resharded in any of the three — FSDP2's
# root clamp: `None` on the root means `False`, since backward starts with it at once. The unit
# states of rank 0 in the first step of k = 2: the blocks rest in `sharded_post_forward` (yellow)
# from their forward to their backward, the root stays gathered.

# %%
unit_state_figure(raf[2]["events"], rank=0, step=0, title="reshard_after_forward=2, rank 0, step 0")

# %% [markdown]
# At cluster scale (the planner, Llama-3-8B on 2 nodes × 8 H100s joined by InfiniBand HDR):

# %%
# NBVAL_CHECK_OUTPUT
c = Cluster(DEVICES["h100-80gb"], 8, nodes=2, inter=LINKS["ib-hdr-200"])
options = {"flat FSDP (reshard_after_forward=True)": dict(),
           "reshard_after_forward=8 (a node)": dict(reshard_after_forward=8),
           "hybrid sharding": dict(hybrid=True)}
print(f"{'':<40}{'waiting':>8}{'tok/s/GPU':>11}{'memory (GiB)':>14}")
at_scale = {}
for name, extra in options.items():
    p = at_scale[name] = plan("llama3-8b", c, "fsdp", seq_len=8192, recompute=True, **extra)
    wait = glue(f"raf-plan-{len(at_scale)}-waiting", p.exposed_comm_s / p.step_s, "{:.0%}")
    gib = glue(f"raf-plan-{len(at_scale)}-gib", p.total_memory / GiB, "{:.1f}")
    print(f"{name:<40}{wait:>8}{p.tokens_per_s_per_rank:>11,.0f}{gib:>14}")
flat_p, k8, hyb = at_scale.values()
assert flat_p.exposed_comm_s > k8.exposed_comm_s and k8.total_memory > flat_p.total_memory

# %% [markdown]
# ### 4.4 Bad wrap granularity
# §2 measured the memory side: one unit for the model gathers all of Ψ at once. The time side:
# that unit's 2 collectives per step (§2's table) each carry the whole model, and nothing can
# overlap them — compute cannot start before the whole gather lands, and the reduce-scatter waits
# for the whole backward. Going the other way, one unit per Linear multiplies the collectives
# ([chapter 06 §3](06-fsdp-units.ipynb) measured 41 per step on the nano model against 11 per
# block), each paying its latency. (From a trace, `minishard doctor` names a unit that holds most
# of the parameters: [chapter 11 §5](11-when-it-breaks.ipynb).) The planner, for Llama-3-8B on two
# nodes with InfiniBand NDR:

# %%
# NBVAL_CHECK_OUTPUT
pw.set(model="llama3-8b", nodes=2, inter="ib-ndr-400", strategy="fsdp", hybrid=False)
for wrap in ("block", "model"):
    pw.wrap = wrap
    p = pw.plan
    print(f"wrap={wrap:<6} {glue(f'wrap-{wrap}-gib', p.total_memory / GiB, '{:.1f}'):>5} GiB per GPU, {p.notes[-1]:<44} "
          f"{glue('wrap-model-waiting', p.exposed_comm_s / p.step_s, '{:.0%}') if wrap == 'model' else f'{p.exposed_comm_s / p.step_s:.0%}':>4} of the step waiting")
wraps = {w: pw.plan_for("fsdp", wrap=w) for w in ("block", "model")}
assert wraps["model"].memory["unsharded"] == 2 * GPT("llama3-8b", device="meta").num_params()
assert wraps["model"].exposed_comm_s > 10 * wraps["block"].exposed_comm_s
pw.wrap = "block"

# %% [markdown]
# ### 4.5 No checkpoint plan
# A sharded run writes sharded checkpoints. Will they load on a different number of ranks? Can
# you export full weights for inference? Decide on day one, and test the N → M reload and the
# export early: [chapter 09](09-checkpoints.ipynb).
#
# ### 4.6 Recomputation combined badly
# Recomputation runs every block's forward a second time, inside backward. §2's last two runs
# fixed the same OOM two ways — row 3 recomputes every block, row 4 only the loss's chunks — and
# their traces show the difference: the ratio of backward to forward time on the same rank, step
# by step, so that the load of other processes affects both phases alike (the faster of the two
# steps is shown):

# %%
# NBVAL_IGNORE_OUTPUT
ratio = {}
for name in ("4. or: chunked loss", "3. recompute"):
    fwd, bwd = (phase_seconds(traces[name], 0, ph) for ph in ("forward", "backward"))
    ratio[name] = min(bwd) / min(fwd)
    key = "recompute" if name == "3. recompute" else "chunked-loss"
    print(f"{name:<22} forward {min(fwd) * 1e3:5.0f} ms, backward {min(bwd) * 1e3:5.0f} ms: "
          f"backward = {glue(f'{key}-backward-ratio', ratio[name], '{:.1f}')} x forward")
# (timing, not asserted: under load the ratio can flip) ratio["3. recompute"] > ratio["4. or: chunked loss"]

# %% [markdown]
# With recomputation, backward should grow by one forward's worth of time: the textbook ratio
# goes from 2× to 3×. The table above need not show that gap — some runs show less, some more —
# because the chunked loss of row 4 recomputes the head in backward too, and FSDP's gathers and
# the load of a shared machine blur both rows; it is one run's timing (not asserted: under load
# the order can even flip). The
# extra forward is worth paying when activations are what does not fit (§2), and waste when the
# job truly fits without it — the planner's hint in §1: 25% less time per step without, but at
# 97% of the device, a plan to measure before trusting. On a slow network it compounds: the extra
# forward and the exposed gathers add up, step after step.
#
# ### 4.7 CPU offload switched on blindly
# Offload keeps the sharded state in host memory; every step the parameter shards come to the
# device for each gather and the reduced gradient shards go back. Measured on two ranks (tiny
# model), and the planner's price for Llama-3-8B, which fits on 8 H100s without it:

# %%
# NBVAL_CHECK_OUTPUT
off = R2.run(train, TrainConfig(strategy="fsdp", model="tiny", micro_batch=2, steps=2, prefetch=1, offload="host"))[0]
moved = off["transfer"][-1]
dev = off["ledger"]["by_device"]
print(f"per step: host -> device {moved['h2d_bytes']:,} bytes, device -> host {moved['d2h_bytes']:,} bytes")
print(f"between steps the device holds {sum(dev.get('device', {}).values()) / MiB:.1f} MiB of state, "
      f"the host {sum(dev['host'].values()) / MiB:.1f} MiB (16Ψ/2)")
eight = Cluster(DEVICES["h100-80gb"], 8)
on, off8 = (plan("llama3-8b", eight, "fsdp", seq_len=8192, recompute=True, offload=o) for o in (None, "host"))
print(f"Llama-3-8B, 8 H100s: {off8.total_memory / GiB:.1f} GiB per GPU instead of {on.total_memory / GiB:.1f}, "
      f"{glue('offload-step-s', off8.step_s, '{:.2f}')} s per step instead of "
      f"{glue('no-offload-step-s', on.step_s, '{:.2f}')} s ({off8.notes[-1]})")
print(f"offload adds {glue('offload-adds-s', off8.offload_pcie_s + off8.offload_cpu_s, '{:.2f}')} s: "
      f"{glue('offload-pcie-s', off8.offload_pcie_s, '{:.2f}')} s of PCIe (in and out at once) and "
      f"{glue('offload-cpu-adam-s', off8.offload_cpu_s, '{:.2f}')} s of CPU Adam (8 GPUs sharing one host's memory)")
assert moved["h2d_bytes"] == 4 * (2 * (PSI - ROOT) + ROOT) // 2     # each block's shard twice, the root's once
assert moved["d2h_bytes"] == 4 * PSI // 2                            # every gradient shard, once
assert sum(dev["host"].values()) == 16 * PSI // 2 and not dev.get("device")
assert off8.fits and on.fits and off8.step_s > on.step_s
assert abs(off8.step_s - (on.step_s + off8.offload_pcie_s + off8.offload_cpu_s)) < 1e-9

# %% [markdown]
# A capacity problem became a bandwidth problem ([chapter 08](08-offload.ipynb)): for a job that
# fits, offload only adds the transfers. It is a way to run what cannot run otherwise, not a
# free memory button.
#
# ### 4.8 Memorising names without the trade-off
# The names are rows of one trade-off table. Measured on two ranks (nano model, fp32 AdamW, two
# steps): the model state a rank keeps, and the bytes it sends per step, per parameter:

# %%
# NBVAL_CHECK_OUTPUT
NANO = GPT("nano", device="meta").num_params()
STATE = ("params", "grads", "exp_avg", "exp_avg_sq")
print(f"{'':<8}{'state bytes/param':>18}{'sent bytes/param/step':>23}")
names = {}
for s in ("ddp", "zero1", "zero2", "fsdp"):
    r = R2.run(train, TrainConfig(strategy=s, model="nano", micro_batch=2, steps=2, track_activations=False))[0]
    state = sum(r["ledger"]["final"].get(c, 0) for c in STATE) / NANO
    names[s] = (state, r["wire"][-1] / NANO)
    sent = glue("fsdp-sent-per-param", names[s][1], "{:.2f}") if s == "fsdp" else f"{names[s][1]:.2f}"
    print(f"{s:<8}{state:>18.1f}{sent:>23}")
assert [names[s][0] for s in ("ddp", "zero1", "zero2", "fsdp")] == [16, 12, 10, 8]     # 4+4+8/N ... 16/N
assert names["ddp"][1] == names["zero1"][1] == names["zero2"][1] == 4.0    # 2(N-1)/N x 4 bytes
assert 4.0 < names["fsdp"][1] <= 6.0                                        # up to 1.5x

# %% [markdown]
# Stage by stage, memory falls and traffic stays at DDP's until stage 3, which adds a third pass
# over the parameters. That is the sentence to remember, not the names.
#
# The eight pitfalls are choices that cost time or memory. The failures that are bugs — a rank
# that skips a collective and leaves the others waiting, collectives issued in different orders,
# ranks that start from different weights, bf16 weights stepped without a master, a clip by the
# local norm — are [chapter 11](11-when-it-breaks.ipynb): each reproduced on real ranks,
# diagnosed from the ranks' flight recorders, fixed and run again.
#
# ## 5. The profiling checklist, from real traces
# Before tuning anything, measure these five — here read off the scaling runs of §4.1 by
# [`profile`](../minishard/course/ch10.py): step time (median, and p99, of the slowest rank),
# utilisation (the share of the step a rank computes rather than waits for the network:
# 1 − exposed communication / step), communication share (the time some collective is in
# flight, from the trace's collective events; it can overlap compute), peak memory (the ledger),
# and scaling efficiency (tokens/s over N × one process's).

# %%
# NBVAL_IGNORE_OUTPUT
print(f"{'ranks':>5}{'step p50':>10}{'p99':>8}{'utilisation':>13}{'comm share':>12}{'peak MiB':>10}{'efficiency':>12}")
for n in (2, 4):
    m = scaling[n]
    print(f"{n:>5}{m['step_s']:>10.3f}{m['p99_s']:>8.3f}{m['utilisation']:>13.0%}{m['comm_share']:>12.0%}"
          f"{m['peak_bytes'] / MiB:>10.1f}{m['scaling_efficiency']:>12.0%}")
for n in (2, 4):
    assert 0 < scaling[n]["utilisation"] <= 1 and 0 < scaling[n]["comm_share"] <= 1
assert scaling[4]["peak_bytes"] < scaling[2]["peak_bytes"] < scaling[1]["peak_bytes"]   # 1/N state

# %% [markdown]
# ### 5.1 How cost grows with the model and the world size
# One run says where its time goes; how the costs *grow* says what the next, larger run will
# cost. [`benchmarks/bench_scaling.py`](../benchmarks/bench_scaling.py) measures step time and
# bytes sent per step for DDP, ZeRO-1, ZeRO-2 and FSDP, minishard's and PyTorch's side by side
# (`DistributedDataParallel`, with `ZeroRedundancyOptimizer`, FSDP2's `fully_shard`): three GPTs
# (width and depth growing together) on 2 ranks, the middle one on 1, 2, 4 and 8 ranks, and
# minishard's checkpoint save and load of each GPT's sharded state. A full run takes about six
# minutes on a quiet machine, so the chapter does not run it: the next cell reads the committed
# result, `benchmarks/scaling.json`, and draws it with the least-squares fits the benchmark
# stored (lines; PyTorch's dotted with open markers).
#
# **Bytes grow exactly as the formulas say**: linearly in Ψ, times (N−1)/N — c · 4Ψ(N−1)/N per
# rank, with c = 2 for DDP and ZeRO-1/2 (an all-reduce, or a reduce-scatter and an all-gather),
# 3 − Ψ_root/Ψ for minishard's FSDP (the blocks are gathered twice, the root once). **Time grows
# linearly in Ψ too**, but time against N measures this machine's cores, not the network: with 4
# ranks on 2 cores each rank computes on half a core, with 8 on a quarter (*oversubscription*),
# so a step grows about N/2 before a byte is sent. On a cluster, where every rank has its own
# device, a flat curve means the work scales and a rising one points at the network.

# %%
# NBVAL_IGNORE_OUTPUT
import json
from pathlib import Path

from plotly.subplots import make_subplots

SCALING = json.loads(Path("../benchmarks/scaling.json").read_text())   # benchmarks/bench_scaling.py's run
pts, fit, MID = SCALING["points"], SCALING["fits"], SCALING["middle"]
COLOURS = {"torch_ddp": "#1f77b4", "ddp": "#1f77b4", "torch_zero1": "#2ca02c", "zero1": "#2ca02c",
           "zero2": "#ff7f0e", "torch_fsdp": "#d62728", "fsdp": "#d62728"}
fig = make_subplots(rows=1, cols=3, horizontal_spacing=0.07, subplot_titles=(
    "bytes sent per step, 2 ranks", "step time, 2 ranks",
    f"step time, {SCALING['models'][MID]['params'] / 1e6:.1f} M params (N > 2: cores shared)"))
for c in SCALING["contenders"]:
    label, torch_side = c["label"], c["side"] == "PyTorch"
    style = dict(color=COLOURS[c["strategy"]], dash="dot" if torch_side else "solid", width=1.5)
    mark = dict(symbol="circle-open" if torch_side else "circle", size=8)
    two = sorted((p for p in pts if p["contender"] == label and p["world_size"] == 2), key=lambda p: p["params"])
    psi = [p["params"] / 1e6 for p in two]
    b, t = fit["bytes"][label], fit["time_vs_params"][label]
    for col, ys, line in ((1, [p["sent"] / 1e6 for p in two], [b["c"] * 4 * x / 2 for x in psi]),
                          (2, [p["p50"] for p in two], [t["slope"] * 1e6 * x + t["intercept"] for x in psi])):
        fig.add_scatter(x=psi, y=ys, mode="markers", marker=mark, line=style, name=label, legendgroup=label,
                        showlegend=col == 1, row=1, col=col)
        fig.add_scatter(x=psi, y=line, mode="lines", line=style, legendgroup=label, showlegend=False,
                        hoverinfo="skip", row=1, col=col)
    by_n = sorted((p for p in pts if p["contender"] == label and p["model"] == MID), key=lambda p: p["world_size"])
    fig.add_scatter(x=[p["world_size"] for p in by_n], y=[p["p50"] for p in by_n], mode="markers+lines",
                    marker=mark, line=style, legendgroup=label, showlegend=False, row=1, col=3)
t2 = statistics.median(p["p50"] for p in pts if p["model"] == MID and p["world_size"] == 2)
fig.add_scatter(x=[2, 4, 8], y=[t2 * n / 2 for n in (2, 4, 8)], mode="lines", name="N/2 × t(2): cores shared, no network",
                line=dict(color="grey", dash="dash"), row=1, col=3)
fig.update_xaxes(title_text="Ψ (million parameters)", col=1)
fig.update_xaxes(title_text="Ψ (million parameters)", col=2)
fig.update_xaxes(title_text="ranks N (on 2 cores)", type="log", tickvals=[1, 2, 4, 8], col=3)
fig.update_yaxes(title_text="MB per rank per step", col=1)
fig.update_yaxes(title_text="seconds per step (p50)", col=2)
fig.update_yaxes(title_text="seconds per step (p50)", col=3)
fig.update_layout(height=430, legend=dict(orientation="h", y=-0.25), margin=dict(t=40))
fig.show()
print(f"the committed run: {SCALING['started']}, {SCALING['cores']} cores, {SCALING['seconds'] / 60:.0f} min; "
      f"lines are least-squares fits (timing: different on every run)")
print(f"{'':<40}{'time/step vs Ψ, 2 ranks':>26}{'vs N, N >= 2':>22}")
print(f"{'':<40}{'ms per M params':>17}{'R²':>9}{'s per rank':>14}{'R²':>8}")
slopes = [fit["time_vs_params"][c["label"]]["slope"] * 1e9 for c in SCALING["contenders"]]
for c in SCALING["contenders"]:
    t, n = fit["time_vs_params"][c["label"]], fit["time_vs_ranks"].get(c["label"], {})
    slope = t["slope"] * 1e9
    ms = (glue("slope-ms-per-m-least", slope, "{:.0f}") if slope == min(slopes) else
          glue("slope-ms-per-m-most", slope, "{:.0f}") if slope == max(slopes) else f"{slope:.0f}")
    print(f"{c['label']:<40}{ms:>17}{t['r2']:>9.2f}{n.get('slope', 0):>14.2f}{n.get('r2', 0):>8.2f}")
for kind, f in fit["checkpoint"].items():
    print(f"checkpoint {kind} at 2 ranks: {f['mb_per_s_per_rank']:.0f} MB/s per rank beyond a fixed "
          f"{f['intercept']:.2f} s (R² {f['r2']:.2f})")

# %%
# NBVAL_CHECK_OUTPUT
sizes = ", ".join(f"{m['params'] / 1e6:.1f} M" for m in SCALING["models"].values())
print(f"GPTs of {sizes} parameters on 2 ranks; the {SCALING['models'][MID]['params'] / 1e6:.1f} M one on "
      f"{', '.join(str(n) for n in sorted({p['world_size'] for p in pts}))} ranks")
print(f"every measured bytes/step (the kernel's count, {glue('measured-runs', len(pts))} runs) equals its formula within 0.1%: "
      f"{all(b['all_match'] for b in fit['bytes'].values())}")
print(f"{'bytes/step = c · 4Ψ(N−1)/N':<40}{'c fitted':>9}{'c formula':>14}")
C_QUOTED = {"minishard FSDP, per-parameter": "minishard-fsdp-c", "torch FSDP2 fully_shard (block + root)": "fsdp2-c"}
for label, b in fit["bytes"].items():
    lo, hi = min(b["formula_c"]), max(b["formula_c"])
    c_fit = glue(C_QUOTED[label], b["c"], "{:.2f}") if label in C_QUOTED else f"{b['c']:.2f}"
    print(f"{label:<40}{c_fit:>9}{lo:>9.2f}" + (f"–{hi:.2f}" if hi - lo > 0.005 else ""))
sent = {(p["contender"], p["model"], p["world_size"]): p["sent"] for p in pts}
for c in SCALING["contenders"]:
    if c["baseline"]:
        ok = all(sent[(c["label"], *k[1:])] <= 1.001 * sent[k] for k in sent if k[0] == c["baseline"])
        print(f"{c['label']} sends at most what {c['baseline']} sends (+0.1%), every run: {ok}")
state = {m: 12 * v["params"] for m, v in SCALING["models"].items()}    # fp32 params + two AdamW moments
print("checkpoint on disk = 12Ψ bytes (fp32 parameters and both AdamW moments) within 1%:",
      all(abs(r["disk_bytes"] - state[r["model"]]) < 0.01 * state[r["model"]] for r in SCALING["checkpoint"]))

# %% [markdown]
# The bytes are the benchmark's only exact output, and the fits recover the formulas' constants
# to two decimals from measured counts. Per rank, traffic grows with the model and hardly with
# N — (N−1)/N goes from 1/2 to 7/8 between 2 and 8 ranks — while a sharded rank's memory falls
# as 1/N: the trade-off of §4.8, now as curves. The times are one shared machine's.

# %% [markdown]
# ## 6. The course's four questions, answered with evidence
#
# | question | answer | evidence |
# |---|---|---|
# | 1. Are ZeRO-3 and FSDP the same thing? | No: ZeRO-3 is *what* is sharded (all state, 16Ψ/N); FSDP is PyTorch's framework that does it with units, hooks, wrap policies, layouts and reshard options — some of which are not stage 3 at all | [chapter 05](05-zero3.ipynb) §1, [chapter 06](06-fsdp-units.ipynb) §8 |
# | 2. If stage 3 saves the most memory, why not always use it? | 1.5× the traffic, more and smaller collectives on the critical path; on a model that fits anyway it is slower, and on a slow network much slower | [chapter 05](05-zero3.ipynb) §4; §1 and §4.3 here |
# | 3. FSDP vs tensor parallelism? | FSDP shards storage and gathers each layer whole; TP splits the multiply, never holds a full matrix, and sends activations | §3 here |
# | 4. FSDP is on and it still OOMs: what first? | wrap granularity → prefetch depth → recomputation → the big logits tensor, reading the ledger at the OOM | §2 here |
#
# ## 7. "FSDP vs ZeRO" in four steps
# 1. **The problem.** Training keeps ~16 bytes per parameter (bf16 weights and gradients, fp32
#    master, two Adam moments) plus activations, and DDP keeps all of it on every rank: N copies
#    ([chapter 01](01-memory-ledger.ipynb), [02](02-ddp.ipynb)).
# 2. **ZeRO's logic.** Remove the redundancy stage by stage: optimizer state (1), gradients (2),
#    parameters (3). Memory falls with each stage; traffic stays at DDP's until stage 3 adds a
#    third pass ([03](03-zero1.ipynb), [04](04-zero2.ipynb), [05](05-zero3.ipynb)).
# 3. **FSDP's position.** PyTorch's fully sharded data parallelism organised around the module
#    lifecycle: units gathered before they compute and freed after, with wrap policies,
#    prefetch and reshard options, per-parameter sharding in FSDP2 ([06](06-fsdp-units.ipynb)).
# 4. **The trade-off.** Both buy memory with communication. Choose by model size, device memory,
#    network and the team's tolerance for complexity — not by which sounds more advanced (§1).
#
# ### 7.1 The trade-off, measured: ZeRO against FSDP, every implementation on one batch
# Step 4 as one table: minishard's DDP, ZeRO-1, ZeRO-2 and FSDP, DeepSpeed 0.19's stages 1, 2
# and 3 (stage 3 three ways: its defaults, the persistence threshold at 0, and the live and reuse
# bounds at 0 too) and PyTorch's FSDP2, each on the same two ranks, nano model and global batch
# (two sequences a rank, fp32 AdamW, 0.15 MiB buckets, five steps), every one traced — the
# strategies of minishard by themselves, DeepSpeed's and PyTorch's by `minishard.watch` — and read
# in the third step. Chapters 03 §7, 04 §8 and 05 §6 take each row apart.
#
# <details><summary>中文</summary>
#
# 把第 4 步做成一张表：minishard 的 DDP、ZeRO-1、ZeRO-2 和 FSDP，DeepSpeed 0.19 的 stage 1、2、3（stage 3
# 跑三种：默认值；常驻阈值设为 0；在途上限与复用距离也设为 0），以及 PyTorch 的 FSDP2，都在同样的两个
# rank、nano 模型和全局批次上（每个 rank 两条序列、fp32 AdamW、0.15 MiB 的桶、五步），每个都留下轨迹——
# minishard 的策略自己记录，DeepSpeed 和 PyTorch 的由 `minishard.watch` 记录——读第三步。第 03 章 §7、
# 第 04 章 §8 和第 05 章 §6 逐行拆开讲。
#
# </details>

# %%
from minishard.course.zero_vs_fsdp import CONTENDERS, compare
ALL = [name for name in CONTENDERS if name != "ZeRO-1, all-reduce (minishard)"]     # (chapter 03's variant)
every = {r["name"]: r for r in compare(R2, ALL, step=2, model="nano", micro_batch=2, steps=5, bucket_cap_mb=0.15)}

# %%
# NBVAL_CHECK_OUTPUT
# claim: D9
DDP_ROW = every["DDP (minishard)"]
print(f"{'2 ranks, nano, fp32 AdamW':<34}{'state B/param':>14}{'sent B/param':>14}{'× DDP':>7}{'collectives':>13}")
per_param = {}
for name, r in every.items():
    state, sent = sum(r["state"].values()) / NANO, r["wire"] / NANO
    per_param[name] = (state, r["wire"] / DDP_ROW["wire"])
    print(f"{name:<34}{state:>14.2f}{sent:>14.2f}{r['wire'] / DDP_ROW['wire']:>7.3f}{r['calls']:>13}")
x = {name: round(w, 3) for name, (_, w) in per_param.items()}
assert [per_param[n][0] for n in ("DDP (minishard)", "ZeRO-1 (minishard)", "ZeRO-2 (minishard)",
                                  "ZeRO-3 / FSDP (minishard)")] == [16, 12, 10, 8]
assert per_param["ZeRO-1 (DeepSpeed)"][0] == per_param["ZeRO-2 (DeepSpeed)"][0] == 10
assert x["ZeRO-1 (minishard)"] == x["ZeRO-2 (minishard)"] == 1.0 and x["ZeRO-1 (DeepSpeed)"] == x["ZeRO-2 (DeepSpeed)"] == 1.5
assert x["ZeRO-3 / FSDP (minishard)"] == x["FSDP2 (PyTorch)"] < x["ZeRO-3 (DeepSpeed, bounds 0)"] == 1.5
assert every["ZeRO-3 (DeepSpeed, bounds 0)"]["calls"] > 4 * every["ZeRO-3 / FSDP (minishard)"]["calls"]
assert per_param["ZeRO-3 (DeepSpeed, its defaults)"][0] > per_param["ZeRO-2 (DeepSpeed)"][0]  # nothing sharded
print(f"\nstate between steps, bytes per parameter: DeepSpeed's stage 3 "
      f"{glue('ds-zero3-state-per-param', per_param['ZeRO-3 (DeepSpeed, bounds 0)'][0], '{:.2f}')} bounded, "
      f"{glue('ds-zero3-defaults-state-per-param', per_param['ZeRO-3 (DeepSpeed, its defaults)'][0], '{:.2f}')} "
      f"with its defaults, against FSDP's 8")

# %% [markdown]
# The peaks (activations included) and the step times are this run's, on this shared machine:
#
# <details><summary>中文</summary>
#
# 峰值（含激活值）和单步耗时是这一次运行在这台共享机器上的数字：
#
# </details>

# %%
# NBVAL_IGNORE_OUTPUT
fastest = min(r["step_s"] for r in every.values())
print(f"{'':<34}{'peak B':>12}{'ms a step':>11}{'× fastest':>11}")
for name, r in every.items():
    print(f"{name:<34}{r['peak']:>12,}{r['step_s'] * 1e3:>11.1f}{r['step_s'] / fastest:>11.1f}")
print(f"DeepSpeed's bounded stage 3 / FSDP: "
      f"{glue('ds-zero3-vs-fsdp-time', every['ZeRO-3 (DeepSpeed, bounds 0)']['step_s'] / every['ZeRO-3 / FSDP (minishard)']['step_s'], '{:.1f}')}× "
      f"the step; DeepSpeed's stage 2 / minishard's: "
      f"{glue('ds-zero2-vs-minishard-time', every['ZeRO-2 (DeepSpeed)']['step_s'] / every['ZeRO-2 (minishard)']['step_s'], '{:.1f}')}×")

# %%
R2.close()

# %% [markdown]
# What the table decides. The stage is still chosen by memory — the smallest that fits — but a
# stage's cost is its implementation's: ask which collective and which unit. DeepSpeed's stages
# 1 and 2 send 1.5× (they all-reduce each bucket; `use_multi_rank_bucket_allreduce: false` sends
# each rank its slices instead), so on a network that limits the step, minishard's or PyTorch's
# reduce-scatter is the cheaper stage 1–2. DeepSpeed's stage 3 gathers submodule by submodule:
# the smallest gathered peak, the most collectives — on a link where latency dominates, FSDP's
# block units win; and it shards what its thresholds say, not what "stage 3" says — with its
# defaults a small model is not sharded at all. Set `stage3_param_persistence_threshold`,
# `stage3_max_live_parameters` and `stage3_max_reuse_distance` for the model, and read the ledger
# to check they did what you meant.
#
# <details><summary>中文</summary>
#
# 这张表决定什么。stage 仍按显存来选——放得下的最小那个——但一个 stage 的代价是它的实现的代价：要问用的是
# 哪种集合通信、什么样的单元。DeepSpeed 的 stage 1 和 2 发送 1.5 倍（它们对每个桶做 all-reduce；
# `use_multi_rank_bucket_allreduce: false` 则把每片直接发给所属 rank），所以在网络限制单步耗时的地方，
# minishard 或 PyTorch 用 reduce-scatter 的 stage 1–2 更省。DeepSpeed 的 stage 3 逐个子模块收集：已收集
# 参数的峰值最小，集合通信最多——在延迟占主导的链路上，FSDP 以 block 为单元更好；而且它切什么由阈值决定，
# 而不是由"stage 3"决定——用默认值时，小模型根本不切。按模型设定 `stage3_param_persistence_threshold`、
# `stage3_max_live_parameters` 和 `stage3_max_reuse_distance`，再读账本确认它们做到了你想要的。
#
# </details>

# %% [markdown]
# ## 8. A learning route
# Compute the ledger by hand (chapter 01) → see DDP's redundancy (02) → ZeRO 1, 2, 3 (03–05) →
# FSDP's module lifecycle, prefetch and offload (06–08) → checkpoints (09) → profile before you
# tune (§5 here). Then do it on a real cluster: `torchrun -m minishard demo` writes the same
# traces ([chapter 00](00-how-to-run.ipynb)).
#
# > **Takeaway.** ZeRO and FSDP trade communication for memory; none of it is free. Ask first
# > whether you are short of memory or of throughput, and take the *simplest* strategy that fits
# > (Llama-3-8B on 8 H100s: ZeRO-1; 70B on 32: only FSDP). Check that your network hides the
# > extra traffic — if it is fast only inside a node, shard inside the node (hybrid sharding). When
# > FSDP still OOMs, read the ledger at the OOM and walk the checklist in order: wrap, prefetch,
# > recomputation, the logits. And judge every change by step time, tokens/s, tail latency and
# > scaling efficiency, not by "it runs".
#
# <details><summary>中文</summary>
#
# > **要点。** ZeRO 和 FSDP 都是用通信换显存，哪一样都不是白来的。先问自己缺的是显存还是吞吐，
# > 选放得下的*最简单*策略（8 张 H100 上的 Llama-3-8B：ZeRO-1；32 张上的 70B：只有 FSDP）。
# > 确认网络能藏住多出来的通信——如果网络只在节点内快，就只在节点内分片（混合分片）。FSDP 还是 OOM
# > 时，在 OOM 那一刻读显存账本，按顺序过一遍清单：包裹粒度、预取、重计算、logits。
# > 评判每一项改动都要看单步耗时、tokens/s、尾部抖动和扩展效率，而不是"能跑"。
#
# </details>
#
# **Questions**
#
# 1. A 13B model, bf16-mixed AdamW, on one node of 8 A100-80GB with NVLink. DDP, ZeRO-1 or FSDP?
#
# <details><summary>Answer</summary>
#
# DDP needs 16 × 13e9 = 208 GB per GPU: no. ZeRO-1 keeps bf16 weights and gradients whole
# (4 bytes/param = 52 GB) plus 12/8 bytes/param of optimizer state (19.5 GB): 71.5 GB before
# activations — too tight for long sequences. ZeRO-2 (2 + 14/8 = 3.75 bytes/param, 49 GB) or FSDP
# (2 bytes/param, 26 GB) leave room for activations; on NVLink the extra traffic of FSDP is
# hidden, so either works — take ZeRO-2 if the stack makes it easy, FSDP if activations need the
# room. Check it in the planner widget.
# </details>
#
# 2. An FSDP job OOMs and the report says "allocating 512 MiB of unsharded"; the ledger holds
# 3 GiB of `unsharded` on a model whose blocks are 500 MiB each. First suspect?
#
# <details><summary>Answer</summary>
#
# Prefetch depth (or a coarse unit): 3 GiB of gathered parameters is six blocks' worth, while the
# usual schedule keeps the root plus one or two. Check the prefetch depth and the wrap policy
# before touching recomputation.
# </details>
#
# 3. Mean step time is fine but the job misses its throughput target by 20% at 1,024 GPUs. What do
# you measure?
#
# <details><summary>Answer</summary>
#
# Per-rank step-time distributions (p50 vs p99, max) and scaling efficiency against a smaller run:
# a synchronous job runs at the speed of its slowest rank at every collective (§4.2), so a few
# slow nodes or an oversubscribed network link tax everyone. Then the communication share and
# exposed communication per step (§5).
# </details>

# %% [markdown]
# ## Exercise: a tensor-parallel MLP forward
# Write the forward of an MLP split the Megatron way: this rank's columns of the first matrix W
# (in Y = XW) and the same rows of the second — in `nn.Linear` terms, which store Wᵀ, rows of
# the first Linear's weight and columns of the second's — then one all-reduce of the partial
# outputs. The check runs it on 1, 2
# and 4 real ranks with the tiny GPT's first MLP, compares with the whole MLP and with
# `TensorParallelMLP`, and checks that only activations crossed the wire, never a weight. The
# function is sent to the ranks as source: keep it self-contained.
#
# Write it in the cell below (or edit the stub in
# [`minishard/course/exercises/ch10.py`](../minishard/course/exercises/ch10.py)), then run the check. A
# reference solution is in [`solutions/ch10.py`](../solutions/ch10.py): try first.
#
# <details><summary>中文</summary>
#
# **练习：张量并行 MLP 的前向。** 按 Megatron 的方式切分 MLP，写出它的前向：本 rank 持有第一个矩阵
# W（Y = XW 中的 W）的若干列和第二个矩阵对应的行——换成 `nn.Linear` 的说法（它存的是 Wᵀ），就是第一个
# Linear 权重的行、第二个 Linear 权重的列——然后对部分输出做一次 all-reduce。检查程序用 tiny GPT
# 的第一个 MLP 在 1、2、4 个真实 rank 上运行它，与完整 MLP 和 `TensorParallelMLP` 比较，
# 并确认网络上只传了激活值、从未传过权重。这个函数会以源码形式发送给各 rank：请让它自包含。
#
# 在下面的单元格里写（或编辑
# [`minishard/course/exercises/ch10.py`](../minishard/course/exercises/ch10.py) 里的桩函数），
# 然后运行检查。参考答案在 [`solutions/ch10.py`](../solutions/ch10.py)：先自己试。
#
# </details>

# %%
def tp_mlp_forward(comm, x, fc_w, fc_b, proj_w, proj_b):
    """proj(gelu(fc(x))) with this rank's parts: fc_w (h_ff/N, h), fc_b (h_ff/N,), proj_w (h, h_ff/N);
    proj_b (h,) whole (add it once). comm.all_reduce(t) sums t over ranks in place."""
    raise NotImplementedError("your code here")

# %%
# NBVAL_CHECK_OUTPUT
from minishard.course.exercises import ch10

ch10.check_tp_mlp_forward(tp_mlp_forward)
