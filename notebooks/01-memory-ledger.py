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
# # 01 · The memory ledger: where a training step's bytes live
#
# > **An 8B-parameter model's bf16 weights are only 16 GB. Why does plain DDP not even start on an
# > 80 GB GPU?**
#
# This chapter answers that question twice: first with the analytic ledger, then by *measuring*
# the ledger of real ranks and checking that the two agree. The reasoning is in
# [tutorial/01-memory-ledger.md](../tutorial/01-memory-ledger.md); the evidence is below.
#
# <details><summary>中文</summary>
#
# > **一个 8B 参数模型的 bf16 权重只有 16 GB，为什么在 80 GB 的 GPU 上，朴素的 DDP 连启动都启动不了？**
#
# 本章把这个问题回答两遍：先用理论账本（按公式算），再用真实 rank 上的*实测*账本，并检查两者是否一致。推理过程见
# [tutorial/zh/01-memory-ledger.md](../tutorial/zh/01-memory-ledger.md)；证据在下面。
#
# </details>
#
# **The one-line "syntax"** — mixed-precision AdamW keeps, for every parameter, for the whole run:
#
# $$\underbrace{2}_{\text{bf16 weights}} + \underbrace{2}_{\text{bf16 grads}} + \underbrace{4}_{\text{fp32 master}} + \underbrace{4}_{\text{Adam } m} + \underbrace{4}_{\text{Adam } v} = 16 \text{ bytes per parameter, on every DDP rank,}$$
#
# plus activations, which depend on the batch rather than on the parameter count.
#
# <details><summary>中文</summary>
#
# **一行"语法"**：混合精度 AdamW 在整个训练过程中，为每个参数保留 bf16 权重 2 + bf16 梯度 2 + fp32 主权重
# 4 + Adam 一阶矩 *m* 4 + 二阶矩 *v* 4 = 16 字节，每个 DDP rank 都一样；激活值另算，它取决于批次而不是参数量。
#
# </details>
#
# Terms, in English and Chinese: [glossary · 术语表](../tutorial/glossary.md).

# %%
import plotly.graph_objects as go
import plotly.io as pio
import psutil
from IPython.display import display

from minishard import GPT, Ranks, conventions, estimate, gpt_activation_bytes, model_config
from minishard.course.glue import glue
from minishard.training.loop import TrainConfig, train
from minishard.viz import LedgerCalculator, ledger_bars

pio.renderers.default = "plotly_mimetype+notebook_connected"
GB = 1e9

# %% [markdown]
# ## 1. The ledger of an 8B model
# `GPT("llama3-8b", device="meta")` builds Llama-3-8B's shapes without allocating a byte; the
# analytic ledger counts its parameters and multiplies by the bytes each category keeps.

# %%
# NBVAL_CHECK_OUTPUT
# claim: L1
llama = GPT("llama3-8b", device="meta")
e8b = estimate(llama, world_size=1, strategy="ddp", precision="bf16_mixed", optimizer="adamw")
print(f"llama3-8b: {glue('llama3-8b-params', e8b.n_params, '{:,}')} parameters, "
      f"{e8b.bytes_per_param:g} bytes per parameter")
table = e8b.table(unit=GB, unit_name="GB")
total = glue("llama3-8b-state-gb", e8b.total / GB, "{:.3f} GB")
weights = glue("llama3-8b-weights-gb", e8b.per_rank["params"] / GB, "{:.3f} GB")
print(table)
assert total in table and weights in table                  # the total row and the params row
assert e8b.n_params == 8_030_261_248 and e8b.bytes_per_param == 16
assert e8b.per_rank["params"] == 2 * e8b.n_params          # the "16 GB" of the question
assert round(e8b.total / GB, 1) == 128.5

# %%
bars = [("bf16 weights", "params"), ("bf16 grads", "grads"), ("fp32 master", "master"),
        ("Adam m", "exp_avg"), ("Adam v", "exp_avg_sq")]
fig = go.Figure(go.Waterfall(x=[label for label, _ in bars] + ["total"],
                             y=[e8b.per_rank[c] / GB for _, c in bars] + [0],
                             measure=["relative"] * len(bars) + ["total"],
                             text=[f"{e8b.per_rank[c] / GB:.1f}" for _, c in bars] + [f"{e8b.total / GB:.1f}"]))
