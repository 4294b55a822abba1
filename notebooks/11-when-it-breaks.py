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
# # 11 · When it breaks: hangs, desyncs, and memory that did not drop
#
# > **The job hangs, the ranks quietly disagree, or memory did not drop: which rank, which
# > collective, which line — and what do you change?**
#
# The questions people ask most about sharded training are not "how does ZeRO work" but "why
# does it hang", "why didn't memory drop", "why do the ranks disagree". This chapter plants the
# failures behind those questions on four real ranks — one at a time, each the way it happens
# in practice — reads what the ranks left behind with `minishard doctor`, applies the fix the
# doctor names, and runs the job again until the doctor finds nothing. Where PyTorch's own
# strategies fail the same way, their run is next to minishard's. The reasoning is in
# [tutorial/11-when-it-breaks.md](../tutorial/11-when-it-breaks.md).
#
# <details><summary>中文</summary>
#
# > **作业卡住了、各 rank 悄悄算得不一样了、显存没降下来：是哪个 rank、哪次集合通信、哪一行代码——该改什么？**
#
# 关于分片训练，大家问得最多的不是"ZeRO 怎么工作"，而是"为什么卡住""为什么显存没降""为什么各 rank
# 不一致"。本章在四个真实的 rank 上把这些问题背后的故障一个一个地造出来（照它们在实际中发生的样子），
# 用 `minishard doctor` 读各 rank 留下的文件，按诊断工具给出的修法改掉，再跑一遍，直到它什么也找不到。
# 凡是 PyTorch 自己的策略也会这样出错的地方，都同时跑一遍 PyTorch 的版本，与 minishard 的结果对照。中文讲解见
# [tutorial/zh/11-when-it-breaks.md](../tutorial/zh/11-when-it-breaks.md)。
#
# </details>
#
# **The one-line "syntax"** — the contract every rank of a group keeps, collective by collective:
#
# $$\text{collective}_i(\text{rank } r) = \text{collective}_i(\text{rank } 0)\quad\text{for every } i \text{ and } r:
# \text{ same op, shapes, dtypes, and the same tensor}$$
#
# plus three things the collectives do not check: the same starting weights, one global gradient
# norm, and an fp32 master for the optimizer to step. Every rank keeps a **flight recorder** of
# its last collectives; `python -m minishard doctor DIR` lines the ranks' recorders up by
# collective number and names the first place the contract broke.
#
# <details><summary>中文</summary>
#
# **一行"语法"**：同一组里的每个 rank 都遵守同一份约定——第 i 次集合通信在每个 rank 上都是同一个：
# 同样的操作、形状、dtype，搬的是同一个张量。还有三件集合通信本身不检查的事：起点权重相同、
# 梯度按一个全局范数裁剪、优化器更新的是 fp32 主权重。每个 rank 都保留一份记录最近若干次集合通信的
# 飞行记录器（flight recorder）；`python -m minishard doctor DIR` 按集合通信的序号把各 rank 的记录对齐，
# 指出约定第一次被打破的地方。
#
# </details>
#
# Terms, in English and Chinese: [glossary · 术语表](../tutorial/glossary.md).

# %%
import contextlib
import io
import json
import shutil
import tempfile
from pathlib import Path

import torch

from minishard import GPT, RankError, Ranks
from minishard.instruments import doctor
from minishard.core.trace import read_events
from minishard.cli import main as minishard_cli
from minishard.course.ch11 import broken, doctor_text, drifting, outcome, stable, summary, verdict
from minishard.course.glue import glue
from minishard.viewers.playback import fmt_bytes

RUNS = Path(tempfile.mkdtemp(prefix="ch11-"))      # each run leaves its flight dumps and traces here
NANO = GPT("nano", device="meta").num_params()
R4 = Ranks(4)                                      # one warm pool for every run that does not hang


def run(name: str, **knobs) -> list[dict]:
    """The nano GPT, 2 steps of 2 sequences per rank, on the 4 warm ranks; its files in runs/NAME."""
    return R4.run(broken, str(RUNS / name), **knobs)


def show(name: str, full: bool = True) -> doctor.Report:
    """What `python -m minishard doctor runs/NAME` prints (``full``), or its findings in a line each."""
    report = doctor.diagnose(RUNS / name)
    lines = doctor_text(RUNS / name, f"runs/{name}") if full else [summary(f) for f in report.findings]
    print("\n".join(lines or [verdict(RUNS / name, f"runs/{name}")]))
    return report


print(f"nano GPT: Ψ = {NANO:,} parameters; 4 ranks, 2 steps of 2 sequences per rank")

# %% [markdown]
# ## 1. The flight recorder, and a run with nothing to find
# Every collective minishard issues goes through its communicator (`minishard/core/comm.py`), which
# enters it in the rank's **flight recorder** (`minishard/core/flight.py`): a ring of the last 256
# collectives — per group a sequence number `seq`, the op, the shapes and dtypes, the bytes,
# what it moves (the unit or bucket), the step and phase, the line that issued it, and whether
# it completed. With `TrainConfig(flight_dir=DIR)` the ring lives in a file from the first
# collective on, `flight_rank{r}.ring`, each entry written as it is issued (§9 shows why), and the
# whole recorder is also written as `flight_rank{r}.json` at the end of the run, when the rank
# raises, and on SIGTERM. PyTorch keeps the same kind of ring for NCCL
# (its Flight Recorder), and its `torchfrtrace` script reads the dumps; `minishard.watch`
# records PyTorch's own DDP and FSDP2 collectives into minishard's recorder, so the doctor reads
# both alike.
#
# A healthy DDP run first: rank 0's recorder, entry by entry.

