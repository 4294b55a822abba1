"""DeepSpeed's memory estimator (``estimate_zero{2,3}_model_states_mem_needs``) rebuilt from the
ledger's categories: the published table a learner can check the ledger against
(``docs/costmodel.md``, chapter 10). The planner (``costmodel.py``) models one run; this
reproduces one other tool's accounting, with its deliberate differences named.
"""
from __future__ import annotations

from dataclasses import dataclass

from .analytic import estimate


@dataclass(frozen=True)
class EstimatorRow:
    """One line of DeepSpeed's ``estimate_zero{2,3}_model_states_mem_needs`` table, in bytes."""
    options: str
    per_cpu: float            # host memory of one node (all its ranks)
    per_gpu: float
    terms: dict[str, float]   # where per_gpu comes from, by ledger category


def largest_layer_params(model) -> int:
    """DeepSpeed's "largest layer": the most parameters any one module holds directly (not its
    children's) — the unit ZeRO-3 gathers when every module is its own unit."""
    return max(sum(p.numel() for p in m.parameters(recurse=False)) for m in model.modules())


def deepspeed_estimate(n_params: int, largest_layer: int, stage: int, gpus_per_node: int = 1,
                       nodes: int = 1, buffer_factor: float = 1.5) -> list[EstimatorRow]:
    """DeepSpeed's published memory-estimator table, rebuilt from the ledger's categories.

    The GPU column is :func:`minishard.planner.analytic.estimate` for fp16/bf16 mixed precision with fp32
    gradients (DeepSpeed's fused Adam updates fp32 gradients), plus the terms DeepSpeed's
    accounting adds on purpose:

    * ZeRO-2: the whole model's 16-bit gradients (2 bytes/param, unsharded) — the estimator
      counts them as resident because backward writes them before the bucketed reduce-scatter
      frees them; minishard's ZeRO-2 (chapter 04) holds only the in-flight buckets instead.
    * ZeRO-3: the largest layer gathered — its 16-bit parameters and 16-bit gradients
      (4 bytes/param), i.e. FSDP with every module its own unit and no prefetch.

    Offloading moves ledger categories to host memory: the optimizer option takes gradients,
    master weights and Adam moments; the parameter option (ZeRO-3) also the 16-bit shards. The
    CPU column is one node's ranks' offloaded state, or — without ``zero.Init`` — every rank
    building the full model in fp32 first, whichever is larger, times a ``buffer_factor`` of
    1.5 that DeepSpeed adds "to be conservative". (DeepSpeed's ZeRO-2 CPU formula does not
    divide the offloaded state by the number of nodes; this one does, so the two agree on one
    node — where DeepSpeed's examples live — and this one is smaller on several.)
    """
    if stage not in (2, 3):
        raise ValueError(f"DeepSpeed's estimator covers ZeRO stages 2 and 3, not {stage!r}")
    if n_params < 1 or largest_layer < 1 or largest_layer > n_params:
        raise ValueError(f"need 1 <= largest_layer ({largest_layer}) <= n_params ({n_params})")
    if gpus_per_node < 1 or nodes < 1:
        raise ValueError(f"gpus_per_node and nodes must be >= 1 (got {gpus_per_node}, {nodes})")
    N, n = gpus_per_node * nodes, gpus_per_node
    est = estimate(n_params=n_params, world_size=N, strategy=f"zero{stage}",
                   precision="bf16_mixed_fp32_grads").per_rank    # 2 + 4 + 4 + 4 + 4 bytes
    optimizer_side = ("grads", "master", "exp_avg", "exp_avg_sq")
    gathered = {"largest layer gathered (16-bit params + grads)": 4 * largest_layer}
    fp32_init = 4 * n_params * n                # no zero.Init: each rank builds the fp32 model

    def row(options: str, offloaded: tuple[str, ...], init: float,
            extra: dict[str, float]) -> EstimatorRow:
        gpu = {k: v for k, v in est.items() if k not in offloaded} | extra
        host = n * sum(v for k, v in est.items() if k in offloaded)
        return EstimatorRow(options, max(init, host) * buffer_factor, sum(gpu.values()), gpu)

    if stage == 2:
        # offloaded, the 16-bit gradients stream to the host bucket by bucket and are not counted
        return [row("offload_optimizer=cpu", optimizer_side, fp32_init, {}),
                row("offload_optimizer=none", (), fp32_init,
                    {"whole-model 16-bit grads": 2 * n_params})]
    rows = []
    for opts, off in (("offload_param=cpu , offload_optimizer=cpu ", optimizer_side + ("params",)),
                      ("offload_param=none, offload_optimizer=cpu ", optimizer_side),
                      ("offload_param=none, offload_optimizer=none", ())):
        for zero_init in (1, 0):
            # with zero.Init each rank materialises at most one layer in fp32 before sharding it
            init = 4 * largest_layer * n if zero_init else fp32_init
            rows.append(row(f"{opts}, zero_init={zero_init}", off, init, gathered))
    return rows


