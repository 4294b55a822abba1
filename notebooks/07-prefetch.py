# ---
# jupyter:
#   jupytext:
#     formats: ipynb,py:percent
#     text_representation:
#       extension: .py
#       format_name: percent
#       format_version: '1.3'
#       jupytext_version: 1.19.6
#   kernelspec:
#     display_name: Python 3
#     language: python
#     name: python3
# ---

# %% [markdown]
# # 07 · Prefetch: start the next gather early, and pay for it in memory
#
# > **An FSDP unit gathers its parameters just before it computes. Who waits while they travel —
# > and what does it cost to stop waiting?**
#
# <details><summary>中文</summary>
#
# > **FSDP 单元在计算前一刻才收集自己的参数。参数在路上时，谁在干等？不想再等，又要付出什么代价？**
#
# 预取（prefetch）在当前单元计算时就发起后面单元的 all-gather（反向时是前面的单元）。本 notebook 在真实
# rank 上测量它换来什么、花掉什么。中文讲解见 [tutorial/zh/07-prefetch.md](../tutorial/zh/07-prefetch.md)。
#
# </details>
#
# Chapter 06 walked one unit through its lifecycle: gather, compute, free. Done strictly in that
# order, compute stops at every unit until its all-gather has arrived. *Prefetch* issues the
# all-gather of the next units while this one computes (in backward, the units before it, since
# backward runs the model in reverse). This notebook measures what that buys and what it costs on
# real ranks; the reasoning is in [tutorial/07-prefetch.md](../tutorial/07-prefetch.md).
#
# **The one-line "syntax"** — prefetch depth d, N ranks, fp32 AdamW; the peak comes at the start
# of backward, when every activation is alive, the root computes the head and d blocks are
# already gathered for backward:
#
# $$\text{peak per rank} = \frac{16\,\Psi}{N} + \text{root} + d\cdot\text{block} + \text{activations},
# \qquad \text{full parameters held} = \text{root} + (d+1)\cdot\text{block}.$$
#
# ```python
# set_prefetch(model, forward=d, backward=d)               # depth d for every unit of the root
# set_modules_to_forward_prefetch(model.blocks[0], [model.blocks[1]])   # or explicit, per unit
# ```
#
# <details><summary>中文</summary>
#
# **一行"语法"**——预取深度 d，N 个 rank，fp32 AdamW。峰值出现在反向开始时：所有激活值都还在显存里，root 在算
# head，d 个 block 已经为反向收集好。每个 rank 的峰值 = 16Ψ/N + root + d·block + 激活值；同时持有的完整
# 参数 = root + (d+1)·block。`set_prefetch` 给 root 下的所有单元设置预取深度，
# `set_modules_to_forward_prefetch` 则逐个单元显式指定。
#
# </details>
#
# Terms, in English and Chinese: [glossary · 术语表](../tutorial/glossary.md).

# %%
import statistics

import plotly.io as pio
from IPython.display import display

from minishard import GPT, Ranks, model_config
from minishard.core.launch import RankError
from minishard.planner.analytic import gpt_activation_bytes
from minishard.course.ch07 import (gather_waits, gathered_peaks, prefetch_race,
                                        prefetch_timeline, who_is_gathered)
from minishard.course.glue import glue
from minishard.training.loop import TrainConfig, train
from minishard.viz import Player

pio.renderers.default = "plotly_mimetype+notebook_connected"
TINY = GPT("tiny", device="meta")
PSI = TINY.num_params()
ROOT = 4 * sum(p.numel() for n, p in TINY.named_parameters() if not n.startswith("blocks."))
BLOCK = 4 * sum(p.numel() for p in TINY.blocks[0].parameters())      # fp32 bytes
ACT = gpt_activation_bytes(model_config("tiny"), 4)                        # micro-batch 4
STATE = 16 * PSI // 2                                                # 16 Ψ / N, N = 2
print(f"tiny GPT, 2 ranks, micro-batch 4: 16Ψ/N = {STATE:,} B, root unit {ROOT:,} B, "
      f"one block {glue('block-bytes', BLOCK, '{:,}')} B, activations {ACT:,} B")