# %%
# NBVAL_CHECK_OUTPUT
healthy = run("ddp", strategy="ddp")
dump = json.loads((RUNS / "ddp" / "flight_rank0.json").read_text())
print(f"runs/ddp/flight_rank0.json: {len(dump['entries'])} collectives (a ring of {dump['capacity']}), "
      f"written at the {dump['reason']} of the run")
print(f"{'seq':>3}  {'op':<11}{'of':<10}{'shape':<10}{'dtype':<9}{'bytes':>9}{'step':>6}  {'phase':<10}{'state':<11}issued at")
for e in dump["entries"]:
    print(f"{e['seq']:>3}  {e['op']:<11}{e['tag']:<10}{str(e['shapes'][0]):<10}{e['dtypes'][0]:<9}{e['bytes']:>9,}"
          f"{str(e['step']):>6}  {str(e['phase']):<10}{e['state']:<11}{stable(e['where'])}")
print("beside them, the facts the doctor compares:", ", ".join(sorted(dump["facts"])))
report = show("ddp")
assert [e["seq"] for e in dump["entries"]] == [0, 1, 2] and not report.findings
assert all(e["bytes"] == 4 * NANO for e in dump["entries"])       # the whole model, fp32, each time

# %% [markdown]
# Three collectives: DDP's broadcast of rank 0's weights at the start, then one gradient
# all-reduce per step (the nano model's 850 KiB fit in one 25 MiB bucket). Beside the entries,
# the facts the collectives cannot tell: the run's config, a fingerprint (a hash) of every
# parameter as the rank built it and as training started from it, each step's dtypes and
# gradient norm, and — every `fingerprint_every` steps and after the last — the replicas'
# fingerprints with the optimizer's settings and step count (§4). The doctor compares the four ranks' recorders seq by seq, then the facts, then
# the ledger in the traces, and finds nothing — the baseline every fix below must get back to.
#
# ## 2. A rank that skips a collective: the hang
# A LoRA job (small trainable low-rank matrices beside frozen base weights) hangs under PyTorch's
# first FSDP (konstmish/prodigy#35): FSDP1 shards a unit's flattened parameters, so one rank's
# shard can hold only frozen weights; the optimizer returns early there, before an all-reduce
# every other rank issues, and they wait in it forever. Under DDP every rank holds every
# parameter, so that exact cause cannot occur — but any rank-dependent exit before a collective
# does the same, and `fault="skip-collective"` plants one on rank 1 of DDP: it skips the gradient
# reduction of the last step. Waiting "forever" means until the process group's timeout —
# minutes in a real job; here a pool whose collectives give up after 3 s.
# [`outcome`](../minishard/course/ch11.py) hands each rank's error back as data, after its flight
# dump is written, so that every rank reports.

# %%
# NBVAL_CHECK_OUTPUT
with Ranks(4, collective_timeout=3) as hung:                 # a hang ends in 3 s instead of minutes
    ends = hung.run(outcome, str(RUNS / "hang"), strategy="ddp", fault="skip-collective")
for r, o in enumerate(ends):
    print(f"rank {r}: " + ("finished its 2 steps" if o["finished"] else
                           f"{o['error'].split(':')[0]}, gave up waiting in a collective "
                           f"(timed out, or its peer went away): {bool(doctor.TIMED_OUT.search(o['error']))}"))
assert [o["finished"] for o in ends] == [False, True, False, False]

# %% [markdown]
# Rank 1 — the one with the bug — is the only rank that finished. What the others report is a
# timeout (or a connection their peer closed as it gave up), which says nothing about the
# cause. The doctor, from the four dumps:

# %%
# NBVAL_CHECK_OUTPUT
report = show("hang")
hang, timed_out = report.findings
assert (hang.kind, hang.ranks, timed_out.kind, timed_out.ranks) == ("hang", [1], "timeout", [0, 2, 3])
print(f"\nthe seq rank 1 never issued: {glue('hang-seq', int(hang.title.split('seq ')[1].split()[0]))}")

# %% [markdown]
# The finding names the rank (1), the collective it never issued (seq 2 of the world group, the
# all-reduce of `bucket0` in step 1's backward), where the others wait, and rank 1's last
# collective; the timeouts come second, as the consequence they are: where each rank waited, and
# for how long (that, and whether a rank's own wait ran out or a peer that gave up first closed
# the connection, depend on timing and show as `…` above; `minishard doctor --verbose` adds
# gloo's own message, which names ports and source paths of this machine). The fix is the
# doctor's: every rank issues every collective, even one with nothing to send; without the skip
# the run is §1's healthy one. Frozen parameters were never the problem: with the embedding
# frozen on *every* rank, as a LoRA job freezes its base weights, DDP buckets the same trainable
# parameters everywhere and every rank reduces them:

# %%
# NBVAL_CHECK_OUTPUT
frozen = run("frozen", strategy="ddp", freeze=("tok_emb",))
print(verdict(RUNS / "frozen", "runs/frozen"), "— tok_emb frozen on every rank")
print(f"bytes each rank sent per step: {frozen[0]['wire'][-1]:,}, against {healthy[0]['wire'][-1]:,} with nothing frozen")
trainable = NANO - GPT("nano", device="meta").tok_emb.weight.numel()
assert not doctor.diagnose(RUNS / "frozen").findings
assert healthy[0]["wire"][-1] == 2 * 3 * 4 * NANO // 4               # a ring all-reduce: 2(N-1)/N of 4Ψ
assert frozen[0]["wire"][-1] == 2 * 3 * 4 * trainable // 4            # ... of the trainable parameters only

# %% [markdown]
# ## 3. Collectives in different orders: the silent desync
# A collective is matched across ranks by its position in the sequence, not by its name. If
# rank 1 gathers `blocks.1` before `blocks.0` while the others gather `blocks.0` first — a
# prefetch list built in another order, parameters registered in another order — and the two
# units are the same size, every all-gather finds a partner of the right size: nothing fails,
# nothing hangs, and every rank computes with a mix of two blocks' shards. `fault="reorder"`
# plants it on rank 1 of minishard's FSDP:

# %%
# NBVAL_CHECK_OUTPUT
ours = run("reorder", strategy="fsdp", fault="reorder")
report = show("reorder")
right = run("fsdp", strategy="fsdp")
print()
print(verdict(RUNS / "fsdp", "runs/fsdp"), "— the same job, every rank gathering in order")
differ = any(abs(a - b) > 1e-4 for o, w in zip(ours, right) for a, b in zip(o["losses"], w["losses"]))
print(f"the reordered run's losses differ from the right order's (by more than 1e-4): {differ}")
(f,) = report.findings
assert (f.kind, f.ranks) == ("desync", [1]) and differ
assert any("nothing failed" in e for e in f.evidence) and not doctor.diagnose(RUNS / "fsdp").findings

# %% [markdown]
# The doctor lines the four recorders up and stops at the first seq where they disagree. Op,
# shape, dtype and bytes all agree there — that is why nothing failed — but what the collective
# moves does not: `blocks.1` on rank 1, `blocks.0` elsewhere. Everything after that seq is the
# desync's consequence, so it says no more. PyTorch's FSDP2 fails the same way: the same
# swapped prefetch list, set with its own `set_modules_to_forward_prefetch`, recorded by
# `minishard.watch` around its all-gathers:

# %%
# NBVAL_CHECK_OUTPUT
theirs = run("torch-reorder", strategy="torch_fsdp", fault="reorder")
report = show("torch-reorder", full=False)
run("torch-fsdp", strategy="torch_fsdp")
print(verdict(RUNS / "torch-fsdp", "runs/torch-fsdp"), "— FSDP2 gathering in order")
same = all(abs(a - b) <= 1e-5 for o, t in zip(ours, theirs) for a, b in zip(o["losses"], t["losses"]))
print(f"FSDP2's reordered run computed the same wrong losses as minishard's (within 1e-5): {same}")
(f,) = report.findings
assert (f.kind, f.ranks) == ("desync", [1]) and same and not doctor.diagnose(RUNS / "torch-fsdp").findings

# %% [markdown]
# The seq differs (FSDP2 does not broadcast at the start, so its first block's all-gather is
# seq 1 where minishard's is seq 5), the finding does not. The fix is the same for both: build
# every rank's units, buckets and prefetch lists from the same, rank-independent order.
#
# ## 4. Ranks that start from different weights
# Data parallelism averages gradients; it never compares weights. Ranks that start from
# different weights stay different: each applies the same averaged update to its own model.
# DDP avoids it by broadcasting rank 0's weights in its constructor. `fault="unsynced-init"`
# builds rank 1 from another seed and skips that broadcast. The doctor reads the fingerprints
# each rank noted at the first step; `return_params=True` shows what two steps did with them:

# %%
# NBVAL_CHECK_OUTPUT
apart = run("unsynced-ddp", strategy="ddp", fault="unsynced-init", return_params=True)
report = show("unsynced-ddp")
synced = run("ddp-own-seeds", strategy="ddp", rank_seeds=True, return_params=True)
print()
print(verdict(RUNS / "ddp-own-seeds", "runs/ddp-own-seeds"), "— every rank built from its own seed, DDP's broadcast kept")


def replicas_equal(out) -> bool:
    return all(torch.equal(o["params"][n], out[0]["params"][n]) for o in out for n in out[0]["params"])


print(f"after 2 steps the 4 replicas are equal — planted: {replicas_equal(apart)}; fixed: {replicas_equal(synced)}")
(f,) = report.findings
assert (f.kind, f.ranks) == ("weights", [1]) and not replicas_equal(apart) and replicas_equal(synced)
assert not doctor.diagnose(RUNS / "ddp-own-seeds").findings

# %% [markdown]
# 15 of the nano model's 41 parameter tensors differ: the embeddings and the Linear weights,
# drawn at random; the other 26 — LayerNorm weights and every bias — start from constants, the
# same from any seed. The fix run builds *every* rank from its own seed, as processes that never
# agreed on one would: DDP's broadcast makes them one model anyway, and the replicas are equal
# to the bit after two steps.
#
# Sharded, it is worse: each rank keeps only its shard of the model it built, so the model
# trained is a patchwork of four models' slices, and no rank holds a replica to compare.
# PyTorch's FSDP2 `fully_shard` broadcasts nothing (pytorch#148756): ranks that build their model
# from their own seeds train such a patchwork, with no fault planted. minishard's `fully_shard`
# broadcasts rank 0's weights before sharding, unless the fault tells it not to:

# %%
# NBVAL_CHECK_OUTPUT
run("unsynced-fsdp", strategy="fsdp", fault="unsynced-init")
report = show("unsynced-fsdp", full=False)
run("torch-fsdp-own-seeds", strategy="torch_fsdp", rank_seeds=True)
theirs = show("torch-fsdp-own-seeds", full=False)
run("torch-ddp-own-seeds", strategy="torch_ddp", rank_seeds=True)
print(verdict(RUNS / "torch-ddp-own-seeds", "runs/torch-ddp-own-seeds"), "— PyTorch's DDP, own seeds: its constructor broadcasts")
print(verdict(RUNS / "fsdp", "runs/fsdp"), "— minishard's FSDP, rank 0's weights broadcast before sharding (§3)")
print(verdict(RUNS / "torch-fsdp", "runs/torch-fsdp"), "— FSDP2, every rank built from the same seed (§3)")
assert [(f.kind, f.ranks) for f in report.findings] == [("weights", [1])]
assert [(f.kind, f.ranks) for f in theirs.findings] == [("weights", [1, 2, 3])]
assert not doctor.diagnose(RUNS / "torch-ddp-own-seeds").findings

