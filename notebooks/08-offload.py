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
# # 08 · Offload: keep the state off the device, pay for it in transfers
#
# > **Fully sharded, and it still does not fit. Can the state live somewhere else — and what does
# > every step then pay to bring it back?**
#
# <details><summary>中文</summary>
#
# > **已经全分片了，还是放不下。状态能不能放到别处——那样的话，每步又要付出什么代价把它搬回来？**
#
# 卸载（offload）把分片后的状态（参数、梯度、Adam 的矩）挪到主机内存或 NVMe 盘上的文件里，每次 gather
# 前再把该单元的参数分片搬过来。本 notebook 把一个显存放不下的配置变成能训练的配置，并测量每步在
# 两层之间搬运了什么。中文讲解见 [tutorial/zh/08-offload.md](../tutorial/zh/08-offload.md)。
#
# </details>
#
# After FSDP a rank holds 16Ψ/N bytes of training state plus what one step needs on the spot:
# activations and a few gathered units. Offload moves the first part — the parameter shards,
# their gradients, Adam's moments — to a larger, slower tier: host memory, or files on an NVMe
# drive. The device keeps only what compute touches right now, and each unit's parameter shard
# comes over for every gather: parameter *and* optimizer offload, as PyTorch FSDP2's
# `CPUOffloadPolicy` or DeepSpeed ZeRO-3's `offload_param` + `offload_optimizer` (not
# ZeRO-Offload, which keeps the fp16 parameters on the GPU; §3.1 measures that choice beside this
# one). This notebook shows a
# configuration that runs out of device memory become one that trains, and measures what
# crosses between the tiers every step; the reasoning is in
# [tutorial/08-offload.md](../tutorial/08-offload.md).
#
# **The one-line "syntax"** — fp32 shards, a model of L blocks plus a root unit, N ranks:
#
# $$\text{device} = \text{activations} + \text{gathered units} + \text{buffers},\qquad
# \text{host} = \frac{16\,\Psi}{N},$$
# $$\text{per step:}\quad \text{in} = \big(2L\cdot\text{block} + \text{root}\big)\frac{4}{N}\ \text{bytes},
# \qquad \text{out} = \big(L\cdot\text{block} + \text{root}\big)\frac{4}{N} = \frac{4\,\Psi}{N}\ \text{bytes}.$$
#
# ```python
# train(rank, TrainConfig(strategy="fsdp_flat", offload="host"))                       # CPU memory
# train(rank, TrainConfig(strategy="fsdp_flat", offload="disk", offload_dir="/nvme"))  # memory-mapped files
# ```
#
# <details><summary>中文</summary>
#
# **一行"语法"**——fp32 分片，L 个 block 加一个 root 单元，N 个 rank：设备上只剩激活值、已收集的单元和
# 缓冲区，16Ψ/N 的状态放在主机（或磁盘）上；每步搬入 (2L·block + root)·4/N 字节（block 收集两次，
# root 一次），搬出 (L·block + root)·4/N = 4Ψ/N 字节的梯度。`offload="host"` 用主机内存，
# `offload="disk"` 用内存映射文件。
#
# </details>
#
# Terms, in English and Chinese: [glossary · 术语表](../tutorial/glossary.md).

# %%
import math
import statistics
import tempfile
from pathlib import Path

from minishard import GPT, Ranks
from minishard.planner.costmodel import DEVICES, LINKS, Cluster, plan
from minishard.core.launch import RankError
from minishard.course.ch08 import disk_tier_files, offload_compare, transfer_table
from minishard.course.glue import glue
from minishard.training.loop import TrainConfig, train

TINY = GPT("tiny", device="meta")
PSI = TINY.num_params()
N = 2
BLOCK_SHARD = 4 * math.ceil(sum(p.numel() for p in TINY.blocks[0].parameters()) / N)   # bytes
ROOT_SHARD = 4 * math.ceil(sum(p.numel() for n, p in TINY.named_parameters()
                               if not n.startswith("blocks.")) / N)
L = len(TINY.blocks)
print(f"tiny GPT, {N} ranks: 16Ψ/N = {glue('state-bytes-per-rank', 16 * PSI // N, '{:,}')} B of state per rank; "
      f"one block's shard {glue('block-shard-bytes', BLOCK_SHARD, '{:,}')} B, "
      f"the root's {glue('root-shard-bytes', ROOT_SHARD, '{:,}')} B")