R2 = Ranks(2)                                                        # one warm pool for the chapter

# %% [markdown]
# ## 1. The schedule: what is in flight while each unit computes
# Two training steps for each depth d = 0, 1, 2, 3, in both layouts: FSDP1's flat buffer
# (`fsdp_flat`) and FSDP2's per-parameter shards (`fsdp`). Everything else is the same: tiny
# model, one unit per block plus the root, micro-batch 4.

# %%
DEPTHS = (0, 1, 2, 3)
sweep, traces = {}, {}
for layout in ("fsdp_flat", "fsdp"):
    for k in DEPTHS:
        sweep[layout, k] = R2.run(train, TrainConfig(strategy=layout, model="tiny", micro_batch=4, steps=2, prefetch=k))
        traces[layout, k] = R2.last_events

# %% [markdown]
# Read from rank 0's trace of the second step (`step=1`: steps count from 0), at the moment each
# unit starts computing: which units' all-gathers are then in flight behind it.

# %%
# NBVAL_CHECK_OUTPUT
def short(units):
    return ",".join(u.replace("blocks.", "b") for u in units) or "-"

blocks = [f"blocks.{i}" for i in range(len(TINY.blocks))]
for k in DEPTHS:
    rows = who_is_gathered(traces["fsdp_flat", k], rank=0, step=1)
    for p in ("forward", "backward"):
        line = "  ".join(f"{short([r['unit']])}[{short(r['in_flight'])}]" for r in rows if r["pass"] == p)
        print(f"d={k} {p:<9} {line}")
    order = {"forward": blocks, "backward": blocks[::-1]}
    for r in rows:                            # the rule: the next k units of the pass, in its order
        seq = order[r["pass"]]
        nxt = seq[:k] if r["unit"] == "root" else seq[seq.index(r["unit"]) + 1:seq.index(r["unit"]) + 1 + k]
        assert sorted(r["in_flight"]) == sorted(nxt), (k, r)
    # the same schedule in the per-parameter layout
    assert who_is_gathered(traces["fsdp", k], rank=0, step=1) == rows

# %% [markdown]
# `b2[b3,b4]` reads: block 2 computes while the all-gathers of blocks 3 and 4 travel. With d = 0
# nothing is ever in flight: each unit gathers when it is reached, and compute waits. In
# backward the order is reversed, and the root (which computes the head first) prefetches the
# *last* blocks. (The root itself is gathered once per step and kept: chapter 06.)
#
# ## 2. Peak memory: one block more per unit of depth
# Each prefetched unit has to hold its full parameters from the moment its gather starts, so
# depth costs memory. Measured on rank 0, next to the formula; then where the full parameters
# sit in each layout.

# %%
# NBVAL_CHECK_OUTPUT
def formula(k):
    return STATE + ROOT + k * BLOCK + ACT

print(f"{'d':>2}{'formula':>14}{'peak flat':>14}{'peak per-param':>16}{'flat − formula':>16}")
for k in DEPTHS:
    flat, pp = (sweep[s, k][0]["ledger"]["peak"] for s in ("fsdp_flat", "fsdp"))
    print(f"{k:>2}{formula(k):>14,}{glue(f'peak-flat-k{k}', flat, '{:,}'):>14}"
          f"{glue('peak-per-param-k0', pp, '{:,}') if k == 0 else f'{pp:,}':>16}{flat - formula(k):>16,}")
    for s in ("fsdp_flat", "fsdp"):
        for o in sweep[s, k]:
            assert abs(o["ledger"]["peak"] - formula(k)) <= 0.02 * formula(k)
            assert sum(v for c, v in o["ledger"]["estimate"].items() if c != "activations") == STATE
    assert flat == formula(k)                                      # to the byte, in the flat layout
    if k >= 1:
        assert pp == flat                                          # the same peak in both layouts
for k in DEPTHS[1:]:                                               # one block per unit of depth
    assert sweep["fsdp_flat", k][0]["ledger"]["peak"] - sweep["fsdp_flat", k - 1][0]["ledger"]["peak"] == BLOCK