# %% [markdown]
# For FSDP2 the fix is on the user's side: build the model from one seed on every rank (or on
# the meta device, then load one checkpoint), or broadcast rank 0's weights before
# `fully_shard`.
#
# ### Replicas that drift apart after the start
# Replicas that start equal can still part later, every collective matching: rank 1's optimizer
# built with another learning rate, or rank 1 skipping `optimizer.step()` once (a NaN check on
# its own loss). The averaged gradient is the same on every rank; what each rank does with it is
# not. So `minishard.watch` — and `train` with a `flight_dir` — fingerprints the parameters each
# rank holds as a replica every `fingerprint_every` steps (10 by default, and after the last),
# beside each rank's optimizer settings and step count. A user's own script, PyTorch's DDP and
# AdamW, where rank 1 was given twice the learning rate:
#
# ```python
# opt = torch.optim.AdamW(model.parameters(), lr=2e-3 if rank == 1 else 1e-3)   # the bug
# with minishard.watch(model, opt, trace="runs/drift") as w:
#     for x, y in batches:
#         model(x, y).backward(); opt.step(); opt.zero_grad(); w.step()
# ```

# %%
# NBVAL_CHECK_OUTPUT
drifted = R4.run(drifting, str(RUNS / "drift"), odd_lr=2e-3)
report = show("drift")
print()
fixed = R4.run(drifting, str(RUNS / "drift-fixed"))
show("drift-fixed")
print(f"after 2 steps the 4 replicas are equal — planted: {replicas_equal(drifted)}; fixed: {replicas_equal(fixed)}")
(f,) = report.findings
assert (f.kind, f.ranks) == ("drift", [1]) and "after step 0" in f.title and "another lr" in f.title
assert not doctor.diagnose(RUNS / "drift-fixed").findings
assert not replicas_equal(drifted) and replicas_equal(fixed)

# %% [markdown]
# The doctor names rank 1 — ranks 0, 2 and 3 agree, and the majority is the reference (with two
# ranks, rank 0 is) — the first recorded step at which its replica differs, step 0 (every
# parameter took another step from the first update on), and the cause its records show: the
# learning rate, both values. A skipped step shows as step counts that differ, and the doctor
# names the step that rank's optimizer did not take. The fix run finds nothing, and says what it
# compared. Under ZeRO the same bug leaves the replicas equal — each rank steps its own part and
# sends it to the others — and under FSDP2 no rank holds a replica; there the settings and step
# counts that differ are the finding (`tests/test_drift.py` runs all three jobs, both bugs).
#
# ## 5. Memory that did not drop
# "FSDP's memory is no lower than DDP's" (fairscale#1050, pytorch#82001, accelerate#3474) has
# several causes; two of them are configurations, not bugs, and the doctor reads both from the
# ledger in the traces.
#
# **No wrap policy.** `fully_shard` on the model alone makes one unit: before the forward it
# gathers all of Ψ, and at that moment sharding saves nothing.

# %%
# NBVAL_CHECK_OUTPUT
flat = run("no-wrap", strategy="fsdp", wrap="model")
report = show("no-wrap")
print()
print(verdict(RUNS / "fsdp", "runs/fsdp"), "— wrap='block': one unit per block, then the root (§3's run)")
whole, block = flat[0]["peak_snapshot"]["unsharded"], right[0]["peak_snapshot"]["unsharded"]
print(f"peak per rank, from the ledger: one unit {glue('no-wrap-peak', flat[0]['peak'], '{:,}')} bytes, "
      f"one per block {glue('wrapped-peak', right[0]['peak'], '{:,}')} bytes")
print(f"unsharded at the peak: {glue('no-wrap-unsharded', whole, '{:,}')} bytes = 4Ψ (all of it, fp32) "
      f"against {block:,}")
assert [(f.kind, f.ranks) for f in report.findings] == [("memory", [0, 1, 2, 3])]
assert whole == 4 * NANO and flat[0]["peak"] > right[0]["peak"] and block < whole

# %% [markdown]
# PyTorch's FSDP2 with `fully_shard(model)` alone is the same single unit, and the watch's
# trace of it gets the same finding:

# %%
# NBVAL_CHECK_OUTPUT
run("torch-no-wrap", strategy="torch_fsdp", wrap="model")
report = show("torch-no-wrap", full=False)
assert [(f.kind, f.ranks) for f in report.findings] == [("memory", [0, 1, 2, 3])]

# %% [markdown]
# **Accumulation without synchronising.** Gradient accumulation under `no_sync` (or FSDP2's
# `set_requires_gradient_sync(False)`) skips the reduce-scatter of every micro-batch but the
# last — and so keeps every unit's *full* gradient from one micro-batch to the next. In one report
# (meta-pytorch/tnt#1057: 26B parameters on 16 GPUs) the gradients a rank keeps go from its 3.25 GB
# shard to the whole 52 GB, and the GPUs' reported memory from 38 % to 86 %. minishard's
# `accumulation="no_sync"` does the same; its default, like torchtitan's, reduce-scatters
# every micro-batch:

# %%
# NBVAL_CHECK_OUTPUT
kept = run("accum-unsharded", strategy="fsdp", accum=2, accumulation="no_sync")
report = show("accum-unsharded")
synced = run("accum", strategy="fsdp", accum=2)
print()
print(verdict(RUNS / "accum", "runs/accum"), "— a reduce-scatter every micro-batch")

def full_grads_as_forward_begins(name: str, rank: int = 0) -> int:
    """The most bytes of full (unsharded) gradients live as a forward began: rank's ledger, from its trace."""
    live, seen = 0, [0]
    for ev in read_events(RUNS / name / f"rank{rank}.jsonl")[0]:
        if ev["kind"] in ("alloc", "free") and ev.get("category") == "grads" and ":grad_full" in ev["tag"]:
            live += ev["bytes"] if ev["kind"] == "alloc" else -ev["bytes"]
        if ev["kind"] == "phase" and ev.get("name") == "forward" and ev.get("edge") == "begin":
            seen.append(live)
    return max(seen)