fig.add_hline(y=80, line_dash="dash", annotation_text="one 80 GB GPU")
fig.update_layout(title="Llama-3-8B, mixed-precision AdamW: what one DDP rank must hold (GB)",
                  yaxis_title="GB", height=380, width=700, showlegend=False)
fig.show()

# %% [markdown]
# The weights alone cross nothing; the gradients and the fp32 master copy bring the total to about
# 64 GB, and Adam's first moment carries it past the device at the fourth bar. 16 bytes is the
# usual figure, not the only one: [`conventions()`](../minishard/core/ledger.py) lists the settings
# behind the others people quote, each with its source (more in
# [docs/reference-figures.md](../docs/reference-figures.md)). Note that 16 stands for three
# different settings, and that 18 and 20 are both Megatron-Core's: fp32 gradients in place of
# 16-bit ones (18), or 16-bit gradients plus the optimizer's fp32 copy of them, `main_grads` (20).

# %%
# NBVAL_CHECK_OUTPUT
for c in conventions():
    print(f"{c.bytes_per_param:>3} B/param  {c.precision + ', ' + c.optimizer:<34}{c.breakdown}")
    print(f"{'':>13}source: {c.source}")
quoted = {(c.bytes_per_param, c.precision, c.optimizer) for c in conventions()}
assert quoted >= {(16, "bf16_mixed", "adamw"), (16, "bf16_fsdp", "adamw"), (18, "bf16_mixed_fp32_grads", "adamw"),
                  (20, "fp16_mixed", "adamw"), (10, "bf16_mixed", "adamw_8bit")}

# %% [markdown]
# ## 2. Activations come on top
# What forward saves for backward grows with the micro-batch $b$, the layers $L$ and the sequence
# length $s$ — linearly in $b$ and $L$, and faster than linearly in $s$, because attention as
# written here keeps an $s\times s$ matrix per head. `gpt_activation_bytes` derives it op by op for
# minishard's GPT; here, for the course's tiny model (fp32):

# %%
# NBVAL_CHECK_OUTPUT
# claim: L2
def act(**cfg_overrides):
    b = cfg_overrides.pop("b", 4)
    return gpt_activation_bytes(model_config("tiny", **cfg_overrides), micro_batch=b)

rows = [("micro-batch b", "b", (1, 2, 4, 8)), ("layers L", "n_layer", (3, 6, 12, 24)),
        ("sequence s", "seq_len", (64, 128, 256, 512))]
for label, key, values in rows:
    sizes = [act(**{key: v}) for v in values]
    print(f"{label:<14}" + "  ".join(f"{v:>4}: {s / 2**20:7.1f} MiB" for v, s in zip(values, sizes)))
    steps = [b - a for a, b in zip(sizes, sizes[1:])]
    if key in ("b", "n_layer"):                   # equal steps for equal increments: linear
        assert steps[1] == 2 * steps[0] and steps[2] == 4 * steps[0]
    else:                                         # each doubling of s more than doubles it
        assert all(b / a > 2 for a, b in zip(sizes, sizes[1:]))

# %% [markdown]
# At Llama-3-8B's scale, with bf16 activations, one sequence of 4096 tokens already adds tens of
# GB per rank with this explicit attention (a fused FlashAttention kernel avoids storing the
# $s\times s$ scores, which is most of it):

# %%
# NBVAL_CHECK_OUTPUT
for s in (2048, 4096, 8192):
    a = gpt_activation_bytes(model_config("llama3-8b"), micro_batch=1, seq_len=s, dtype_bytes=2)
    shown = glue("llama3-8b-activations-t4096", a / GB, "{:.1f}") if s == 4096 else f"{a / GB:.1f}"
    print(f"llama3-8b, micro-batch 1, s = {s:>4}: activations {shown:>6} GB")