flat0, pp0 = (sweep[s, 0][0]["ledger"]["peak"] for s in ("fsdp_flat", "fsdp"))
print(f"d=0: the per-parameter peak is {glue('per-param-k0-excess', pp0 / flat0 - 1, '{:.1%}')} above the flat one")

# %% [markdown]
# The formula is exact to the byte for the flat layout; the per-parameter layout peaks at the
# same bytes from d = 1 on (at d = 0 its peak falls inside backward, 0.8% above). Each unit of
# depth costs one block: 3,159,040 bytes here, 436 MB of bf16 for a Llama-3-8B block, 1.7 GB
# for a Llama-3-70B block — on every rank, whatever N is.
#
# Where do the full parameters sit? `gathered_peaks` folds rank 0's trace: `unsharded` are
# parameters a module can compute with; *in flight* are the packed all-gather buffers the
# per-parameter layout receives into before it copies out (`comm_buffers` tagged `<unit>:ag`).

# %%
# NBVAL_CHECK_OUTPUT
print(f"{'':>2}{'flat layout':>15}{'per-parameter layout':>54}")
print(f"{'d':>2}{'unsharded':>15}{'unsharded':>15}{'in flight':>13}{'both at once':>15}"
      f"{'root+(k+1)·block':>19}")
for k in DEPTHS:
    f, p = gathered_peaks(traces["fsdp_flat", k]), gathered_peaks(traces["fsdp", k])
    print(f"{k:>2}{f['unsharded']:>15,}{p['unsharded']:>15,}{p['in_flight']:>13,}{p['both']:>15,}"
          f"{ROOT + (k + 1) * BLOCK:>19,}")
    assert f["unsharded"] == ROOT + (k + 1) * BLOCK and f["in_flight"] == 0   # gathered in place
    assert sweep["fsdp_flat", k][0]["ledger"]["category_peaks"]["unsharded"] == ROOT + (k + 1) * BLOCK
    assert p["unsharded"] == ROOT + BLOCK                  # only the unit computing is unpacked
    assert p["in_flight"] == max(ROOT, k * BLOCK)          # the root's buffer, or k blocks in flight
    assert p["both"] == max(2 * ROOT, ROOT + (k + 1) * BLOCK)

# %% [markdown]
# * **Flat (FSDP1)** gathers straight into the unit's full buffer, allocated when the gather
#   starts: a prefetched unit is `unsharded` memory at once, and the category peaks at
#   root + (d+1) blocks.
# * **Per-parameter (FSDP2)** gathers into one packed buffer per unit and allocates the
#   parameters only at the copy-out, when the unit is about to compute. So `unsharded` never
#   exceeds the root and one block, and the prefetched units are *in flight* instead: d blocks
#   of buffers (or the root's buffer, the largest single gather here). Counting both, the same
#   root + (d+1) blocks come back as soon as depth dominates (d = 2, 3) — plus, at every
#   copy-out, the unit's packed buffer and its parameters side by side for a moment, which is
#   2 × root when the root copies out. Same bytes, different ledger lines: when you read an OOM
#   report, prefetched parameters may be filed under communication buffers.
#
# ## 3. The overlap, on the timeline
# One step on rank 0 without prefetch and with depth 1. Each row is a unit: the pale bar is its
# all-gather in flight (from launch to completion), the teal bar the unit gathered and
# computing, purple its gradients' reduce-scatter, and red the time compute **waited** for that
# unit's communication (`wait_unshard` / `wait_reduce_scatter`, what `FSDPUnit.exposed_s` sums).

# %%
prefetch_timeline({"k = 0 (no prefetch)": traces["fsdp_flat", 0], "k = 1": traces["fsdp_flat", 1]},
                  rank=0, step=1,
                  title="rank 0, step 1, flat layout: all-gathers, compute, and compute waiting").show()

# %% [markdown]
# Without prefetch every block's pale bar sits *before* its teal bar, red wherever compute
# stopped until the bytes arrived. With d = 1 the pale bar of block i+1 lies under the teal bar
# of block i — it traveled while block i computed — and most red is gone. Measured per
# all-gather (the root's, issued first in the step, can hide behind nothing):

