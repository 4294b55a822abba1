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
# # 03 · ZeRO-1: shard the optimizer state
#
# > **Every DDP rank keeps the same 12 bytes per parameter of optimizer state and runs the same
# > update on it. What if each rank kept, and updated, only its own 1/N of it?**
#
# <details><summary>中文</summary>
#
# **DDP 的每个 rank 都为每个参数存着同样的 12 字节优化器状态，还在上面跑一模一样的更新。如果每个
# rank 只保存、只更新属于自己的那 1/N 呢？**
#
# ZeRO（零冗余优化器）的 stage 1 把 fp32 主权重和 Adam 的一阶矩、二阶矩切成 N 片，每个 rank 一片。
# 反向之后，一个 rank 只需要自己那片的求和梯度；它更新自己那片，再由一次 all-gather 把更新后的参数
# 发给所有人。推理过程见 [中文版第 03 章](../tutorial/zh/03-zero1.md)；这个 notebook 在真实的 rank
# 上运行并测量它。
#
# </details>
#
# Stage 1 of ZeRO (the *Zero Redundancy Optimizer*) cuts the fp32 master weights and Adam's two
# moments into N slices, one per rank. After backward a rank needs the summed gradient of its
# slice only; it updates its slice, and an all-gather hands the updated parameters to everyone.
# The reasoning is in [tutorial/03-zero1.md](../tutorial/03-zero1.md); this notebook runs it on
# real ranks and measures it.
#
# **The one-line "syntax"** — with Ψ parameters, bf16-mixed AdamW (2 + 2 + 4 + 4 + 4 bytes per
# parameter, chapter 01), on each of N ranks:
#
# $$\text{memory per rank} = \underbrace{2\Psi + 2\Psi}_{\text{bf16 weights, grads: replicated}} + \underbrace{\frac{12\Psi}{N}}_{\text{master}+m+v\text{: sharded}},\qquad
# \text{grads} \xrightarrow{\text{reduce-scatter}} \text{update my slice} \xrightarrow{\text{all-gather}} \text{params}.$$
#
# <details><summary>中文</summary>
#
# **一行"语法"**——Ψ 个参数，bf16 混合精度 AdamW（每参数 2 + 2 + 4 + 4 + 4 字节，见第 01 章），
# N 个 rank 中的每一个：显存 = 2Ψ + 2Ψ（bf16 权重和梯度，每个 rank 一份完整副本）+ 12Ψ/N（主权重
# + m + v，分片）。一步训练：梯度 →（reduce-scatter）→ 更新自己那片 →（all-gather）→ 参数。
#
# </details>
#
# Terms, in English and Chinese: [glossary · 术语表](../tutorial/glossary.md).

# %%
import plotly.graph_objects as go
import plotly.io as pio
import torch
from IPython.display import display

from minishard import GPT, Ranks, estimate
from minishard.course.glue import glue
from minishard.training.parity import bitwise_equal, drift, params_of, max_diff
from minishard.training.loop import TrainConfig, train
from minishard.viz import Player, replay_html, ring_schedule
from minishard.viz.figures import category_order, color

pio.renderers.default = "plotly_mimetype+notebook_connected"
PSI = GPT("nano", device="meta").num_params()               # the course's smallest model
STATE = ("params", "grads", "master", "exp_avg", "exp_avg_sq")
GB = 1e9
print(f"nano GPT: Ψ = {glue('nano-params', PSI, '{:,}')} parameters")
assert PSI == 217_664
R4 = Ranks(4)                                               # one warm pool per world size

# %% [markdown]
# ## 1. The ledger of one rank, before and after
# The same job twice on four ranks — the nano model, bf16 weights with an fp32 master copy, two
# AdamW steps — first under DDP, then under ZeRO-1. The player follows the ZeRO-1 run live.

# %%
ddp_run = R4.run(train, TrainConfig(strategy="ddp", steps=2, model="nano", micro_batch=2, precision="bf16_mixed"))
ddp_player = Player(R4.last_events, title="DDP, 4 ranks")
live = Player(title="ZeRO-1, 4 ranks, nano model, bf16 mixed, 2 steps")
display(live.widget)
zero_run = R4.run(train, TrainConfig(strategy="zero1", steps=2, model="nano", micro_batch=2, precision="bf16_mixed"), on_event=live.feed)
live.flush()
zero_events = R4.last_events

# %% [markdown]
# Move both players to the end of the first optimizer step — the moment Adam's moments exist —
# and read the ledgers:

# %%
# NBVAL_CHECK_OUTPUT
# claim: Z1
def after_first_step(player):
    """Show the moment every rank has ended its first optimizer step, and return each rank's
    ledger at the end of its *own* step: events of different ranks arrive interleaved, so when
    rank 0's phase ends another rank's last allocation may not have been received yet."""
    ends = {r: player.jump_to_phase("optimizer", step=0, rank=r, edge="end") for r in range(4)}
    player.jump(max(ends.values()))
    return {r: player.replay.snapshot(i)[r] for r, i in ends.items()}