# %% [markdown]
# ### The literature's formula, measured
# Korthikanti et al. ("Reducing Activation Recomputation in Large Transformer Models", 2022)
# count a transformer layer's activations with 16-bit tensors, sequence length $s$, micro-batch
# $b$, hidden size $h$ and $a$ heads as
#
# $$s\,b\,h\left(34 + 5\,\frac{a\,s}{h}\right)\ \text{bytes}
# = \underbrace{11\,sbh + 5\,as^2b}_{\text{attention}} + \underbrace{19\,sbh}_{\text{MLP}} + \underbrace{4\,sbh}_{\text{2 layer norms}} .$$
#
# Those terms include dropout: a 1-byte mask and a 2-byte output after the softmax
# ($as^2b + 2as^2b$) and a 1-byte mask after each of the attention and MLP outputs ($sbh$
# each). minishard's GPT has no dropout, so what is left is
#
# $$\underbrace{(2 + 4 + 2 + 2)\,sbh + 2\,as^2b}_{\text{qkv input, q k, v, proj input, softmax}}
# + \underbrace{(2 + 8 + 8)\,sbh}_{\text{fc input, GELU input, proj input}} + 4\,sbh
# = 32\,sbh + 2\,as^2b .$$
#
# The live ledger measures one layer of the tiny model in bf16 as the difference between a 2-layer
# and a 1-layer model (one process, one step): the formula plus two small terms Korthikanti leaves
# out, the causal mask masked_fill keeps ($s^2$ bools) and each layer norm's per-token mean and
# reciprocal standard deviation ($2 \cdot 2 \cdot sb$ values of 2 bytes).

# %%
# NBVAL_CHECK_OUTPUT
def measured_activations(n_layer: int, b: int) -> int:
    out = train(None, TrainConfig(strategy="single", steps=1, model="tiny", micro_batch=b, precision="bf16_mixed", model_overrides={"n_layer": n_layer}))
    return out["ledger"]["category_peaks"]["activations"]

tiny = model_config("tiny")
s, h, a = tiny.seq_len, tiny.d_model, tiny.n_head
for b in (2, 4):
    layer = measured_activations(2, b) - measured_activations(1, b)
    korthikanti = s * b * h * 34 + 5 * a * s * s * b          # with dropout
    no_dropout = 32 * s * b * h + 2 * a * s * s * b
    small = s * s + 2 * 2 * s * b * 2                           # causal mask, norm statistics
    print(f"s={s}, b={b}, h={h}, a={a}: sbh(34 + 5as/h) = {glue(f'layer-with-dropout-b{b}', korthikanti, '{:,}')}; "
          f"without dropout 32sbh + 2as²b = {glue(f'layer-no-dropout-b{b}', no_dropout, '{:,}')}; "
          f"measured one layer = {glue(f'layer-measured-b{b}', layer, '{:,}')} = that + "
          f"{glue(f'layer-extra-b{b}', layer - no_dropout, '{:,}')} (s² mask + 4sb statistics = {small:,})")
    assert layer == no_dropout + small                         # measured, to the byte
    assert layer == (gpt_activation_bytes(model_config("tiny", n_layer=2), b, dtype_bytes=2)
                     - gpt_activation_bytes(model_config("tiny", n_layer=1), b, dtype_bytes=2))

# %% [markdown]
# ## 3. The calculator
# Every knob of the analytic ledger in one widget: the bars are one rank's memory (one bar per
# rank: under DDP they are identical), the dashed line one device. Change the strategy to
# `zero1`…`zero3` to preview chapters 03–05.

# %%
calc = LedgerCalculator(model="llama3-8b", world_size=8, strategy="ddp", device_gb=80)
calc.widget

# %% [markdown]
# The widget's controls are attributes too, so a cell can set them and check the result:

# %%
# NBVAL_CHECK_OUTPUT
# claim: L4
print(calc.verdict)
assert not calc.fits and calc.smallest_world_size() is None   # DDP: more ranks never help
calc.world_size = 64
print(calc.verdict)
assert calc.per_rank_bytes == e8b.total                      # 64 ranks, 64 identical copies
calc.strategy = "zero3"
print(calc.verdict, f"-> fits from {calc.smallest_world_size()} ranks")
assert calc.fits and calc.smallest_world_size() == 2
calc.strategy, calc.world_size = "ddp", 8
assert calc.figure.data[0].y == (e8b.per_rank["params"] / GB,) * 8   # the bars follow