# %%
# NBVAL_IGNORE_OUTPUT
for k in (0, 1):
    rows = [r for r in gather_waits(traces["fsdp_flat", k], rank=0, step=1) if r["unit"] != "root"]
    for p in ("forward", "backward"):
        rs = [r for r in rows if r["pass"] == p]
        waited = glue(f"block-wait-k{k}-{p}", sum(r["waited"] for r in rs) * 1e3, "{:.1f}")
        print(f"d={k} {p:<9}: {len(rs)} block all-gathers, {sum(r['seconds'] for r in rs) * 1e3:6.1f} ms "
              f"in flight, compute waited {waited:>6} ms "
              f"({statistics.mean(r['hidden'] for r in rs):.0%} hidden on average)")

# %% [markdown]
# The step-through player replays the same trace. Its timeline draws the top-level phases and
# every collective on each rank's communication lane; the per-unit waits are phases *inside*
# forward and backward, so they are not drawn as lanes but named in the title as you step —
# "jump to phase" → `wait_unshard` goes to the next one. (A wait is recorded only when compute
# actually had to wait, so how many there are depends on the run.) The cell below jumps instead
# to a unit event every run has: "blocks.0 → unsharded" in rank 0's forward of step 1. Blocks.0
# was prefetched by the root; at that moment rank 0 holds the root and that one block in full,
# and the gather of blocks.1 is issued right after:

# %%
player = Player(traces["fsdp_flat", 1], title="FSDP (flat), prefetch depth 1, 2 ranks, tiny model")
display(player.widget)

# %%
# NBVAL_CHECK_OUTPUT
player.jump(next(i for i, e in enumerate(player.replay.events)
                 if e["kind"] == "unit" and e["rank"] == 0 and e.get("step") == 1
                 and e["name"] == "blocks.0" and e["state"] == "unsharded"))
title = player.replay.title(player.index)
print(title[:title.rindex("·")].strip())                 # (the event's index depends on the interleaving)
print("rank 0 now holds unsharded:",
      f"{glue('blocks0-unsharded-bytes', player.snapshot()[0]['unsharded'], '{:,}')} B = root + one block")
assert "blocks.0" in title and "forward" in title
assert player.snapshot()[0]["unsharded"] == ROOT + BLOCK  # blocks.0 arrived; blocks.1 not yet issued
ag = [e for e in player.replay.events if e["kind"] == "collective" and e["op"] == "all_gather"
      and e["rank"] == 0 and e.get("step") == 1]
assert len(ag) == 1 + 2 * len(TINY.blocks)               # the root once, every block twice

# %% [markdown]
# The same trace in the offline player (no kernel: it plays on the static site too), opening at
# the same event. Its timeline shows each all-gather on the comm lane running ahead of the block
# that needs it; click the timeline to jump to a moment, and "jump to phase" → `wait_unshard`
# finds the waits that remain.

# %%
from minishard.viz import replay_html
replay_html(player.replay, title="FSDP (flat), prefetch depth 1, 2 ranks, tiny model (offline player)",
            start=player.index)

# %% [markdown]
# ## 4. Exposed communication and step time against depth
# Timing on this machine is noisy: two CPU cores shared with other work. To compare depths
# fairly, [`prefetch_race`](../minishard/course/ch07.py) builds one model per depth (0, 1
# and 3 here) on the same two ranks and trains them side by side, alternating the order every
# step, each step starting from a barrier. For each depth: the median over steps of the slower
# rank's step time, of the seconds compute waited on communication, and of the CPU seconds the
# rank burned.

# %%
# NBVAL_IGNORE_OUTPUT
RACE = (0, 1, 3)
race = R2.run(prefetch_race, depths=RACE, model="tiny", steps=3, micro_batch=4)
med = {key: {k: statistics.median(max(a, b) for a, b in zip(race[0][key][k], race[1][key][k]))
             for k in RACE} for key in ("step_s", "exposed_s", "cpu_s")}
