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
# # 02 · DDP: N replicas, one all-reduce of the gradients
#
# > **How do N ranks train one model, and what does it cost per step?**
#
# Data parallelism gives every rank a full replica of the model and its own slice of the global
# batch. After backward, the ranks average their gradients with an all-reduce, so each applies the
# same update and the replicas stay identical. The long explanation is in
# [tutorial/02-ddp.md](../tutorial/02-ddp.md); this notebook runs it and measures it.
#
# <details><summary>中文</summary>
#
# > **N 个 rank 怎样一起训练同一个模型？每一步要付出什么代价？**
#
# 数据并行让每个 rank 持有模型的完整副本，并分到全局批次中属于自己的一片。反向之后，各 rank 用一次
# all-reduce 对梯度取平均，于是每个 rank 执行相同的更新，各副本保持一致。详细讲解见
# [tutorial/zh/02-ddp.md](../tutorial/zh/02-ddp.md)；这个 notebook 把它跑起来并测量。
#
# </details>
#
# **The one-line "syntax"** — on rank $r$ of $N$, with $\Psi$ the number of parameters (so the
# fp32 gradient is $4\Psi$ bytes):
#
# $$g = \frac{1}{N}\sum_{r=0}^{N-1} \nabla\,\mathrm{loss}(x_r) \quad\text{(all-reduce)},\qquad
# \text{elements each rank sends per step} = \frac{2(N-1)}{N}\,\Psi
# \ \ (\times 4 \text{ bytes in fp32}).$$
#
# <details><summary>中文</summary>
#
# **一行"语法"**：在 $N$ 个 rank 中的第 $r$ 个上（$\Psi$ 为参数量，fp32 梯度即 $4\Psi$ 字节），梯度
# $g = \frac{1}{N}\sum_r \nabla\,\mathrm{loss}(x_r)$ 由一次 all-reduce 得到；每个 rank 每步发送 $\frac{2(N-1)}{N}\,\Psi$
# 个元素（fp32 下乘以 4 字节）。
#
# </details>
#
# Terms, in English and Chinese: [glossary · 术语表](../tutorial/glossary.md).

# %%
import hashlib
import statistics

import plotly.io as pio
import torch
from IPython.display import display

from minishard import GPT, Ranks
from minishard.course.glue import glue
from minishard.training.parity import bitwise_equal, drift, params_of, max_diff
from minishard.training.loop import TrainConfig, train
from minishard.viz import Player, ring_figure, ring_schedule, timeline_figure

pio.renderers.default = "plotly_mimetype+notebook_connected"
TINY = GPT("tiny", device="meta")
PSI = TINY.num_params()                                    # Ψ: parameters
GRAD_BYTES = 4 * PSI                                       # 4Ψ: one fp32 gradient, in bytes
N_TENSORS = len(list(TINY.parameters()))
print(f"tiny GPT: Ψ = {PSI:,} parameters in {N_TENSORS} tensors; its fp32 gradient is 4Ψ = {GRAD_BYTES:,} bytes")
R2 = Ranks(2)                                             # one warm pool for most of the chapter

# %% [markdown]
# ## 1. Identical replicas, watched live
# Two ranks train the tiny model for three AdamW steps while the player follows their events.
# The gradient buckets are capped at 4 MiB here (PyTorch's default is 25 MiB) so that there are
# several of them to watch.

# %%
live = Player(title="DDP, 2 ranks, tiny model, 3 steps, 4 MiB buckets")
display(live.widget)
run = R2.run(train, TrainConfig(strategy="ddp", steps=3, model="tiny", bucket_cap_mb=4, return_params=True), on_event=live.feed)
live.flush()
events = R2.last_events

# %% [markdown]
# Each rank saw different data, yet after three optimizer steps their parameters are bit-for-bit
# the same, because every rank applied the same averaged gradient to the same starting weights:

# %%
# NBVAL_IGNORE_OUTPUT
# claim: L3
def fingerprint(params: dict) -> str:
    flat = torch.cat([p.reshape(-1) for p in params.values()])
    return hashlib.sha256(flat.numpy().tobytes()).hexdigest()[:16]