full_grads = full_grads_as_forward_begins("accum-unsharded")
print(f"{'':<30}{'peak per rank':>15}{'sent per step':>15}")
for name, out in (("full gradients kept", kept), ("reduce-scatter each", synced)):
    key = "accum-unsharded" if out is kept else "accum-sync"
    print(f"{name:<30}{glue(f'{key}-peak', out[0]['peak'], '{:,}'):>15}{glue(f'{key}-sent', out[0]['wire'][-1], '{:,}'):>15}")
print(f"full gradients live as the second micro-batch's forward begins (rank 0's ledger): "
      f"{glue('kept-grads', full_grads, '{:,}')} bytes; = 4Ψ: {full_grads == 4 * NANO}")
assert full_grads == 4 * NANO and full_grads_as_forward_begins("accum") == 0
assert [(f.kind, f.ranks) for f in report.findings] == [("memory", [0, 1, 2, 3])]
assert f"{fmt_bytes(full_grads)} of full gradients" in report.findings[0].title
assert kept[0]["peak"] > synced[0]["peak"] and synced[0]["wire"][-1] > kept[0]["wire"][-1]
assert not doctor.diagnose(RUNS / "accum").findings

# %% [markdown]
# The trade is the course's usual one, the other way round: reduce-scattering every micro-batch
# sends more bytes per step and keeps only the shards; skipping it saves bytes and holds 4Ψ of
# full gradients — at 8B parameters, 32 GB a rank. The other causes in those reports are not
# bugs either: activations that dominate (sharding never divides them: chapter 10's checklist,
# [§2](10-choosing-and-debugging.ipynb)), a small world (two ranks save half the sharded state:
# chapter 05 §1), the root kept gathered (FSDP2 does not reshard the root after forward:
# chapter 05 §3), and on a GPU reserved against allocated memory (`nvidia-smi` shows what
# PyTorch's caching allocator reserved, which stays high after tensors are freed; minishard's
# ledger counts allocated bytes).
#
# ## 6. bf16 weights without a master
# bf16 has 8 significant bits: numbers near 1.0 are 2⁻⁷ ≈ 0.0078 apart. An AdamW step moves a
# weight by about the learning rate, 1e-3 — less than half that spacing, so for a weight near
# 1.0 (every LayerNorm weight starts there) the update is rounded away, every step.
# `fault="no-master"` trains the model in bf16 and lets the optimizer step the bf16 weights
# themselves; each rank notes how many of the elements it stepped came out unchanged:

# %%
# NBVAL_CHECK_OUTPUT
one = torch.tensor(1.0, dtype=torch.bfloat16)
print(f"bf16: 1.0 + 1e-3 == 1.0: {bool(one + 1e-3 == one)}; spacing above 1.0: {torch.finfo(torch.bfloat16).eps}")
run("no-master", strategy="ddp", fault="no-master")
report = show("no-master")
run("torch-no-master", strategy="torch_ddp", fault="no-master")
theirs = show("torch-no-master", full=False)
run("bf16-master", strategy="ddp", precision="bf16_mixed")
print(verdict(RUNS / "bf16-master", "runs/bf16-master"), "— bf16 compute, fp32 master and moments")
dumps = [json.loads(p.read_text()) for p in sorted((RUNS / "no-master").glob("flight_rank*.json"))]
lost = [n["unchanged"] / n["low_precision_elements"] for d in dumps for n in d["facts"]["steps"]]
print(f"every rank lost more than 5 % of its updates at every step: {min(lost) > 0.05}")
assert [(f.kind, f.ranks) for f in report.findings] == [("precision", [0, 1, 2, 3])]
assert [(f.kind, f.ranks) for f in theirs.findings] == [("precision", [0, 1, 2, 3])]
assert min(lost) > 0.05 and not doctor.diagnose(RUNS / "bf16-master").findings

# %% [markdown]
# The `…` are the counts, which depend on the CPU's float kernels; the next cell prints this
# run's. PyTorch's DDP with bf16 parameters and `torch.optim.AdamW` loses the same updates. The
# fix is mixed precision as chapter 01 counts it: compute in bf16, keep an fp32 master and step
# that.

# %%
# NBVAL_IGNORE_OUTPUT
for d in dumps:
    print(f"rank {d['rank']}: " + ", ".join(f"step {n['step']} {n['unchanged']:,} of {n['low_precision_elements']:,} "
                                            f"({n['unchanged'] / n['low_precision_elements']:.1%})" for n in d["facts"]["steps"]))

# %% [markdown]
# ## 7. A clip by the local norm
# `clip_grad_norm_` scales the gradient by `max_norm / ‖g‖`, where ‖g‖ is the norm of the whole
# gradient. Under ZeRO-2 or FSDP each rank holds only its shards; a clip that computes the norm
# of those alone scales each rank's part by a different factor, and the update no longer points
# where the gradient does. `fault="local-clip"` skips the all-reduce of the squared norm:

# %%
# NBVAL_CHECK_OUTPUT
run("local-clip", strategy="fsdp", fault="local-clip", clip=0.5)
report = show("local-clip")
run("clip", strategy="fsdp", clip=0.5)
print()
print(verdict(RUNS / "clip", "runs/clip"), "— the squares summed with one all-reduce, one norm on every rank")
assert [(f.kind, f.ranks) for f in report.findings] == [("clip", [0, 1, 2, 3])]
assert not doctor.diagnose(RUNS / "clip").findings

# %% [markdown]
# The norms themselves (the `…` above) are float sums, this run's:

# %%
# NBVAL_IGNORE_OUTPUT
for name in ("local-clip", "clip"):
    norms = [[n["grad_norm"] for n in json.loads((RUNS / name / f"flight_rank{r}.json").read_text())["facts"]["steps"]]
             for r in range(4)]
    print(f"{name:<11}" + "  ".join(f"rank {r}: " + ", ".join(f"{x:.4f}" for x in ns) for r, ns in enumerate(norms)))

# %% [markdown]
# ## 8. From the command line
# The same faults are flags of the demo, so a reader can break a run outside the notebook and
# diagnose it:
#
# ```bash
# torchrun --standalone --nproc-per-node 4 -m minishard demo --model nano --steps 2 \
#     --fault skip-collective --fault-rank 1 --timeout 5 --trace traces/hang
# python -m minishard doctor traces/hang          # the findings, most important first
# python -m minishard doctor traces/hang --json   # the same, for tools
# ```
#
# (`--fault reorder` needs `--strategy fsdp`; `local-clip` a `--clip` and a sharded strategy.)
# A hung `torchrun` job ends within its `--timeout`, every rank writing its dump. The doctor's
# exit status says what it found — 0 nothing, 1 a problem, 2 input it cannot read (the file and
# the line named) or files that are not one run's (every run's files carry its id: two ids in one
# folder, two world sizes, a ring whose records are scrambled — the files named, nothing
# diagnosed), 3 a run it could not check (traces, but no dump and no ring to align) — so a job
# script can run it after a failure. On this chapter's directories:

# %%
# NBVAL_CHECK_OUTPUT
cut = RUNS / "cut"
cut.mkdir()
(cut / "flight_rank0.json").write_text('{"v": 1, "rank": 0,\n "entries": [')   # a dump cut short
for name in ("ddp", "hang", "reorder", "cut"):
    err = io.StringIO()
    with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(err):
        code = minishard_cli(["doctor", str(RUNS / name)])
    said = err.getvalue().strip().replace(str(RUNS), "runs")
    print(f"python -m minishard doctor runs/{name:<8} exit {code}" + (f": {said}" if said else ""))

# %% [markdown]
# ## 9. The crash that leaves nothing
# In §3 the swapped collectives had one size, so nothing failed. Now rank 1 takes a branch the
# others do not — a condition on its own data — and issues one extra all-reduce of 4 elements,
# just before step 1's gradient all-reduce (`fault="extra-collective"`). The other ranks' 850 KiB
# all-reduce pairs with it. gloo notices that the sizes differ and aborts the process that
# receives the larger message, from its own C++ thread:
# `terminate called after throwing an instance of 'gloo::EnforceNotMet' … Received data size
# doesn't match expected size`. No Python runs after that — no `except`, no `finally`, no signal
# handler — so rank 1 cannot write its flight dump, nor its trace. The same holds for a rank
# the kernel's OOM killer ends, a `SIGKILL`, a segfault in an extension, a CUDA error that
# aborts: the deaths where a recorder matters most are the ones where nothing can be written at
# the end.
#
# So the ring is on disk while the run flies: `flight_rank{r}.ring` is a memory-mapped file of
# fixed 1 KiB slots, one per collective, written when the collective is issued and marked when
# it completes. The mapped pages belong to the kernel's page cache, not to the process, so they
# reach the file however the process ends. It costs 5–6 µs a collective on top of the in-memory
# recorder (1.4–1.7× its cost, under 0.5 % of a step in every strategy measured:
# [RESULTS.md](../benchmarks/RESULTS.md)). The crash takes its pool with it, so it runs in a
# pool of its own; [`outcome`](../minishard/course/ch11.py) lets the ranks that survive report.

# %%
crash = RUNS / "crash"
with Ranks(4, collective_timeout=5) as dying:           # the abort ends this pool, not R4
    try:
        dying.run(outcome, str(crash), strategy="ddp", fault="extra-collective")
    except RankError as e:
        died = e

# %% [markdown]
# The two lines above are rank 1's last words, gloo's, on the stderr it shares with this
# notebook's kernel (the sizes it quotes depend on how the ring all-reduce chunked the bucket).
# What the pool and the disk say:

# %%
# NBVAL_CHECK_OUTPUT
print(f"the pool: rank {died.rank} {died.error.split(' without')[0]}")
rank1 = sorted(p.name for p in crash.iterdir() if "rank1" in p.name)
print(f"rank 1 left: {', '.join(rank1)} — no flight dump, no trace")
rings = sorted(int(p.stem.removeprefix("flight_rank")) for p in crash.glob("flight_rank*.ring"))
print(f"ranks whose ring is on disk: {rings}")
assert died.rank == 1 and "SIGABRT" in died.error and rank1 == ["flight_rank1.ring"] and rings == [0, 1, 2, 3]

# %% [markdown]
# The pool can say only that rank 1 was killed by a signal (SIGABRT: what `terminate` ends in).
# The doctor reads rank 1's ring beside the dumps the other ranks wrote as they raised or as the
# pool stopped them (its header says which file stands for which rank):

# %%
report = show("crash")

# %% [markdown]
# Three findings, the cause first. The **desync**: at seq 2 of the world group ranks 0, 2 and 3
# issued the gradient all-reduce of `bucket0`, 850 KiB, and rank 1 an all-reduce of 4 elements,
# 16 B, from a line of its own. **died**: rank 1 wrote no dump, and its ring ends in that extra
# all-reduce, issued and never completed — it died inside it. The **timeout** of the others
# comes last: they lost their peer (which of them raised before the pool stopped the rest
# depends on timing; the first two findings do not). The part that holds on any machine:

# %%
# NBVAL_CHECK_OUTPUT
found = {f.kind: f for f in report.findings}
desync, gone = found["desync"], found["died"]
print(stable(summary(desync)))
print(stable(summary(gone)))
extra_at = stable(desync.evidence[1].split("; at ")[1])
print(f"the line that issued rank 1's extra all-reduce: {extra_at}")
seq = int(desync.title.split("at seq ")[1].split()[0])
print(f"seq {glue('crash-seq', seq)}: {glue('crash-theirs', 4 * GPT('nano', device='meta').num_params(), '{:,}')} "
      f"bytes on ranks 0, 2, 3 against {glue('crash-extra', 4 * 4)} on rank 1")
with contextlib.redirect_stdout(io.StringIO()):
    code = minishard_cli(["doctor", str(crash)])
print(f"python -m minishard doctor runs/crash: exit {code}")
assert desync.ranks == [1] and gone.ranks == [1] and "inside the collective" in gone.title and code == 1
assert "extra [4] float32, 16 B" in desync.title and "the_branch_only_this_rank_takes" in extra_at

# %% [markdown]
# The fix is the one of §2 and §3: every rank issues the same collectives. A branch on a rank's
# own data that communicates must be taken by every rank — decide it with a collective first
# (an all-reduce of the flag, as minishard's `Comm.anyone` does), or move the communication out
# of the branch. Without the branch, the same job on the same four ranks:

# %%
# NBVAL_CHECK_OUTPUT
run("crash-fixed", strategy="ddp")
print(verdict(RUNS / "crash-fixed", "runs/crash-fixed"), "— the branch removed")
left = sorted(p.suffix for p in (RUNS / "crash-fixed").glob("flight_rank0.*"))
print(f"rank 0 left: flight_rank0{' and flight_rank0'.join(left)}")
assert not doctor.diagnose(RUNS / "crash-fixed").findings and left == [".json", ".ring"]

# %% [markdown]
# **On a GPU cluster.** NCCL does not compare sizes the way gloo's message header does: a mismatched
# pair waits, or reads the wrong number of bytes, and the job stops at a timeout rather than an
# abort. Two tools of PyTorch's own catch it earlier or explain it afterwards.
# `TORCH_DISTRIBUTED_DEBUG=DETAIL` wraps every process group (gloo's and NCCL's) in a checking one
# that, before each collective, compares its op, shapes and dtypes across the ranks over a side gloo
# group and raises on the first difference — run this section's job under it and both ranks raise
# "Detected mismatch between collectives on ranks" at the extra all-reduce, its shapes `[1000]`
# against `[4]` named. The check is itself a collective per collective, so it is a debugging run,
# not a production setting. The NCCL Flight Recorder is the same idea as this chapter's recorder:
# each rank keeps a ring of its last `TORCH_FR_BUFFER_SIZE` collectives in memory (2,000 by default;
# 0 turns it off; seq, op, sizes, state, the Python stack), and on a timeout or an NCCL error the
# process group's *watchdog thread* — a thread of its own, which still runs while the main thread is
# stuck inside the collective — writes it to `TORCH_FR_DUMP_TEMP_FILE` followed by the rank. Dumping
# on a timeout (`TORCH_NCCL_DUMP_ON_TIMEOUT`) is on by default in recent PyTorch; it was off in
# older releases, which is why older guides say to set it to 1. (The variables had `TORCH_NCCL_`
# names before PyTorch 2.9 — `TORCH_NCCL_TRACE_BUFFER_SIZE`, `TORCH_NCCL_DEBUG_INFO_TEMP_FILE` —
# still read as aliases.) `torchfrtrace DIR` (the `fr_trace` analyser in
# `torch.distributed.flight_recorder`) then lines the ranks' dumps up and names the first collective
# where they disagree and the ranks that never joined it. What it cannot keep is the ring of a
# process killed outright: an OOM kill or a `SIGKILL` takes the watchdog with it, and only the
# surviving ranks' dumps are left, showing the dead rank as the one that is missing. A ring on disk
# keeps the dead rank's own last collectives as well.

# %% [markdown]
# ## 10. What each failure looks like, and its fix
#
# | failure | what you see | the doctor says | the fix | PyTorch's own, here |
# |---|---|---|---|---|
# | a rank skips a collective (§2) | the others time out | `hang`: the rank, the seq it never issued, its last collective | every rank issues every collective | not run: the fault is planted in minishard's communicator |
# | collectives in different orders (§3) | nothing when the sizes agree | `desync`: the first seq where the ranks disagree | one rank-independent order for units, buckets, prefetch | FSDP2: the same finding |
# | ranks start from different weights (§4) | replicas that never agree | `weights`: which ranks, which parameters | broadcast rank 0's weights, or one seed | FSDP2, own seeds: the same finding; DDP: nothing (it broadcasts) |
# | replicas drift apart after the start (§4) | nothing: every collective matches | `drift`: the rank, the first recorded step, the parameters, another lr or a skipped step | one optimizer setting everywhere; a step skipped by all ranks or none | this is PyTorch's DDP under `watch`; ZeRO and FSDP2: the same finding (`tests/test_drift.py`) |
# | no wrap policy (§5) | FSDP no lower than DDP | `memory`: one unit holds all of Ψ | one unit per block | FSDP2: the same finding |
# | accumulation without sync (§5) | 4Ψ more memory from the first micro-batch on | `memory`: 4Ψ of full gradients kept | reduce-scatter every micro-batch | not run (FSDP2's switch: `set_requires_gradient_sync(False)`) |
# | bf16 weights stepped in bf16 (§6) | the loss stalls | `precision`: the updates rounded away | an fp32 master | DDP with bf16 parameters: the same finding |
# | a clip by the local norm (§7) | a wrong update direction | `clip`: ranks clipped by different norms | one all-reduce of the squares | not run (`clip_grad_norm_` on FSDP2's DTensors is global) |
# | a rank dies in C++ (§9) | an abort, and no dump from that rank | `desync`: the extra collective and its line; `died`: the rank that died inside it | the same collectives on every rank | DDP and FSDP2 under `watch`: the same (`tests/test_deaths.py`) |