print(f"{'d':>2}{'step (ms)':>11}{'waited (ms)':>13}{'CPU (ms)':>10}")
for k in RACE:
    print(f"{k:>2}{glue(f'race-step-k{k}', med['step_s'][k] * 1e3, '{:.0f}'):>11}"
          f"{glue(f'race-waited-k{k}', med['exposed_s'][k] * 1e3, '{:.1f}'):>13}{med['cpu_s'][k] * 1e3:>10.0f}")
print("exposed communication with d=1 below d=0:", med["exposed_s"][1] < med["exposed_s"][0])

# %% [markdown]
# What to expect, and why it is not asserted here. Prefetch removes the *waiting* — the time
# compute sits idle while bytes travel — not the work of moving them. On a GPU that work runs
# elsewhere (NCCL's kernels and the network card), so hidden communication is close to free, and
# the waits of §3 turn into step time saved. On this machine there is nothing elsewhere: gloo's
# threads copy the bytes over loopback on the same two cores the ranks compute on, and other
# processes take turns on them too. What prefetch still hides here is mostly *skew*: a gather
# cannot complete until the slower rank has joined it, and without prefetch the faster rank
# idles at every unit. In most of our runs the waits drop as soon as d ≥ 1 (§3's single step shows
# them almost gone for the blocks), while the step time follows less clearly and deeper prefetch
# sometimes helps a little more, sometimes not — under this much noise, not a claim to assert.
# The memory cost of §2, in contrast, is exact on every run. (`scripts/gpu_check.py` is where the GPU side gets measured.)
#
# ## 5. The OOM that prefetch causes
# Give each rank a device of 129 MiB (`device_budget=129 * 2**20` bytes: the ledger raises
# `DeviceOutOfMemory` when an allocation would cross it). Sharding is unchanged; only the depth
# moves. The formula predicts which depths fit:

# %%
# NBVAL_CHECK_OUTPUT
BUDGET = 129 * 2**20                                                 # 135,266,304 bytes
for k in DEPTHS:
    verdict = "fits" if formula(k) <= BUDGET else f"over by {glue(f'budget-over-k{k}', formula(k) - BUDGET, '{:,}')} B"
    peak = glue("budget-peak-k1", formula(k), "{:,}") if k == 1 else f"{formula(k):,}"
    print(f"d={k}: peak {peak} B -> {verdict}")
assert [formula(k) <= BUDGET for k in DEPTHS] == [True, True, False, False]

# %% [markdown]
# Run depth 1 and depth 3 under that budget:

# %%
# NBVAL_CHECK_OUTPUT
budget_kw = dict(strategy="fsdp_flat", model="tiny", micro_batch=4, steps=2, device_budget=BUDGET)
fits = R2.run(train, TrainConfig(prefetch=1, **budget_kw))
print("d=1: peak per rank", [o["ledger"]["peak"] for o in fits], "<= budget:",
      all(o["ledger"]["peak"] <= BUDGET for o in fits))
assert all(o["ledger"]["peak"] == formula(1) for o in fits)
try:
    R2.run(train, TrainConfig(prefetch=3, **budget_kw))
    raise AssertionError("depth 3 should not fit")
except RankError as e:
    print("d=3:", e.error.split(" would take")[0] + " ... over its budget")
    assert e.error.startswith("DeviceOutOfMemory") and "over its budget of 129.0 MiB" in e.error

# %% [markdown]
# Same model, same sharding, same budget: depth 1 trains; depth 3 dies at the start of
# backward of the second step (the first with Adam's moments), where the root's backward
# prefetch gathers blocks 5, 4 and 3 on top of every activation — the second of the three does
# not fit. A rank that runs out of memory closes the pool; the chapter is done with it.

# %%
R2.close()