for o in run:
    losses = [round(x, 4) for x in o["losses"]]
    first = glue(f"rank{o['rank']}-first-loss", losses[0])          # the list prints it as its repr
    sha = fingerprint(o["params"])
    sha = glue("params-sha256", sha) if o["rank"] == 0 else sha
    print(f"rank {o['rank']}: losses [{', '.join([first] + [repr(x) for x in losses[1:]])}], "
          f"parameter sha256 {sha}")
assert fingerprint(run[0]["params"]) == fingerprint(run[1]["params"])
assert all(torch.equal(run[0]["params"][n], run[1]["params"][n]) for n in run[0]["params"])
assert run[0]["losses"] != run[1]["losses"]               # ... although each saw its own data

# %% [markdown]
# ## 2. Naive DDP against bucketed DDP
# The naive version (`NaiveDDP` in [`minishard/strategies/ddp.py`](../minishard/strategies/ddp.py)) waits for backward
# to finish and then all-reduces every gradient tensor, one collective each. The real one keeps
# gradients in a few flat *buckets* and starts each bucket's all-reduce, asynchronously, the
# moment backward has produced its last gradient. Same bytes, far fewer messages:

# %%
naive = R2.run(train, TrainConfig(strategy="ddp_naive", steps=3, model="tiny"))
bucketed = R2.run(train, TrainConfig(strategy="ddp", steps=3, model="tiny"))          # 25 MiB buckets

# %%
# NBVAL_CHECK_OUTPUT
print(f"{'strategy':<26}{'collectives/step':>17}{'bytes sent/step':>17}")
for name, key, out in [("ddp_naive", "naive", naive), ("ddp, 4 MiB buckets", "bucket-4mib", run),
                       ("ddp, 25 MiB buckets", "bucket-25mib", bucketed)]:
    calls = glue(f"{key}-collectives-per-step", out[0]["calls"][-1])
    sent = glue("bytes-per-step", out[0]["wire"][-1], "{:,}") if key == "naive" else f"{out[0]['wire'][-1]:,}"
    print(f"{name:<26}{calls:>17}{sent:>17}")
assert naive[0]["calls"] == [N_TENSORS] * 3                # one all-reduce per parameter tensor
assert run[0]["calls"] == [6] * 3 and bucketed[0]["calls"] == [2] * 3
assert naive[0]["wire"] == run[0]["wire"] == bucketed[0]["wire"] == [GRAD_BYTES] * 3

# %%
# NBVAL_IGNORE_OUTPUT
for name, key, out in [("ddp_naive", "naive", naive), ("ddp (25 MiB buckets)", "bucket-25mib", bucketed)]:
    t = statistics.median(o["step_times"][-1] for o in out)
    print(f"{name:<22} step time {glue(f'{key}-step-ms', t * 1e3, '{:.0f}'):>6} ms (last step, median over ranks; a shared 2-core CPU)")

# %% [markdown]
# The player's timeline shows where the bucketed all-reduces run: each starts *during* backward,
# as soon as its bucket is full, while the earlier layers are still computing their gradients.
# (A bar runs from the launch to the moment backward waits for it at its end; the bytes may have
# arrived sooner.)

# %%
live.timeline_figure

# %%
# NBVAL_CHECK_OUTPUT
def launched_during_backward(events, rank, step):
    """Bucket all-reduces this rank launched before its backward pass ended, and all of them."""
    end = next(e["t"] for e in events if e["kind"] == "phase" and e["name"] == "backward"
               and e["edge"] == "end" and e["rank"] == rank and e.get("step") == step)
    ars = [e for e in events if e["kind"] == "collective" and e["op"] == "all_reduce"
           and e["rank"] == rank and e.get("step") == step]
    return sum(e["t"] < end for e in ars), len(ars)

for rank in (0, 1):
    for step in (1, 2):
        early, total = launched_during_backward(events, rank, step)
        print(f"rank {rank} step {step}: {early} of {total} bucket all-reduces launched during backward")
        assert total == 6 and early == total          # all of them start before backward returns

