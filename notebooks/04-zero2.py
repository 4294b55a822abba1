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
# # 04 · ZeRO-2: shard the gradients too
#
# > **Under ZeRO-1 each rank updates only its slice, yet it still stores the whole gradient.
# > Why keep what it never reads?**
#
# <details><summary>中文</summary>
#
# **在 ZeRO-1 下，每个 rank 只更新自己那片，却仍然存着整份梯度。从来不读的东西，为什么还要留着？**
#
# Stage 2 在每个 rank 上只保留它要更新的那片求和梯度。反向不再往完整的梯度缓冲区里累积：每个梯度桶
# 一填满就做 reduce-scatter，rank 留下自己那片求和结果，然后丢掉这个桶。推理过程见
# [中文版第 04 章](../tutorial/zh/04-zero2.md)；这个 notebook 运行并测量它。
#
# </details>
#
# Stage 2 keeps, on each rank, only the summed gradient of the slice that rank updates. Backward
# no longer accumulates into a full gradient buffer: as each bucket of gradients fills up, it is
# reduce-scattered, the rank keeps its slice of the sum, and the bucket is dropped. The reasoning
# is in [tutorial/04-zero2.md](../tutorial/04-zero2.md); this notebook runs and measures it.
#
# **The one-line "syntax"** — Ψ parameters, bf16-mixed AdamW, N ranks:
#
# $$\text{memory per rank} = \underbrace{2\Psi}_{\text{bf16 weights: replicated}} + \underbrace{\frac{2\Psi + 12\Psi}{N}}_{\text{grads}+\text{master}+m+v\text{: sharded}} \;(+\ \text{the buckets in flight}),\qquad
# \text{each rank sends } \frac{2(N-1)}{N}\,\Psi \text{ elements per step, as DDP.}$$
#
# <details><summary>中文</summary>
#
# **一行"语法"**——Ψ 个参数，bf16 混合精度 AdamW，N 个 rank：每个 rank 的显存 = 2Ψ（bf16 权重，
# 每个 rank 一份完整副本）+ (2Ψ + 12Ψ)/N（梯度 + 主权重 + m + v，分片）（+ 在途的梯度桶）；每个
# rank 每步发送 2(N−1)/N · Ψ 个元素，与 DDP 相同。
#
# </details>
#
# Terms, in English and Chinese: [glossary · 术语表](../tutorial/glossary.md).

# %%
import plotly.io as pio
import torch
from IPython.display import display

from minishard import GPT, Ranks, batch, estimate, model_config
from minishard.course.glue import glue
from minishard.strategies.ddp import named_buckets
from minishard.training.parity import drift, params_of
from minishard.training.loop import TrainConfig, train
from minishard.viz import Player, ledger_bars, timeline_figure

pio.renderers.default = "plotly_mimetype+notebook_connected"
PSI = GPT("nano", device="meta").num_params()               # 217,664 parameters
TINY = GPT("tiny", device="meta").num_params()              # 6,868,992 parameters
STATE = ("params", "grads", "master", "exp_avg", "exp_avg_sq")
GB = 1e9
print(f"nano: Ψ = {PSI:,} parameters; tiny: Ψ = {TINY:,} parameters")
R2 = Ranks(2)                                               # one warm pool per world size

# %% [markdown]
# ## 1. Reduce-scatter, bucket by bucket, during backward
# Two ranks train the tiny model (fp32) under ZeRO-2 while the player follows. Buckets are capped
# at 4 MiB, as in chapter 02's DDP run, so that there are several of them.

# %%
live = Player(title="ZeRO-2, 2 ranks, tiny model, 2 steps, 4 MiB buckets")
display(live.widget)
run = R2.run(train, TrainConfig(strategy="zero2", steps=2, model="tiny", micro_batch=4, bucket_cap_mb=4), on_event=live.feed)
live.flush()
events = R2.last_events
n_buckets = len(run[0]["layout"]["buckets"])

# %% [markdown]
# The same run in the offline player (no kernel: it plays on the static site too). "Jump to
# collective" → `reduce_scatter` walks through the buckets' reduce-scatters during backward.

# %%
from minishard.viz import replay_html
replay_html(events, title="ZeRO-2, 2 ranks, tiny model, 2 steps, 4 MiB buckets (offline player)")

# %% [markdown]
# In the timeline the reduce-scatters (purple) sit under backward: each starts as soon as its
# bucket's last gradient arrives, while earlier layers are still being differentiated. The
# parameter all-gathers follow in the optimizer phase.

# %%
live.timeline_figure

# %%
# NBVAL_CHECK_OUTPUT
# claim: Z2
def collectives_by_phase(events, rank, step):
    """(op, launched during backward?) for each collective of ``rank`` in ``step``."""
    bw = [e["t"] for e in events if e["kind"] == "phase" and e["name"] == "backward"
          and e["rank"] == rank and e.get("step") == step]
    return [(e["op"], bw[0] <= e["t"] < bw[1]) for e in events
            if e["kind"] == "collective" and e["rank"] == rank and e.get("step") == step]