# %%
R4.close()
shutil.rmtree(RUNS)                               # the runs' dumps and traces

# %% [markdown]
# > **Takeaway.** Every rank of a group must issue the same collectives in the same order, with
# > the same shapes, dtypes and tensors — and must start from the same weights, clip by one norm
# > and step an fp32 master, which no collective checks. A hang is one rank that did not issue
# > what the others wait in; a desync of equal sizes fails silently. Do not read the timeout, read
# > the flight recorders: line the ranks up by sequence number and the first place they disagree
# > names the rank, the collective and the line — kept on disk as the run flies, since a rank
# > that dies outright writes nothing at the end. Memory that did not drop is a configuration:
# > one unit for the whole model, or full gradients kept across micro-batches. Fix, run again,
# > and stop when the doctor finds nothing.
#
# <details><summary>中文</summary>
#
# > **要点。** 同一组里的每个 rank 都必须以同样的顺序发起同样的集合通信，形状、dtype 和张量都相同——
# > 而且必须从相同的权重出发、按一个范数裁剪、更新 fp32 主权重，这些是任何集合通信都不检查的。
# > 卡住（hang），是某个 rank 没有发起其他 rank 正在等的那次集合通信；大小相同的不同步（desync）则悄无声息。
# > 不要去读超时报错，要读飞行记录器：按序号把各 rank 对齐，它们第一次不一致的地方，就指明了 rank、
# > 集合通信和代码行——而且要在运行过程中就落盘，因为被直接杀掉的 rank 在最后一刻什么也写不了。显存没降是配置问题：整个模型只有一个单元，或者完整梯度跨微批次保留着。
# > 改掉，再跑一遍，直到诊断工具什么也找不到为止。
#
# </details>
#
# **Questions**
#
# 1. Rank 3 of 8 raises in its data loader; ranks 0–2 and 4–7 report collective timeouts a few
#    seconds later. Which error do you read, and what does the doctor put first?
#
# <details><summary>Answer</summary>
#
# Rank 3's. The timeouts are the consequence: the others waited in a collective rank 3 never
# reached. The doctor orders its findings cause first — the exception quoted from rank 3's dump,
# then the hang (rank 3 never issued the seq the others wait in), then the timeouts.
# </details>
#
# 2. In §3 the ranks disagree at one seq and then at many after it. Why does the doctor report
#    only the first?
#
# <details><summary>Answer</summary>
#
# Because everything after it is the consequence. Once rank 1's all-gather of `blocks.1` paired
# with the others' `blocks.0`, every later collective pairs with the wrong partner too (or the
# right one by chance); fixing the first difference — one order on every rank — removes the rest.
# The doctor reads a group's recorders up to the first disagreement and stops there, as you
# would.
# </details>
#
# 3. An FSDP job's memory per rank did not drop when going from 2 to 8 ranks. Which two things in
#    §5 do you check, and how does each show in the ledger?
#
# <details><summary>Answer</summary>
#
# The wrap policy — `unsharded` at the peak equals the whole model (one unit); and accumulation
# without sync — `grads` holds the full gradients of every unit as the next micro-batch's forward
# begins. Both stay the same size whatever the world size, which is why adding ranks did not help.
# If neither, activations (chapter 10 §2).
# </details>

# %% [markdown]
# ## Exercise: find the first desync
# Write what the doctor does first: given each rank's flight-recorder entries of one group (a
# dict rank → list of entries, each with `seq`, `op`, `shapes`, `dtypes`, `tag`, `step`), return
# the first `seq` held by every rank where the ranks issued different collectives, and the ranks
# outside the largest set that agree (every rank if no set is larger) — or `None`. Two traps: a
# ring drops its oldest entries, and not every rank the same ones (align by `seq`); and two units
# of one size swapped agree in everything but what they move. The check compares your answer
# with the doctor's on hand-made rings and on the dumps of a real 4-rank reordered run.
#
# Write it in the cell below (or edit the stub in
# [`minishard/course/exercises/ch11.py`](../minishard/course/exercises/ch11.py)), then run the check. A
# reference solution is in [`solutions/ch11.py`](../solutions/ch11.py): try first.
#
# <details><summary>中文</summary>
#
# **练习：找出第一次不同步。** 写出诊断工具最先做的那件事：给定每个 rank 在一个组里的飞行记录（字典
# rank → 记录列表，每条记录有 `seq`、`op`、`shapes`、`dtypes`、`tag`、`step`），返回所有 rank
# 都还保留着、且各 rank 发起的集合通信不一致的第一个 `seq`，以及不属于"最大的一致集合"的那些 rank
# （如果没有哪个集合最大，就是全部 rank）；都一致则返回 `None`。两个陷阱：环形缓冲区会丢掉最旧的记录，
# 而且各 rank 丢掉的不一定相同（要按 `seq` 对齐）；两个大小相同的单元互换顺序时，除了搬的是什么之外，
# 其他一切都一致。检查程序在手工构造的记录和一次真实的 4-rank 乱序运行留下的 dump 文件上，把你的答案和诊断工具的答案比较。
#
# 在下面的单元格里写（或编辑
# [`minishard/course/exercises/ch11.py`](../minishard/course/exercises/ch11.py) 里的桩函数），
# 然后运行检查。参考答案在 [`solutions/ch11.py`](../solutions/ch11.py)：先自己试。
#
# </details>

# %%
def first_desync(held):
    """held: rank -> that rank's entries of one group, oldest first. Return (seq, ranks) of the
    first seq every rank holds where they issued different collectives, or None."""
    raise NotImplementedError("your code here")

# %%
# NBVAL_CHECK_OUTPUT
from minishard.course.exercises import ch11

ch11.check_first_desync(first_desync)