# %% [markdown]
# Static copy of the same timeline (it renders without a kernel):

# %%
timeline_figure([e for e in events if e.get("step") == 1]).update_layout(
    title="step 1: forward, backward with the bucket all-reduces in flight, optimizer").show()

# %% [markdown]
# ## 3. Inside one all-reduce: reduce-scatter, then all-gather
# A ring all-reduce on N ranks cuts the buffer into N chunks. For N−1 rounds each rank passes a
# partial sum of one chunk to its neighbour (**reduce-scatter**: afterwards each rank owns one
# fully summed chunk); then for N−1 more rounds each forwards finished chunks (**all-gather**).
# Every round a rank sends one chunk of Ψ/N elements, so it sends 2(N−1)·Ψ/N elements in all —
# 2(N−1)/N · 4Ψ bytes for an fp32 gradient.

# %%
# NBVAL_CHECK_OUTPUT
for k, rnd in enumerate(ring_schedule("all_reduce", 4)):
    print(f"round {k}: {rnd.label:<26} " + "  ".join(f"{s}->{d}:{c}" for s, d, c in rnd.sends))
assert [r.label.split()[0] for r in ring_schedule("all_reduce", 4)] == ["reduce-scatter"] * 3 + ["all-gather"] * 3

# %% [markdown]
# The same on a real 4-rank run: train two steps, then stop the player inside a bucket's
# all-reduce and step through its six rounds (`ring_round`), or press play and watch the chunks
# travel.

# %%
R4 = Ranks(4)
four = R4.run(train, TrainConfig(strategy="ddp", steps=2, model="tiny"))
p4 = Player(R4.last_events, title="DDP, 4 ranks: one bucket's all-reduce on the ring")
i = next(i for i, e in enumerate(p4.replay.events)
         if e["kind"] == "collective" and e["op"] == "all_reduce" and e.get("step") == 1)
p4.jump(i)
p4.ring_round = 0
display(p4.widget)

# %%
# NBVAL_CHECK_OUTPUT
coll = p4.current_collective()
print(f"in flight: {coll['op']} {coll['tag']}, payload {coll['payload']:,} bytes")
for k in range(6):
    p4.ring_round = k
    print(p4.ring_figure.layout.title.text.split("<br>")[1])
assert coll["op"] == "all_reduce" and coll["group"] == 4
p4.ring_round = None

# %%
ring_figure(4, coll, round=1).show()

# %% [markdown]
# The same 4-rank run in the offline player: no kernel (it plays on the course's static site and
# in any browser), every event, opening at the same all-reduce. Step through its rounds on the
# ring, or press play; "jump to collective" walks from one bucket's all-reduce to the next.

# %%
from minishard.viz import replay_html
replay_html(p4.replay, title="DDP, 4 ranks, tiny model, 2 steps (offline player)", start=p4.index)

# %% [markdown]
# ## 4. Bytes per step, measured two ways, for N = 2, 3, 4
# `wire` is what comm recorded for each collective (the ring formula for the op that really ran);
# `wchar` is the operating system's count of bytes each rank process wrote, read from
# `/proc/self/io` around each step — an independent witness.

# %%
R3 = Ranks(3)
per_n = {2: bucketed, 3: R3.run(train, TrainConfig(strategy="ddp", steps=2, model="tiny")), 4: four}
R3.close()

# %%
# NBVAL_CHECK_OUTPUT
# claim: W1
print(f"{'N':>2}{'2(N-1)/N x 4Ψ':>16}{'recorded (wire)':>17}{'ratio to 4Ψ':>14}")
for N, out in per_n.items():
    formula = 2 * (N - 1) / N * GRAD_BYTES
    wire = out[0]["wire"][-1]
    shown = glue("ring-formula-bytes-n3", formula, "{:,.0f}") if N == 3 else f"{formula:,.0f}"
    print(f"{N:>2}{shown:>16}{glue(f'wire-bytes-n{N}', wire, '{:,}'):>17}{wire / GRAD_BYTES:>14.4f}")
    for o in out:                                     # every rank, every step
        assert all(abs(w - formula) <= o["calls"][0] for w in o["wire"])   # exact up to rounding per bucket