for rank in (0, 1):
    for step in (0, 1):
        ops = collectives_by_phase(events, rank, step)
        rs = [during for op, during in ops if op == "reduce_scatter"]
        ag = [during for op, during in ops if op == "all_gather"]
        in_bw, launched = ((glue("rs-in-backward-rank0-step0", sum(rs)), glue("rs-launched-rank0-step0", len(rs)))
                           if (rank, step) == (0, 0) else (sum(rs), len(rs)))
        print(f"rank {rank} step {step}: {in_bw} of {launched} bucket reduce-scatters launched "
              f"during backward; {sum(ag)} of {len(ag)} all-gathers")
        assert len(rs) == len(ag) == n_buckets == 6 and all(rs) and not any(ag)

# %% [markdown]
# Static copy of step 1's timeline:

# %%
timeline_figure([e for e in events if e.get("step") == 1]).update_layout(
    title="step 1: the bucket reduce-scatters run inside backward; the all-gathers after the update").show()

# %% [markdown]
# ## 2. Each rank keeps only its slice
# Follow rank 0's gradient memory through the backward pass of step 1. A bucket's gradients are
# copied into a temporary buffer (`grad_bucket`) as autograd produces them, and each parameter's
# own `.grad` is dropped at once. When the bucket is complete its reduce-scatter is launched (on
# two ranks the other rank's chunk arrives straight into the rank's own; with more ranks a
# receive buffer, `rs_recv`, holds the rest, see `Comm.reduce_scatter`). The buffer is freed
# once the rank's chunk of the sum has been added to its gradient shard — and ZeRO-2 waits for
# the oldest bucket before launching a third, so at most two are in flight.

# %%
# NBVAL_CHECK_OUTPUT
# claim: Z2
def bucket_buffers(events, rank=0, step=1):
    """Rank ``rank``'s comm_buffers allocs and frees in ``step``'s backward: [(index, line, held)]."""
    bw = [i for i, e in enumerate(events) if e["kind"] == "phase" and e["name"] == "backward"
          and e["rank"] == rank and e.get("step") == step]
    held, rows = 0, []
    for i in range(bw[0], bw[1] + 1):
        e = events[i]
        if e["rank"] == rank and e["kind"] in ("alloc", "free") and e["category"] == "comm_buffers":
            held += e["bytes"] if e["kind"] == "alloc" else -e["bytes"]
            what = ":".join(e["tag"].split(":")[:2])        # grad_bucket:k (or rs_recv:bucketk)
            rows.append((i, f"{e['kind']:<5} {what:<17} {e['bytes']:>10,}", held))
    return rows

rows = bucket_buffers(live.replay.events)
for _, line, held in rows:
    print(f"{line}   held {held:>11,}")
worst_i, _, worst = max(rows, key=lambda r: r[2])
grads = run[0]["ledger"]["final"]["grads"]
print(f"gradient shard, held throughout: {grads:,} bytes = 4Ψ/2 (fp32); "
      f"bucket buffers: at most {glue('bucket-buffers-peak-4mib', worst, '{:,}')}; "
      f"a full fp32 gradient: {glue('tiny-grad-bytes', 4 * TINY, '{:,}')}")
assert grads == 4 * TINY // 2 and rows[-1][2] == 0 and worst < 4 * TINY
live.jump(worst_i)

# %% [markdown]
# The player now stands at that worst moment (move it on from there). Its memory bars, as a
# static figure:

# %%
ledger_bars(live.snapshot(), live.replay.ymax,
            "when the bucket buffers peak: step 1, backward (MiB)").show()

# %% [markdown]
# Two buckets in flight plus the one filling: at most three buckets' worth. With 4 MiB buckets on a 26 MiB gradient that is most of it —
# the bound depends on the bucket size, not on the model, so it is the *ratio* that matters.
# Smaller buckets, same model:

# %%
# NBVAL_CHECK_OUTPUT
one = R2.run(train, TrainConfig(strategy="zero2", steps=2, model="tiny", micro_batch=4, bucket_cap_mb=1))
by_cap = {4: (run, live.replay.events), 1: (one, R2.last_events)}
print(f"{'bucket cap':>10}{'buckets':>9}{'largest':>12}{'most held':>12}{'÷ gradient':>12}")
for cap, (out, evs) in by_cap.items():
    largest = 4 * 2 * max(chunk for _, _, chunk in out[0]["layout"]["buckets"])   # N x chunk, fp32
    most = max(held for _, _, held in bucket_buffers(evs))
    n = len(out[0]["layout"]["buckets"])
    print(f"{cap:>7} MiB{n:>9}{largest:>12,}{most:>12,}"
          f"{glue(f'bucket-buffers-share-{cap}mib', most / (4 * TINY), '{:.2f}'):>12}")
    assert most <= 3 * largest
assert max(h for *_, h in bucket_buffers(by_cap[1][1])) < worst / 2

# %% [markdown]
# For the ZeRO paper's 7.5B model, PyTorch's default 25 MiB buckets bound the buffers at
# 3 × 25 = 75 MiB against a bf16 gradient of 2Ψ = 15 × 10⁹ bytes (14,305 MiB), on two ranks as
# on NCCL (with N > 2 ranks on gloo each reduce-scatter in flight adds (N−2)/N of its bucket).
#
# ## 3. Memory per rank: 2Ψ + 14Ψ/N, for N = 1…4
# bf16 mixed, the nano model, buckets capped at 0.1 MiB. The state categories at the end of
# training against the formula; next to them the largest amount of bucket buffers (`comm_buffers`)
# a rank held at its peak — the price of reducing during backward.