# %% [markdown]
# ## 4. Measured: the ledger of real ranks
# The prediction is only worth something if it matches what real ranks hold. Every tensor minishard's
# DDP allocates is entered in a per-rank `LiveLedger` by category, and saved activations are counted
# as autograd stores them (saved-tensor hooks). Train the tiny model (6,868,992 parameters) for two
# steps — the peak comes in the second, once Adam's moments exist — on 2 and on 4 ranks, first in
# plain fp32 (4 + 4 + 4 + 4: the weights are their own master copy, second row of the table above).

# %%
R2 = Ranks(2)                      # one warm pool for this section
with Ranks(4) as R4:
    measured = {2: R2.run(train, TrainConfig(strategy="ddp", steps=2, model="tiny", micro_batch=4)),
                4: R4.run(train, TrainConfig(strategy="ddp", steps=2, model="tiny", micro_batch=4))}
    rss = [psutil.Process(pid).memory_info().rss for pid in R4.pids]   # while the ranks live

# %%
# NBVAL_CHECK_OUTPUT
# claim: L3, L4
tiny = GPT("tiny", device="meta")

def compare(out, precision, act_dtype_bytes, names=None):
    """Print predicted vs measured peak per category and rank; return the largest relative gap.
    ``names``: {category or "peak": figure name} of rank 0's measured values the chapter quotes."""
    names = names or {}
    def shown(cat, rank, got):
        return glue(names[cat], got, "{:,}") if rank == 0 and cat in names else f"{got:,}"
    N = len(out)
    act = gpt_activation_bytes(model_config("tiny"), micro_batch=4, dtype_bytes=act_dtype_bytes)
    pred = estimate(tiny, world_size=N, strategy="ddp", precision=precision, optimizer="adamw",
                    activation_bytes=act)
    print(f"--- DDP on {N} ranks, {precision}: predicted vs measured peak, bytes per rank")
    print(f"{'category':<12}{'predicted':>13}" + "".join(f"{'rank ' + str(r):>13}" for r in range(N)))
    gaps = {}
    for cat, p in pred.per_rank.items():
        got = [o["ledger"]["peak_snapshot"].get(cat, 0) for o in out]
        print(f"{cat:<12}{p:>13,}" + "".join(f"{shown(cat, r, g):>13}" for r, g in enumerate(got)))
        gaps[cat] = max(abs(g - p) / p for g in got)
    peaks = [o["ledger"]["peak"] for o in out]
    print(f"{'peak':<12}{pred.total:>13,}" + "".join(f"{shown('peak', r, g):>13}" for r, g in enumerate(peaks)))
    return gaps

for N, out in measured.items():
    gaps = compare(out, "fp32", 4, names={"params": "ddp-fp32-state-bytes", "activations": "ddp-fp32-activations",
                                          "peak": "ddp-fp32-peak"} if N == 4 else None)
    assert max(gaps.values()) <= 0.02            # the course's bar: within 2% ...
    assert max(gaps.values()) == 0               # ... and in fact exact, every category, every rank

# %% [markdown]
# Exact, category by category, on every rank. The figure shows the 4-rank peak: four identical
# stacks.

# %%
ledger_bars({o["rank"]: o["ledger"]["peak_snapshot"] for o in measured[4]},
            title="measured peak per rank, DDP on 4 ranks, tiny model (MiB)").show()

# %% [markdown]
# Now the setting of the opening question, bf16 mixed precision: bf16 weights and gradients, an
# fp32 master copy that AdamW updates, fp32 moments.

# %%
# NBVAL_CHECK_OUTPUT
# claim: L1
mixed = R2.run(train, TrainConfig(strategy="ddp", steps=2, model="tiny", micro_batch=4, precision="bf16_mixed"))
gaps = compare(mixed, "bf16_mixed", 2, names={"activations": "ddp-bf16-activations", "peak": "ddp-bf16-peak"})
split = {c: mixed[0]["ledger"]["peak_snapshot"][c] / mixed[0]["n_params"]
         for c in ("params", "grads", "master", "exp_avg", "exp_avg_sq")}