R2 = Ranks(2)

# %% [markdown]
# ## 1. A configuration that does not fit
# Give each rank a device of 80 MiB (`device_budget`: the ledger raises `DeviceOutOfMemory` when
# an allocation would cross it) and train the tiny model with FSDP, micro-batch 2. First without
# a budget, to see what it needs:

# %%
BUDGET = 80 * 2**20
KW = dict(strategy="fsdp_flat", model="tiny", micro_batch=2, steps=2)
plain = R2.run(train, TrainConfig(**KW))

# %%
# NBVAL_CHECK_OUTPUT
print(f"needs {glue('plain-peak-bytes', plain[0]['ledger']['peak'], '{:,}')} B per rank at its peak; "
      f"the device has {glue('budget-bytes', BUDGET, '{:,}')} B")
try:
    R2.run(train, TrainConfig(device_budget=BUDGET, **KW))
    raise AssertionError("plain FSDP should not fit")
except RankError as e:
    print(e.error.split(" would take")[0] + " ... over its budget")
    held = e.error[e.error.index("held now"):].rstrip("')")
    head, items = held.split(": ", 1)                    # "held now (MiB): activations 16.1, ..."
    print("  " + head + ": " + ", ".join(
        f"{c} {glue('oom-held-' + c.replace('_', '-'), v)}" for c, v in (i.rsplit(" ", 1) for i in items.split(", "))))
    assert e.error.startswith("DeviceOutOfMemory") and "exp_avg" in held
assert plain[0]["ledger"]["peak"] > BUDGET
R2 = Ranks(2)                       # a rank that failed closed the pool: start a fresh one (warm)

# %% [markdown]
# It does not even finish: step 1 runs (Adam's moments do not exist yet), step 2 runs out in
# forward, once `exp_avg` and `exp_avg_sq` have joined the state. Now the same run with the
# sharded state in host memory, and once more in memory-mapped files (the disk tier):

# %%
offload_dir = tempfile.mkdtemp(prefix="minishard-offload-")
host = R2.run(train, TrainConfig(offload="host", device_budget=BUDGET, **KW))
host_events = R2.last_events
disk = R2.run(train, TrainConfig(offload="disk", offload_dir=offload_dir, device_budget=BUDGET, **KW))

# %%
# NBVAL_CHECK_OUTPUT
for name, out in [("no offload", plain), ("offload='host'", host), ("offload='disk'", disk)]:
    peak = out[0]["ledger"]["peak"]
    peak = glue("host-device-peak", peak, "{:,}") if name == "offload='host'" else f"{peak:,}"
    print(f"{name:<16} device peak {peak:>11} B   losses bit-identical to no offload: "
          f"{[o['losses'] for o in out] == [o['losses'] for o in plain]}")
for out in (host, disk):
    assert all(o["ledger"]["peak"] <= BUDGET for o in out)
    assert [o["losses"] for o in out] == [o["losses"] for o in plain]    # the same training, bit for bit
assert not any(Path(offload_dir).iterdir())                              # the files are gone

# %% [markdown]
# Same losses to the last bit: offload changes where the bytes live, not the arithmetic.
#
# ## 2. Where the bytes live
# The ledger files every allocation under a device (`LiveLedger.by_device()`). At the end of the
# run, rank 0:

# %%
# NBVAL_CHECK_OUTPUT
STATE = ("params", "grads", "exp_avg", "exp_avg_sq")
print(f"{'':<16}" + "".join(f"{c:>13}" for c in STATE) + f"{'where':>9}")
for name, out in [("no offload", plain), ("offload='host'", host), ("offload='disk'", disk)]:
    for dev, cats in out[0]["ledger"]["by_device"].items():
        cols = {c: f"{cats.get(c, 0):,}" for c in STATE}
        if name == "no offload":                         # the size the chapter quotes, one of four alike
            cols["params"] = glue("state-category-bytes", cats["params"], "{:,}")
        print(f"{name:<16}" + "".join(f"{cols[c]:>13}" for c in STATE) + f"{dev:>9}")