# %% [markdown]
# ## 6. So: what does prefetch buy, and what does it cost?
#
# > **Takeaway.** Prefetch depth d issues the all-gathers of the next d units (the previous d in
# > backward) while this one computes, so their bytes travel under compute instead of in front
# > of it. The price is exact: d more blocks' full parameters resident at the peak,
# > 16Ψ/N + root + d·block + activations at the start of backward — measured to the byte.
# > Depth 1 hides most of what can be hidden (it needs one unit's compute to cover one unit's
# > gather); more depth only helps when compute per unit is uneven, and costs a block each time.
# > So when FSDP runs out of memory with sharding on, look at the prefetch depth before you
# > blame sharding: many FSDP OOMs are aggressive prefetch.
#
# <details><summary>中文</summary>
#
# > **要点。** 预取深度 d 在当前单元计算时发起后面 d 个单元（反向时是前面 d 个）的 all-gather，让传输与
# > 计算重叠，而不是挡在计算前面。代价是精确的：峰值时多驻留 d 个 block 的完整参数，反向开始时为
# > 16Ψ/N + root + d·block + 激活值——测量精确到字节。深度 1 就能藏住能藏的大部分（一个单元的计算覆盖
# > 一个单元的 gather）；只有各单元计算量不均匀时，更深才有用，而每加一级都要多花一个 block。所以开着
# > 分片的 FSDP 还是 OOM 时，先查预取深度，再去怪分片：很多 FSDP 的 OOM 是预取太激进。
#
# </details>
#
# **Questions**
#
# 1. Whatever the depth, the root's all-gather is never hidden (§3). Why not?
#
# <details><summary>Answer</summary>
#
# It is the first collective of the step: forward starts with the embeddings, which belong to the
# root, and nothing computes before them that the gather could hide behind. (The previous step's
# optimizer could cover it in principle — prefetching across steps; minishard does not.)
# </details>
#
# 2. In §5, depth 2 was over the 129 MiB budget by 745,476 bytes. Name three ways to make depth 2
#    fit without changing the budget.
#
# <details><summary>Answer</summary>
#
# Shrink any other term of the formula: a smaller micro-batch (activations are 66,220,036 bytes
# of it), activation recomputation (keep each block's input, recompute the rest in backward), or
# more ranks (on four ranks 16Ψ/N drops by 27,475,968 bytes). Or keep depth 2 in forward and
# use depth 1 in backward, where the peak is — `set_prefetch(model, forward=2, backward=1)`.
# </details>
#
# 3. In §2's per-parameter table, "both at once" is 2 × root at d = 0 and 1, not
#    root + (d+1) blocks. When does that moment matter on a real model?
#
# <details><summary>Answer</summary>
#
# When the root is large: at its copy-out, the root exists packed and unpacked at once. Llama-3-8B's
# root (embeddings plus an untied head over a 128k vocabulary) is 1.05 billion parameters, 2.1 GB
# in bf16 — 4.2 GB for that moment, more than nine blocks. Wrapping the embeddings and the head as
# units of their own splits it; it is the "large unwrapped tensor" item of the OOM checklist.
# </details>

# %% [markdown]
# ## Exercise: the prefetch schedule
# Write which units a unit starts gathering when it begins computing, with prefetch depth d, in
# forward and in backward. The check trains the nano model on 2 real ranks with depths 0–3 and
# compares your schedule with the all-gathers the trace shows in flight.
#
# Write it in the cell below (or edit the stub in
# [`minishard/course/exercises/ch07.py`](../minishard/course/exercises/ch07.py)), then run the check. A
# reference solution is in [`solutions/ch07.py`](../solutions/ch07.py): try first.
#
# <details><summary>中文</summary>
#
# **练习：预取调度。** 写出预取深度为 d 时，一个单元开始计算时要发起哪些单元的 gather，前向、反向各一份。
# 检查程序在 2 个真实 rank 上用深度 0–3 训练 nano 模型，把你的调度与轨迹中在途的 all-gather 对比。写在
# 下面的单元格里（或编辑 `minishard/course/exercises/ch07.py` 里的桩函数），再运行检查；参考答案在
# `solutions/ch07.py`，先自己试。
#
# </details>

# %%
def prefetch_targets(blocks, unit, depth, forward):
    """The units whose all-gathers `unit` ("root" or one of `blocks`, given in forward order)
    starts when it begins computing, with prefetch depth `depth`, in the forward pass or not."""
    raise NotImplementedError("your code here")

# %%
# NBVAL_CHECK_OUTPUT
from minishard.course.exercises import ch07