before, after = after_first_step(ddp_player), after_first_step(live)
print(f"{'category':<12}{'DDP, rank 0':>14}{'ZeRO-1, rank 0':>16}{'ratio':>7}   bytes/param (DDP → ZeRO-1)")
for c in STATE:
    b, a = before[0][c], after[0][c]
    print(f"{c:<12}{b:>14,}{a:>16,}{b / a:>7g}   {b / PSI:g} → {a / PSI:g}")
    assert all(after[r][c] == after[0][c] for r in range(4))      # every rank holds the same share
    assert b / a == (4 if c in ("master", "exp_avg", "exp_avg_sq") else 1)
tot_b, tot_a = (sum(s[0][c] for c in STATE) for s in (before, after))
print(f"{'total':<12}{glue('ddp-state-bytes-rank0', tot_b, '{:,}'):>14}"
      f"{glue('zero1-state-bytes-rank0', tot_a, '{:,}'):>16}{tot_b / tot_a:>7.3g}   "
      f"{glue('bytes-per-param-ddp-to-zero1', (tot_b / PSI, tot_a / PSI), '{:g} → {:g}')}")
assert (tot_b, tot_a) == (16 * PSI, 4 * PSI + 12 * PSI // 4)

# %% [markdown]
# The weights and gradients are untouched; the three optimizer categories are a quarter of what
# they were — 12 bytes per parameter down to 3 — and the total goes from 16 to 7 bytes per
# parameter. Stepping rank 0 through that first optimizer phase shows where the difference comes
# from: DDP's AdamW creates a moment for every one of the model's parameter tensors; ZeRO-1's
# creates one for the rank's shard of the flat parameter buffer, and nothing else.

# %%
# NBVAL_CHECK_OUTPUT
def optimizer_allocs(player, rank=0, step=0):
    """The allocations rank ``rank`` makes in the optimizer phase of ``step``, read event by
    event from the player's trace (the player shows the phase's end; redrawing the figures at
    every one of these events would only flood the browser)."""
    i = player.jump_to_phase("optimizer", step=step, rank=rank)
    end = player.jump_to_phase("optimizer", step=step, rank=rank, edge="end")
    return [ev for ev in player.replay.events[i + 1:end + 1]
            if ev["kind"] == "alloc" and ev["rank"] == rank]

allocs_by_run = {"DDP": optimizer_allocs(ddp_player), "ZeRO-1": optimizer_allocs(live)}
for name, allocs in allocs_by_run.items():
    key = {"DDP": "ddp", "ZeRO-1": "zero1"}[name]
    example = f"{allocs[0]['bytes']:,}" if key == "ddp" else glue("zero1-moment-bytes", allocs[0]["bytes"], "{:,}")
    print(f"{name}: {glue(f'{key}-optimizer-allocs', len(allocs))} allocations on rank 0, "
          f"e.g. {allocs[0]['tag']} ({example} bytes); "
          f"by category: " + ", ".join(f"{c} {sum(e['bytes'] for e in allocs if e['category'] == c):,}"
                                       for c in ("exp_avg", "exp_avg_sq")))
n_tensors = len(list(GPT("nano", device="meta").parameters()))
assert len(allocs_by_run["DDP"]) == 2 * n_tensors and len(allocs_by_run["ZeRO-1"]) == 2

# %% [markdown]
# Static copy, side by side (it renders without a kernel):

# %%
def side_by_side(snapshots: dict[str, dict[int, dict[str, int]]], title: str) -> go.Figure:
    """Stacked ledger bars of several runs next to each other, one bar per (run, rank)."""
    cats = category_order(c for s in snapshots.values() for snap in s.values() for c in snap
                          if snap[c])
    x = [f"{name}<br>rank {r}" for name, s in snapshots.items() for r in sorted(s)]
    fig = go.Figure([go.Bar(name=c, x=x, marker_color=color(c),
                            y=[s[r].get(c, 0) / 2**20 for s in snapshots.values() for r in sorted(s)])
                     for c in cats])
    fig.update_layout(barmode="stack", title=title, yaxis_title="MiB", width=760, height=380,
                      legend=dict(traceorder="reversed"))
    return fig

side_by_side({"DDP": before, "ZeRO-1": after},
             "after the first AdamW step, nano model, bf16 mixed, 4 ranks (MiB per rank)").show()

# %% [markdown]
# And the whole ZeRO-1 run in the offline player, which needs no kernel: every event, the
# reduce-scatter and the all-gather on the ring, the timeline. It opens where the tables above
# read the ledgers, at the end of rank 0's first optimizer step:

# %%
replay_html(zero_events, title="ZeRO-1, 4 ranks, nano model, bf16 mixed, 2 steps (offline player)",
            start=next(i for i, e in enumerate(zero_events) if e["kind"] == "phase" and e["rank"] == 0
                       and e["name"] == "optimizer" and e["edge"] == "end" and e.get("step") == 0))

# %% [markdown]
# ## 2. The update: reduce-scatter, my slice, all-gather
# ZeRO-1 packs the parameters into one flat buffer, cut into N equal chunks; rank r owns chunk r.
# A step then needs two collectives, and they are exactly the two halves of DDP's all-reduce (the
# ring of chapter 02), with the optimizer moved into the middle:

# %%
# NBVAL_CHECK_OUTPUT
print("DDP    : all-reduce = " + " | ".join(r.label for r in ring_schedule("all_reduce", 4)))
print("ZeRO-1 : " + " | ".join(r.label for r in ring_schedule("reduce_scatter", 4))
      + " | UPDATE MY SLICE | " + " | ".join(r.label for r in ring_schedule("all_gather", 4)))
assert [r.label for r in ring_schedule("all_reduce", 4)] == \
    [r.label for r in ring_schedule("reduce_scatter", 4) + ring_schedule("all_gather", 4)]

# %% [markdown]
# In the ZeRO-1 trace: which collectives rank 0 ran in step 1, in which phase, on what. The
# layout says which slice of the flat buffer each rank updates.

# %%
# NBVAL_CHECK_OUTPUT
# claim: Z1
layout = zero_run[0]["layout"]
for start, numel, chunk in layout["buckets"]:
    print(f"bucket at {start}: {numel:,} parameters, padded to 4 x {chunk:,};",
          ", ".join(f"rank {r} updates [{start + r * chunk:,}, {start + (r + 1) * chunk:,})"
                    for r in range(4)))
rp = live.replay
for i in rp.collectives:
    e = rp.events[i]
    if e["rank"] == 0 and e.get("step") == 1:
        payload = (glue("allgather-bytes", e["payload"], "{:,}") if e["op"] == "all_gather"
                   else f"{e['payload']:,}")
        print(f"  {rp.phase(i):<9} {e['op']:<15} {e['tag']:<8} {payload:>9} bytes ({e['dtype']})")
ops = [(rp.phase(i), rp.events[i]["op"]) for i in rp.collectives
       if rp.events[i]["rank"] == 0 and rp.events[i].get("step") == 1]
assert ops == [("backward", "reduce_scatter"), ("optimizer", "all_gather")]

# %% [markdown]
# The reduce-scatter is launched from backward (as soon as the gradient bucket is complete, like
# DDP's all-reduce); the all-gather runs at the end of the optimizer step, after each rank has
# updated its fp32 master slice and rounded it into its chunk of the bf16 parameters. Both move a
# bf16 buffer of 2Ψ bytes.
#
# ## 3. Two versions of stage 1, measured
# Stage 1 does not *need* the full summed gradient on every rank — only its own slice. The version
# most write-ups describe still all-reduces the gradients as DDP does and then all-gathers the
# parameters; the other reduce-scatters. Same memory, same result, different traffic. Counted in
# gradient elements (Ψ parameters, so one gradient is Ψ elements), with the ring formulas of
# chapter 02. The runs below are fp32, 4 bytes an element, so the table prints each rank's bytes
# sent ÷ 4Ψ:
#
# | version | collectives | volume (N→∞, elements) | each rank sends (elements) |
# |---|---|---|---|
# | DDP | all-reduce | 2Ψ | 2(N−1)/N · Ψ |
# | ZeRO-1, `zero1_allreduce` | all-reduce + all-gather | 3Ψ | 3(N−1)/N · Ψ |
# | ZeRO-1, `zero1` | reduce-scatter + all-gather | 2Ψ | 2(N−1)/N · Ψ |

# %%
R2, R3 = Ranks(2), Ranks(3)
pools = {2: R2, 3: R3, 4: R4}
one_step = dict(model="nano", steps=1, micro_batch=1, track_activations=False)
traffic = {(N, s): pools[N].run(train, TrainConfig(strategy=s, **one_step))
           for N in pools for s in ("ddp", "zero1_allreduce", "zero1")}

# %%
# NBVAL_CHECK_OUTPUT
# claim: Z1w
PSI_B = 4 * PSI                                             # one fp32 gradient, in bytes
print(f"{'N':>2} {'strategy':<16}{'collectives':<30}{'sent (wire)':>12}{'formula':>12}{'÷ 4Ψ':>7}")
for (N, s), out in traffic.items():
    k = {"ddp": 2, "zero1_allreduce": 3, "zero1": 2}[s]
    formula = k * (N - 1) * PSI_B / N
    wire = out[0]["wire"][0]
    ops = " + ".join(out[0]["by_op"])
    sent = glue(f"wire-bytes-{s.replace('_', '-')}-n4", wire, "{:,}") if N == 4 and s != "ddp" else f"{wire:,}"
    print(f"{N:>2} {s:<16}{ops:<30}{sent:>12}{formula:>12,.0f}{wire / PSI_B:>7.3f}")
    for o in out:                                  # every rank; padding to N chunks: < N elements
        assert o["wire"] == out[0]["wire"] and abs(o["wire"][0] - formula) <= k * 4 * N
    if s == "zero1":
        assert abs(wire - traffic[(N, "ddp")][0]["wire"][0]) <= 4 * 2 * N      # DDP's volume
    if s == "zero1_allreduce":
        assert wire == 3 * traffic[(N, "zero1")][0]["wire"][0] // 2               # 1.5 x

# %% [markdown]
# The operating system's count of bytes each rank process wrote (`/proc/self/io`) agrees, up to
# the few kilobytes of gloo's message headers. It also measures a version minishard did not
# write: PyTorch's `ZeroRedundancyOptimizer` (with `DistributedDataParallel`, strategy
# `torch_zero1`), which all-reduces the gradients and then *broadcasts* each parameter from the
# rank that owns it.

# %%
# NBVAL_IGNORE_OUTPUT
for N in (2, 4):
    torch_z = pools[N].run(train, TrainConfig(strategy="torch_zero1", **one_step))
    for s in ("ddp", "zero1_allreduce", "zero1"):
        extra = max(o["wchar"][0] - o["wire"][0] for o in traffic[(N, s)])
        os_count = traffic[(N, s)][0]["wchar"][0] / PSI_B
        os_text = glue("ddp-os-count-n2", os_count, "{:.3f}") if (N, s) == (2, "ddp") else f"{os_count:.3f}"
        print(f"N={N} {s:<16} OS count {os_text} × 4Ψ "
              f"(recorded + at most {extra:,} bytes of headers)")
        assert all(0 <= o["wchar"][0] - o["wire"][0] < 16 * 1024 for o in traffic[(N, s)])
    ratios = [o["wchar"][0] / PSI_B for o in torch_z]
    os_range = (glue("torch-zero1-os-count-n2", (min(ratios), max(ratios)), "{:.3f}–{:.3f}") if N == 2
                else f"{min(ratios):.3f}–{max(ratios):.3f}")
    print(f"N={N} torch_zero1      OS count {os_range} × 4Ψ per rank")
    assert all(abs(x - 3 * (N - 1) / N) < 0.1 for x in ratios)   # the all-reduce version's 3(N-1)/N

# %% [markdown]
# So "ZeRO-1 costs 1.5× DDP's communication" and "ZeRO-1 costs the same as DDP" are both true —
# of different implementations. The ZeRO paper's analysis reduce-scatters and finds no extra
# traffic for stage 1; DeepSpeed's first stage-1 code all-reduced and later announced the switch
# to a reduce-scatter as a 1.5× → 1× reduction; PyTorch's `ZeroRedundancyOptimizer` still
# all-reduces (it sits on top of an unchanged DDP) and measures at 1.5× here. When a source quotes
# a number, ask which collective it assumes.
#
# ## 4. Memory per rank: 4Ψ + 12Ψ/N, for N = 1…4
# The ledger at the end of training, summed over the five state categories, against the formula
# (bf16 mixed; the nano model has 217,664 parameters, which 3 does not divide: rank shares are
# padded to equal chunks):

# %%
R1 = Ranks(1)
pools[1] = R1
mem_kw = dict(model="nano", steps=2, micro_batch=1, precision="bf16_mixed", track_activations=False)
mem = {N: pools[N].run(train, TrainConfig(strategy="zero1", **mem_kw)) for N in (1, 2, 3, 4)}
R1.close()

# %%
# NBVAL_CHECK_OUTPUT
print(f"{'N':>2}{'params':>10}{'grads':>10}{'master+m+v':>12}{'measured':>11}{'4Ψ+12Ψ/N':>11}{'gap':>8}")
for N, out in mem.items():
    formula = 4 * PSI + 12 * PSI / N
    for o in out:
        f = o["ledger"]["final"]
        measured = sum(f.get(c, 0) for c in STATE)
        assert abs(measured - formula) <= 0.02 * formula                       # within 2% ...
        assert all(abs(f[c] - o["ledger"]["estimate"][c]) <= 0.02 * o["ledger"]["estimate"][c]
                   for c in STATE)                                             # ... per category
    f = out[0]["ledger"]["final"]
    opt = f["master"] + f["exp_avg"] + f["exp_avg_sq"]
    measured = sum(f.get(c, 0) for c in STATE)
    measured_text, formula_text = f"{measured:,}", f"{formula:,.0f}"
    if N == 3:                                     # the padded case the chapter quotes
        measured_text = glue("zero1-state-bytes-n3", measured, "{:,}")
        formula_text = glue("zero1-formula-bytes-n3", formula, "{:,.0f}")
    print(f"{N:>2}{f['params']:>10,}{f['grads']:>10,}{opt:>12,}{measured_text:>11}{formula_text:>11}"
          f"{(measured - formula) / formula:>8.4%}")

# %% [markdown]
# Exact at N = 1, 2, 4. At N = 3 the flat buffer gets one element of padding so that it splits
# into three equal chunks: 8 bytes more per rank. The optimizer's share falls as 1/N; the 4Ψ of
# bf16 weights and gradients does not move.
#
# ## 5. Is it the same training?
# One process on the whole global batch is the reference; PyTorch's `ZeroRedundancyOptimizer` is
# the second oracle. fp32, three AdamW steps, two ranks, both versions of stage 1.

# %%
threads = torch.get_num_threads()
torch.set_num_threads(1)
single = train(None, TrainConfig(strategy="single", steps=3, model="nano", micro_batch=4, return_params=True))
torch.set_num_threads(threads)
parity = {s: R2.run(train, TrainConfig(strategy=s, steps=3, model="nano", micro_batch=2, return_params=True))
          for s in ("zero1", "zero1_allreduce", "torch_zero1")}

# %%
# NBVAL_IGNORE_OUTPUT
INIT = params_of(GPT("nano", seed=0))                 # the weights every run starts from
ZRO = parity["torch_zero1"][0]["params"]
rows = {}
for s, out in parity.items():
    mean_loss = [sum(o["losses"][k] for o in out) / 2 for k in range(3)]
    rows[s] = dict(loss_gap=max(abs(a - b) / b for a, b in zip(mean_loss, single["losses"])),
                   drift=drift(out[0]["params"], single["params"], INIT))
    worst = (glue("zero1-worst-tensor-drift", rows[s]["drift"].worst, "{:.1e}") if s == "zero1"
             else f"{rows[s]['drift'].worst:.1e}")
    print(f"{s:<16} loss within {rows[s]['loss_gap']:.1e} (relative) of one process; params: largest "
          f"element gap {rows[s]['drift'].max_abs:.1e}, worst tensor's gap / its movement "
          f"{worst}; {max_diff(out[0]['params'], ZRO):.1e} from ZeroRedundancyOptimizer")

# %%
# NBVAL_CHECK_OUTPUT
print(f"{'':<16}{'loss within 1e-6':>18}{'params within 0.1% of movement':>33}{'bitwise = torch':>17}"
      f"{'ranks agree':>13}")
for s, out in parity.items():
    same_as_torch = bitwise_equal(out[0]["params"], ZRO)      # 2 ranks: a + b is b + a, bit for bit
    agree = bitwise_equal(out[1]["params"], out[0]["params"])
    print(f"{s:<16}{str(rows[s]['loss_gap'] <= 1e-6):>18}{str(rows[s]['drift'].within(1e-3)):>33}"
          f"{str(same_as_torch):>17}{str(agree):>13}")
    assert rows[s]["loss_gap"] <= 1e-6 and rows[s]["drift"].within(1e-3) and same_as_torch and agree

# %% [markdown]
# Both ranks hold the same full model after every all-gather. It is bit for bit the model
# PyTorch's `ZeroRedundancyOptimizer` trains (with two ranks every reduction adds the same two
# numbers, whatever the collective), and the model one process trains up to the summation-order
# noise chapter 02 explained (Adam amplifies it wherever a gradient is nearly zero): losses within
# 10⁻⁶, every tensor within 0.1% of its movement. The digits of the cell before the table depend
# on this machine's float kernels; the relations in the table hold on any CPU.
#
# ## 6. The ZeRO paper's table, regenerated
# The ZeRO paper illustrates the stages with a 7.5B-parameter model under mixed-precision Adam
# (K = 12 bytes of optimizer state per parameter). `estimate` gives the same per-device figures
# from the same rules — stage 1 shards the optimizer state, stage 2 the gradients too, stage 3
# the parameters as well (chapter 05):

# %%
# NBVAL_CHECK_OUTPUT
PAPER = {  # the paper's Table 1 (GB per device), columns P_os, P_os+g, P_os+g+p
    1: (120, 120, 120), 4: (52.5, 41.3, 30), 16: (35.6, 21.6, 7.5), 64: (31.4, 16.6, 1.88),
    256: (30.4, 15.4, 0.47), 1024: (30.1, 15.1, 0.12)}
BIG = 7_500_000_000
print(f"{'N':>5}{'DDP':>8}{'ZeRO-1':>9}{'ZeRO-2':>9}{'ZeRO-3':>9}   GB per device, Ψ = 7.5B")
table = {}
for N, paper in PAPER.items():
    row = [estimate(n_params=BIG, world_size=N, strategy=s, precision="bf16_mixed").state_bytes / GB
           for s in ("ddp", "zero1", "zero2", "zero3")]
    table[N] = row
    print(f"{N:>5}" + "".join(f"{x:>9.2f}" if k else f"{x:>8.1f}" for k, x in enumerate(row)))
    for ours, theirs in zip(row[1:], paper):             # equal to the paper's last digit
        digits = len(str(theirs).partition(".")[2])
        assert abs(ours - theirs) <= 0.5 * 10 ** -digits + 1e-9, (N, ours, theirs)
    assert row[0] == 120
fig1 = [round(x, 1) for x in table[64]]
print("Figure 1 of the paper, 64 GPUs:",
      "[" + ", ".join([repr(fig1[0])] + [glue(f"{s}-gb-n64", x) for s, x in zip(("zero1", "zero2", "zero3"), fig1[1:])])
      + "]", "GB")
assert [round(x, 1) for x in table[64]] == [120, 31.4, 16.6, 1.9]

# %%
fig = go.Figure([go.Scatter(x=list(table), y=[row[k] for row in table.values()], name=name,
                            mode="lines+markers")
                 for k, name in enumerate(("DDP", "ZeRO-1: 4Ψ + 12Ψ/N", "ZeRO-2: 2Ψ + 14Ψ/N",
                                           "ZeRO-3: 16Ψ/N"))])
fig.add_hline(y=80, line_dash="dash", annotation_text="one 80 GB GPU")
fig.update_layout(title="model state per device, Ψ = 7.5B, bf16-mixed AdamW", xaxis_type="log",
                  yaxis_type="log", xaxis_title="data-parallel ranks N", yaxis_title="GB",
                  width=700, height=400)
fig.show()

# %% [markdown]
# ZeRO-1 flattens out at 4Ψ = 30 GB: from N ≈ 16 on, more ranks barely help, because what is
# left is the replicated bf16 weights and gradients. Chapter 04 shards the gradients.

# %% [markdown]
# ## 7. DeepSpeed's stage 1, beside minishard's
# §3 measured the two versions of stage 1 that minishard implements. DeepSpeed, the library the
# ZeRO paper came with, is installed beside minishard (0.19): `strategy="deepspeed_zero1"` trains
# with DeepSpeed's own engine, and `minishard.watch` records every collective it issues and
# everything its ZeRO optimizer holds. Same ranks, model and global batch for every contender:
# the nano model on two ranks, two sequences a rank, fp32 AdamW, 0.15 MiB buckets (DeepSpeed's
# `reduce_bucket_size` of 39,321 elements), five steps; the tables read the third, the times
# are the median of the last four ([`minishard/course/zero_vs_fsdp.py`](../minishard/course/zero_vs_fsdp.py)).
#
# <details><summary>中文</summary>
#
# §3 测的是 minishard 实现的两种 stage 1。DeepSpeed——与 ZeRO 论文一同发布的库——装在 minishard 旁边
# （0.19）：`strategy="deepspeed_zero1"` 用 DeepSpeed 自己的引擎训练，`minishard.watch` 记下它发起的
# 每一次集合通信和它的 ZeRO 优化器持有的一切。所有参赛者用同样的 rank、模型和全局批次：nano 模型、
# 两个 rank、每个 rank 两条序列、fp32 AdamW、0.15 MiB 的桶（DeepSpeed 的 `reduce_bucket_size` 为
# 39,321 个元素）、五步；表格读的是第三步，耗时取后四步的中位数。
#
# </details>

# %%
from minishard.course.zero_vs_fsdp import (calls_by_tag, compare, deepspeed_terms, measured_terms,
                                           standing, state_table, terms_table, wire_table)
SIDE = dict(model="nano", micro_batch=2, steps=5, bucket_cap_mb=0.15)
side = {r["name"]: r for r in compare(R2, ["DDP (minishard)", "ZeRO-1 (minishard)", "ZeRO-1, all-reduce (minishard)",
                                           "ZeRO-1 (DeepSpeed)"], step=2, **SIDE)}
mine, theirs = side["ZeRO-1 (minishard)"], side["ZeRO-1 (DeepSpeed)"]

# %% [markdown]
# **Memory per rank, by category.** What rank 0 holds between steps, and DeepSpeed's holdings
# term by term — each term read in DeepSpeed 0.19's code
# (`minishard.planner.deepspeed_estimator.deepspeed_holdings`) beside what the watch measured:

# %%
# NBVAL_CHECK_OUTPUT
# claim: Z1d
print(state_table(list(side.values())))
terms = deepspeed_terms(1, world_size=2, bucket_cap_mb=SIDE["bucket_cap_mb"])
print()
print(terms_table(terms, measured_terms(theirs, terms)))
assert measured_terms(theirs, terms) == {t: b for t, (_, b) in terms.items()}     # to the byte
assert theirs["state"] == standing(1, terms)
assert theirs["state"]["master"] == 4 * PSI // 2 and "grads" not in theirs["state"]
assert mine["state"]["grads"] == 4 * PSI and "master" not in mine["state"]
print(f"\nbetween steps: minishard {glue('ds-zero1-mine-state', sum(mine['state'].values()), '{:,}')} B, "
      f"DeepSpeed {glue('ds-zero1-state', sum(theirs['state'].values()), '{:,}')} B — "
      f"DeepSpeed's copy of its fp32 partition {glue('ds-zero1-master', theirs['state']['master'], '{:,}')} B = 4Ψ/N, "
      f"minishard's gradient buffer {mine['state']['grads']:,} B = 4Ψ")

# %% [markdown]
# Both keep the whole model (4Ψ) and their half of Adam's moments, and differ in one term each.
# DeepSpeed steps a **copy** of its partition, `single_partition_of_fp32_groups`: in bf16-mixed
# training that copy is the fp32 master weights stage 1 keeps anyway, but DeepSpeed makes it in
# fp32 training too, 4Ψ/N bytes more. minishard's stage 1 steps its chunk of the flat parameter
# buffer in place, but keeps the whole gradient buffer between steps, 4Ψ. DeepSpeed's stage 1
# holds every full gradient as well, in `.grad`, from backward until its reduction at the end of
# backward (the `every full gradient` term), and frees them at the step. On two ranks: 10 bytes
# per parameter between steps against minishard's 12.
#
# **Bytes per step, by collective:**
#
# <details><summary>中文</summary>
#
# 两者都保留完整的模型（4Ψ）和 Adam 两个矩的一半，各自只差一项。DeepSpeed 更新的是自己那片的
# 一份**副本** `single_partition_of_fp32_groups`：bf16 混合精度训练里，这份副本就是 stage 1 本来就要保留的
# fp32 主权重；但 fp32 训练时 DeepSpeed 也照样复制，多出 4Ψ/N 字节。minishard 的 stage 1 原地更新扁平
# 缓冲区中属于自己的 chunk，却在两步之间保留整个梯度缓冲区，4Ψ。DeepSpeed 的 stage 1 同样持有每一份完整
# 梯度（在 `.grad` 里），从反向开始一直到反向结束时的归约（`every full gradient` 这一项），在优化器步时释放。
# 两个 rank 上：两步之间每参数 10 字节，minishard 为 12 字节。下面是每步各集合通信的字节数：
#
# </details>

# %%
# NBVAL_CHECK_OUTPUT
print(wire_table(list(side.values()), baseline="DDP (minishard)", label="× DDP"))
ddp = side["DDP (minishard)"]["wire"]
assert mine["wire"] == ddp and abs(theirs["wire"] / ddp - 1.5) < 1e-3
assert calls_by_tag(theirs, "all_reduce") == {"allreduce_bucket": 7, "get_grad_norm_direct": 1}
assert theirs["wire"] == side["ZeRO-1, all-reduce (minishard)"]["wire"] + 4          # + one fp32 norm
print(f"\nDeepSpeed's stage 1 sends {glue('ds-zero1-wire-ratio', theirs['wire'] / ddp, '{:.3f}')}× DDP's bytes: "
      f"7 bucket all-reduces, 1 all-reduce of the gradient norm (4 bytes), 1 all-gather of the parameters")

# %% [markdown]
# DeepSpeed's stage 1 is §3's all-reduce version, to the byte, plus the 4 bytes of the gradient
# norm it all-reduces every step whether or not it clips. Its `reduce_scatter` setting (true by
# default) does not call a reduce-scatter: DeepSpeed sorts each bucket's gradients by the rank
# that owns them and, with `use_multi_rank_bucket_allreduce` (true by default in 0.19),
# all-reduces the whole bucket, each rank then keeping its own slices. Set false, it sends each
# rank's slices to that rank with a `reduce` instead — the volume of the reduce-scatter version
# (not measured here). DeepSpeed's configuration documents the all-reduce as the choice for a
# small model on many GPUs, where the per-rank messages would be small. So the two figures of §3
# are both DeepSpeed's, depending on one setting; the sources are in
# [docs/sources.md](../docs/sources.md#deepspeed-zero).
#
# The step time, on this machine (not compared across machines: it is one shared CPU's, with
# gloo):
#
# <details><summary>中文</summary>
#
# DeepSpeed 的 stage 1 就是 §3 的 all-reduce 版本，字节分毫不差，外加每步 all-reduce 梯度范数的 4 字节——
# 无论裁不裁剪都算。它的 `reduce_scatter` 选项（默认为 true）并不调用 reduce-scatter：DeepSpeed 把每个桶
# 里的梯度按所属 rank 排好，在 `use_multi_rank_bucket_allreduce`（0.19 中默认为 true）下对整个桶做
# all-reduce，再由各 rank 留下自己的那几片。设为 false 时，它改用 `reduce` 把每片发给所属 rank——即
# reduce-scatter 版本的通信量（这里没有测）。DeepSpeed 的配置文档说，all-reduce 是为小模型跑在很多 GPU 上
# 准备的，那时每个 rank 的消息太小。所以 §3 的两个数字都是 DeepSpeed 的，取决于一个选项；出处见
# [docs/sources.md](../docs/sources.md#deepspeed-zero)。下面是本机上的单步耗时（不跨机器比较：它属于一台
# 共享 CPU 和 gloo）：
#
# </details>

# %%
# NBVAL_IGNORE_OUTPUT
for name, r in side.items():
    print(f"{name:<34}{r['step_s'] * 1e3:8.1f} ms a step (median of the slowest rank)")
print(f"DeepSpeed's stage 1 / minishard's: "
      f"{glue('ds-zero1-time-ratio', theirs['step_s'] / mine['step_s'], '{:.2f}')}× the step time")

# %%
R2.close()
R3.close()
R4.close()

# %% [markdown]
# > **Takeaway.** ZeRO-1 keeps the fp32 master weights and Adam's moments — 12 of the 16 bytes
# > per parameter — as one slice per rank, measured here at exactly 1/N of DDP's; memory per rank
# > is 4Ψ + 12Ψ/N. The step becomes reduce-scatter the gradients → update my slice → all-gather
# > the parameters: the two halves of DDP's all-reduce with the optimizer in between, so the
# > reduce-scatter version sends exactly DDP's 2(N−1)/N · Ψ elements. The all-reduce version,
# > which many texts and PyTorch's `ZeroRedundancyOptimizer` use, sends 1.5× that. Either way it
# > trains the same model as one process.
#
# <details><summary>中文</summary>
#
# > **要点。** ZeRO-1 把 fp32 主权重和 Adam 的两个矩——每参数 16 字节中的 12 字节——按 rank 各存
# > 一片，这里实测恰好是 DDP 的 1/N；每个 rank 的显存是 4Ψ + 12Ψ/N。一步训练变成：reduce-scatter
# > 梯度 → 更新自己那片 → all-gather 参数：正是 DDP 那次 all-reduce 的两半，中间插入优化器，所以
# > reduce-scatter 版本发送的恰好是 DDP 的 2(N−1)/N · Ψ 个元素。很多资料和 PyTorch 的
# > `ZeroRedundancyOptimizer` 用的 all-reduce 版本要发送 1.5 倍。无论哪种，训练出的模型都与单进程
# > 相同。
#
# </details>
#
# **Questions**
#
# 1. On 8 ranks, how many bytes per parameter does ZeRO-1 keep per rank in bf16-mixed AdamW, and
#    how many does DDP keep?
#
# <details><summary>Answer</summary>
#
# ZeRO-1: 2 + 2 + 12/8 = 5.5 bytes per parameter. DDP: 16, whatever the number of ranks. For
# Llama-3-8B that is 44 GB against 128.5 GB.
# </details>
#
# 2. Why is the all-gather of the *parameters* needed at all, when each rank has already updated
# its own slice?
#
# <details><summary>Answer</summary>
#
# Forward and backward still run the whole model on every rank (stage 1 does not shard the
# working weights). After the update only the owner of a slice has its new values; the all-gather
# brings every rank's bf16 weights up to date before the next forward. In DDP that step is not
# needed because every rank ran the same full update itself.
# </details>
#
# 3. A blog says ZeRO-1 sends 1.5× DDP's bytes; the ZeRO paper says it sends the same. Who is
# right?
#
# <details><summary>Answer</summary>
#
# Both, for different implementations (§3). All-reduce the gradients and all-gather the
# parameters: 2(N−1)/N + (N−1)/N = 3(N−1)/N · Ψ elements, 1.5× DDP. Reduce-scatter instead, since
# a rank only needs its own slice of the summed gradient: (N−1)/N + (N−1)/N = 2(N−1)/N · Ψ, DDP's
# volume.
# </details>

# %% [markdown]
# ## Exercise: the ZeRO-1 update of one shard
# Write one ZeRO-1 step on one rank: average your chunk of the gradient (a reduce-scatter), update
# your shard, all-gather the updated chunks. The check runs it for three AdamW steps on 1, 2 and 4
# real ranks next to minishard's `ZeroOptimizer(stage=1)` on the same model and data, compares the
# parameters, and checks that you sent DDP's volume — not the all-reduce version's 1.5×. The
# function is sent to the ranks as source: keep it self-contained (`torch` is there).
#
# Write it in the cell below (or edit the stub in
# [`minishard/course/exercises/ch03.py`](../minishard/course/exercises/ch03.py)), then run the check. A
# reference solution is in [`solutions/ch03.py`](../solutions/ch03.py): try first.
#
# <details><summary>中文</summary>
#
# **练习：一个分片的 ZeRO-1 更新。** 写出一个 rank 上的一步 ZeRO-1：对自己那个 chunk 的梯度求平均
# （一次 reduce-scatter），更新自己的分片，再 all-gather 所有更新后的 chunk。检查程序会在 1、2、4 个
# 真实 rank 上跑三步 AdamW，与 minishard 的 `ZeroOptimizer(stage=1)` 在同样的模型和数据上对比参数，
# 并检查你发送的是 DDP 的通信量——而不是 all-reduce 版本的 1.5×。函数以源码形式发送到各个 rank：
# 请让它自包含（那边有 `torch`）。
#
# 在下面的单元格里写（或者编辑 [`minishard/course/exercises/ch03.py`](../minishard/course/exercises/ch03.py)
# 里的桩函数），然后运行检查。参考答案在 [`solutions/ch03.py`](../solutions/ch03.py)：先自己试。
#
# </details>

# %%
def zero1_step(comm, flat_param, flat_grad, shard, optimizer):
    """flat_param: all parameters (N * chunk elements, the same on every rank) — update in place.
    flat_grad: this rank's local gradient, same layout, not averaged over ranks.
    shard: the optimizer's copy of chunk comm.rank; optimizer: over [shard] only.
    comm.reduce_scatter(out, inp): out = slice comm.rank of the sum over ranks of inp;
    comm.all_gather(out, inp): out = every rank's inp in rank order (pass a copy)."""
    raise NotImplementedError("your code here")

# %%
# NBVAL_CHECK_OUTPUT
from minishard.course.exercises import ch03

ch03.check_zero1_step(zero1_step)