# %%
# NBVAL_IGNORE_OUTPUT
# claim: W1
for N, out in per_n.items():
    extra = [w - x for o in out for w, x in zip(o["wchar"], o["wire"])]
    print(f"N={N}: the OS counted {min(extra):,} to {glue(f'os-extra-bytes-max-n{N}', max(extra), '{:,}')} bytes more than recorded per rank per step "
          f"(message headers), on {out[0]['wire'][-1]:,}")
    assert all(0 <= x < 16 * 1024 for x in extra)

# %% [markdown]
# ## 5. Is it the same training? Parity with one process and with PyTorch's DDP
# One process training on the whole global batch (8 sequences) is the reference; PyTorch's own
# `DistributedDataParallel` on the same two ranks is a second oracle. (The single process runs on
# one thread, like each rank, so that both use the same kernels.)

# %%
threads = torch.get_num_threads()
torch.set_num_threads(1)
single = train(None, TrainConfig(strategy="single", steps=3, model="tiny", micro_batch=8, return_params=True))
torch.set_num_threads(threads)
ours = R2.run(train, TrainConfig(strategy="ddp", steps=3, model="tiny", micro_batch=4, return_params=True))
theirs = R2.run(train, TrainConfig(strategy="torch_ddp", steps=3, model="tiny", micro_batch=4, return_params=True))

# %%
# NBVAL_IGNORE_OUTPUT
INIT = params_of(GPT("tiny", seed=0))                 # the weights every run starts from
mean_loss = [sum(o["losses"][s] for o in ours) / 2 for s in range(3)]   # the global batch's loss
print("single-process loss :", [f"{x:.6f}" for x in single["losses"]])
print("minishard DDP (mean):", [f"{x:.6f}" for x in mean_loss])
print("largest loss gap    :", max(abs(a - b) for a, b in zip(mean_loss, single["losses"])))
print("params vs single    : largest element gap", max_diff(ours[0]["params"], single["params"]),
      "; worst tensor's gap / its movement", drift(ours[0]["params"], single["params"], INIT).worst)

# %% [markdown]
# Those digits depend on the machine (its float kernels, its thread count); the relations below
# do not, and they are what the notebook checks:

# %%
# NBVAL_CHECK_OUTPUT
adamw = drift(ours[0]["params"], single["params"], INIT)
print("losses within 1e-6 (relative) of one process at every step:",
      all(abs(a - b) <= 1e-6 * abs(b) for a, b in zip(mean_loss, single["losses"])))
print("losses and params bitwise equal to PyTorch's DDP:",
      [o["losses"] for o in ours] == [o["losses"] for o in theirs]
      and bitwise_equal(ours[0]["params"], theirs[0]["params"]))
print("params vs one process: every tensor within 0.1% of how far training moved it:", adamw.within(1e-3))
assert all(abs(a - b) <= 1e-6 * abs(b) for a, b in zip(mean_loss, single["losses"]))
assert [o["losses"] for o in ours] == [o["losses"] for o in theirs]             # bitwise
assert bitwise_equal(ours[0]["params"], theirs[0]["params"])
assert adamw.within(1e-3)

# %% [markdown]
# Bitwise equal to PyTorch's DDP; close to, not equal to, the single process. That gap is not a
# DDP bug: summing the same numbers in a different order changes the last bits, and Adam divides
# by $\sqrt{v}$, which amplifies those bits wherever a gradient is nearly zero — an element can
# land up to about one learning rate away. So the check compares each tensor with how far
# training moved it (`minishard.training.parity.drift`): a model that did not train is off by 100% of
# that; summation order stays well below the 0.1% the check allows. With plain SGD, whose update
# is linear in the gradient, the noise stays the size of the gradients' own rounding — measured
# over the whole model, at least ten times smaller than AdamW's:

# %%
# NBVAL_IGNORE_OUTPUT
torch.set_num_threads(1)
single_sgd = train(None, TrainConfig(strategy="single", steps=3, model="tiny", micro_batch=8, optimizer="sgd", lr=0.1, return_params=True))
torch.set_num_threads(threads)
ours_sgd = R2.run(train, TrainConfig(strategy="ddp", steps=3, model="tiny", micro_batch=4, optimizer="sgd", lr=0.1, return_params=True))
sgd = drift(ours_sgd[0]["params"], single_sgd["params"], INIT)
print(f"whole model, gap / movement after 3 steps: SGD {glue('sgd-drift', sgd.overall, '{:.1e}')}, "
      f"AdamW {glue('adamw-drift', adamw.overall, '{:.1e}')}")

# %%
# NBVAL_CHECK_OUTPUT
print("SGD: the whole model within 0.001% of its movement:", sgd.overall < 1e-5)
print("AdamW's gap at least ten times SGD's:", adamw.overall > 10 * sgd.overall)
assert sgd.overall < 1e-5 and adamw.overall > 10 * sgd.overall and sgd.within(1e-3)

# %% [markdown]
# ## 6. Gradient accumulation with `no_sync`
# With `accum=2` each optimizer step runs two micro-batches per rank. Inside `no_sync()` the first
# backward only accumulates into the buckets; the all-reduce runs once, after the second. The
# traffic per optimizer step stays that of one all-reduce of the gradient, 4Ψ bytes at N = 2, and
# the result still matches one process that accumulates over the same data.

# %%
# NBVAL_CHECK_OUTPUT
acc = R2.run(train, TrainConfig(strategy="ddp", steps=2, model="tiny", micro_batch=4, accum=2, return_params=True))
torch.set_num_threads(1)
single_acc = train(None, TrainConfig(strategy="single", steps=2, model="tiny", micro_batch=8, accum=2, return_params=True))
torch.set_num_threads(threads)
print(f"accum=2: {acc[0]['calls']} all-reduces per step (accum=1: {bucketed[0]['calls'][:2]}), "
      f"{glue('accum-bytes-per-step', acc[0]['wire'][0], '{:,}')} bytes per step")
assert acc[0]["calls"] == bucketed[0]["calls"][:2] and acc[0]["wire"] == [GRAD_BYTES] * 2
mean_acc = [sum(o["losses"][s] for o in acc) / 2 for s in range(2)]
assert all(abs(a - b) <= 1e-6 * abs(b) for a, b in zip(mean_acc, single_acc["losses"]))
assert drift(acc[0]["params"], single_acc["params"], INIT).within(1e-3)

# %% [markdown]
# ## 7. Beside PyTorch's DDP, bucket by bucket
# Parity says minishard's DDP and PyTorch's end with the same bits; here is how each gets there.
# `minishard.watch` records PyTorch's own `DistributedDataParallel` in minishard's trace — two
# lines in any training script (README, "Your own PyTorch job") — and `train` runs the
# `torch_ddp` strategy under it. Both runs: the nano model, buckets of 0.25 MB (so that its
# 217,664 parameters make three), two steps. One slider moves both players to the same step and
# phase.
#
# <details><summary>中文</summary>
#
# 逐位比对（parity）只说明 minishard 的 DDP 和 PyTorch 的训练结果逐位相同；这里看各自是怎么走到那里的。
# `minishard.watch` 把 PyTorch 自己的 `DistributedDataParallel` 记进 minishard 的 trace——任何训练脚本里
# 加两行就行（README 的 “Your own PyTorch job”）——`train` 跑 `torch_ddp` 策略时就套着它。两边都是：
# nano 模型，桶大小 0.25 MB（这样它的 217,664 个参数分成三个桶），两步。一个滑块把两个回放器同时
# 拨到同一步的同一个阶段。
#
# </details>

# %%
# NBVAL_IGNORE_OUTPUT
from minishard.course import side_by_side as sbs
from minishard.viz import PlayerPair