print("bytes per parameter:", " + ".join(f"{b:g} ({c})" for c, b in split.items()), "=", sum(split.values()))
assert split == {"params": 2, "grads": 2, "master": 4, "exp_avg": 4, "exp_avg_sq": 4}
assert all(gaps[c] == 0 for c in split)               # the state: exact
assert gaps["activations"] <= 0.02                       # activations: within the course's 2%

# %% [markdown]
# The state is exact again, 2 + 2 + 4 + 4 + 4, and so are the activations. Getting them exact in
# bf16 took the formula one lesson from this very comparison: PyTorch's CPU layer-norm kernel keeps
# its per-token mean and inverse standard deviation in the compute dtype (bf16 here), where GPU
# kernels keep fp32. An analytic ledger is a model of the kernels that run; the measured ledger is
# how you find out where the model is wrong.
#
# The calculator, set to the fp32 run, predicts its peak to the byte:

# %%
# NBVAL_CHECK_OUTPUT
calc.model, calc.precision, calc.world_size, calc.micro_batch, calc.seq_len = "tiny", "fp32", 4, 4, 128
print(calc.verdict)
assert calc.per_rank_bytes == measured[4][0]["ledger"]["peak"]

# %% [markdown]
# Activations are measured the same way; they grow with the micro-batch exactly as predicted:

# %%
# NBVAL_CHECK_OUTPUT
for B in (2, 4, 8):
    got = [o["ledger"]["peak_snapshot"]["activations"]
           for o in R2.run(train, TrainConfig(strategy="ddp", steps=2, model="tiny", micro_batch=B))]
    want = gpt_activation_bytes(model_config("tiny"), micro_batch=B)
    print(f"micro-batch {B}: predicted {glue(f'tiny-activations-b{B}', want, '{:,}'):>11}  measured {got}")
    assert got == [want, want]
R2.close()

# %% [markdown]
# **What the formula leaves out.** The ledger counts the model-sized state and the saved
# activations. It does not count: Adam's per-tensor `step` counters (one scalar per parameter
# tensor: 77 × 4 bytes here); temporary buffers that live for one operation (the gradient of the
# logits, the optimizer's intermediates, communication buffers); the allocator's cache and
# fragmentation; and the framework itself — on a GPU the CUDA context and NCCL's buffers, here
# the torch libraries loaded into each rank process. The operating system's view of a rank
# (resident memory) shows how large that last part is next to the ledger's peak:

# %%
# NBVAL_IGNORE_OUTPUT
n_tensors = len(list(tiny.parameters()))
peak = measured[4][0]["ledger"]["peak"]
print(f"Adam step counters: {glue('adam-step-tensors', n_tensors)} tensors x 4 bytes = "
      f"{glue('adam-step-bytes', 4 * n_tensors)} bytes")
rss_mib = tuple(round(r / 2**20) for r in rss)       # a link's text holds no brackets: no list repr
print("resident memory of each rank process:", glue("rank-peaks-mib", rss_mib, ", ".join(["{}"] * len(rss_mib)) + " MiB"),
      f"vs ledger peak {glue('ledger-peak-mib', peak / 2**20, '{:.0f} MiB')}")
assert n_tensors == 77 and all(r > peak for r in rss)

# %% [markdown]
# ## 5. The answer
# Under DDP each rank keeps the whole ledger: the 2-rank and 4-rank runs above hold exactly the same
# bytes per rank, so N ranks store N identical copies. The bytes of model state per parameter
# measured in bf16 mixed precision, scaled to Llama-3-8B:

# %%
# NBVAL_CHECK_OUTPUT
# claim: Q0
state = ("params", "grads", "master", "exp_avg", "exp_avg_sq")
def state_per_param(out):
    return sum(out[0]["ledger"]["peak_snapshot"].get(c, 0) for c in state) / out[0]["n_params"]

assert state_per_param(measured[2]) == state_per_param(measured[4])   # per rank, whatever N
need = state_per_param(mixed) * e8b.n_params
print(f"measured: {state_per_param(mixed):g} bytes of state per parameter on every rank")
print(f"llama3-8b under DDP: {glue('llama3-8b-ddp-state-gb', need / GB, '{:.1f}')} GB per rank before activations, on any number of ranks;"
      f" its bf16 weights alone: {2 * e8b.n_params / GB:.1f} GB; the GPU: 80 GB")