# %%
R1, R3, R4 = Ranks(1), Ranks(3), Ranks(4)
pools = {1: R1, 2: R2, 3: R3, 4: R4}
mem_kw = dict(model="nano", steps=2, micro_batch=1, precision="bf16_mixed",
              track_activations=False, bucket_cap_mb=0.1)
mem = {N: pools[N].run(train, TrainConfig(strategy="zero2", **mem_kw)) for N in pools}
R1.close()

# %%
# NBVAL_CHECK_OUTPUT
print(f"{'N':>2}{'params':>10}{'grads':>10}{'master+m+v':>12}{'measured':>11}{'2Ψ+14Ψ/N':>11}"
      f"{'gap':>9}{'comm_buffers':>14}{'bucket':>9}")
for N, out in mem.items():
    formula = 2 * PSI + 14 * PSI / N
    largest = max(numel for _, numel, _ in out[0]["layout"]["buckets"]) * 2     # bf16 bytes
    for o in out:
        f, est = o["ledger"]["final"], o["ledger"]["estimate"]
        assert abs(sum(f.get(c, 0) for c in STATE) - formula) <= 0.02 * formula
        assert all(abs(f[c] - est[c]) <= 0.02 * est[c] for c in STATE)
        buffers = o["ledger"]["peak_snapshot"].get("comm_buffers", 0)
        assert buffers <= 6 * largest                      # a few buckets, never the gradient
        assert "comm_buffers" not in f                     # and all gone after the step
    f = out[0]["ledger"]["final"]
    measured = sum(f.get(c, 0) for c in STATE)
    buffers = out[0]["ledger"]["peak_snapshot"].get("comm_buffers", 0)
    measured_text, formula_text = f"{measured:,}", f"{formula:,.0f}"
    buffers_text, largest_text = f"{buffers:,}", f"{largest:,}"
    if N in (3, 4):                                # the rows the chapter quotes
        measured_text = glue(f"zero2-state-bytes-n{N}", measured, "{:,}")
    if N == 3:
        formula_text = glue("zero2-formula-bytes-n3", formula, "{:,.0f}")
    if N == 2:
        buffers_text = glue("comm-buffers-peak-n2", buffers, "{:,}")
        largest_text = glue("nano-bucket-bytes-n2", largest, "{:,}")
    print(f"{N:>2}{f['params']:>10,}{f['grads']:>10,}{f['master'] + f['exp_avg'] + f['exp_avg_sq']:>12,}"
          f"{measured_text:>11}{formula_text:>11}{(measured - formula) / formula:>9.4%}"
          f"{buffers_text:>14}{largest_text:>9}")

# %% [markdown]
# The state matches the formula (exact at N = 1, 2, 4; at N = 3 each bucket is padded by up to two
# elements so that it splits into three equal chunks). The `comm_buffers` column is what the
# formula leaves out: a few buckets' worth of gradient in transit, set by `bucket_cap_mb`, not by
# the model size. At N = 1 nothing needs reducing: the buckets are only copied.
#
# ## 4. Bytes on the wire: DDP's 2(N−1)/N · Ψ
# Same volume as DDP and as ZeRO-1's reduce-scatter version (chapter 03): a reduce-scatter of
# the gradients, (N−1)/N · Ψ elements, plus an all-gather of the parameters, (N−1)/N · Ψ
# elements. fp32 here, 4 bytes an element, so the table prints each rank's bytes ÷ 4Ψ.

# %%
one_step = dict(model="nano", steps=1, micro_batch=1, track_activations=False, bucket_cap_mb=0.1)
traffic = {(N, s): pools[N].run(train, TrainConfig(strategy=s, **one_step))
           for N in (2, 3, 4) for s in ("ddp", "zero2")}
R3.close()

# %%
# NBVAL_CHECK_OUTPUT
PSI_B = 4 * PSI
print(f"{'N':>2} {'strategy':<9}{'collectives':<28}{'sent (wire)':>12}{'2(N-1)/N·4Ψ':>13}{'÷ 4Ψ':>7}")
for (N, s), out in traffic.items():
    formula = 2 * (N - 1) * PSI_B / N
    wire = out[0]["wire"][0]
    calls = " + ".join(f"{v['calls']} {op}" for op, v in out[0]["by_op"].items())
    sent = (glue(f"wire-bytes-{s}-n{N}", wire, "{:,}") if (N, s) in ((4, "zero2"), (3, "zero2"), (3, "ddp"))
            else f"{wire:,}")
    print(f"{N:>2} {s:<9}{calls:<28}{sent:>12}{formula:>13,.0f}{wire / PSI_B:>7.3f}")
    n_buckets = len(traffic[(N, "zero2")][0]["layout"]["buckets"])
    for o in out:       # padding each bucket to N equal chunks: under N elements per bucket
        assert abs(o["wire"][0] - formula) <= 2 * 4 * N * n_buckets
        assert 0 <= o["wchar"][0] - o["wire"][0] < 16 * 1024          # and the OS agrees
assert all(abs(traffic[(N, "zero2")][0]["wire"][0] - traffic[(N, "ddp")][0]["wire"][0]) < 0.001 * PSI_B
           for N in (2, 3, 4))

# %% [markdown]
# ## 5. Gradient accumulation: a reduce-scatter per micro-batch
# With `accum=2`, DDP and ZeRO-1 accumulate the first micro-batch's gradients locally (`no_sync`)
# and reduce once. ZeRO-2 cannot: it has no full gradient to accumulate into, only its slice, so
# every micro-batch's buckets are reduce-scattered and the reduced slices are summed. Two ranks,
# nano, fp32:

# %%
acc = {(s, a): R2.run(train, TrainConfig(strategy=s, steps=2, model="nano", micro_batch=1, accum=a, bucket_cap_mb=0.1, track_activations=False, return_params=(a == 2)))
       for s in ("ddp", "zero1", "zero2") for a in (1, 2)}

# %%
# NBVAL_CHECK_OUTPUT
GRAD_OPS = ("all_reduce", "reduce_scatter")
def gradient_traffic(out):
    """(gradient collectives, their bytes on the wire) per optimizer step on rank 0."""
    ops = {op: v for op, v in out[0]["by_op"].items() if op in GRAD_OPS}
    steps = len(out[0]["losses"])
    return sum(v["calls"] for v in ops.values()) // steps, sum(v["wire"] for v in ops.values()) // steps

print(f"{'strategy':<9}{'gradient collectives/step':>27}{'gradient bytes sent/step':>27}{'grads held':>12}")
print(f"{'':<9}{'accum=1':>13}{'accum=2':>14}{'accum=1':>13}{'accum=2':>14}")
for s in ("ddp", "zero1", "zero2"):
    (c1, w1), (c2, w2) = gradient_traffic(acc[(s, 1)]), gradient_traffic(acc[(s, 2)])
    grads = acc[(s, 2)][0]["ledger"]["final"]["grads"]
    texts = [str(c1), str(c2), f"{w1:,}", f"{w2:,}"]
    if s == "zero2":                               # the row the chapter quotes
        texts = [glue("zero2-grad-collectives-accum1", c1), glue("zero2-grad-collectives-accum2", c2),
                 glue("zero2-grad-bytes-accum1", w1, "{:,}"), glue("zero2-grad-bytes-accum2", w2, "{:,}")]
    print(f"{s:<9}{texts[0]:>13}{texts[1]:>14}{texts[2]:>13}{texts[3]:>14}{grads:>12,}")
    assert (c2, w2) == ((2 * c1, 2 * w1) if s == "zero2" else (c1, w1))
    assert grads == (PSI_B // 2 if s == "zero2" else PSI_B)

# %% [markdown]
# The trade in one table: ZeRO-2 holds half the gradient bytes on two ranks (1/N in general), and
# pays for it with one gradient reduction per micro-batch instead of one per optimizer step. With
# many micro-batches per step that can make stage 1 the faster choice. (DDP's all-reduce counts
# both halves of the ring; the ZeRO stages' other half is the parameter all-gather, which runs
# once per optimizer step in both and is left out here.)
#
# Same training as one process accumulating over the same data:

# %%
# NBVAL_IGNORE_OUTPUT
threads = torch.get_num_threads()
torch.set_num_threads(1)
single_acc = train(None, TrainConfig(strategy="single", steps=2, model="nano", micro_batch=2, accum=2, track_activations=False, return_params=True))
torch.set_num_threads(threads)

INIT = params_of(GPT("nano", seed=0))                 # the weights every run starts from
acc_drift = {}
for s in ("zero1", "zero2"):
    out = acc[(s, 2)]
    mean = [sum(o["losses"][k] for o in out) / 2 for k in range(2)]
    acc_drift[s] = (max(abs(a - b) / b for a, b in zip(mean, single_acc["losses"])),
                    drift(out[0]["params"], single_acc["params"], INIT))
    print(f"{s}, accum=2: loss within {acc_drift[s][0]:.1e}, params: largest element gap "
          f"{acc_drift[s][1].max_abs:.1e}, worst tensor's gap / its movement {acc_drift[s][1].worst:.1e}")

# %%
# NBVAL_CHECK_OUTPUT
for s, (loss_gap, d) in acc_drift.items():
    print(f"{s}, accum=2 vs one process: losses within 1e-6: {loss_gap <= 1e-6}; "
          f"every tensor within 0.1% of its movement: {d.within(1e-3)}")
    assert loss_gap <= 1e-6 and d.within(1e-3)

# %% [markdown]
# ## 6. Clipping by the global norm
# `clip_grad_norm_(max_norm)` scales the gradient by max_norm / ‖g‖ when the norm of the *whole*
# gradient exceeds max_norm. Under ZeRO-2 no rank has the whole gradient. The squares add up,
# though: ‖g‖² = Σ_r ‖g_r‖². Here is the nano model's first gradient (one process, the global
# batch), cut into the slices two ZeRO ranks would hold:

# %%
# NBVAL_IGNORE_OUTPUT
net = GPT("nano", seed=0)                                # the weights every run below starts from
x, y = batch(model_config("nano"), 0, 2)                       # step 0's global batch (2 sequences)
net(x, y).backward()
(group,) = named_buckets(net, 25.0)                       # nano: one bucket, as in the runs below
flat = torch.cat([p.grad.reshape(-1) for _, p in group])
shards = flat.tensor_split(2)
local = [s.norm().item() for s in shards]
total = torch.nn.utils.clip_grad_norm_(net.parameters(), float("inf")).item()
MAX_NORM = 1.0
print(f"slice norms ‖g_0‖ = {local[0]:.4f}, ‖g_1‖ = {local[1]:.4f}")
print(f"sqrt(‖g_0‖² + ‖g_1‖²) = {sum(n * n for n in local) ** 0.5:.4f}; "
      f"torch's norm of the whole gradient = {total:.4f}")
print(f"max_norm {MAX_NORM}: the global scale is {glue('clip-global-scale', MAX_NORM / total, '{:.4f}')} "
      f"on every rank; clipping each slice by its own norm would scale them by "
      f"{glue('clip-slice0-scale', MAX_NORM / local[0], '{:.4f}')} and "
      f"{glue('clip-slice1-scale', MAX_NORM / local[1], '{:.4f}')}")

# %% [markdown]
# (Those digits come from this machine's float kernels; the relations are what holds everywhere.)

# %%
# NBVAL_CHECK_OUTPUT
print("‖g‖² = ‖g_0‖² + ‖g_1‖² (to 1e-5):", abs(sum(n * n for n in local) ** 0.5 - total) <= 1e-5 * total)
print(f"‖g‖ > max_norm = {MAX_NORM}: clipping acts:", total > MAX_NORM)
print("per-slice clipping would scale each slice by over 1.3x the global factor:",
      all(MAX_NORM / n > 1.3 * MAX_NORM / total for n in local))
print("... and by a different factor on each rank:", local[0] != local[1])
assert abs(sum(n * n for n in local) ** 0.5 - total) <= 1e-5 * total
assert total > MAX_NORM and all(MAX_NORM / n > 1.3 * MAX_NORM / total for n in local)
assert local[0] != local[1]

# %% [markdown]
# Clipping each slice by its own norm would scale every slice by more than the true factor, and
# by a different factor on each rank: a larger update, in another direction.
# `ZeroOptimizer.clip_grad_norm_` sums the squares of its slice and all-reduces that one number —
# 8 bytes — so every rank applies the same global scale. Measured: one extra all-reduce per step,
# and the same training as one process clipping the whole gradient.

# %%
# NBVAL_CHECK_OUTPUT
clip_kw = dict(steps=2, model="nano", track_activations=False, clip=MAX_NORM, return_params=True)
clipped = R2.run(train, TrainConfig(strategy="zero2", micro_batch=1, **clip_kw))
torch.set_num_threads(1)
single_clip = train(None, TrainConfig(strategy="single", micro_batch=2, **clip_kw))
unclipped = train(None, TrainConfig(strategy="single", micro_batch=2, **dict(clip_kw, clip=None)))
torch.set_num_threads(threads)
norm_op = clipped[0]["by_op"]["all_reduce"]
print(f"extra collective: {norm_op['calls']} all-reduces in 2 steps, "
      f"{glue('clip-allreduce-bytes', norm_op['payload'] // norm_op['calls'])} bytes each")
mean = [sum(o["losses"][k] for o in clipped) / 2 for k in range(2)]
print("ZeRO-2 + clipping matches one process clipping the whole gradient:",
      all(abs(a - b) <= 1e-6 * b for a, b in zip(mean, single_clip["losses"]))
      and drift(clipped[0]["params"], single_clip["params"], INIT).within(1e-3))
assert norm_op["calls"] == 2 and norm_op["payload"] == 2 * 8
assert all(abs(a - b) <= 1e-6 * b for a, b in zip(mean, single_clip["losses"]))
assert drift(clipped[0]["params"], single_clip["params"], INIT).within(1e-3)
assert not drift(clipped[0]["params"], unclipped["params"], INIT).within(1e-3)   # and clipping did act

# %% [markdown]
# ## 7. Why stop at 2?
# After stage 2 every rank still holds the full bf16 weights, 2Ψ, because forward and backward
# use them. The sharded part shrinks as 1/N; the replicated part does not. Its share of a rank's
# state, for the ZeRO paper's 7.5B-parameter model:

# %%
# NBVAL_CHECK_OUTPUT
BIG = 7_500_000_000
for N in (4, 64, 1024):
    e2 = estimate(n_params=BIG, world_size=N, strategy="zero2", precision="bf16_mixed")
    e3 = estimate(n_params=BIG, world_size=N, strategy="zero3", precision="bf16_mixed")
    share = e2.per_rank["params"] / e2.state_bytes
    print(f"N = {N:>4}: ZeRO-2 {e2.state_bytes / GB:6.2f} GB per rank, of which replicated weights "
          f"{e2.per_rank['params'] / GB:.1f} GB ({glue(f'zero2-weights-share-n{N}', share, '{:.0%}')});  ZeRO-3: {e3.state_bytes / GB:6.2f} GB")
    assert e2.per_rank["params"] == 2 * BIG and not e2.sharded["params"] and e3.sharded["params"]
assert round(e2.state_bytes / GB, 1) == 15.1 and share > 0.99

# %% [markdown]
# From a few dozen ranks on, ZeRO-2's memory *is* the replicated weights: 15 GB that no number of
# ranks removes. Sharding them too is stage 3 — each rank keeps 1/N of the weights and gathers a
# layer's full parameters just before it computes — which changes the forward and backward
# passes themselves, not only the optimizer. That is the next chapter.

# %% [markdown]
# ## 8. DeepSpeed's stage 2, beside minishard's
# DeepSpeed's stage 2 (`strategy="deepspeed_zero2"`: DeepSpeed 0.19's engine, recorded by
# `minishard.watch`) on the same ranks, model and global batch as minishard's stage 2, with
# DeepSpeed's stage 1 beside it: the nano model on two ranks, two sequences a rank, fp32 AdamW,
# 0.15 MiB buckets, five steps; the tables read the third, the times are the median of the last
# four ([`minishard/course/zero_vs_fsdp.py`](../minishard/course/zero_vs_fsdp.py)). Then two more
# bucket sizes, which the two libraries spend differently.
#
# <details><summary>中文</summary>
#
# DeepSpeed 的 stage 2（`strategy="deepspeed_zero2"`：DeepSpeed 0.19 的引擎，由 `minishard.watch`
# 记录）与 minishard 的 stage 2 用同样的 rank、模型和全局批次，旁边再放上 DeepSpeed 的 stage 1：nano
# 模型、两个 rank、每个 rank 两条序列、fp32 AdamW、0.15 MiB 的桶、五步；表格读第三步，耗时取后四步的
# 中位数。然后再换两种桶的大小——两个库在桶上花显存的方式不同。
#
# </details>

# %%
from minishard.course.zero_vs_fsdp import (calls_by_tag, compare, deepspeed_terms, measured_terms,
                                           reduce_bucket_size, standing, state_table, terms_table, wire_table)
SIDE = dict(model="nano", micro_batch=2, steps=5, bucket_cap_mb=0.15)
side = {r["name"]: r for r in compare(R2, ["ZeRO-2 (minishard)", "ZeRO-1 (DeepSpeed)", "ZeRO-2 (DeepSpeed)"],
                                      step=2, **SIDE)}
mine, one, two = side["ZeRO-2 (minishard)"], side["ZeRO-1 (DeepSpeed)"], side["ZeRO-2 (DeepSpeed)"]
by_size = {mb: {r["name"]: r for r in compare(R2, ["ZeRO-2 (minishard)", "ZeRO-2 (DeepSpeed)"], step=2,
                                              **{**SIDE, "steps": 3, "bucket_cap_mb": mb})}
           for mb in (0.05, 0.6)}
by_size[0.15] = side

# %% [markdown]
# **Memory per rank, by category**, between steps, then DeepSpeed's stage-2 holdings term by
# term as DeepSpeed 0.19's code sizes them, beside the watch's measurement, then the gradient
# each holds at once:

# %%
# NBVAL_CHECK_OUTPUT
# claim: Z2d
print(state_table(list(side.values())))
terms = deepspeed_terms(2, world_size=2, bucket_cap_mb=SIDE["bucket_cap_mb"])
print()
print(terms_table(terms, measured_terms(two, terms)))
assert measured_terms(two, terms) == {t: b for t, (_, b) in terms.items()}     # to the byte
assert one["state"] == two["state"] == standing(2, terms)
assert sum(mine["state"].values()) == sum(two["state"].values()) and mine["state"]["grads"] == 4 * PSI // 2
held = {name: r["category_peaks"]["grads"] for name, r in side.items()}
print(f"\ngradient held at once, rank 0: minishard's stage 2 {held['ZeRO-2 (minishard)']:,} B (its shard; "
      f"the buckets in flight are comm_buffers), DeepSpeed's stage 1 "
      f"{glue('ds-zero1-grads-held', held['ZeRO-1 (DeepSpeed)'], '{:,}')} B, "
      f"stage 2 {glue('ds-zero2-grads-held', held['ZeRO-2 (DeepSpeed)'], '{:,}')} B")
assert held["ZeRO-1 (DeepSpeed)"] == 4 * PSI                                    # every full gradient
assert held["ZeRO-2 (DeepSpeed)"] == terms["gradient partition (whole parameters)"][1] > 4 * PSI // 2

# %% [markdown]
# Between steps the three hold the same total, 2,176,640 bytes on two ranks, in different
# terms: minishard keeps its gradient shard (4Ψ/N), DeepSpeed a copy of its parameter partition
# in fp32 (4Ψ/N, chapter 03 §7). DeepSpeed's two stages differ in backward only. Stage 1 holds
# every full gradient until backward ends and reduces them then; stage 2 copies each gradient
# into its reduce bucket as autograd produces it and reduces the bucket when the next gradient
# would not fit, so its gradient memory is its partition — of *whole* parameters: every
# parameter that touches the rank's part is kept whole, here 472,320 bytes against 4Ψ/N =
# 435,328 — plus the bucket.
#
# **Bytes per step, by collective:**
#
# <details><summary>中文</summary>
#
# 两步之间三者持有的总量相同（两个 rank 上 2,176,640 字节），组成不同：minishard 保留自己的梯度分片
# （4Ψ/N），DeepSpeed 保留自己那片参数的一份 fp32 副本（4Ψ/N，见第 03 章 §7）。DeepSpeed 的两个 stage
# 只在反向中不同。stage 1 持有每一份完整梯度直到反向结束，再统一归约；stage 2 在 autograd 产生每个梯度时
# 就把它复制进归约桶，下一个梯度放不下时就归约这个桶，所以它的梯度显存是它的那片——按*完整参数*计：与本
# rank 那部分有交集的参数都整个保留，这里是 472,320 字节，而 4Ψ/N = 435,328——再加上桶。下面是每步各集合
# 通信的字节数：
#
# </details>

# %%
# NBVAL_CHECK_OUTPUT
print(wire_table(list(side.values()), baseline="ZeRO-2 (minishard)", label="× minishard"))
assert mine["wire"] == 4 * PSI                         # 2(N-1)/N · 4Ψ on two ranks: DDP's bytes
for r in (one, two):
    assert abs(r["wire"] / mine["wire"] - 1.5) < 1e-3 and calls_by_tag(r, "all_reduce")["get_grad_norm_direct"] == 1
print(f"\nDeepSpeed's stage 2 sends {glue('ds-zero2-wire-ratio', two['wire'] / mine['wire'], '{:.3f}')}× "
      f"minishard's (= DDP's): it all-reduces each bucket, as its stage 1 does")

# %% [markdown]
# Stage 2 changes where DeepSpeed's gradients wait, not how they travel: each bucket is still
# all-reduced whole (`use_multi_rank_bucket_allreduce`, chapter 03 §7), 1.5× minishard's
# reduce-scatter. **The bucket size.** minishard's `bucket_cap_mb` becomes DeepSpeed's
# `reduce_bucket_size`, in elements (`bucket_cap_mb` × 2²⁰ / 4), and DeepSpeed allocates its reduce
# bucket *whole*, at the step's first gradient, whatever the gradients it will hold; minishard
# sizes each bucket to the parameters it packs, two in flight at most (§2). Three sizes, the same
# bytes sent:
#
# <details><summary>中文</summary>
#
# stage 2 改变的是 DeepSpeed 的梯度在哪里等待，而不是怎样传输：每个桶仍然整个做 all-reduce
# （`use_multi_rank_bucket_allreduce`，见第 03 章 §7），是 minishard 的 reduce-scatter 的 1.5 倍。
# 再看桶的大小：minishard 的 `bucket_cap_mb` 变成 DeepSpeed 的 `reduce_bucket_size`，按元素计
# （`bucket_cap_mb` × 2²⁰ / 4）；DeepSpeed 在一步的第一个梯度到来时就把归约桶*整个*分配出来，不管它
# 将装下多少梯度；minishard 的每个桶按它打包的参数定大小，最多两个在途（§2）。三种大小，发送的字节
# 相同：
#
# </details>

# %%
# NBVAL_CHECK_OUTPUT
print(f"{'bucket_cap_mb':>13}{'elements':>10}{'reduce bucket B':>17}{'buffers in step B':>19}{'all-reduces':>13}"
      f"{'sent B':>11}   minishard:{'buffers in step B':>19}{'reduce-scatters':>17}{'sent B':>10}")
for mb in sorted(by_size):
    ds, ms = by_size[mb]["ZeRO-2 (DeepSpeed)"], by_size[mb]["ZeRO-2 (minishard)"]
    elements = reduce_bucket_size(mb)
    bucket = ds["tag_peaks"]["reduce bucket"]
    shown = glue(f"ds-reduce-bucket-{str(mb).replace('.', '')}", bucket, "{:,}")
    print(f"{mb:>13}{elements:>10,}{shown:>17}{ds['step_peaks']['comm_buffers']:>19,}"
          f"{calls_by_tag(ds, 'all_reduce')['allreduce_bucket']:>13}{ds['wire']:>11,}   {'':10}"
          f"{ms['step_peaks']['comm_buffers']:>19,}{ms['ops']['reduce_scatter']['calls']:>17}{ms['wire']:>10,}")
    assert bucket == 4 * elements and ms["wire"] == 4 * PSI and abs(ds["wire"] / ms["wire"] - 1.5) < 1e-3
DEFAULT = 500_000_000                          # DeepSpeed's reduce_bucket_size when it is not set
print(f"DeepSpeed's default, {DEFAULT:.0e} elements: a reduce bucket of "
      f"{glue('ds-default-bucket-gb', 4 * DEFAULT / GB, '{:.0f}')} GB in fp32 ({2 * DEFAULT / GB:.0f} GB in bf16), "
      f"{4 * DEFAULT / (4 * PSI):,.0f}× this model's gradient")

# %% [markdown]
# The reduce bucket is exactly 4 bytes × `reduce_bucket_size` at every size, while minishard's
# buffers follow what is in flight. A larger bucket means fewer, larger all-reduces; the bytes
# sent do not move. Left at DeepSpeed's default of 5 × 10⁸ elements, the bucket alone is 2 GB of
# fp32 on every rank, allocated at every step's first gradient (two with `overlap_comm`, off
# here) — a term to read in the ledger before blaming activations for an OOM: size
# `reduce_bucket_size` to the model. The step time, on this machine (not compared across
# machines):
#
# <details><summary>中文</summary>
#
# 每种大小下归约桶都恰好是 4 字节 × `reduce_bucket_size`，而 minishard 的缓冲区随在途的内容变化。桶越大，
# all-reduce 越少、越大；发送的字节不变。若保持 DeepSpeed 的默认值 5 × 10⁸ 个元素，单这个桶就是每个
# rank 上 2 GB 的 fp32，在每一步的第一个梯度到来时分配（打开 `overlap_comm` 时是两个，这里关着）——遇到
# OOM 时，先在账本里找这一项，再去怪激活值：按模型设定 `reduce_bucket_size`。下面是本机上的单步耗时
# （不跨机器比较）：
#
# </details>

# %%
# NBVAL_IGNORE_OUTPUT
for name, r in side.items():
    print(f"{name:<22}{r['step_s'] * 1e3:8.1f} ms a step (median of the slowest rank)")
print(f"DeepSpeed's stage 2 / minishard's: "
      f"{glue('ds-zero2-time-ratio', two['step_s'] / mine['step_s'], '{:.2f}')}× the step time")

# %%
R2.close()
R4.close()

# %% [markdown]
# > **Takeaway.** ZeRO-2 reduce-scatters each gradient bucket during backward, as soon as it
# > fills, and keeps only the summed slice the rank updates: memory per rank is
# > 2Ψ + 14Ψ/N — measured within the formula for N = 1…4 — plus a few buckets in flight
# > (`comm_buffers`), bounded by the bucket size, not the model. It sends exactly what DDP sends,
# > 2(N−1)/N · Ψ elements per step. Two costs: with gradient accumulation it reduces every
# > micro-batch instead of once per step, and clipping needs one extra all-reduce of the squared
# > norm. The replicated bf16 weights (2Ψ) are now the floor; stage 3 removes it.
#
# <details><summary>中文</summary>
#
# > **要点。** ZeRO-2 在反向期间，每个梯度桶一填满就 reduce-scatter，只保留本 rank 要更新的那片
# > 求和结果：每个 rank 的显存是 2Ψ + 14Ψ/N——N = 1…4 实测都在公式范围内——另加几个在途的桶
# > （`comm_buffers`），上限由桶大小决定，与模型无关。它发送的与 DDP 完全相同，每步
# > 2(N−1)/N · Ψ 个元素。两项代价：有梯度累积时每个微批次都要归约一次，而不是每步一次；裁剪需要多
# > 一次对平方范数的 all-reduce。每个 rank 各存一份的 bf16 权重（2Ψ）成了新的显存下限；stage 3 会拿掉它。
#
# </details>
#
# **Questions**
#
# 1. With 8 micro-batches per optimizer step on 64 ranks, how much gradient traffic does each rank
#    send per step under ZeRO-1 and under ZeRO-2?
#
# <details><summary>Answer</summary>
#
# In gradient elements (times 2 for bf16 bytes): ZeRO-1 (with `no_sync`), one reduce-scatter per
# step, 63/64 · Ψ ≈ Ψ. ZeRO-2: one per micro-batch, 8 · 63/64 · Ψ ≈ 7.9 Ψ. The parameter
# all-gather (≈ Ψ) is the same for both.
# When accumulation is deep and the network slow, stage 1 (or stage 2 with a full local
# accumulation buffer, giving up its memory saving for gradients) can win.
# </details>
#
# 2. Why must the bucket reduce-scatters be launched in the same order on every rank, and why does
#    ZeRO-2 bound the number of buckets in flight?
#
# <details><summary>Answer</summary>
#
# Order: collectives are matched by call order, not by name (chapter 02); rank 0 reducing
# bucket 3 against rank 1's bucket 4 would mix unrelated gradients. Bound: every bucket in flight
# holds its local gradients (and, on more than two gloo ranks, a receive buffer) until it completes. Without a bound, a slow
# network lets them pile up until the whole gradient is in flight — the memory stage 2 set out to
# save. Waiting for the oldest bucket before launching a third keeps it to a few buckets.
# </details>
#
# 3. Does clipping by the global norm change the bytes on the wire noticeably?
#
# <details><summary>Answer</summary>
#
# No: it all-reduces a single number per step (8 bytes here, §6). Its cost is latency — one more
# synchronisation between the gradient reduction and the update — not bandwidth.
# </details>

# %% [markdown]
# ## Exercise: ZeRO-2's bucket hook
# Write the hook that ZeRO-2 registers on every parameter of a bucket: copy the gradient into the
# bucket, drop `p.grad`, and when the bucket's last gradient is in, reduce-scatter it and keep only
# your averaged slice. The check runs your hooks during backward on 1, 2 and 4 real ranks and
# compares the slices with an all-reduced gradient; it also checks that no full gradient is left
# and that each bucket was reduced during backward. The function is sent to the ranks as source:
# keep it self-contained.
#
# Write it in the cell below (or edit the stub in
# [`minishard/course/exercises/ch04.py`](../minishard/course/exercises/ch04.py)), then run the check. A
# reference solution is in [`solutions/ch04.py`](../solutions/ch04.py): try first.
#
# <details><summary>中文</summary>
#
# **练习：ZeRO-2 的梯度桶 hook。** 写出 ZeRO-2 在一个桶的每个参数上注册的 hook：把梯度拷进桶里，
# 丢掉 `p.grad`；桶里最后一个梯度到齐时，对它做 reduce-scatter，只保留本 rank 那片平均后的结果。
# 检查程序在 1、2、4 个真实 rank 上于反向期间运行你的 hook，把得到的分片与 all-reduce 后的梯度对比；
# 它还检查没有留下完整梯度，并且每个桶都是在反向期间归约的。函数以源码形式发送到各个 rank：请让它
# 自包含。
#
# 在下面的单元格里写（或者编辑 [`minishard/course/exercises/ch04.py`](../minishard/course/exercises/ch04.py)
# 里的桩函数），然后运行检查。参考答案在 [`solutions/ch04.py`](../solutions/ch04.py)：先自己试。
#
# </details>

# %%
def make_bucket_hook(comm, params, offsets, chunk, out):
    """Return hook(p), registered with p.register_post_accumulate_grad_hook on each parameter of
    one bucket. params[i] starts at offsets[i] in the bucket of comm.world_size * chunk elements;
    out (chunk elements): add this rank's averaged slice of the bucket's gradient to it."""
    raise NotImplementedError("your code here")

# %%
# NBVAL_CHECK_OUTPUT
from minishard.course.exercises import ch04

ch04.check_make_bucket_hook(make_bucket_hook)
