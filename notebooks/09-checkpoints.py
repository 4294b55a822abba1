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
# # 09 · Checkpoints after sharding
#
# > **No rank holds the whole model any more. How do you save the run, resume it on a different
# > number of GPUs, and hand the weights to an inference engine?**
#
# Sharded training writes sharded checkpoints: each rank saves the slice it owns, all ranks at
# once. That is the easy part. The two questions that bite later are whether the checkpoint can
# be loaded under *another* layout (a 64-rank job resumed on 32 after losing a node) and whether
# the released weights come out in the format inference engines want (complete tensors, one
# file per layer). The reasoning is in [tutorial/09-checkpoints.md](../tutorial/09-checkpoints.md);
# the code is [`minishard/checkpoint/`](../minishard/checkpoint/).
#
# <details><summary>中文</summary>
#
# > **已经没有哪个 rank 持有完整的模型了。训练怎么存档？怎么换一个 GPU 数量续训？
# > 权重又怎么交给推理引擎？**
#
# 分片训练写的是分片检查点：每个 rank 同时保存自己负责的那一片，这一步很容易。
# 真正麻烦的是后面两个问题：检查点能不能在*另一种*布局下加载（掉了一个节点，64 rank 的作业要在
# 32 个 rank 上续训），以及发布的权重能不能导出成推理引擎要的格式（完整张量，每层一个文件）。
# 中文讲解见 [tutorial/zh/09-checkpoints.md](../tutorial/zh/09-checkpoints.md)。
#
# </details>
#
# **The one-line "syntax"** — every tensor of the training state (each parameter, each Adam
# moment) is a flat index space; what a rank holds is a set of *regions* of it:
#
# $$\text{rank } r \text{ saves } \bigcup_{\text{tensors}} [\,\text{start}_r, \text{start}_r + n_r) ,\qquad
# \text{new rank } r' \text{ reads } \bigcup_{\text{pieces } p} \; p \,\cap\, \text{regions}(r').$$
#
# ```python
# train(rank, TrainConfig(strategy="fsdp", steps=3, save_to="ckpt"))            # rank{r}.safetensors + metadata.json
# train(rank, TrainConfig(strategy="zero1", steps=3, resume_from="ckpt"))       # on any number of ranks
# checkpoint.export("ckpt", "release/")                            # per-layer files + index.json
# ```
#
# <details><summary>中文</summary>
#
# **一行"语法"**：训练状态中的每个张量（每个参数、每个 Adam 矩）都是一个扁平下标空间，一个 rank
# 持有的是其中的一组*区段*：rank $r$ 保存它自己的区段，新 rank $r'$
# 读取每个已保存片段与自己区段的交集。上面三行依次是：保存（`rank{r}.safetensors` +
# `metadata.json`）、在任意数量的 rank 上恢复、导出逐层文件和 `index.json`。
#
# </details>
#
# Terms, in English and Chinese: [glossary · 术语表](../tutorial/glossary.md).

# %%
import hashlib
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import plotly.io as pio
import torch

from minishard import GPT, RankError, Ranks, checkpoint
from minishard.core.comm import Comm
from minishard.checkpoint.from_deepspeed import ALLOWED
from minishard.course.ch09 import (SAVES, deepspeed_and_dcp, killed_mid_write, resume_and_compare, save_peaks,
                                  save_stalls, median_round)
from minishard.course.glue import glue
from minishard.core.model import config
from minishard.training.parity import bitwise_equal, drift, params_of
from minishard.training.loop import TrainConfig, train
from minishard.viz import reshard_figure
from safetensors.torch import load_file

pio.renderers.default = "plotly_mimetype+notebook_connected"
TINY = GPT("tiny", device="meta")
PSI = TINY.num_params()
STATE = 3 * 4 * PSI                  # fp32 parameters + Adam's two moments; gradients are not saved
WORK = Path(tempfile.mkdtemp(prefix="minishard-ch09-"))
KW = dict(model="tiny", track_activations=False)
GLOBAL = 12                          # sequences per step, whatever the world size: 4x3, 3x4, 2x6
print(f"tiny GPT: Ψ = {glue('tiny-params', PSI, '{:,}')} parameters; parameters + AdamW moments = 12Ψ = {STATE:,} bytes")
R4 = Ranks(4)

# %% [markdown]
# ## 1. Four ranks save, each its own quarter
# Four FSDP ranks train three AdamW steps and save (`save_to`). Every rank writes one
# [safetensors](https://huggingface.co/docs/safetensors) file with its pieces; rank 0 then writes
# `metadata.json` and the directory is renamed into place.