SBS = dict(model="nano", steps=2, micro_batch=2, bucket_cap_mb=0.25)
ours_ev, torch_ev = sbs.traces(R2, "ddp", "torch_ddp", **SBS)
pair = PlayerPair(ours_ev, torch_ev, titles=("minishard DDP", "PyTorch DDP (watched)"))
pair.show("backward", step=1, edge="end")
display(pair.widget)

# %% [markdown]
# Each step's buckets in the order they were launched, on rank 0 (`minishard.course.side_by_side`;
# `tests/test_side_by_side.py` asserts every row):

# %%
# NBVAL_CHECK_OUTPUT
NANO_PSI = GPT("nano", device="meta").num_params()
rows = sbs.compare_ddp(ours_ev, torch_ev, rank=0)
print("step  bucket  minishard bytes  PyTorch bytes")
for r in rows:
    ours_b = "" if r["bytes"] is None else f"{r['bytes']:,}"
    theirs_b = "" if r["their_bytes"] is None else (
        glue("sbs-torch-step0-bucket", r["their_bytes"], "{:,}") if r["step"] == 0 else f"{r['their_bytes']:,}")
    print(f"{r['step']:>4}  {r['i']:>6}  {ours_b:>15}  {theirs_b:>13}")
later = [r for r in rows if r["step"] == 1]
print("from step 1 on, the same buckets in the same order:", all(r["difference"] == "same" for r in later),
      f"({glue('sbs-ddp-buckets', len(later))} buckets)")
print("PyTorch's step 0: one bucket of 4Ψ:", [r["their_bytes"] for r in rows if r["step"] == 0 and r["their_bytes"]] == [4 * NANO_PSI],
      f"(once rebuilt, its first bucket is capped at {glue('sbs-first-bucket-mib', torch.distributed._DEFAULT_FIRST_BUCKET_BYTES // 2**20)} MiB)")
assert all(r["difference"] == "same" for r in later) and len(later) == 3
assert sum(r["bytes"] for r in rows if r["step"] == 0) == 4 * NANO_PSI

# %% [markdown]
# From the second step on, the two reducers launch the same three buckets, last layers first,
# with the same bytes: minishard plans its buckets in the order backward produces the gradients
# (the reverse of the parameters'), which is the order PyTorch's reducer *learns*. In the first
# step PyTorch does not know that order yet: with `find_unused_parameters=False`, its default, it
# puts the whole gradient in one bucket, whatever its size, records the order in which the
# gradients actually arrive, and then rebuilds its buckets in that order (the first capped at
# 1 MiB, the cap printed above, the others at 25 MiB) and broadcasts the new plan to every rank
# (two small broadcasts issued from C++, which the watch does not see). So step 0 is a single
# all-reduce of the whole gradient, on nano 870,656 bytes. Table and sources:
# [docs/side-by-side.md](../docs/side-by-side.md).
#
# <details><summary>中文</summary>
#
# 从第二步起，两个 reducer 发起同样的三个桶，从最后几层开始，字节数也一样：minishard 按反向
# 产生梯度的顺序（参数顺序的逆序）规划桶，这正是 PyTorch 的 reducer *学到*的顺序。第一步时
# PyTorch 还不知道这个顺序：在默认的 `find_unused_parameters=False` 下，它不管梯度多大，都放进同一个桶，
# 记下梯度实际到达的顺序，然后按这个顺序重建桶（第一个桶上限 1 MiB，即上面打印的上限，其余的 25 MiB），
# 并把新方案广播给每个 rank（两次从 C++ 发起的小广播，watch 看不到）。所以第 0 步是整个梯度的一次
# all-reduce，nano 上是 870,656 字节。表格和出处见
# [docs/side-by-side.md](../docs/side-by-side.md)。
#
# </details>

# %%
R2.close()
R4.close()