ch07.check_prefetch_targets(prefetch_targets)

# %% [markdown]
# ## 7. ZeRO-3 à la DeepSpeed: three bounds beside the depth
# DeepSpeed's ZeRO-3 bounds the same gathers with three config keys, and counts them in
# *parameters* — numbers of elements, not bytes (× 4 in fp32, × 2 in bf16):
#
# | DeepSpeed config key | minishard | what it bounds |
# |---|---|---|
# | `stage3_prefetch_bucket_size` | `fsdp.set_stage3_limits(model, prefetch_bucket_size=n)` | elements gathered ahead of the unit computing, instead of a number of units |
# | `stage3_max_live_parameters` | `fsdp.set_stage3_limits(model, max_live_parameters=n)` | elements gathered at once (unsharded or in flight, the root included): a prefetch that would cross it is not issued |
# | `stage3_param_persistence_threshold` | `fully_shard(..., param_persistence_threshold=n)` | parameters of at most n elements are never sharded |
#
# [`stage3_train`](../minishard/course/ch07.py) is `train` with these set on its units. Tiny
# model, 2 ranks, flat layout, micro-batch 1 (only the gathered parameters matter here), two
# steps; first the prefetch bounds, next to FSDP's depth.

# %%
# NBVAL_CHECK_OUTPUT
from minishard.course.ch07 import stage3_train