assert plain[0]["ledger"]["by_device"] == {"device": dict.fromkeys(STATE, 4 * PSI // N)}
assert host[0]["ledger"]["by_device"] == {"host": dict.fromkeys(STATE, 4 * PSI // N)}
assert disk[0]["ledger"]["by_device"] == {"disk": dict.fromkeys(STATE, 4 * PSI // N)}

# %% [markdown]
# Between steps the device holds nothing at all: all 16Ψ/N = 54,951,936 bytes per rank sit in the
# tier.
# What is left on the device is what a step needs while it runs, broken down at its peak:

# %%
# NBVAL_CHECK_OUTPUT
for name, out in [("no offload", plain), ("offload='host'", host)]:
    snap = out[0]["ledger"]["peak_snapshot"]
    parts = {c: glue("host-peak-" + c.replace("_", "-"), b, "{:,}") if out is host else f"{b:,}" for c, b in snap.items()}
    print(f"{name:<16} peak {sum(snap.values()):>11,} B: " + ", ".join(f"{c} {b}" for c, b in parts.items()))
snap = host[0]["ledger"]["peak_snapshot"]
assert not set(STATE) & set(snap)                       # no state on the device, ever
assert plain[0]["ledger"]["peak"] - host[0]["ledger"]["peak"] == 16 * PSI // N   # exactly the state

# %% [markdown]
# The disk tier is what it claims: one memory-mapped file per shard tensor — every unit's
# parameter shard, its gradient shard and its two moments ([`disk_tier_files`](../minishard/course/ch08.py)
# trains one step and lists the rank's folder):

# %%
# NBVAL_CHECK_OUTPUT
files = R2.run(disk_tier_files, tempfile.mkdtemp(prefix="minishard-offload-"))
print(f"rank 0: {glue('disk-tier-files', files[0]['files'])} files, {glue('disk-tier-bytes', files[0]['bytes'], '{:,}')} B; "
      f"sizes {sorted(set(files[0]['sizes']))}")
assert files[0]["files"] == 4 * (L + 1)                  # params, grads, m, v for every unit
assert files[0]["bytes"] == 16 * PSI // N and not files[0]["left_behind"]

# %% [markdown]
# ## 3. What crosses over every step: exactly the state sizes
# Before each all-gather the unit's parameter shard comes in from the tier (h2d); after each
# reduce-scatter the reduced gradient slice goes out (d2h). Blocks are gathered twice per step
# (forward and backward), the root once (it stays gathered from forward to backward). Measured
# per step, against the formula:

# %%
# NBVAL_CHECK_OUTPUT
h2d = (2 * L * BLOCK_SHARD + ROOT_SHARD)
d2h = (L * BLOCK_SHARD + ROOT_SHARD)
print(f"formula: in {glue('transfer-in-bytes', h2d, '{:,}')} B = (2·{L}·{BLOCK_SHARD:,} + {ROOT_SHARD:,}), "
      f"out {glue('transfer-out-bytes', d2h, '{:,}')} B = 4Ψ/N")
for name, out in [("host", host), ("disk", disk)]:
    for o in out:
        print(f"{name} rank {o['rank']}: in", [s["h2d_bytes"] for s in o["transfer"]],
              "out", [s["d2h_bytes"] for s in o["transfer"]])
        assert all(s["h2d_bytes"] == h2d and s["d2h_bytes"] == d2h for s in o["transfer"])
assert d2h == 4 * PSI // N
assert all(s["h2d_bytes"] == 0 for s in plain[0]["transfer"])

# %% [markdown]
# Every transfer is also an event in the trace (`kind="transfer"`, with bytes and seconds). Per
# unit, in the last step on rank 0:

# %%
# NBVAL_CHECK_OUTPUT
table = transfer_table(host_events, rank=0, step=1)
for (direction, unit), (count, nbytes, _) in sorted(table.items()):
    print(f"{direction} {unit:<9} {count} x {nbytes // count:,} B")
for i in range(L):
    assert table["h2d", f"blocks.{i}"][:2] == [2, 2 * BLOCK_SHARD]
    assert table["d2h", f"blocks.{i}"][:2] == [1, BLOCK_SHARD]
assert table["h2d", "root"][:2] == table["d2h", "root"][:2] == [1, ROOT_SHARD]

# %% [markdown]
# The host-tier run in the offline player (no kernel: it plays on the static site too): the
# transfers sit on each rank's comm lane next to the collectives, and "jump to collective" →
# `transfer h2d` / `transfer d2h` steps from one crossing to the next. (Its bars, like the live
# player's, count every byte of the ledger by category wherever it lives, the tier's state
# included; §2 split them by device.) It opens at rank 0's first transfer of the last step:

# %%
from minishard.viz import replay_html
replay_html(host_events, title="FSDP, offload='host', 2 ranks (offline player)",
            start=next(i for i, e in enumerate(host_events)
                       if e["kind"] == "transfer" and e["rank"] == 0 and e.get("step") == 1))

# %% [markdown]
# The optimizer step itself moves nothing: it runs where the state lives (here, the CPU).
#
# ### 3.1 Only the optimizer state — ZeRO-Offload's choice
# Everything offloaded is what FSDP2's `CPUOffloadPolicy` does. ZeRO-Offload (Ren et al., 2021)
# keeps the parameters on the device and offloads only the optimizer's side: the moments and a
# master copy of the parameters live in host memory, and the optimizer step runs there. minishard
# does it with `ShardedOptimizer(model, opt, offload_policy=CPUOffloadPolicy())` on units that
# offload nothing ([`OptimizerOffload`](../minishard/strategies/offload.py)). Once per step — not
# once per gather — every gradient shard goes out and every updated shard comes back, 4Ψ/N bytes
# each way; the device keeps the parameter and gradient shards, 8Ψ/N; the host holds 16Ψ/N either
# way (master 4, gradients 4, moments 8 bytes an element):
#
# $$\text{optimizer only:}\quad \text{in} = \text{out} = \frac{4\,\Psi}{N},\qquad
# \text{device state} = \frac{8\,\Psi}{N};\qquad
# \text{everything:}\quad \text{in} = (2L\cdot\text{block} + \text{root})\frac{4}{N},\
# \text{out} = \frac{4\,\Psi}{N},\qquad \text{device state} = 0.$$
#
# [`offload_compare`](../minishard/course/ch08.py) trains §1's two AdamW steps three ways — nothing,
# the optimizer state, everything offloaded — and reads the ledger and the transfer logs of each
# rank:
#
# <details><summary>中文</summary>
#
# **只卸载优化器状态——ZeRO-Offload 的做法。** 把所有状态都卸载，是 FSDP2 的 `CPUOffloadPolicy` 的做法。
# ZeRO-Offload（Ren 等，2021）把参数留在设备上，只卸载优化器那一侧：Adam 的矩和一份主权重副本放在主机
# 内存里，优化器步也在主机上跑。minishard 的写法是在不做卸载的单元上用
# `ShardedOptimizer(model, opt, offload_policy=CPUOffloadPolicy())`。每步只搬一次（而不是每次
# gather 都搬）：梯度分片搬出，更新后的参数分片搬回，每个方向 4Ψ/N 字节；设备上保留参数分片和梯度分片，
# 共 8Ψ/N；主机上两种做法都是 16Ψ/N（主权重 4、梯度 4、矩 8 字节/元素）。`offload_compare` 用三种方式
# ——不卸载、只卸载优化器状态、全部卸载——训练 §1 的两个 AdamW 步，读出每个 rank 的账本和搬运记录。
#
# </details>

# %%
# NBVAL_CHECK_OUTPUT
runs = {w: R2.run(offload_compare, w) for w in ("nothing", "optimizer", "everything")}
S = 4 * PSI // N                                        # one state category: 4 bytes an element
moved = {w: out[0]["moved"][-1] for w, out in runs.items()}
total = {w: m["h2d"] + m["d2h"] for w, m in moved.items()}
on_device = {w: sum(out[0]["by_device"].get("device", {}).values()) for w, out in runs.items()}
peak = {w: out[0]["peak"] for w, out in runs.items()}
keys = {"optimizer": "opt-only", "everything": "everything"}
print(f"{'offloaded':<11}{'in B/step':>12}{'out B/step':>12}{'device state':>14}{'host state':>12}{'device peak':>13}")
for w, out in runs.items():
    k = keys.get(w)
    cols = [f"{moved[w]['h2d']:,}", f"{moved[w]['d2h']:,}", f"{on_device[w]:,}",
            f"{sum(out[0]['by_device'].get('host', {}).values()):,}", f"{peak[w]:,}"]
    if k:
        cols[0] = glue(f"{k}-in-bytes", moved[w]["h2d"], "{:,}")
        cols[4] = glue(f"{k}-device-peak", peak[w], "{:,}")
    if w == "optimizer":
        cols[1] = glue("opt-only-out-bytes", moved[w]["d2h"], "{:,}")
        cols[2] = glue("opt-only-device-state", on_device[w], "{:,}")
    print(f"{w:<11}" + "".join(f"{c:>{n}}" for c, n in zip(cols, (12, 12, 14, 12, 13))))
print(f"bytes moved per step: everything / optimizer only = "
      f"{glue('moved-ratio', total['everything'] / total['optimizer'], '{:.2f}')}; "
      f"device peak: optimizer only is {glue('opt-only-peak-above', peak['optimizer'] - peak['everything'], '{:,}')} B "
      f"above everything, {peak['nothing'] - peak['optimizer']:,} B below nothing")
for i in range(N):
    nothing, opt, every = (runs[w][i] for w in ("nothing", "optimizer", "everything"))
    assert opt["losses"] == every["losses"] == nothing["losses"] == plain[i]["losses"]
    assert all(m == {"h2d": S, "d2h": S} for m in opt["moved"])               # 4Ψ/N each way
    assert all(m == {"h2d": h2d, "d2h": d2h} for m in every["moved"])          # §3's formula
    assert opt["by_device"] == {"device": {"params": S, "grads": S},
                                "host": {"master": S, "grads": S, "exp_avg": S, "exp_avg_sq": S}}
    assert nothing["peak"] == plain[i]["ledger"]["peak"]                      # §1's run, to the byte
    assert nothing["peak"] - opt["peak"] == 2 * S and nothing["peak"] - every["peak"] == 4 * S
assert peak["everything"] < peak["optimizer"] <= BUDGET < peak["nothing"]

# %% [markdown]
# The trade is exact. Offloading only the optimizer state moves fewer bytes per step — the
# parameters do not come over for every gather, only the updated shard once — but it leaves 8Ψ/N
# of parameters and gradients on the device, so its peak sits exactly that much above
# everything-offloaded's (and 8Ψ/N below no offload's; here it still fits §1's 80 MiB). Which one
# a run wants depends on which is short: device memory (offload everything) or the link (offload
# the optimizer state, and step on the CPU, as ZeRO-Offload does with its vectorised CPU Adam).
# On a GPU ZeRO-Offload keeps fp16 parameters on the device and the fp32 master weights on the
# host, so each crossing carries 2 bytes an element instead of 4; here everything is fp32.
#
# <details><summary>中文</summary>
#
# 这笔交换是精确的。只卸载优化器状态时每步搬的字节更少——参数不必在每次 gather 前都搬过来，只有更新
# 后的分片搬回一次——但设备上留着 8Ψ/N 的参数和梯度，所以它的峰值正好比全部卸载高出这么多（比不卸载低
# 8Ψ/N；这里仍然放得进 §1 的 80 MiB）。选哪一种，看哪样更紧缺：设备显存（全部卸载），还是链路带宽（只卸载
# 优化器状态，并像 ZeRO-Offload 那样用向量化的 CPU Adam 在 CPU 上做优化器步）。在 GPU 上，ZeRO-Offload 把
# fp16 参数留在设备上、fp32 主权重放在主机上，所以每次搬运每个元素是 2 字节而不是 4 字节；这里全部是 fp32。
#
# </details>
#
# ## 4. How long the transfers take — measured here, modelled for a GPU
# **Measured on this machine.** There is no GPU here: "device" and "host" are the same RAM, so a
# host-tier transfer is a memory copy, and a disk-tier transfer a copy out of memory-mapped pages
# that the page cache still holds (nothing waits for a drive). These seconds are real, but they
# measure memcpy, not PCIe or NVMe:

# %%
# NBVAL_IGNORE_OUTPUT
rates = {}
for name, out in [("host", host), ("disk", disk)]:
    for d in ("h2d", "d2h"):
        sec = statistics.median(s[f"{d}_s"] for s in out[0]["transfer"])
        nbytes = out[0]["transfer"][-1][f"{d}_bytes"]
        rates[name, d] = (nbytes, sec, f"{nbytes / sec / 1e9:.2f}")
lo = min(rates, key=lambda key: float(rates[key][2]))      # the range the chapter quotes, as printed
hi = max(rates, key=lambda key: float(rates[key][2]))
for (name, d), (nbytes, sec, rate) in rates.items():
    rate = (glue("transfer-rate-min", rate) if (name, d) == lo else
            glue("transfer-rate-max", rate) if (name, d) == hi else rate)
    print(f"{name} {d}: {nbytes / 1e6:6.2f} MB per step in {sec * 1e3:5.2f} ms -> {rate:>5} GB/s "
          f"(measured: memcpy in RAM{' via the page cache' if name == 'disk' else ''})")
for name, out in [("no offload", plain), ("host", host), ("disk", disk)]:
    print(f"{name:<11} median step {statistics.median(out[0]['step_times']) * 1e3:6.0f} ms (measured, busy 2-core CPU)")

# %% [markdown]
# **Modelled for a GPU.** On a GPU server the same bytes cross PCIe. The planner's link figures
# (`minishard.planner.costmodel.LINKS`) give 25 GB/s for PCIe 4.0 x16 and 50 GB/s for PCIe 5.0 x16 per
# direction (practical rates; the specifications' raw rates are 32 and 64 GB/s). For comparison,
# reading the same bytes from the GPU's own memory: 3.35 TB/s for an H100 SXM's HBM3 and
# 4.8 TB/s for an H200's HBM3e (NVIDIA's H100 and H200 datasheets; `costmodel.DEVICES` carries
# capacities and FLOP/s, not memory bandwidth, so they are written out here).

# %%
# NBVAL_CHECK_OUTPUT
HBM = {"H100 SXM HBM3": 3.35e12, "H200 HBM3e": 4.8e12}          # bytes/s, NVIDIA datasheets
PCIE = {"PCIe 4.0 x16": LINKS["pcie4-x16"].bandwidth, "PCIe 5.0 x16": LINKS["pcie5-x16"].bandwidth}


def transfer_bytes(model: str, n: int) -> tuple[int, int]:
    """Per rank per step, fp32 shards: in (2 gathers per block, 1 for the root), out (4Ψ/N)."""
    net = GPT(model, device="meta")
    block = math.ceil(sum(p.numel() for p in net.blocks[0].parameters()) / n)
    root = math.ceil((net.num_params() - len(net.blocks) * sum(p.numel() for p in net.blocks[0].parameters())) / n)
    return 4 * (2 * len(net.blocks) * block + root), 4 * (len(net.blocks) * block + root)


cases = [("tiny, N=2 (this notebook)", transfer_bytes("tiny", 2)),
         ("Llama-3-70B, N=8", transfer_bytes("llama3-70b", 8))]
assert cases[0][1] == (h2d, d2h)                                   # the formula measured in §3
def seconds(s: float) -> str:
    return f"{s:.3g} s" if s >= 1 else f"{s * 1e3:.3g} ms" if s >= 1e-3 else f"{s * 1e6:.3g} µs"


print(f"{'shards in, per rank per step':<30}{'bytes':>12}" + "".join(f"{k:>15}" for k in [*PCIE, *HBM]))
for name, (i, o) in cases:
    cols = {k: seconds(i / bw) for k, bw in {**PCIE, **HBM}.items()}
    gb = f"{i / 1e9:.3f}"
    if name.startswith("Llama-3-70B"):                   # the row the chapter quotes
        gb = glue("llama70b-shards-in-gb", gb)
        for k, fig in (("PCIe 5.0 x16", "llama70b-in-pcie5"), ("PCIe 4.0 x16", "llama70b-in-pcie4"),
                       ("H100 SXM HBM3", "llama70b-in-h100-hbm3")):
            cols[k] = glue(fig, cols[k])
    print(f"{name:<30}{gb:>9} GB" + "".join(f"{c:>15}" for c in cols.values()))
print(f"HBM3 / PCIe 5.0 x16 = {glue('hbm3-pcie5-ratio', HBM['H100 SXM HBM3'] / PCIE['PCIe 5.0 x16'], '{:.0f}')}x")
assert HBM["H100 SXM HBM3"] / PCIE["PCIe 5.0 x16"] > 10            # more than an order of magnitude

# %% [markdown]
# (All of the above is modelled: bytes from the measured formula, seconds from published
# bandwidths.) On a real GPU machine, [`scripts/gpu_check.py`](../scripts/gpu_check.py) measures
# these bandwidths — device-to-device (HBM), pinned and pageable host↔device copies — and an FSDP
# step of a 1.1B-parameter model with and without offload. It is not run here: this machine has no
# GPU.
#
# ## 5. What offload makes possible, at scale (modelled)
# Llama-3-70B on one node of eight 80 GB H100s, FSDP with activation recomputation, micro-batch 1
# at 8,192 tokens. The planner (`costmodel.plan`) builds the memory from the same ledger code the
# runs above are checked against:

# %%
# NBVAL_CHECK_OUTPUT
node = Cluster(DEVICES["h100-80gb"], gpus_per_node=8)
for off in (None, "host"):                      # the tier, named as TrainConfig names it
    p = plan("llama3-70b", node, "fsdp", recompute=True, offload=off)
    state = sum(v for c, v in p.memory.items() if c in STATE + ("master",))
    total = glue(f"plan-{'offload' if off else 'no-offload'}-gib", p.total_memory / 2**30, "{:.1f}")
    state = glue("plan-no-offload-state-gib", state / 2**30, "{:.1f}") if not off else f"{state / 2**30:.1f}"
    print(f"offload={off!r:<6}: {total:>6} GiB per GPU -> {'fits' if p.fits else 'does not fit'}"
          f"   (state on the device: {state} GiB)")
    assert p.fits == (off == "host")
psi70 = GPT("llama3-70b", device="meta").num_params()
F = 0.4 * DEVICES["h100-80gb"].flops            # achieved FLOP/s: 40% of the dense bf16 peak
T = 8192                                        # tokens per GPU per step
compute = 6 * psi70 * T / F                     # forward + backward (recomputation adds more)
i, o = cases[1][1]
t_in = i / PCIE["PCIe 5.0 x16"]
print(f"host memory the node needs for the offloaded state: 16Ψ = {glue('host-state-tb', 16 * psi70 / 1e12, '{:.2f}')} TB")
print(f"per GPU per step: compute {glue('compute-s', compute, '{:.1f}')} s; "
      f"shards in over PCIe 5.0 {glue('shards-in-gb', i / 1e9, '{:.1f}')} GB = {glue('shards-in-s', t_in, '{:.2f}')} s "
      f"({glue('transfer-share', t_in / compute, '{:.0%}')} of the compute); "
      f"gradients out {glue('grads-out-gb', o / 1e9, '{:.1f}')} GB the other way")
recompute = 8 * psi70 * T / F                   # with recomputation's extra forward
print(f"with recomputation's extra forward: compute {glue('compute-recompute-s', recompute, '{:.1f}')} s, "
      f"the shards in {glue('transfer-share-recompute', t_in / recompute, '{:.0%}')} of it")

# %% [markdown]
# On the device it needs 160.9 GiB per GPU; with the state offloaded, 29.5 GiB. The host must then
# hold 1.13 TB of state for the node, and each GPU pulls about 70 GB of fp32 shards over PCIe
# every step. At this size that is still small next to the compute — if the shard copies are
# prefetched like the all-gathers of chapter 07, they can hide behind it. Not counted, and not
# small: the optimizer step now runs on the CPU, streaming all 16Ψ/N bytes of state through host
# memory every step, with the eight GPUs' processes sharing that memory's bandwidth.
#
# The ratio is what matters. Per GPU the inbound shards take about 8Ψ/(N·β_h) seconds (β_h the PCIe
# bandwidth; the 4Ψ/N of gradients go out at the same time, the other way) and the compute
# about 6Ψ·T/F (T tokens per GPU per step, F achieved FLOP/s), so
#
# $$\frac{\text{transfer}}{\text{compute}} \approx \frac{4F}{3\,N\,T\,\beta_h}.$$
#
# Few tokens per step, few GPUs to spread the state over, or a slow link — and the transfer
# dominates. That is the capacity-to-transfer trade in one line:

# %%
# NBVAL_CHECK_OUTPUT
B = PCIE["PCIe 5.0 x16"]
for n, tokens in [(8, 8192), (8, 1024), (2, 1024)]:
    ratio = glue(f"transfer-compute-n{n}-t{tokens}", 4 * F / (3 * n * tokens * B), "{:.2f}")
    print(f"N={n}, {tokens:>5} tokens per GPU per step: transfer / compute ≈ {ratio:>5}")
assert abs(4 * F / (3 * 8 * T * B) - t_in / compute) < 0.05 * t_in / compute   # the one-liner, checked

# %%
R2.close()

# %% [markdown]
# ## 6. So: when is offload worth it?
#
# > **Takeaway.** Offload moves the sharded state — parameters, gradients, optimizer moments,
# > 16Ψ/N bytes per rank — to host memory or memory-mapped files; the device keeps only
# > activations and the units being gathered. Measured here: a run that dies under an 80 MiB
# > budget trains under it, bit for bit the same, and every step moves exactly the shard bytes:
# > each unit's parameters in once per gather, its gradient slice out once. What it costs is
# > modelled, not measured, on this CPU: those bytes cross PCIe, more than an order of magnitude
# > slower than HBM, and the optimizer step runs on the CPU. A capacity problem becomes a transfer
# > problem. Use it to get a job running on scarce hardware, or for state that is touched rarely
# > and read in long sequential sweeps; do not switch it on hoping for speed.
#
# <details><summary>中文</summary>
#
# > **要点。** 卸载把分片后的状态——参数、梯度、优化器的矩，每个 rank 16Ψ/N 字节——挪到主机内存或内存
# > 映射文件里；设备上只留激活值和正在收集的单元。这里实测到：一个在 80 MiB 预算下会崩的运行，卸载后能在
# > 预算内训练，结果逐位相同；每步搬运的恰好是分片的字节：每个单元的参数每 gather 一次搬入一次，
# > 梯度分片搬出一次。代价在这台 CPU 机器上只能建模、不能实测：这些字节要走 PCIe，比 HBM 慢一个数量级
# > 以上，优化器步也跑在 CPU 上。容量问题变成了传输问题。用它让作业在紧缺的硬件上跑起来，或用于
# > 很少访问、按长顺序扫描读取的状态；别指望靠它提速。
#
# </details>
#
# **Questions**
#
# 1. §1's run died in the second step, not the first. Would it have fit with plain SGD (no
#    momentum) instead of AdamW?
#
# <details><summary>Answer</summary>
#
# Yes. SGD keeps no moments, so the state is 8Ψ/N instead of 16Ψ/N: the peak drops by
# `exp_avg` + `exp_avg_sq` = 2 × 13,737,984 bytes (2 × 13.1 MiB), from 92.2 MiB to about 66 MiB,
# under the 80 MiB budget. The choice of optimizer is a memory setting too.
# </details>
#
# 2. With `reshard_after_forward=False`, how many bytes would come in per step in §3, and what
#    would the device pay instead?
#
# <details><summary>Answer</summary>
#
# Every unit would be gathered once, so each shard crosses once: 6 · 1,579,520 + 4,260,864 =
# 13,737,984 bytes, 4Ψ/N, the same as going out. In exchange every block stays gathered from
# its forward to its backward: up to all six blocks' full parameters (18,954,240 bytes) on the
# device at the start of backward — the memory offload was meant to free.
# </details>
#
# 3. In some runs §4 measures the disk tier faster than the host tier. Is that evidence that
#    memory-mapped files beat RAM?
#
# <details><summary>Answer</summary>
#
# No. Both are copies within RAM here: the disk tier's files were just written and sit in the page
# cache. The differences are noise from a busy machine and from which copy happens to run when.
# A real drive would only be read from once the state exceeds host memory — and then at a few
# GB/s.
# </details>

# %% [markdown]
# ## Exercise: what crosses over every step
# Write the bytes that offload moves per step and rank, from the size of one block's shard, the
# root's shard and the number of blocks. The check trains the nano model with its state in host
# memory on 2 and 3 real ranks and compares with the transfers the ranks measured.
#
# Write it in the cell below (or edit the stub in
# [`minishard/course/exercises/ch08.py`](../minishard/course/exercises/ch08.py)), then run the check. A
# reference solution is in [`solutions/ch08.py`](../solutions/ch08.py): try first.
#
# <details><summary>中文</summary>
#
# **练习：每步搬运多少。** 根据一个 block 的分片大小、root 的分片大小和 block 数，写出卸载时每个
# rank 每步搬运的字节数。检查程序在 2 个和 3 个真实 rank 上把状态放在主机内存里训练 nano 模型，
# 并与各 rank 实测的传输量对比。写在下面的单元格里（或编辑 `minishard/course/exercises/ch08.py` 里的
# 桩函数），再运行检查；参考答案在 `solutions/ch08.py`，先自己试。
#
# </details>

# %%
def offload_bytes(block_shard, root_shard, n_blocks):
    """(host -> device, device -> host) bytes per step and rank with the sharded state offloaded."""
    raise NotImplementedError("your code here")

# %%
# NBVAL_CHECK_OUTPUT
from minishard.course.exercises import ch08

ch08.check_offload_bytes(offload_bytes)