# %% [markdown]
# > **Takeaway.** DDP keeps N identical replicas and makes them stay identical by all-reducing the
# > gradients once per step: each rank sends 2(N−1)/N · Ψ gradient elements — Ψ at N = 2, 1.5Ψ at
# > N = 4, approaching 2Ψ; in fp32 bytes 4Ψ, 6Ψ, approaching 8Ψ — measured here exactly, and
# > confirmed by the operating system's byte count.
# > Bucketing turns one collective per tensor into a few large ones and starts them during
# > backward. The result is bitwise PyTorch's DDP and, up to summation order, one process training
# > on the whole batch. What DDP does not do is save memory: chapter 01's full ledger sits on every
# > rank.
#
# <details><summary>中文</summary>
#
# > **要点。** DDP 保留 N 个相同的副本，并靠每步对梯度做一次 all-reduce 让它们保持一致：每个 rank 发送
# > 2(N−1)/N · Ψ 个梯度元素——N = 2 时 Ψ，N = 4 时 1.5Ψ，趋近 2Ψ；换成 fp32 字节是 4Ψ、6Ψ，趋近 8Ψ——这里
# > 实测精确吻合，并由操作系统的字节计数印证。分桶把每个张量一次集合通信变成少数几次大的，并在反向期间
# > 就发起。结果与 PyTorch 的 DDP 逐位一致，与单进程训练整个批次只差求和顺序。DDP 做不到的是省显存：
# > 第 01 章的完整账本在每个 rank 上都有一份。
#
# </details>
#
# **Questions**
#
# 1. Going from 4 to 64 ranks, by how much does the traffic each rank sends per step grow?
#
# <details><summary>Answer</summary>
#
# From 2·3/4 · Ψ = 1.5Ψ to 2·63/64 · Ψ ≈ 1.97Ψ gradient elements (× 4 bytes in fp32): about 31%
# more. Per-rank traffic of a ring all-reduce is almost independent of N; the number of rounds
# (the latency) is what grows with N.
# </details>
#
# 2. Why must every rank launch its buckets in the same order, even if on some rank bucket 2 is
# ready before bucket 1?
#
# <details><summary>Answer</summary>
#
# Collectives are matched by the order in which ranks call them, not by name. If rank 0 calls
# all-reduce(bucket 1) while rank 1 calls all-reduce(bucket 2), the two are paired with each
# other: they sum unrelated gradients (or, if the sizes differ, hang or crash). minishard's DDP
# launches buckets strictly in index order for this reason.
# </details>

# %% [markdown]
# ## Exercise: the ring's bytes on the wire
# Write how many bytes one rank sends for a ring all-reduce, reduce-scatter and all-gather of S
# bytes on N ranks. The check compares your formula with minishard's, then with the operating
# system's count of the bytes each DDP rank process wrote in one step, on 2 and on 3 ranks.
#
# Write it in the cell below (or edit the stub in
# [`minishard/course/exercises/ch02.py`](../minishard/course/exercises/ch02.py)), then run the check. A
# reference solution is in [`solutions/ch02.py`](../solutions/ch02.py): try first.
#
# <details><summary>中文</summary>
#
# **练习：环形算法的实发字节。** 写出在 N 个 rank 上，对 S 字节做环形 all-reduce、reduce-scatter 和
# all-gather 时，一个 rank 发送的字节数。检查程序先把你的公式与 minishard 的对比，再与操作系统统计的、每个
# DDP rank 进程一步写出的字节数对比，分别在 2 个和 3 个 rank 上。答案写在下面的单元格里（或者编辑
# [`minishard/course/exercises/ch02.py`](../minishard/course/exercises/ch02.py) 里的桩函数），然后运行检查。
# 参考答案在 [`solutions/ch02.py`](../solutions/ch02.py)：先自己试。
#
# </details>

# %%
def ring_bytes(op: str, nbytes: int, world_size: int) -> int:
    """Bytes one rank sends for op ("all_reduce", "reduce_scatter", "all_gather") on a buffer of
    nbytes over world_size ranks with the ring algorithm (rounded down to whole bytes)."""
    raise NotImplementedError("your code here")

# %%
# NBVAL_CHECK_OUTPUT
from minishard.course.exercises import ch02

ch02.check_ring_bytes(ring_bytes)