R = Ranks(2)
EL_ROOT, EL_BLOCK = ROOT // 4, BLOCK // 4                            # elements, as DeepSpeed counts
run_kw = dict(strategy="fsdp_flat", model="tiny", micro_batch=1, steps=2, track_activations=False)
CAP = EL_ROOT + 5 * EL_BLOCK // 2                                    # root + 2.5 blocks
settings = {                                   # name: (depth, limits, blocks gathered at the peak)
    "depth 0": (0, {}, 1), "depth 1": (1, {}, 2), "depth 2": (2, {}, 3), "depth 3": (3, {}, 4),
    "bucket = 1 block": (0, dict(prefetch_bucket_size=EL_BLOCK), 2),
    "bucket = 1.5 blocks": (0, dict(prefetch_bucket_size=3 * EL_BLOCK // 2), 2),
    "bucket = 2 blocks": (0, dict(prefetch_bucket_size=2 * EL_BLOCK), 3),
    "depth 3, cap root+2.5 blocks": (3, dict(max_live_parameters=CAP), 2),
    "depth 3, cap 1 element": (3, dict(max_live_parameters=1), 1),
}
print(f"one block {EL_BLOCK:,} elements, the root {EL_ROOT:,}; cap = {CAP:,} elements = "
      f"{glue('stage3-cap-bytes', 4 * CAP, '{:,}')} B")
print(f"{'':<30}{'gathered peak (B)':>19}{'root+j·block':>14}{'all-gathers/step':>18}")
quoted = {"depth 3": "stage3-peak-depth-3", "bucket = 1 block": "stage3-peak-bucket-1-block",
          "bucket = 2 blocks": "stage3-peak-bucket-2-blocks"}          # the figures the chapter names
bounds = {}
for name, (k, limits, j) in settings.items():
    bounds[name] = R.run(stage3_train, TrainConfig(prefetch=k, **run_kw), **limits)
    r = bounds[name][0]
    peak = r["ledger"]["category_peaks"]["unsharded"]
    gathers = r["by_op"]["all_gather"]["calls"] // 2
    shown = glue(quoted[name], peak, "{:,}") if name in quoted else f"{peak:,}"
    print(f"{name:<30}{shown:>19}{f'j = {j}':>14}{glue('stage3-all-gathers-per-step', gathers):>18}")
    for o in bounds[name]:
        assert o["ledger"]["category_peaks"]["unsharded"] == ROOT + j * BLOCK      # to the byte
        assert o["by_op"]["all_gather"]["calls"] == 2 * (1 + 2 * len(TINY.blocks))
assert ROOT + 2 * BLOCK <= 4 * CAP < ROOT + 3 * BLOCK               # the cap, in bytes

# %% [markdown]
# * **The bucket** is a window of elements: a bucket of exactly d blocks is depth d, byte for
#   byte; a bucket between one and two blocks holds one (a block is gathered whole or not at
#   all). Where units differ in size — a large embedding, MoE experts — the bucket keeps the
#   bytes in flight steady where a depth would not.
# * **The cap** stops depth 3 at the root and two blocks: the third would take the gathered
#   elements past root + 2.5 blocks. A cap below one unit cannot stop the unit that must
#   compute: it gathers anyway, and the run is depth 0. So the bound is the cap or the root plus
#   the largest unit, whichever is larger.
# * **Neither changes the number of collectives**: every setting issues 13 all-gathers per step
#   (the root once, each of the 6 blocks twice). Bounds move gathers earlier or later; only the
#   wrapping decides how many there are.
#
# DeepSpeed differs in one detail: at each fetch it spends a fresh bucket on parameters not yet
# in flight (and may pass it by one parameter), so what is gathered ahead is bounded by
# `stage3_max_live_parameters`, not by the bucket — with its default of 10⁹ elements, by
# nothing a small model notices. Here the bucket bounds what is ahead; the cap bounds it all.
#
# Now the persistence threshold: 1,024 elements keeps every norm and bias whole on every rank.

# %%
# NBVAL_CHECK_OUTPUT
small = {n: p.numel() for n, p in TINY.named_parameters() if p.numel() <= 1024}
P = sum(small.values())
print(f"{glue('persistent-params', len(small))} persistent parameters, "
      f"Ψ_p = {glue('persistent-elements', P, '{:,}')} elements of Ψ = {PSI:,}")
base = bounds["depth 0"][0]
kept = R.run(stage3_train, TrainConfig(prefetch=0, **run_kw), param_persistence_threshold=1024)
r = kept[0]
for what, o in (("all sharded", base), ("threshold 1024", r)):
    ops = {op: (v["calls"] // 2, v["payload"] // 2) for op, v in o["by_op"].items()}
    print(f"{what:<15} params on a rank {o['ledger']['final']['params']:>11,} B; per step: "
          + ", ".join(f"{op} ×{n} {b:,} B" for op, (n, b) in sorted(ops.items())))
for o in kept:
    for category in ("params", "grads", "exp_avg", "exp_avg_sq"):
        assert o["ledger"]["final"][category] == 4 * ((PSI - P) // 2 + P)     # (Ψ − P)/N + P
    assert o["by_op"]["all_gather"]["calls"] == base["by_op"]["all_gather"]["calls"]
    assert o["by_op"]["all_reduce"]["calls"] == 2 * (1 + len(TINY.blocks))   # one per unit a step
    assert o["by_op"]["all_reduce"]["payload"] == 2 * 4 * P
    assert base["by_op"]["reduce_scatter"]["payload"] - o["by_op"]["reduce_scatter"]["payload"] == 2 * 4 * P
print("state per rank: 16·((Ψ − Ψ_p)/N + Ψ_p) =", f"{glue('state-with-persistence', 16 * ((PSI - P) // 2 + P), '{:,}')} B, "
      f"was 16·Ψ/N = {glue('state-all-sharded', 16 * PSI // 2, '{:,}')} B")
R.close()

# %% [markdown]
# The Ψ_p = 20,480 persistent elements leave every all-gather and reduce-scatter; their gradients
# travel in one all-reduce per unit and step (7 more collectives, 4Ψ_p bytes), and each rank holds
# them whole — parameters, gradients and both Adam moments: 16Ψ_p(1 − 1/N) bytes more per rank,
# 163,840 on two ranks. The number of all-gathers does not move: minishard gathers by unit, and
# every unit keeps large parameters to gather. What persistence buys is in the launches — a
# unit made only of small parameters needs no all-gather at all: it gathers nothing and
# all-reduces its gradients, as DDP would. DeepSpeed, which gathers parameter by parameter, drops a persistent
# parameter's gathers outright, keeps its optimizer state sharded, reduce-scatters its gradient
# like any other, and all-gathers the persistent parameters once after each optimizer step;
# minishard replicates them outright, as DDP would (`replicate_params`).