assert need == e8b.total and need > 80 * GB

# %% [markdown]
# > **Takeaway.** Training keeps about 16 bytes per parameter — weights, gradients, an fp32 master
# > copy and two Adam moments — so an 8B model needs ≈128 GB of state before a single activation,
# > and the 16 GB of bf16 weights are only an eighth of it. DDP gives every rank the full copy:
# > adding GPUs adds copies, never room. The measured ledger of real ranks equals the formula
# > exactly for the state and the activations; what it leaves out
# > (step counters, temporaries, allocator cache, the framework) is small next to it on a large
# > model, but not zero.
#
# <details><summary>中文</summary>
#
# > **要点。** 训练时每个参数约占 16 字节——权重、梯度、fp32 主权重和两个 Adam 矩——所以 8B 模型在任何激活值
# > 出现之前就需要约 128 GB 的状态，16 GB 的 bf16 权重只占八分之一。DDP 让每个 rank 持有完整的一份：加 GPU
# > 只是加副本，永远腾不出空间。真实 rank 的实测账本与公式完全吻合，状态和激活值都是；它没算的部分（步数
# > 计数器、临时缓冲区、分配器缓存、框架本身）在大模型上相对很小，但不是零。
#
# </details>
#
# **Questions**
#
# 1. A 70B model with 8-bit Adam moments, bf16 weights and grads and an fp32 master copy: bytes per
#    parameter, and does DDP fit on 141 GB GPUs?
#
# <details><summary>Answer</summary>
#
# 2 + 2 + 4 + 1 + 1 = 10 bytes/param (the 10 in the table): ≈ 706 GB per rank for Llama-3-70B's
# 70.6 B parameters. No: DDP still holds all of it on every rank. Try it in the calculator
# (`optimizer = "adamw_8bit"`).
# </details>
#
# 2. Why do activations not shrink when you add DDP ranks while keeping the micro-batch fixed?
#
# <details><summary>Answer</summary>
#
# Each rank runs forward on its own micro-batch, so it saves its own activations; adding ranks
# grows the *global* batch, not any rank's share of the work. Activations shrink per rank only if
# the micro-batch (or the sequence, or what is saved: recomputation) shrinks.
# </details>

# %% [markdown]
# ## Exercise: write the ledger of one DDP rank
# Write the bytes of model state one DDP rank holds, by ledger category, for AdamW in fp32 and in
# bf16 mixed precision. The check compares your ledger with `estimate` for models from 0.2 M to
# 405 B parameters, then with the ledger *measured* on 2 real ranks.
#
# Write it in the cell below (or edit the stub in
# [`minishard/course/exercises/ch01.py`](../minishard/course/exercises/ch01.py)), then run the check. A
# reference solution is in [`solutions/ch01.py`](../solutions/ch01.py): try first.
#
# <details><summary>中文</summary>
#
# **练习：写出一个 DDP rank 的账本。** 按账本类别写出 AdamW 在 fp32 和 bf16 混合精度下，一个 DDP rank 持有的
# 模型状态字节数。检查程序先用 0.2 M 到 405 B 参数的模型把你的账本与 `estimate` 对比，再与 2 个真实 rank 上
# *实测*的账本对比。答案写在下面的单元格里（或者编辑
# [`minishard/course/exercises/ch01.py`](../minishard/course/exercises/ch01.py) 里的桩函数），然后运行检查。
# 参考答案在 [`solutions/ch01.py`](../solutions/ch01.py)：先自己试。
#
# </details>

# %%
def ddp_state_bytes(n_params: int, precision: str) -> dict[str, int]:
    """{category: bytes} of one DDP rank's model state (params, grads, master, exp_avg,
    exp_avg_sq — leave out a category the setting does not have); precision "fp32" or "bf16_mixed"."""
    raise NotImplementedError("your code here")

# %%
# NBVAL_CHECK_OUTPUT
from minishard.course.exercises import ch01

ch01.check_ddp_state_bytes(ddp_state_bytes)