# %%
ck = WORK / "step3"
run4 = R4.run(train, TrainConfig(strategy="fsdp", steps=3, micro_batch=GLOBAL // 4, save_to=str(ck), return_params=True, **KW))
meta = checkpoint.read_metadata(ck)

# %%
# NBVAL_CHECK_OUTPUT
pieces = [p for t in meta["tensors"].values() for p in t["pieces"]]
print(f"{'file':<20}{'bytes':>13}{'pieces':>8}{'tensor data':>14}")
for f, info in sorted(meta["files"].items()):
    data = sum(p["numel"] * 4 for p in pieces if p["file"] == f)
    data_text = glue("file-tensor-bytes", data, "{:,}") if f == "rank0.safetensors" else f"{data:,}"
    print(f"{f:<20}{info['bytes']:>13,}{sum(p['file'] == f for p in pieces):>8}{data_text:>14}")
    assert info["bytes"] == os.path.getsize(ck / f) and data == STATE // 4     # exactly a quarter each
print(f"{'metadata.json':<20}{glue('metadata-bytes', os.path.getsize(ck / 'metadata.json'), '{:,}'):>13}")
assert sum(p["numel"] * 4 for p in pieces) == STATE          # every element saved once: no padding, no copy
assert meta["step"] == 3 and meta["optimizer"]["step"] == 3.0 and meta["world_size"] == 4

# %% [markdown]
# What the metadata says about one tensor — rank *r* holds rows [192 r, 192 (r+1)) of the
# 768-row `qkv` weight, so its piece starts at element 192 · 256 · r. The byte offset points
# into the rank's file; each 64 KiB block of the piece carries an XXH3-64 checksum (not printed).

# %%
# NBVAL_CHECK_OUTPUT
t = meta["tensors"]["param/blocks.0.attn.qkv.weight"]
print("param/blocks.0.attn.qkv.weight", t["shape"], t["dtype"])
for p in t["pieces"]:
    print(f"  {p['file']:<18} elements [{p['start']:>6,}, {p['start'] + p['numel']:>7,})  "
          f"byte offset {p['offset']:>10,}  {len(p['checksums'])} block checksums")
assert [p["start"] for p in t["pieces"]] == [192 * 256 * r for r in range(4)]

# %% [markdown]
# ## 2. Resume on 2 and on 3 ranks — bit-exact
# New ranks build the model with *other* initial weights (seed 1) under a strategy of their own,
# load the checkpoint, and compare what they then hold with the checkpoint's values, bit for bit
# (`course.ch09.resume_and_compare`). Three does not divide 4, so on 3 ranks every saved piece is
# cut somewhere new. Under ZeRO-1 the parameters are replicas and only the moments are sharded, so
# each rank loads all of the parameters and a third of the moments.

# %%
R2, R3 = Ranks(2), Ranks(3)
checks = {(2, "fsdp"): R2.run(resume_and_compare, str(ck), "fsdp"),
          (3, "fsdp"): R3.run(resume_and_compare, str(ck), "fsdp"),
          (3, "zero1"): R3.run(resume_and_compare, str(ck), "zero1"),
          (2, "fsdp_flat"): R2.run(resume_and_compare, str(ck), "fsdp_flat")}

# %%
# NBVAL_CHECK_OUTPUT
print(f"{'load 4 ->':<16}{'rank':>5}{'holds (bytes)':>15}{'reads (bytes)':>15}{'tensors that differ':>21}")
for (M, strategy), out in checks.items():
    for o in out:
        held, read = f"{o['bytes']:,}", f"{o['bytes_read']:,}"
        if (M, strategy, o["rank"]) == (3, "fsdp", 0):             # the rank the chapter quotes
            held, read = glue("load3-rank0-holds", o["bytes"], "{:,}"), glue("load3-rank0-reads", o["bytes_read"], "{:,}")
        print(f"{f'{M} x {strategy}':<16}{o['rank']:>5}{held:>15}{read:>15}"
              f"{len(o['differ']):>21}")
        assert o["differ"] == [] and o["step"] == 3
    if strategy == "zero1":                      # parameters whole on every rank, moments split
        assert sum(o["bytes"] - 4 * PSI for o in out) == 8 * PSI
    else:                                        # everything split: the ranks' bytes add up to 12Ψ
        assert sum(o["bytes"] for o in out) == STATE

# %% [markdown]
# A rank reads a little more than it holds: reads come in whole 64 KiB checksum blocks, so that
# every byte read can be verified. Which blocks each new rank reads is a *plan*, computed from
# the metadata alone — the same reads `load` then executes:

# %%
# NBVAL_CHECK_OUTPUT
plan3 = checkpoint.plan(meta, "fsdp", 3)
print("4 -> 3 ranks (fsdp): new rank reads from saved ranks", plan3.files_read())
print("bytes per (new rank, saved rank):")
for r, row in enumerate(plan3.bytes_matrix()):
    print(f"  new rank {r}: " + "  ".join(f"{b:>11,}" for b in row))
assert plan3.bytes_read() == [o["bytes_read"] for o in checks[(3, "fsdp")]]

# %%
reshard_figure(plan3).show()

# %% [markdown]
# The four ranks' training run that wrote the checkpoint, in the offline player (no kernel: it
# plays on the static site too), with the same 4 → 3 read plan beside it: the bytes each new
# rank reads from each saved rank's file.

# %%
from minishard.viz import replay_html
replay_html(R4.last_events, title="FSDP, 4 ranks, tiny model, 3 steps, then save (offline player)",
            read_plan=plan3)

# %% [markdown]
# ## 3. Training continues exactly
# The uninterrupted run trains 6 steps on 4 ranks. The resumed runs load the step-3 checkpoint
# and train steps 3–5 on the same global batch of 12 sequences, split 4 × 3, 2 × 6 and 3 × 4.

# %%
whole = R4.run(train, TrainConfig(strategy="fsdp", steps=6, micro_batch=GLOBAL // 4, return_params=True, **KW))
resumed = {"4 x fsdp": R4.run(train, TrainConfig(strategy="fsdp", steps=3, micro_batch=GLOBAL // 4, resume_from=str(ck), return_params=True, **KW)),
           "2 x zero1": R2.run(train, TrainConfig(strategy="zero1", steps=3, micro_batch=GLOBAL // 2, resume_from=str(ck), return_params=True, **KW)),
           "3 x fsdp_flat": R3.run(train, TrainConfig(strategy="fsdp_flat", steps=3, micro_batch=GLOBAL // 3, resume_from=str(ck), return_params=True, **KW))}


def mean_losses(out):
    return [sum(o["losses"][s] for o in out) / len(out) for s in range(len(out[0]["losses"]))]


# %%
# NBVAL_IGNORE_OUTPUT
print(f"{'step':>4}{'uninterrupted':>16}" + "".join(f"{k:>16}" for k in resumed))
for s in range(6):
    row = "".join(f"{mean_losses(v)[s - 3]:>16.7f}" if s >= 3 else f"{'':>16}" for v in resumed.values())
    print(f"{s:>4}{mean_losses(whole)[s]:>16.7f}{row}")

# %%
# NBVAL_CHECK_OUTPUT
want = mean_losses(whole)[3:]
for name, out in resumed.items():
    got = mean_losses(out)
    gap = max(abs(a - b) / b for a, b in zip(got, want))
    # parameters: each tensor against how far steps 3-5 moved it (from the checkpoint's weights)
    params = drift(out[0]["params"], whole[0]["params"], run4[0]["params"])
    same = [o["losses"] for o in out] == [o["losses"][3:] for o in whole]
    exact = bitwise_equal(out[0]["params"], whole[0]["params"])
    print(f"resumed on {name:<14}: losses {'bit-identical' if same else 'within 1e-6'}, parameters "
          f"{'bit-identical' if exact else 'within 0.1% of their movement'} after 3 more steps")
    assert gap <= 1e-6 and params.within(1e-3)
    if name == "4 x fsdp":
        assert same and exact                    # same layout: nothing may differ at all

# %% [markdown]
# On the same 4 ranks the continuation is bit-identical — the checkpoint lost nothing, not even
# the optimizer's step count. On 2 or 3 ranks the losses agree to 10⁻⁶ and each parameter tensor
# lies within 0.1% of how far the three steps moved it: the *state* loaded bit-exactly (§2); what
# differs afterwards is only the order in which the new layout sums gradients, exactly as between
# any two world sizes (chapter 02).
#
# ## 4. 64 ranks resumed on 32 — planned on a laptop
# The planner builds each rank's layout on PyTorch's *meta* device (shapes, no memory, no
# ranks): first the metadata a 64-rank FSDP save of this model would write, then the reads of
# each of 32 new ranks.

# %%
meta64 = checkpoint.layout_metadata("fsdp", 64, config("tiny"))
plan32 = checkpoint.plan(meta64, "fsdp", 32)
reshard_figure(plan32).show()

# %%
# NBVAL_CHECK_OUTPUT
print(f"64 -> 32 (fsdp): new rank r reads saved ranks {plan32.files_read()[:3]} ...: 2r and 2r+1")
print(f"  each new rank reads {glue('reshard32-bytes-read', plan32.bytes_read()[0], '{:,}')} bytes and needs {plan32.needed_bytes[0]:,}")
assert plan32.files_read() == [[2 * r, 2 * r + 1] for r in range(32)]
assert plan32.bytes_read() == plan32.needed_bytes           # whole pieces: nothing read in vain
zero32 = checkpoint.plan(meta64, "zero1", 32)
print(f"64 -> 32 (zero1): every new rank reads all 64 files, {glue('zero1-reshard32-bytes-read', zero32.bytes_read()[0], '{:,}')} bytes "
      f"(parameters whole: 4Ψ = {4 * PSI:,}, plus 1/32 of the moments)")
assert all(f == list(range(64)) for f in zero32.files_read())
plan48 = checkpoint.plan(meta64, "fsdp", 48)
extra = sum(plan48.bytes_read()) / sum(plan48.needed_bytes) - 1
print(f"64 -> 48 (fsdp): new ranks read from {sorted({len(f) for f in plan48.files_read()})} files each; "
      f"{glue('reshard48-bytes-read', sum(plan48.bytes_read()), '{:,}')} bytes read for "
      f"{glue('reshard48-bytes-needed', sum(plan48.needed_bytes), '{:,}')} needed (+{glue('reshard48-extra', extra, '{:.0%}')})")
assert sum(plan48.needed_bytes) == STATE and 0 < extra < 1

# %%
reshard_figure(plan48).show()

# %% [markdown]
# 64 → 48 is the uneven case. Each tensor's rows are cut at different places by 64 and by 48,
# so a new rank's rows straddle two or three saved pieces per tensor, and across tensors of
# different heights its files spread out (the band widens towards the last ranks). And 64-way
# pieces of this small model are often smaller than one 64 KiB checksum block, so whole pieces
# are read: about half again as much as needed. Smaller blocks would trim that at the price of a
# longer metadata file; with a real model's megabyte pieces the waste is at most two blocks per
# tensor and rank.
#
# ## 5. Export early: complete, per-layer weights
# Inference engines load complete tensors, usually one safetensors file per few layers plus an
# index (`model.safetensors.index.json`). The export reads the checkpoint on disk, without ranks,
# and streams: each tensor is written as its verified pieces arrive, one piece at a time. We
# export the step-3 checkpoint *now*, load it into a plain single-process `GPT` with
# `strict=True`, and compare it with the ranks' own gathered weights and with one process that
# trained on the same data.

# %%
release = WORK / "release-step3"
report = checkpoint.export(ck, release)
index = json.loads((release / "model.safetensors.index.json").read_text())
plain = GPT("tiny", seed=123)                                  # other weights, then replaced
plain.load_state_dict(checkpoint.load_exported(release), strict=True)
threads = torch.get_num_threads()
torch.set_num_threads(1)
single = train(None, TrainConfig(strategy="single", steps=3, micro_batch=GLOBAL, return_params=True, **KW))
torch.set_num_threads(threads)

# %%
# NBVAL_CHECK_OUTPUT
for f in report["files"]:
    names = [n for n, file in index["weight_map"].items() if file == f]
    print(f"{f}  {len(names):>2} tensors  {os.path.getsize(release / f):>11,} bytes  e.g. {names[0]}")
print(f"total_size {index['metadata']['total_size']:,} = 4Ψ; "
      f"peak buffer {glue('export-peak-buffer', report['peak_buffer_bytes'], '{:,}')} bytes, "
      f"largest tensor {glue('largest-tensor-bytes', report['largest_tensor_bytes'], '{:,}')}")
assert len(report["files"]) == 6 + 1 and index["metadata"]["total_size"] == 4 * PSI
assert report["peak_buffer_bytes"] <= report["largest_tensor_bytes"] <= 2 * report["largest_tensor_bytes"]
exact = all(torch.equal(p.detach(), run4[0]["params"][n]) for n, p in plain.named_parameters())
close = drift(params_of(plain), single["params"], params_of(GPT("tiny", seed=0))).within(1e-3)
print(f"strict load into a plain GPT: ok; equal to the 4 ranks' gathered weights: {exact}; "
      f"within 0.1% of single-process training's movement: {close}")
assert exact and close

# %% [markdown]
# The gap to the single process is the usual summation-order noise of 4 ranks against one
# (chapter 02), not an export error: against the ranks' own weights the export is exact.
#
# ## 6. How fast, against copying the same bytes
# A rank's save covers describing its state, hashing, writing and fsync'ing its file, the ranks'
# agreement, and rank 0's metadata and renames; "its file" is the hash + write + fsync part
# alone. A load covers planning, reading, verifying and copying in. The baseline copies the same
# four rank files with `shutil.copyfile` + fsync, on the same disk, all four at once (as the
# ranks write at once). `benchmarks/bench_checkpoint.py` repeats this with medians.

# %%
# NBVAL_IGNORE_OUTPUT
saves = [o["checkpoint"]["save"] for o in run4]
loads = [o["checkpoint"]["load"] for o in resumed["4 x fsdp"]]
copy_dir = WORK / "copy"
copy_dir.mkdir(exist_ok=True)


def copy_rate(f: str) -> float:
    t0 = time.perf_counter()
    shutil.copyfile(ck / f, copy_dir / f)
    with open(copy_dir / f, "rb+") as fh:
        os.fsync(fh.fileno())
    return os.path.getsize(ck / f) / (time.perf_counter() - t0) / 1e6


with ThreadPoolExecutor(4) as pool:
    copies = list(pool.map(copy_rate, sorted(meta["files"])))
save_rates = [s["bytes_written"] / s["seconds"] / 1e6 for s in saves]


def rate(name, x, xs):
    """A rate as the table prints it; the slowest and the fastest of ``xs`` recorded (the chapter quotes the range)."""
    if x == min(xs):
        return glue(f"{name}-slowest", x, "{:.0f}")
    if x == max(xs):
        return glue(f"{name}-fastest", x, "{:.0f}")
    return f"{x:.0f}"


print(f"{'rank':>4}{'save MB/s':>11}{'its file':>10}{'load MB/s':>11}{'copy MB/s':>11}")
for r, (s, sr, ld, c) in enumerate(zip(saves, save_rates, loads, copies)):
    print(f"{r:>4}{rate('save-rate', sr, save_rates):>11}{s['bytes_written'] / s['write_seconds'] / 1e6:>10.0f}"
          f"{ld['bytes_read'] / ld['seconds'] / 1e6:>11.0f}{rate('copy-rate', c, copies):>11}")
assert all(s["bytes_written"] > 0 and ld["bytes_read"] > 0 for s, ld in zip(saves, loads))

# %% [markdown]
# A copy moves bytes inside the kernel (`sendfile`). A save also checksums every byte — XXH3-64,
# about 20 GB/s per core here (SHA-256, which format version 1 used: 1.7 GB/s), so about 1 ms
# per 20 MB — and then the ranks exchange descriptions and checksums once, rank 0 writes the
# metadata, fsyncs and renames; a load checksums again to verify and copies into the live
# tensors. Those costs are nearly fixed per save (tens of milliseconds here, four ranks on two
# cores): a small state feels them, a large one does not. The table above is one sample on a
# shared 2-core machine: the rates move a lot from run to run. For the comparison — with
# PyTorch's DCP beside it — take the medians of `benchmarks/bench_checkpoint.py` (recorded in
# `benchmarks/RESULTS.md`). On a GPU node the same design is bound by the device-to-host copy
# and the storage's bandwidth. What the checksums buy is §7.

# %% [markdown]
# ## 7. When a file is damaged
# One flipped byte in a copy of rank 2's file. The load names the file and the tensor, and
# changes nothing: ranks read and verify everything first and copy only when all succeeded.

# %%
# NBVAL_CHECK_OUTPUT
bad = WORK / "damaged"
shutil.copytree(ck, bad)
f = bad / "rank2.safetensors"
raw = bytearray(f.read_bytes())
raw[len(raw) // 2] ^= 0x01
f.write_bytes(bytes(raw))
net = GPT("tiny", seed=5)
opt = torch.optim.AdamW(net.parameters(), lr=1e-3)
before = hashlib.sha256(b"".join(p.detach().numpy().tobytes() for p in net.parameters())).hexdigest()
try:
    checkpoint.load(net, opt, bad, comm=Comm())              # one process loads all 4 ranks' state
except checkpoint.CheckpointError as e:
    print("CheckpointError:", str(e).replace(str(WORK), "WORK"))
after = hashlib.sha256(b"".join(p.detach().numpy().tobytes() for p in net.parameters())).hexdigest()
print("model unchanged:", before == after)
assert before == after

# %% [markdown]
# ## 8. Saving without stopping
# A synchronous save holds the training step for the whole write: hash, write, fsync, the
# ranks' exchange, rank 0's metadata and renames. `save(..., background=True)` holds it only
# while each rank copies its pieces to host memory; a thread of its own writes the copy,
# exchanges with the other ranks' threads (in a process group of its own: in the training's
# group its collectives would pair up with the training's) and commits, while training goes on
# changing the live tensors. PyTorch's `torch.distributed.checkpoint.async_save` does the same
# for FSDP2. The three, on the same four ranks and the same state, in three rounds (the order
# rotates each round); after each call returns, every rank computes — fixed matmul bursts,
# standing in for the next steps — until its save is on disk. Per save, the slowest rank's:
# **stall** (the call until it returns: the step is blocked), **slowed** (how much longer the
# compute beside the write took than alone), **visible** = stall + slowed, **written** (the
# call until the checkpoint is on disk) — each row one round, the median one by visible cost, so
# that its columns add up (to within the rounding of the printed milliseconds).

# %%
stalls = R4.run(save_stalls, str(WORK / "stalls"), 3)

# %%
# NBVAL_IGNORE_OUTPUT
med = {name: {m: v * 1e3 for m, v in median_round(stalls, name).items()} for name in SAVES}
keys = {"synchronous": "sync", "background": "background", "DCP async_save": "async"}
print(f"ms, slowest rank, median round of 3  {'stall':>12}{'+ slowed':>10}{'= visible':>11}{'written':>9}")
for name in SAVES:
    m = med[name]
    print(f"{name:<37}{glue(f'stall-{keys[name]}-ms', m['stall'], '{:.0f}'):>12}{m['slowed']:>10.0f}"
          f"{glue(f'visible-{keys[name]}-ms', m['visible'], '{:.0f}'):>11}{m['written']:>9.0f}")
print(f"background / synchronous: stall {glue('stall-ratio', med['background']['stall'] / med['synchronous']['stall'], '{:.2f}')}, "
      f"visible {glue('visible-ratio', med['background']['visible'] / med['synchronous']['visible'], '{:.2f}')}")

# %%
# NBVAL_CHECK_OUTPUT
last = Path(stalls[0]["last"])
same = {f.name: f.read_bytes() for f in sorted((last / "background").iterdir())} == \
       {f.name: f.read_bytes() for f in sorted((last / "synchronous").iterdir())}
print("each save written, on every rank and in every round:",
      all(0 < m["stall"] <= m["written"] for o in stalls for r in o["rounds"] for m in r.values()))
print("the background save's files are the synchronous save's, byte for byte:", same)
print("DCP's async_save left its checkpoint (.metadata and one file per rank):",
      (last / "dcp_async" / ".metadata").exists() and len(list((last / "dcp_async").glob("*.distcp"))) == 4)
assert same

# %% [markdown]
# The stall is what a background save is for, and it shrinks (the table above; on this 2-core
# machine the benchmark's medians put it at 0.19–0.46× a synchronous save's). But the write is
# not free: here the four ranks already use both cores, so the writer thread's CPU — checksums,
# the copy into the page cache, the exchange — comes out of the compute beside it, and *visible*
# can exceed a synchronous save's. On a GPU node the step's compute is on the device and the
# host cores mostly wait, which is where a background save pays in full.
#
# ### The memory: a full state on rank 0, against a sharded save
# Each way of saving allocates something on top of the state a rank holds anyway. Measured here
# tensor by tensor as each is made (`course.ch09.save_peaks`, after one FSDP step): the sharded
# save writes from the live shards and allocates no tensor; the background save copies the
# rank's share to host memory; a full-state save first assembles every parameter and both
# moments, whole, on rank 0 (`full_state_on_rank0`: the other ranks send their pieces straight
# into place) — and the gathered state must be the sharded checkpoint's, element for element.

# %%
peaks = R4.run(save_peaks, str(WORK / "peaks"))

# %%
# NBVAL_CHECK_OUTPUT
N = len(peaks)
print(f"{'rank':>4}{'holds':>13}{'+ sharded':>11}{'+ background':>14}{'+ full state':>14}{'sent':>13}")
for o in peaks:
    full = glue("full-state-bytes", o["full"], "{:,}") if o["rank"] == 0 else f"{o['full']:,}"
    print(f"{o['rank']:>4}{o['held']:>13,}{o['sharded']:>11,}{o['background']:>14,}{full:>14}{o['sent']:>13,}")
    assert o["held"] == o["background"] == STATE // N and o["sharded"] == 0
    assert (o["full"], o["sent"]) == ((STATE, 0) if o["rank"] == 0 else (0, STATE // N))
p0 = peaks[0]
print(f"rank 0 at its peak: sharded {glue('sharded-save-peak', p0['held'] + p0['sharded'], '{:,}')} = 12Ψ/N; "
      f"background {glue('background-save-peak', p0['held'] + p0['background'], '{:,}')} = 2 · 12Ψ/N; "
      f"full state {glue('full-state-peak', p0['held'] + p0['full'], '{:,}')} = 12Ψ(1 + 1/N)")
print(f"full state / sharded: {glue('full-vs-sharded', (p0['held'] + p0['full']) / (p0['held'] + p0['sharded']), '{:.0f}×')} = N + 1; "
      f"the gathered state equals the sharded checkpoint: {p0['full_equals_checkpoint']}")
assert p0["held"] + p0["full"] == STATE * (N + 1) // N and p0["full_equals_checkpoint"]

# %% [markdown]
# Exactly the formula: rank 0 needs 12Ψ more for a full-state save — at its peak N + 1 times
# what a sharded save needs — while the other ranks allocate nothing (they send from their
# shards). For a 7B model in fp32 with AdamW, 12Ψ is 84 GB on one host: the memory sharding
# removed, back on one rank. A background save costs each rank its share again, 12Ψ/N, for as
# long as its write takes.
#
# ### Killed while writing
# A background save is still a save: its thread runs the same four phases, so a rank that dies
# while its thread writes leaves what a synchronous save killed midway leaves. Here, in a pool of
# its own (a rank is killed on purpose): two FSDP ranks train two steps saving in the background
# after each, resume and train on; inside the next background write, rank 1 writes the first
# 1,000 bytes of its file, fsyncs them and is SIGKILLed while rank 0 trains on.

# %%
# NBVAL_IGNORE_OUTPUT
killed = WORK / "killed"
died = None
try:
    with Ranks(2, timeout=120) as own:
        own.run(killed_mid_write, str(killed), 1)
except RankError as e:
    died = e
print("the run failed:", str(died).splitlines()[0][:100])

# %%
# NBVAL_CHECK_OUTPUT
saving = WORK / ".killed.saving"
print("the pool reported the dead rank:", isinstance(died, RankError))
print(f"{saving.name}: rank 1's file {(saving / 'rank1.safetensors').stat().st_size:,} bytes, "
      f"metadata.json there: {(saving / 'metadata.json').exists()} (never renamed into place)")
net = GPT("tiny", seed=7)
opt = torch.optim.AdamW(net.parameters(), lr=1e-3)
info = checkpoint.load(net, opt, killed, comm=Comm())     # one process: both ranks' pieces, every block verified
print(f"{killed.name}: the checkpoint of step {info['step']} loads, saved by {info['saved_world_size']} ranks")
checkpoint.save(net, opt, killed, comm=Comm(), step=3)      # the next save clears the dead one away
print(f"after the next save: {saving.name} there: {saving.exists()}; {killed.name} holds step "
      f"{checkpoint.read_metadata(killed)['step']}: {sorted(f.name for f in killed.iterdir())}")
assert info["step"] == 2 and not saving.exists()

# %% [markdown]
# ## 9. DeepSpeed's checkpoints
# DeepSpeed's engine saves a format of its own (`engine.save_checkpoint`): per rank, a pickled
# `*_optim_states.pt` with the rank's partition of the fp32 masters and of Adam's moments, and
# the parameters' names and shapes in `*_model_states.pt`. Here DeepSpeed trains the tiny GPT at
# ZeRO-3 on two ranks and saves; the same model under PyTorch's FSDP2 saves its state with DCP
# (`dcp.save`). Then the ways to take DeepSpeed's checkpoint elsewhere, each run as a user runs
# it: DeepSpeed's `zero_to_fp32.py` (weights only), its universal checkpoint
# (`python -m deepspeed.checkpoint.ds_to_universal`), and `python -m minishard from-deepspeed`
# (`checkpoint.from_deepspeed`), which reads the pickles weights-only — no code from the files
# runs — and writes this chapter's format.
#
# <details><summary>中文</summary>
#
# **DeepSpeed 的检查点。** DeepSpeed 用自己的格式保存：每个 rank 一个 pickle 的
# `*_optim_states.pt`（本 rank 那一份 fp32 主权重和 Adam 的两个矩），参数名和形状在
# `*_model_states.pt` 里。这里 DeepSpeed 在两个 rank 上用 ZeRO-3 训练 tiny GPT 并保存；同一个模型在
# FSDP2 下用 DCP 保存。然后像用户那样依次运行三种转换：`zero_to_fp32.py`（只有权重）、通用检查点
# （universal checkpoint，`ds_to_universal`），以及 `python -m minishard from-deepspeed`——它只按权重
# 读取 pickle，不运行文件里的任何代码，写出本章的格式。
#
# </details>

# %%
DS = WORK / "ds"
ds_run = R2.run(deepspeed_and_dcp, str(DS))          # DeepSpeed at ZeRO-3, then FSDP2 and DCP


def as_a_user_runs_it(*argv):
    subprocess.run([sys.executable, *argv], check=True, capture_output=True)


as_a_user_runs_it(str(DS / "deepspeed" / "zero_to_fp32.py"), str(DS / "deepspeed"), str(DS / "fp32"),
                  "--safe_serialization")
as_a_user_runs_it("-m", "deepspeed.checkpoint.ds_to_universal", "--input_folder",
                  str(DS / "deepspeed" / "global_step2"), "--output_folder", str(DS / "universal"),
                  "--inject_missing_state")
as_a_user_runs_it("-m", "minishard", "from-deepspeed", str(DS / "deepspeed"), str(DS / "minishard"),
                  "--model", "tiny")
resumed = R3.run(train, TrainConfig(strategy="fsdp", steps=1, micro_batch=GLOBAL // 3, seed=7, rank_seeds=True,
                                    resume_from=str(DS / "minishard"), **KW))

# %%
# NBVAL_CHECK_OUTPUT
def on_disk(folder):
    files = [f for f in Path(folder).rglob("*") if f.is_file()]
    return len(files), sum(f.stat().st_size for f in files)


forms = {"DeepSpeed's checkpoint, as saved": ("ds", DS / "deepspeed"),
         "zero_to_fp32.py: the weights": ("fp32", DS / "fp32"),
         "DeepSpeed's universal checkpoint": ("universal", DS / "universal"),
         "minishard's, from_deepspeed": ("minishard", DS / "minishard"),
         "DCP: FSDP2's state, dcp.save": ("dcp", DS / "dcp")}
print(f"{'the same training state (12Ψ)':<34}{'files':>6}{'MB':>8}{'/ 12Ψ':>8}")
for name, (key, folder) in forms.items():
    n, nbytes = on_disk(folder)
    print(f"{name:<34}{glue(f'{key}-files', n, '{:,}'):>6}{glue(f'{key}-mb', nbytes / 1e6, '{:.1f}'):>8}"
          f"{nbytes / STATE:>8.2f}")

# %%
# NBVAL_CHECK_OUTPUT
checkpoint.export(DS / "minishard", DS / "export")
exported, z2f = checkpoint.load_exported(DS / "export"), load_file(DS / "fp32" / "model.safetensors")
same = exported.keys() == z2f.keys() and all(torch.equal(exported[n], z2f[n]) for n in z2f)
print("the export of the converted checkpoint equals zero_to_fp32's weights, bit for bit:", same)
ds_meta = checkpoint.read_metadata(DS / "minishard")
print(f"converted: step {ds_meta['step']}, {ds_meta['optimizer']['class']} at step {ds_meta['optimizer']['step']:.0f}, "
      f"{sum(n.startswith('exp_avg/') for n in ds_meta['tensors'])} tensors of each moment, written by "
      f"{ds_meta['world_size']} ranks")
want = statistics.mean(r["next_loss"] for r in ds_run)         # DeepSpeed's own next step
got = statistics.mean(r["losses"][0] for r in resumed)
print(f"FSDP on 3 ranks, from other weights, resumes at step {resumed[0]['checkpoint']['load']['step']}; "
      f"its loss is DeepSpeed's next step's within 1e-6: {abs(got - want) <= 1e-6 * want}")
print("DeepSpeed's types the reader lets in, each as data:", ", ".join(n.rsplit(".", 1)[1] for n, _ in ALLOWED))
assert same and abs(got - want) <= 1e-6 * want and resumed[0]["checkpoint"]["load"]["step"] == 2

# %% [markdown]
# Five forms of one training state. DeepSpeed's own checkpoint resumes only on as many ranks as
# saved it (`load_checkpoint` refuses another data-parallel world size when it loads the
# optimizer state), and every reader of it unpickles; `zero_to_fp32.py` keeps the weights, a third
# of the state, and drops the moments; the universal checkpoint is a folder per parameter — a
# pickled file for the master and for each moment — plus, at ZeRO-3, a copy of rank 0's whole
# optimizer file, and DeepSpeed loads it on any world size with `"checkpoint": {"load_universal":
# true}` in its config. The converted checkpoint is this
# chapter's: one file per saving rank, the same elements, padding removed, loadable by any
# strategy on any world size. DCP writes FSDP2's state in the same spirit.

# %%
R2.close()
R3.close()
R4.close()
shutil.rmtree(WORK)

# %% [markdown]
# > **Takeaway.** A sharded checkpoint is only as useful as its description. Saving each rank's
# > slice is easy and fast — four files of exactly 12Ψ/4, written in parallel, nothing twice. What
# > makes it resumable on another layout is metadata that says which *elements of which tensor*
# > each file holds: then any world size and any strategy computes its own reads (64 → 32 is two
# > files per new rank under FSDP, all 64 under ZeRO-1), loads bit-exactly, and trains on. Plan
# > the other two paths before you need them: resharding (test it while the run is healthy) and
# > the export to complete per-layer weights (run it on an early checkpoint, load it strictly
# > into the inference model, compare). And a background save (§8) takes the wait out of the
# > step, not the work: measure its visible cost, not its stall.
#
# <details><summary>中文</summary>
#
# > **要点。** 分片检查点有多大用处，取决于它的描述。保存每个 rank
# > 的那一片既简单又快——四个文件，每个恰好 12Ψ/4，并行写出，没有任何重复。
# > 让它能在另一种布局上恢复的，是说明每个文件持有*哪个张量的哪些元素*的 metadata：有了它，
# > 任何进程总数、任何策略都能算出自己该读什么（64 → 32 时，FSDP 下每个新 rank 读两个文件，ZeRO-1
# > 下读全部 64 个），逐位一致地加载，然后接着训练。另外两条路要在用到之前规划好：
# > 重分片（趁训练正常时测试），以及导出完整的逐层权重（在早期检查点上跑一遍，
# > 严格加载进推理模型并比对）。后台保存（§8）把等待移出了训练步，却没有省掉工作：要测它的可见开销，
# > 而不是阻塞时间。
#
# </details>
#
# **Questions**
#
# 1. A ZeRO-1 run on 8 ranks saves with this format. How many bytes does each rank write, and
#    why is it not "its optimizer shard plus the whole model"?
#
# <details><summary>Answer</summary>
#
# 12Ψ/8 each (fp32 AdamW). The parameters are replicas on every rank; saving them 8 times would
# write 4Ψ·8. Each rank writes chunk r of every replicated tensor instead, and its own chunk of
# the moments: 4Ψ/8 + 8Ψ/8. The metadata makes the origin irrelevant to the loader.
# </details>
#
# 2. Why must the loading ranks agree before any of them copies a single byte into its model?
#
# <details><summary>Answer</summary>
#
# If rank 1 finds a corrupted block after rank 0 has already loaded, the two ranks hold states
# from different checkpoints; training would go on, silently wrong. Reading and verifying
# everything first, then one collective "all succeeded?", then copying, makes a failed load
# change nothing anywhere (what was read stays memory-mapped until the copy).
# </details>
#
# 3. The 64 → 32 plan reads exactly what is needed; 64 → 48 reads about half again as much.
# Where does the waste come from, and does it grow with the model?
#
# <details><summary>Answer</summary>
#
# From whole-block reads: a rank reads whole 64 KiB checksum blocks so that it can verify them,
# and a 64-way piece of a small tensor is smaller than one block, so a new rank that needs part
# of it reads all of it. The waste is at most two blocks per tensor per rank; with a real model's
# megabyte pieces it is negligible.
# </details>

# %% [markdown]
# ## Exercise: the resharding read plan
# A flat tensor saved by N ranks in chunks of ceil(numel / N) is loaded on M ranks in chunks of
# ceil(numel / M). Write, for every new rank, which element ranges of which saved ranks' files it
# reads. The check compares your plan with minishard's reader (`checkpoint.plan_reads`) for even
# and uneven splits, 64 → 32 included.
#
# Write it in the cell below (or edit the stub in
# [`minishard/course/exercises/ch09.py`](../minishard/course/exercises/ch09.py)), then run the check. A
# reference solution is in [`solutions/ch09.py`](../solutions/ch09.py): try first.
#
# <details><summary>中文</summary>
#
# **练习：重分片的读取计划。** 一个扁平张量由 N 个 rank 按 ceil(numel / N) 大小的块保存，再由 M
# 个 rank 按 ceil(numel / M) 大小的块加载。为每个新 rank 写出它要从哪些原 rank
# 的文件里读哪些元素区间。检查程序会在能整除和不能整除的情况下（包括 64 → 32）把你的计划与 minishard
# 的读取器（`checkpoint.plan_reads`）比较。
#
# 在下面的单元格里写（或编辑
# [`minishard/course/exercises/ch09.py`](../minishard/course/exercises/ch09.py) 里的桩函数），
# 然后运行检查。参考答案在 [`solutions/ch09.py`](../solutions/ch09.py)：先自己试。
#
# </details>

# %%
def read_plan(numel, saved_world_size, world_size):
    """For each new rank, the reads [(saved_rank, start, stop), ...] (element ranges, in order,
    non-empty) that deliver exactly its chunk."""
    raise NotImplementedError("your code here")

# %%
# NBVAL_CHECK_OUTPUT
from minishard.course.exercises import ch09

ch09.check_read_plan(read_plan)

# %% [markdown]
# ## Exercise: which checkpoint survives
# A save of `ck` (synchronous or in the background: the same four phases) was killed somewhere.
# Given the directories it left next to each other — `ck`, `.ck.saving`, `.ck.old`, each with or
# without its `metadata.json` — return the one a load of `ck` reads, or `None`. The check builds
# each case as real directories (copies of a real checkpoint, the metadata removed where the
# save had not written it yet) and asks minishard's loader.
#
# <details><summary>中文</summary>
#
# 第二个练习：**哪个检查点留了下来。** 对 `ck` 的一次保存（同步或后台，四个阶段相同）在某处被杀掉了。
# 给定它留下的几个并列目录——`ck`、`.ck.saving`、`.ck.old`，各自有没有 `metadata.json`——
# 返回加载 `ck` 时实际读取的那个目录，没有完整的检查点就返回 `None`。检查程序把每种情形都做成
# 真实的目录（一个真实检查点的副本；保存还没来得及写 `metadata.json` 的目录，就把它删掉），
# 再交给 minishard 的加载器判断。
#
# </details>

# %%
def survivor(entries):
    """The directory a load of ck reads ("ck", ".ck.old"), or None; ``entries`` maps each
    directory left to whether it holds metadata.json."""
    raise NotImplementedError("your code here")

# %%
# NBVAL_CHECK_OUTPUT
ch09.check_survivor(survivor)
