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
# # 06 · FSDP units: the ZeRO-3 idea as a module lifecycle
#
# > **What exactly happens to a wrapped module during one training step — and are ZeRO-3 and
# > FSDP the same thing?**
#
# <details><summary>中文</summary>
#
# > **一个被包裹的模块，在训练的一步里究竟经历了什么？ZeRO-3 和 FSDP 是一回事吗？**
#
# 本 notebook 先手动走一遍 FSDP 单元的生命周期，再看 hook 如何自动走完它，最后调节包裹粒度、参数布局
# （FSDP1 扁平化参数 / FSDP2 逐参数分片）和 `reshard_after_forward`。中文讲解见
# [tutorial/zh/06-fsdp-units.md](../tutorial/zh/06-fsdp-units.md)。
#
# </details>
#
# Chapter 05 measured what stage 3 saves and costs. This chapter opens the mechanism PyTorch's
# FSDP uses to do it: the model is cut into *units*, and every unit walks the same lifecycle each
# step. We walk it by hand first, then watch the hooks walk it, then turn the knobs that decide
# how well it works — the wrapping granularity, the parameter layout (FSDP1's flat buffer or
# FSDP2's per-parameter shards) and `reshard_after_forward`. The reasoning is in
# [tutorial/06-fsdp-units.md](../tutorial/06-fsdp-units.md).
#
# **The one-line "syntax"** — for every unit, every step:
#
# $$\underbrace{\text{all-gather}}_{\texttt{unshard}}\to\text{forward}\to\underbrace{\text{free}}_{\texttt{reshard}}
# \;\cdots\;\underbrace{\text{all-gather}}_{\texttt{unshard}}\to\text{backward}\to
# \underbrace{\text{reduce-scatter}}_{\texttt{reduce\_scatter\_grads}}\to\underbrace{\text{free}}_{\texttt{reshard}}$$
#
# ```python
# for block in model.blocks:
#     fully_shard(block, comm=comm)          # one unit per transformer block
# fully_shard(model, comm=comm)              # the root: everything left (embeddings, head)
# ```
#
# <details><summary>中文</summary>
#
# **一行"语法"**——每个单元、每步都走一遍：all-gather（`unshard`）→ 前向 → 释放（`reshard`）……
# all-gather（`unshard`）→ 反向 → reduce-scatter（`reduce_scatter_grads`）→ 释放（`reshard`）。
# 代码里每个 transformer block 包成一个单元，最后的 `fully_shard(model)` 生成 root 单元，接管剩下的部分
# （embedding、head）。
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
from minishard.course.ch05 import race, with_unit_states
from minishard.course.ch06 import (layout_views, lifecycle_by_hand, lifecycle_order, mixed_dtypes,
                                   padding_table, unit_state_figure)
from minishard.course.glue import glue
from minishard.training.parity import bitwise_equal, drift, params_of
from minishard.training.loop import TrainConfig, train, wrap_targets
from minishard.viz import Player

pio.renderers.default = "plotly_mimetype+notebook_connected"
NANO = GPT("nano", device="meta")                     # 3 blocks: small enough to read every event
PSI = NANO.num_params()
ROOT = sum(p.numel() for n, p in NANO.named_parameters() if not n.startswith("blocks."))
BLOCK = sum(p.numel() for p in NANO.blocks[0].parameters())
print(f"nano GPT: Ψ = {PSI:,} parameters: root unit {ROOT:,}, each of 3 blocks {BLOCK:,}")
R2 = Ranks(2)

# %% [markdown]
# ## 1. The lifecycle by hand
# `fully_shard(..., manual=True)` makes the units but registers no hooks, so nothing happens
# unless we call it. [`lifecycle_by_hand`](../minishard/course/ch06.py) runs one AdamW step on
# two ranks calling every lifecycle method itself, in the order the hooks would, and takes a
# snapshot of rank 0 after each call. Columns: the state of each unit (**S**harded,
# **~** gathering, **U**nsharded, **R**educe-scattering); the shape of `blocks[0].attn.qkv.weight`
# as the module sees it; the bytes of storage behind the *full* qkv tensor (the one autograd
# saves); then the ledger.

# %%
hand = R2.run(lifecycle_by_hand)

# %%
# NBVAL_CHECK_OUTPUT
SHORT = {"sharded": "S", "unsharding": "~", "unsharded": "U", "reduce_scattering": "R"}
print(f"{'call':<32}{'root b0 b1 b2':<15}{'qkv seen':<10}{'full qkv':>9}{'unsharded':>10}{'grads':>9}"
      f"{'activ.':>11}  collective")
for i, r in enumerate(hand[0]["rows"]):
    st = "   ".join(SHORT[s] for s in r["states"].values())
    led = r["ledger"]
    grads = glue("at-rest-grad-bytes", led["grads"], "{:,}") if i == 0 else f"{led.get('grads', 0):,}"
    print(f"{r['call']:<32}{st:<15}{str(r['qkv_shape']):<10}{r['qkv_full_bytes']:>9,}"
          f"{led.get('unsharded', 0):>10,}{grads:>9}{led.get('activations', 0):>11,}  "
          + " ".join(dict.fromkeys(r["collectives"])))
rows = hand[0]["rows"]
for r in rows:                        # the module computes with the full weight only while gathered
    gathered = r["states"]["blocks.0"] in ("unsharded", "reduce_scattering")
    assert (r["qkv_shape"] == (192, 64)) == gathered
    assert r["qkv_full_bytes"] == (192 * 64 * 4 if gathered else 0)