# ----------------------------------------------------------------------------- what it holds
def deepspeed_holdings(stage: int, numels: list[int], world_size: int, rank: int,
                       reduce_bucket_size: int) -> dict[str, tuple[str, int]]:
    """What DeepSpeed's ZeRO optimizer (0.19) allocates on rank ``rank`` in fp32 training, term by
    term: ``{term: (ledger category, bytes)}``, for parameters of ``numels`` elements in model
    order — what ``minishard.watch`` measures of a DeepSpeed engine, to the byte (tested).

    Stages 1 and 2 flatten a group's parameters into one buffer padded to a multiple of 2N
    elements (DeepSpeed's alignment: ``nccl_start_alignment_factor`` 2 times N), every parameter a
    view of it, and give rank r the r-th N-th of it, ``F/N``: a **copy** of it in fp32 (the
    partition its optimizer steps, even when the model is fp32 already), its two moments, and at
    the step its gradient; the gradients they reduce arrive in the rank's gradient partition,
    which holds **whole** the gradients of every parameter that touches the rank's part. Stage 3
    cuts every parameter into N parts of ``ceil(n/N)`` elements and keeps a second fp32 copy of
    them too (its alias for same-dtype partitions compares a device to a device name, which are
    not equal); its gradient partitions and its reduce bucket live for the whole run. The
    reduce bucket is ``reduce_bucket_size`` elements, allocated whole."""
    if stage not in (1, 2, 3):
        raise ValueError(f"DeepSpeed's ZeRO stages are 1, 2 and 3, not {stage!r}")
    N, psi = world_size, sum(numels)
    bucket = ("comm_buffers", 4 * reduce_bucket_size)
    if stage == 3:
        part = sum(-(-n // N) for n in numels)
        return {"partitions": ("params", 4 * part), "fp32 partitions": ("master", 4 * part),
                "exp_avg": ("exp_avg", 4 * part), "exp_avg_sq": ("exp_avg_sq", 4 * part),
                "gradient partitions": ("grads", 4 * part),
                "fp32 partitions' gradient (at the step)": ("grads", 4 * part),
                "reduce bucket": bucket}
    flat = -(-psi // (2 * N)) * 2 * N
    part = flat // N
    lo, hi = rank * part, (rank + 1) * part
    touching = [(s, n) for s, n in _starts(numels) if s < hi and s + n > lo]
    # from the first parameter touching the part to the last one's end — or the part's end,
    # which on the last rank lies past every parameter, in the padding
    whole = max(hi, touching[-1][0] + touching[-1][1]) - min(lo, touching[0][0]) if touching else 0
    out = {"flat parameters (padded to 2N)": ("params", 4 * flat),
           "fp32 partition": ("master", 4 * part), "exp_avg": ("exp_avg", 4 * part),
           "exp_avg_sq": ("exp_avg_sq", 4 * part),
           "gradient partition (whole parameters)": ("grads", 4 * whole),
           "fp32 partition's gradient (at the step)": ("grads", 4 * part),
           "reduce bucket": bucket}
    if stage == 1:
        out["every full gradient (during backward)"] = ("grads", 4 * psi)
    return out


def _starts(numels: list[int]):
    start = 0
    for n in numels:
        yield start, n
        start += n