assert max(r["ledger"].get("unsharded", 0) for r in rows) == 4 * (ROOT + BLOCK)
assert rows[-1]["ledger"] == {c: 4 * PSI // 2 for c in ("params", "grads", "exp_avg", "exp_avg_sq")}
assert all(h["matches_hooks"] for h in hand)   # bit for bit the step the hooks take

# %% [markdown]
# Read the table top to bottom:
#
# * **At rest** a rank stores only shards: `params` and `grads` are Ψ/2 elements each (4Ψ/2
#   bytes in the ledger), and
#   `blocks[0].attn.qkv.weight` *is* a (96, 64) row block — that is what `model.parameters()`
#   returns, so a plain `torch.optim.AdamW` updates shards and never knows.
# * **`unshard()`** allocates the full parameters and all-gathers them. With `async_op=True` the
#   call returns at once (state **~**; the packed all-gather buffer shows up as `comm_buffers`,
#   not in this table) and `wait_for_unshard()` finishes it — the hook that lets FSDP prefetch.
# * **After forward, `reshard()`** frees the full weight's *storage* (0 bytes) although autograd
#   still holds the tensor object for backward. In backward `unshard()` re-grows the same storage
#   and refills it; autograd never notices. This is the whole trick of stage 3.
# * **Backward** runs the head first (the root stays gathered throughout), then each block:
#   gather, compute its gradients (`grads` rises by one unit's full gradients), reduce-scatter
#   them into the shards' `.grad`, free. The embeddings come last.
# * **`optimizer.step()`** touches only shards; Adam's moments are born sharded.
#
# ## 2. The same lifecycle, driven by hooks
# Without `manual=True`, `fully_shard` registers the hooks that make these calls (all in one
# place: `register_hooks` in [`minishard/strategies/fsdp/hooks.py`](../minishard/strategies/fsdp/hooks.py)): a forward pre-hook
# unshards, a forward hook reshards, a hook on the unit's outputs unshards again when backward
# reaches them, and an autograd node on the unit's inputs reduce-scatters when its backward is
# done. Two steps of the nano model, the player following; the table under it shows each unit's
# state.

# %%
player = Player(title="FSDP, 2 ranks, nano model (3 blocks), 2 steps")
view, panel = with_unit_states(player)
display(view)
hooked = R2.run(train, TrainConfig(strategy="fsdp", steps=2, model="nano", micro_batch=2), on_event=player.feed)
player.flush()
events = R2.last_events

# %% [markdown]
# The same run in the offline player (no kernel: it plays on the static site too). Its unit table
# follows every state change as you step: `unsharding` while a unit's all-gather is in flight,
# `unsharded` while it computes, `reduce_scattering` while its gradients are reduced, `sharded`.

# %%
from minishard.viz import replay_html
replay_html(events, title="FSDP, 2 ranks, nano model (3 blocks), 2 steps (offline player)")

# %% [markdown]
# The order of rank 0's unit state changes and collectives in step 1, as recorded:

# %%
# NBVAL_CHECK_OUTPUT
order = lifecycle_order(events, rank=0, step=1)
line = []
for item in order + ["END"]:
    if item in ("FORWARD", "BACKWARD", "OPTIMIZER", "END") and line:
        print(" -> ".join(line))
        line = []
    line.append(item)
by_hand = [c for r in rows for c in r["collectives"] if "replicate" not in c]
assert [x for x in order if "(" in x] == by_hand          # the same collectives as by hand, in order
assert order.count("all_gather(root)") == 1               # the root: gathered once per step
assert all(order.count(f"all_gather(blocks.{i})") == 2 for i in range(3))

# %% [markdown]
# Each unit's states over time, as a figure (it needs no kernel):

# %%
unit_state_figure(events, rank=0, step=1,
                  title="rank 0, step 1: when each unit is gathering, gathered, reduce-scattering").show()

# %% [markdown]
# ## 3. Wrapping granularity: one unit, one per block, one per Linear
# Which modules become units is the FSDP setting that matters most for memory at the peak (how
# many full parameters a rank holds at once) and for the number of collectives a step issues.
# `wrap="model"` makes the whole
# model one unit; `"block"` one per transformer block (plus the root); `"linear"` one per
# `nn.Linear`. Two steps each on two ranks; the peak and the collectives per step, measured:

# %%
sweep = {w: R2.run(train, TrainConfig(strategy="fsdp", wrap=w, steps=2, model="nano", micro_batch=2))
         for w in ("model", "block", "linear")}
ddp = R2.run(train, TrainConfig(strategy="ddp", steps=2, model="nano", micro_batch=2))

# %%
# NBVAL_CHECK_OUTPUT
print(f"{'wrap':<8}{'units':>6}{'collectives/step':>18}{'bytes/step':>12}{'unsharded at peak':>19}"
      f"{'params+unsharded':>18}{'peak':>11}")
for w, out in [*sweep.items(), ("(ddp)", ddp)]:
    o = out[0]
    snap = o["ledger"]["peak_snapshot"]
    n_units = str(len(wrap_targets(GPT("nano", device="meta"), w)) + 1) if w in sweep else "-"
    key = w.strip("()")
    calls_w = glue(f"{key}-collectives", o["calls"][-1]) if key in ("model", "linear") else str(o["calls"][-1])
    held = snap.get("params", 0) + snap.get("unsharded", 0)
    held = glue(f"{key}-params-at-peak", held, "{:,}") if key in ("model", "ddp") else f"{held:,}"
    print(f"{w:<8}{n_units:>6}{calls_w:>18}{o['wire'][-1]:>12,}{snap.get('unsharded', 0):>19,}"
          f"{held:>18}{o['ledger']['peak']:>11,}")
un = {w: out[0]["ledger"]["peak_snapshot"].get("unsharded", 0) for w, out in sweep.items()}
calls = {w: out[0]["calls"][-1] for w, out in sweep.items()}
assert un["model"] == 4 * PSI > un["block"] > un["linear"]       # whole model gathered at once
assert calls["model"] < calls["block"] < calls["linear"]
for w in sweep:                       # U units: 2 gathers each but the root's 1, U reduce-scatters
    U = len(wrap_targets(GPT("nano", device="meta"), w)) + 1
    assert calls[w] == 2 * (U - 1) + 1 + U
assert 4 * PSI // 2 + un["model"] > 4 * PSI                        # more than DDP's own parameters

# %% [markdown]
# And how long a step takes with each: the three wrappings side by side on the same ranks,
# alternating step by step ([`race`](../minishard/course/ch05.py), as in chapter 05), wall-clock
# time and the CPU seconds each rank burned:

# %%
# NBVAL_IGNORE_OUTPUT
out = R2.run(race, {w: {"strategy": "fsdp", "wrap": w} for w in ("model", "block", "linear")},
             model="nano", steps=20, micro_batch=2)
t = {k: [max(a, b) for a, b in zip(out[0][k], out[1][k])] for k in out[0]}     # the slower rank
for w in ("model", "block", "linear"):
    ms = statistics.median(t[w]) * 1e3
    ms = glue(f"{w}-step-ms", ms, "{:.1f}") if w in ("block", "linear") else f"{ms:.1f}"
    print(f"wrap={w:<7} median step {ms:>5} ms wall-clock, "
          f"{statistics.median(t['cpu:' + w]) * 1e3:5.1f} ms CPU; {calls[w]} collectives per step")

# %% [markdown]
# This is the trade-off in numbers. `wrap="model"` gathers the whole model at once: at its peak a
# rank holds its shards *and* a full copy, 1,305,984 bytes of parameters against DDP's 870,656 —
# sharding the parameters saved nothing at the moment that matters (the total peak stays below
# DDP's only because gradients and Adam state are still sharded). With two collectives a step and
# DDP's bytes, it is also the fastest in the timing above. `wrap="linear"` has the smallest peak
# but 41 collectives, so small that their fixed cost dominates: the timing above shows its step
# well above the per-block one (the digits change from run to run on this machine). It also
# sends more bytes than per-block: the head, a Linear, leaves the root and becomes a unit that is
# gathered twice. One unit per block sits between, and is the usual
# choice: a block is large enough that its gather carries real payload, and one gathered block is a
# small fraction of the model.
#
# ## 4. Two layouts of the same unit: flat (FSDP1) and per-parameter (FSDP2)
# FSDP1 concatenates a unit's parameters into one flat buffer and shards that; FSDP2 shards
# every parameter on its own along its first dimension. The mathematics is the same, so training
# is too — bit for bit:

# %%
kw = dict(steps=3, model="nano", micro_batch=2, return_params=True)
per_param = R2.run(train, TrainConfig(strategy="fsdp", **kw))
flat = R2.run(train, TrainConfig(strategy="fsdp_flat", **kw))

# %%
# NBVAL_IGNORE_OUTPUT
def fingerprint(params: dict) -> str:
    flat = torch.cat([p.reshape(-1) for p in params.values()])
    return hashlib.sha256(flat.numpy().tobytes()).hexdigest()[:16]

for name, out in [("per-parameter (fsdp)", per_param), ("flat (fsdp_flat)", flat)]:
    print(f"{name:<22} losses {[round(x, 6) for x in out[0]['losses']]}  params {fingerprint(out[0]['params'])}")

# %% [markdown]
# (The digits and the fingerprint depend on the machine's float kernels; that the two layouts
# agree does not.)

# %%
# NBVAL_CHECK_OUTPUT
print("losses bit-identical in both layouts:", [o["losses"] for o in per_param] == [o["losses"] for o in flat])
print("parameters bit-identical in both layouts:", bitwise_equal(per_param[0]["params"], flat[0]["params"]))
assert [o["losses"] for o in per_param] == [o["losses"] for o in flat]
assert bitwise_equal(per_param[0]["params"], flat[0]["params"])

# %% [markdown]
# Everything *around* the mathematics differs. What `model.named_parameters()` shows on rank 0,
# which is also what an optimizer gets and what `model.state_dict()` — a checkpoint — saves:

# %%
# NBVAL_CHECK_OUTPUT
views = R2.run(layout_views)
v = views[0]
print(f"per-parameter: {glue('per-param-parameters', len(v['per_param']['parameters']))} parameters, the model's own names, "
      f"each a row block of the original:")
for n, shape, dtype in v["per_param"]["parameters"][:6]:
    print(f"    {n:<28}{str(shape):<12}{dtype}")
print(f"    ... ({len(v['per_param']['parameters']) - 6} more)")
print(f"flat: {glue('flat-parameters', len(v['flat']['parameters']))} parameters, one 1-D buffer per unit:")
for n, shape, dtype in v["flat"]["parameters"]:
    print(f"    {n:<28}{str(shape):<12}{dtype}")
print("state_dict keys: per-parameter", len(v["per_param"]["state_dict"]), "| flat", len(v["flat"]["state_dict"]),
      "-> e.g.", v["flat"]["state_dict"][1])
print("elements stored on this rank: per-parameter", v["per_param"]["stored"], "| flat", v["flat"]["stored"],
      "| Ψ/2 =", PSI // 2)
assert len(v["per_param"]["parameters"]) == len(list(NANO.parameters())) and len(v["flat"]["parameters"]) == 4
assert [n for n, _, _ in v["per_param"]["parameters"]] == [n for n, _ in NANO.named_parameters()]
assert v["per_param"]["full_names"] == v["flat"]["full_names"]
assert sorted(v["flat"]["full_names"]) == sorted(n for n, _ in NANO.named_parameters())

# %% [markdown]
# A per-parameter checkpoint is a set of named tensors, each a known row range of a known
# shape: another world size can reslice it by name. A flat checkpoint is four anonymous blobs;
# reading them needs the layout (which parameter starts at which offset, how much padding), so
# FSDP1 converts to full or named state dicts on save. Both gather back the same named full
# parameters (`full_parameters`, the last assert).
#
# **Padding.** Per-parameter sharding pads *each parameter's rows* up to a multiple of N; the
# flat layout pads *each unit's buffer* to a multiple of N. Elements of padding per rank (summed
# over the units), computed from the two layout classes for several world sizes:

# %%
# NBVAL_CHECK_OUTPUT
print(f"{'model':<10}{'N':>5}{'per-parameter: worst rank':>28}{'all ranks':>12}{'flat: worst':>13}{'all ranks':>11}")
for model, N in [("nano", 2), ("nano", 3), ("nano", 8), ("nano", 128), ("tiny", 3), ("tiny", 1024),
                 ("llama3-8b", 1024)]:
    pad = padding_table(model, N)
    psi = GPT(model, device="meta").num_params()
    pp, fl = pad["per_param"], pad["flat"]
    share = (glue(f"{model}-per-param-padding-n{N}", sum(pp) / psi, "{:.2%}")
             if (model, N) in (("nano", 128), ("llama3-8b", 1024)) else f"{sum(pp) / psi:.2%}")
    print(f"{model:<10}{N:>5}{max(pp):>28,}{share:>12}{max(fl):>13,}{sum(fl) / psi:>11.4%}")
    n_units = GPT(model, device="meta").cfg.n_layer + 1
    assert max(fl) <= sum(fl) <= n_units * (N - 1)                 # < N elements per unit
assert views[0]["per_param"]["padding"] == views[1]["per_param"]["padding"] == dict.fromkeys(
    ["root", "blocks.0", "blocks.1", "blocks.2"], 0)                 # N = 2 divides every row count

# %% [markdown]
# The flat layout never wastes more than N − 1 elements per unit. Per-parameter sharding wastes
# nothing while N divides every first dimension, and then grows quickly: each parameter is padded
# to a multiple of N *rows*, so once N exceeds a parameter's row count (a 64-element bias on 128
# ranks) half the ranks store a row of nothing. At N = 128 the nano model's per-parameter shards
# are 37% padding (its flat buffers 0.09%), and the tiny model spread over 1,024 ranks would be
# mostly padding. What matters is rows against N: Llama-3-8B's parameters have thousands of rows,
# and on 1,024 ranks per-parameter sharding pads 0.08% — the price FSDP2 pays for what follows.
#
# **Frozen parameters inside a unit.** Freeze the positional embedding and the first block's
# first norm: both live in units with trainable parameters. The flat buffer has one
# `requires_grad`, so the flat layout refuses — as PyTorch's FSDP1 does with
# `use_orig_params=False`. (With `use_orig_params=True` FSDP1 accepts such a unit, but its flat
# gradient covers the whole flat parameter, so it still keeps gradient memory for the frozen ones.)

# %%
# NBVAL_CHECK_OUTPUT
FREEZE = ("pos_emb", "blocks.0.ln1")
try:
    train(None, TrainConfig(strategy="fsdp_flat", model="nano", steps=1, freeze=FREEZE))
    raise AssertionError("the flat layout should refuse")
except ValueError as e:
    print("fsdp_flat:", e)
    assert "cannot mix frozen and trainable" in str(e)

# %% [markdown]
# The per-parameter layout keeps `requires_grad` per parameter, trains, and matches one process
# that freezes the same parameters (SGD with momentum rather than AdamW, so that the comparison
# can be tight):

# %%
# NBVAL_CHECK_OUTPUT
threads = torch.get_num_threads()
torch.set_num_threads(1)
fkw = dict(model="nano", steps=3, optimizer="sgd_momentum", lr=0.05, freeze=FREEZE, return_params=True)
single_frozen = train(None, TrainConfig(strategy="single", micro_batch=4, **fkw))
torch.set_num_threads(threads)
frozen = R2.run(train, TrainConfig(strategy="fsdp", micro_batch=2, **fkw))
INIT = params_of(GPT("nano", seed=0))                 # the weights every run starts from
frozen_drift = drift(frozen[0]["params"], single_frozen["params"], INIT)
unmoved = all(torch.equal(frozen[0]["params"][k], INIT[k]) for k in INIT if k.startswith(FREEZE))
print(f"per-parameter FSDP with {FREEZE} frozen: every tensor within 0.1% of how far one process "
      f"moved it: {frozen_drift.within(1e-3)}; frozen parameters bit-identical to the initial ones: {unmoved}")
assert frozen_drift.within(1e-3) and unmoved
frozen_n = sum(p.numel() for n, p in NANO.named_parameters() if n.startswith(FREEZE))
assert frozen[0]["ledger"]["final"]["grads"] == 4 * (PSI - frozen_n) // 2   # no gradient shards for them

# %% [markdown]
# **Mixed dtypes inside a unit.** Keep the first block's norms in fp32 and cast its Linears to
# bf16 (a common recipe). Per-parameter: each shard keeps its own dtype, and a gather gives back
# every value exactly. Flat: one buffer, one dtype — refused.

# %%
# NBVAL_CHECK_OUTPUT
md = R2.run(mixed_dtypes)[0]
dtypes = {}
for fqn, (dtype, shape) in md["per_param"]["shards"].items():
    dtypes.setdefault(dtype, []).append(fqn)
for dtype, names in dtypes.items():
    print(f"per-parameter, {dtype} shards: {', '.join(names)}")
print("per-parameter gather gives back every value exactly:", md["per_param"]["gather_exact"])
print("flat:", md["flat"]["error"][:60] + " ... " + md["flat"]["error"][-30:])
assert set(dtypes) == {"float32", "bfloat16"} and md["per_param"]["gather_exact"]
assert "one dtype per unit" in md["flat"]["error"]

# %% [markdown]
# ## 5. `reshard_after_forward=False`: less traffic, more memory
# If the blocks keep their full parameters from forward to backward, the backward all-gathers
# disappear: one gather and one reduce-scatter per unit, DDP's 2(N−1)/N·Ψ elements
# (2(N−1)/N·4Ψ bytes). The price is holding
# the whole model gathered at the end of forward.

# %%
# NBVAL_CHECK_OUTPUT
keep = R2.run(train, TrainConfig(strategy="fsdp", steps=2, model="nano", micro_batch=2, reshard_after_forward=False))
print(f"{'':<30}{'collectives':>12}{'bytes/step':>12}{'unsharded at peak':>19}{'peak':>11}")
for name, key, out in [("reshard_after_forward=True", "reshard", sweep["block"]),
                       ("reshard_after_forward=False", "keep", keep), ("(ddp)", "ddp", ddp)]:
    o = out[0]
    sent, peak = o["wire"][-1], o["ledger"]["peak"]
    sent = glue(f"{key}-bytes-per-step", sent, "{:,}")
    gathered = o["ledger"]["peak_snapshot"].get("unsharded", 0)
    gathered = glue("keep-unsharded-at-peak", gathered, "{:,}") if key == "keep" else f"{gathered:,}"
    peak = glue(f"{key}-peak-bytes", peak, "{:,}") if key != "ddp" else f"{peak:,}"
    print(f"{name:<30}{o['calls'][-1]:>12}{sent:>12}{gathered:>19}{peak:>11}")
assert keep[0]["wire"][-1] == ddp[0]["wire"][-1] == 2 * (2 - 1) * 4 * PSI // 2    # DDP's volume
assert keep[0]["wire"][-1] < sweep["block"][0]["wire"][-1]
assert keep[0]["ledger"]["peak_snapshot"]["unsharded"] == 4 * PSI                   # everything gathered
assert keep[0]["ledger"]["peak"] > sweep["block"][0]["ledger"]["peak"]

# %% [markdown]
# Between steps the state is still 1/N (the parameters rest sharded), so this is neither DDP nor
# textbook ZeRO-3: PyTorch FSDP1 calls it `SHARD_GRAD_OP`, often described as "ZeRO-2 with
# sharded parameters at rest".
#
# ### Gradient accumulation, three ways
# With several micro-batches per optimizer step the same trade comes back, between the
# micro-batches. `TrainConfig(accumulation=...)`, for FSDP and ZeRO-2:
#
# * `sync`: reduce-scatter every micro-batch; only the gradient shards accumulate. The default
#   of PyTorch's FSDP2 (`set_requires_gradient_sync(True)`), of torchtitan, and of DeepSpeed's
#   ZeRO-2 and ZeRO-3, whose engine refuses `no_sync` because it keeps only its partition.
# * `no_sync`: no reduction until the last micro-batch (FSDP2's `set_requires_gradient_sync(False)`,
#   DDP's `no_sync`): every full gradient stays resident — the report (tnt#1057) whose kept gradients grew from a
#   3.25 GB shard to the whole 52 GB a rank.
# * `gathered` (FSDP): the units stay gathered from one micro-batch's backward to the next one's
#   forward (FSDP2's `set_reshard_after_backward(False)`): the next forward gathers nothing, and
#   every unit's full parameters are held in between.
#
# Three micro-batches on the two ranks, one optimizer step, measured from the trace:

# %%
# NBVAL_CHECK_OUTPUT
from minishard.core.trace import LedgerTimeline


def accumulation_run(strategy, mode):
    out = R2.run(train, TrainConfig(strategy=strategy, steps=1, model="nano", micro_batch=2, accum=3,
                                    accumulation=mode))
    ev = [e for e in R2.last_events if e["rank"] == 0]
    tl = LedgerTimeline.build(ev)
    peak = {c: int(tl.bytes[:, 0, i].max()) for i, c in enumerate(tl.categories)}
    return out[0]["wire"][0], peak, ev


acc = {(s, m): accumulation_run(s, m) for s, m in
       [("fsdp", "sync"), ("fsdp", "no_sync"), ("fsdp", "gathered"), ("zero2", "sync"), ("zero2", "no_sync")]}
print(f"{'':<18}{'bytes sent/step':>16}{'peak gradients':>16}{'peak gathered params':>22}")
for (s, m), (sent, peak, _) in acc.items():
    cells = [glue(f"acc-{s}-{m.replace('_', '-')}-{k}", v, "{:,}") for k, v in
             (("sent", sent), ("grads", peak["grads"]), ("unsharded", peak.get("unsharded", 0)))]
    print(f"{s + ' ' + m:<18}{cells[0]:>16}{cells[1]:>16}{cells[2]:>22}")
ev = acc["fsdp", "sync"][2]
ag_units = {e["tag"]: e["payload"] for e in ev if e["kind"] == "collective" and e["op"] == "all_gather" and e.get("step") == 0}
rs = sum(e["payload"] for e in ev if e["kind"] == "collective" and e["op"] == "reduce_scatter" and e.get("step") == 0) // 3
ag, ag_blk = sum(ag_units.values()), sum(v for u, v in ag_units.items() if u != "root")
half = lambda n: n // 2                                      # a ring on 2 ranks sends half  # noqa: E731
assert acc["fsdp", "sync"][0] == 3 * half(ag + ag_blk + rs)
assert acc["fsdp", "no_sync"][0] == 3 * half(ag + ag_blk) + half(rs)
assert acc["fsdp", "gathered"][0] == half(ag) + 3 * half(ag_blk) + 3 * half(rs)
assert acc["fsdp", "no_sync"][1]["grads"] == acc["fsdp", "no_sync"][1]["params"] + 4 * PSI   # every full gradient
assert acc["fsdp", "gathered"][1]["unsharded"] == 4 * PSI                                   # every unit gathered
assert acc["zero2", "no_sync"][1]["grads"] == acc["zero2", "sync"][1]["grads"] + 4 * PSI     # in its buckets
print("every mode: bytes and peaks as the formulas say")

# %% [markdown]
# Per step with A micro-batches (ag: the bytes one micro-batch all-gathers, ag_blk the blocks'
# part of them; rs: the bytes it reduce-scatters; a ring on N ranks sends (N − 1)/N of each):
# `sync` sends A·(ag + ag_blk + rs), `no_sync` A·(ag + ag_blk) + rs, `gathered` ag + A·ag_blk + A·rs
# — in fp32, where rs = ag, the last two move
# the same bytes and differ only in what they hold: every full gradient (4Ψ on top of the shards'),
# or every full parameter (4Ψ gathered at once). ZeRO-2 reduces A·rs + ag under `sync` and rs + ag
# under `no_sync`, for every full gradient held in its buckets. `tests/test_accumulation.py`
# checks the three modes against one large batch and these formulas on 2 and 3 ranks.
#
# ## 6. Parity: one process and PyTorch's FSDP2
# One process on the whole global batch (4 sequences) is the reference; PyTorch's own
# `fully_shard` on the same two ranks (one unit per block plus the root, as ours) the second
# oracle.

# %%
# NBVAL_CHECK_OUTPUT
torch.set_num_threads(1)
single = train(None, TrainConfig(strategy="single", steps=3, model="nano", micro_batch=4, return_params=True))
torch.set_num_threads(threads)
theirs = R2.run(train, TrainConfig(strategy="torch_fsdp", **kw))
mean_loss = [sum(o["losses"][s] for o in per_param) / 2 for s in range(3)]
fsdp_drift = drift(per_param[0]["params"], single["params"], INIT)
print("losses vs single process : within 1e-6 (relative) at every step:",
      all(abs(a - b) <= 1e-6 * abs(b) for a, b in zip(mean_loss, single["losses"])))
print("params vs single process : every tensor within 0.1% of its movement:", fsdp_drift.within(1e-3))
print("losses and params vs torch FSDP2: bitwise equal:",
      [o["losses"] for o in per_param] == [o["losses"] for o in theirs]
      and bitwise_equal(per_param[0]["params"], theirs[0]["params"]))
assert all(abs(a - b) <= 1e-6 * abs(b) for a, b in zip(mean_loss, single["losses"]))
assert fsdp_drift.within(1e-3)
assert [o["losses"] for o in per_param] == [o["losses"] for o in theirs]
assert bitwise_equal(per_param[0]["params"], theirs[0]["params"])

# %%
# NBVAL_IGNORE_OUTPUT
print("single-process loss      :", [f"{x:.6f}" for x in single["losses"]])
print("minishard FSDP (mean)    :", [f"{x:.6f}" for x in mean_loss])
print(f"params vs single process : largest element gap {fsdp_drift.max_abs:.1e}, "
      f"worst tensor's gap / its movement {fsdp_drift.worst:.1e} ({fsdp_drift.worst_tensor})")

# %% [markdown]
# ## 7. Beside PyTorch's FSDP2, event by event
# Parity says the two FSDPs end with the same bits. This section shows how each gets there.
# `minishard.watch` records PyTorch's own `fully_shard` job in minishard's trace — two lines in
# any training script (README, "Your own PyTorch job") — and `train` runs the `torch_fsdp`
# strategy under it. Both runs: the nano model, a unit per block plus the root, fp32, prefetch 1
# (FSDP2 gets the same schedule on its explicit prefetch lists), two steps. One slider moves both
# players to the same step and phase; in between, each plays its own events.
#
# <details><summary>中文</summary>
#
# 逐位比对（parity）只说明两个 FSDP 的训练结果逐位相同。这一节看它们各自是怎么走到那里的。
# `minishard.watch` 把 PyTorch 自己的 `fully_shard` 作业记进 minishard 的 trace——任何训练脚本里加两行
# 就行（README 的 “Your own PyTorch job”）——`train` 跑 `torch_fsdp` 策略时就套着它。两边都是：nano
# 模型，每个 block 一个单元再加 root，fp32，预取（prefetch）1（FSDP2 通过它显式的预取列表得到同样的
# 调度），两步。一个滑块把两个回放器同时拨到同一步的同一个阶段；两个时刻之间，各自播放
# 自己的事件。
#
# </details>

# %%
# NBVAL_IGNORE_OUTPUT
from minishard.course import side_by_side as sbs
from minishard.viz import PlayerPair

SBS = dict(model="nano", steps=2, micro_batch=2, prefetch=1)
ours, fsdp2 = sbs.traces(R2, "fsdp", "torch_fsdp", **SBS)
pair = PlayerPair(ours, fsdp2, titles=("minishard fully_shard", "PyTorch FSDP2 fully_shard (watched)"))
pair.show("backward", step=1)
display(pair.widget)

# %% [markdown]
# Rank 0, step 1, compared event by event (`minishard.course.side_by_side`; the test that
# asserts every row is `tests/test_side_by_side.py`): the collectives, each unit's lifecycle, the
# units' states interleaved in forward (where a prefetch shows), and each memory category's peak.

# %%
# NBVAL_CHECK_OUTPUT
t = sbs.compare_fsdp(ours, fsdp2, rank=0, step=1)
same = sum(r["difference"] == "same" for r in t["collectives"])
print(f"collectives (op, unit, bytes, dtype) in issue order: {glue('sbs-collectives-same', same)} "
      f"of {glue('sbs-collectives', len(t['collectives']))} the same")
print("units' states in forward, all units interleaved, the same:",
      sbs.interleaving(ours) == sbs.interleaving(fsdp2))
print("each unit's lifecycle (FSDP2's where it differs):")
for r in t["lifecycle"]:
    print(f"  {r['unit']:<9} {' '.join(r['mine']):<70} "
          + ("same" if r["difference"] == "same" else f"FSDP2: ... {' '.join(r['theirs'][-2:])}  ({r['difference']})"))
peak = {(r["category"], r["phase"]): r for r in t["peaks"]}
named = {("unsharded", "all"): ("sbs-unsharded-peak", None),          # the figures the chapter quotes
         ("comm_buffers", "forward"): ("sbs-ag-buffers-ours", "sbs-ag-buffers-fsdp2"),
         ("grads", "backward"): ("sbs-grads-ours", "sbs-grads-fsdp2"),
         ("activations", "optimizer"): (None, "sbs-ids-held")}
print("\npeak bytes, rank 0, step 1      minishard      FSDP2")
for c, ph in (("params", "all"), ("unsharded", "all"), ("exp_avg", "all"), ("activations", "forward"),
              ("comm_buffers", "forward"), ("comm_buffers", "backward"), ("grads", "backward"),
              ("activations", "optimizer")):
    r, names = peak[(c, ph)], named.get((c, ph), (None, None))
    a, b = (glue(n, r[k], "{:,}") if n else f"{r[k]:,}" for n, k in zip(names, ("mine", "theirs")))
    print(f"  {c + ' (' + ph + ')':<28}{a:>12}{b:>12}")
assert same == len(t["collectives"]) and sbs.interleaving(ours) == sbs.interleaving(fsdp2)
assert all(r["difference"] in ("same", "reshard_before_reduce_scatter") for r in t["lifecycle"])
for c in ("params", "unsharded", "exp_avg", "exp_avg_sq"):
    assert peak[(c, "all")]["mine"] == peak[(c, "all")]["theirs"]
assert peak[("activations", "forward")]["mine"] == peak[("activations", "forward")]["theirs"]

# %% [markdown]
# Everything that moves on the wire is the same: every all-gather and reduce-scatter, in the same
# order, with the same bytes; the units change state in the same interleaving; the shards, the
# gathered parameters (at most the root and one block: 470,784 bytes), the optimizer's moments
# and the activations peak at the same byte. Four differences remain, each one a choice the two
# implementations make (the full table, with each formula and where in torch's source it comes
# from: [docs/side-by-side.md](../docs/side-by-side.md)):
#
# - **FSDP2 reshards before it reduce-scatters** (`reshard_before_reduce_scatter`): it takes the
#   gradients out of the gathered parameters and frees them first; minishard's unit keeps its
#   parameters gathered until its reduce-scatter is issued, then reshards.
# - **FSDP2 frees a forward all-gather's buffer one unit late** (`deferred_all_gather_free`):
#   it keeps each unit's all-gather output until the next unit has copied its parameters out,
#   so that on a GPU the copy overlaps the next all-gather — two buffers at once in forward.
# - **minishard keeps one reduce-scatter in flight** (`reduce_scatter_in_flight`): the previous
#   unit's reduced slice is still arriving while the next unit's gradients are computed; on
#   gloo, FSDP2's reduce-scatter is synchronous (on a GPU it overlaps too, on its own stream).
# - **The watch keeps the batch's token ids and targets until the step ends**: the caller holds
#   them; minishard's ledger drops a saved tensor when autograd lets go of it.
#
# <details><summary>中文</summary>
#
# 网络上传的一切都相同：每一次 all-gather 和 reduce-scatter，顺序一样，字节一样；各单元状态交错的次序
# 一样；分片、收集起来的参数（至多 root 加一个 block：470,784 字节）、优化器的两个矩和激活值，峰值
# 精确到字节都相同。剩下四处不同，每一处都是两种实现各自的选择（完整的表、每条公式、出自 torch 源码
# 何处：[docs/side-by-side.md](../docs/side-by-side.md)）：
#
# - **FSDP2 先 reshard 再 reduce-scatter**：它先把梯度从收集起来的参数里取走、释放参数；minishard 的
#   单元则保持参数收集状态直到发出 reduce-scatter，之后才 reshard。
# - **FSDP2 晚一个单元才释放前向 all-gather 的缓冲区**：它留着每个单元的 all-gather 输出，直到下一个
#   单元把参数拷出，这样在 GPU 上拷贝能和下一次 all-gather 重叠——前向时同时有两块缓冲区。
# - **minishard 让一个 reduce-scatter 在途**：下一个单元算梯度时，上一个单元归约后的那一片还在到达；
#   在 gloo 上 FSDP2 的 reduce-scatter 是同步的（GPU 上它也在自己的 stream 上重叠）。
# - **watch 把这一批的 token id 和目标一直记到这一步结束**：调用方还持有它们；minishard 的账本在
#   autograd 放手时就把保存的张量记为释放。
#
# </details>

# %%
R2.close()

# %% [markdown]
# ## 8. So: are ZeRO-3 and FSDP the same thing?
# Not quite, and this notebook holds the evidence. **ZeRO-3 is a partitioning of the training
# state**: every rank stores 1/N of the parameters, gradients and optimizer state, and parameters
# are gathered for use (chapter 05: 16Ψ/N bytes of state, 3(N−1)/N·Ψ elements on the wire).
# **FSDP is PyTorch's
# implementation framework** around that idea — units, a lifecycle driven by module hooks, wrap
# policies, layouts, reshard and prefetch options — and its settings reach well beyond stage 3:
#
# | FSDP setting (measured above) | what it behaves like |
# |---|---|
# | one unit per block, `reshard_after_forward=True` | ZeRO-3 (with the root kept gathered: 1,170,560 bytes a step against DDP's 870,656, 1.34×, not 1.5×) |
# | `reshard_after_forward=False` | DDP's traffic, sharded only at rest (`SHARD_GRAD_OP`, "ZeRO-2-like") |
# | `wrap="model"` | the whole model gathered at once: at the peak, more parameter memory than DDP |
# | flat (FSDP1) vs per-parameter (FSDP2) | the same bits; different parameters, checkpoints, frozen and dtype support |
#
# And DeepSpeed's ZeRO-3 is a different implementation of the same stage, with its own
# parameter-level hooks, prefetch and bucketing. Same goal, different machinery: related, not
# synonyms.
#
# > **Takeaway.** An FSDP unit lives through gather → forward → free → gather → backward →
# > reduce-scatter → free every step; `manual=True` lets you make each call yourself, and the
# > hooks make exactly the same calls (same collectives, same bits). Its storage trick: freeing a
# > full parameter's *storage* while autograd keeps the tensor, and refilling it for backward.
# > Wrap per block: one unit for the model gathers everything (no saving at the peak), one per
# > Linear multiplies the collectives. FSDP1's flat buffer and FSDP2's per-parameter shards train
# > identically, but only per-parameter sharding keeps names, `requires_grad` and dtype per
# > parameter. ZeRO-3 names what is sharded; FSDP is one framework that does it, among other
# > things.
#
# <details><summary>中文</summary>
#
# > **要点。** FSDP 单元每步都走一遍 gather → 前向 → 释放 → gather → 反向 → reduce-scatter → 释放；
# > `manual=True` 让你亲手发起每次调用，hook 发起的调用完全相同（同样的集合通信，结果逐位相同）。关键技巧：
# > 在 autograd 仍持有张量时释放完整参数的*存储*，反向前再填回来。按 block 包裹：整个模型一个单元会收集
# > 全部参数（峰值时一点没省），每个 Linear 一个单元则让集合通信成倍增加。FSDP1 的扁平缓冲区和 FSDP2 的
# > 逐参数分片训练结果完全一样，但只有逐参数分片能按参数保留名字、`requires_grad` 和 dtype。ZeRO-3 说的是
# > 什么被分片；FSDP 是实现它的一种框架，能做的还不止这些。
#
# </details>
#
# **Questions**
#
# 1. Why does `reshard()` free the storage of the full parameter instead of deleting the tensor?
#
# <details><summary>Answer</summary>
#
# Autograd saved a reference to that tensor during forward (a Linear saves its weight for the
# gradient of its input). Deleting our reference would not free the memory — autograd's would
# keep it alive, and stage 3 would save nothing. Shrinking the storage to zero bytes frees the
# memory under both references; re-growing and refilling it before backward hands autograd the
# same object with the right values.
# </details>
#
# 2. A model has a 50k × 4096 embedding and a tied output head. Where should the tied weight go
# when you wrap per block?
#
# <details><summary>Answer</summary>
#
# In one unit together with *every* module that uses it — here the root, which holds both the
# embedding and the head. If the head were its own unit, two units would own one tensor;
# minishard refuses that ("shared with unit"), and PyTorch's FSDP needs the same care.
# </details>
#
# 3. You switch a job from FSDP1 to FSDP2 and your checkpoint loader breaks. Why, given that
# training is bitwise identical?
#
# <details><summary>Answer</summary>
#
# The loader read what the model exposes: under FSDP1 per-unit `_flat_param` blobs (or the
# converted full/named dicts), under FSDP2 the original parameter names with row-sharded values.
# The numbers agree; the names, shapes and sharding metadata in the files do not.
# </details>

# %% [markdown]
# ## Exercise: the lifecycle by hand
# The units below are made with `fully_shard(..., manual=True)`: nothing is gathered or freed
# unless you say so. Write one training step calling `unshard()`, `reshard()` and
# `reduce_scatter_grads()` yourself. The check runs it on 1 and 2 real ranks next to
# `minishard.course.ch06.manual_step`, compares the loss and every gradient shard, counts the collectives, and
# checks that every block is already freed when forward reaches the final norm. The function is
# sent to the ranks as source: keep it self-contained.
#
# Write it in the cell below (or edit the stub in
# [`minishard/course/exercises/ch06.py`](../minishard/course/exercises/ch06.py)), then run the check. A
# reference solution is in [`solutions/ch06.py`](../solutions/ch06.py): try first.
#
# <details><summary>中文</summary>
#
# **练习：手动走一遍生命周期。** 下面的单元用 `fully_shard(..., manual=True)` 创建：你不调用，就什么也不会
# 收集或释放。自己调用 `unshard()`、`reshard()` 和 `reduce_scatter_grads()`，写出训练的一步。检查程序在
# 1 个和 2 个真实 rank 上把它与 `minishard.course.ch06.manual_step` 并排运行，比较 loss 和每个梯度分片，
# 统计集合通信次数，并检查前向到达最后的 norm 时每个 block 都已释放。函数以源码形式发到各 rank，所以要
# 自包含。写在下面的单元格里（或编辑 `minishard/course/exercises/ch06.py` 里的桩函数），再运行检查；参考
# 答案在 `solutions/ch06.py`，先自己试。
#
# </details>

# %%
def manual_step(model, idx, targets):
    """One step; return the loss (detached). root = model._fsdp_unit (embeddings, ln_f, head);
    model.blocks[i]._fsdp_unit (block i). Forward: x = model.tok_emb(idx) + model.pos_emb.weight[:T],
    the blocks, model.head(model.ln_f(x)), cross-entropy against targets."""
    raise NotImplementedError("your code here")

# %%
# NBVAL_CHECK_OUTPUT
from minishard.course.exercises import ch06

ch06.check_manual_step(manual_step)
