"""The planner: memory and step time of a strategy on a cluster nobody has on a laptop.

Memory comes from the *same* ledger code the live runs are checked against
(:func:`minishard.planner.analytic.estimate`, :func:`minishard.planner.analytic.gpt_activation_bytes`), plus the
terms a sharded run adds: the gathered units (root + (1 + prefetch) blocks for ZeRO-3) and the
communication buckets. Time is compute plus the communication compute cannot hide, with each
collective costed by the alpha-beta model of a ring::

    t(collective) = steps * alpha + bytes_sent_per_rank / bandwidth
    all_reduce: 2(N-1) steps, 2(N-1)/N * S     reduce_scatter / all_gather: (N-1) steps, (N-1)/N * S

A ring is as fast as its slowest link: across nodes, that is the network, not NVLink. Hybrid
sharding (HSDP) keeps the sharding collectives inside a node and only all-reduces the gradient
shards across nodes.

Every device and link figure below is a published peak (sources in ``docs/costmodel.md``); an
``mfu`` (model FLOPs utilisation) turns peak FLOP/s into achieved ones.
"""
from __future__ import annotations

import functools
from dataclasses import dataclass, field, replace

from minishard import strategies
from .analytic import estimate, gpt_activation_bytes
from minishard.core.model import GPT, GPTConfig, config


@dataclass(frozen=True)
class Link:
    name: str
    bandwidth: float          # bytes/s one rank can send (per direction)
    latency: float            # seconds per ring step (alpha)


@dataclass(frozen=True)
class Device:
    name: str
    memory: float             # bytes usable for training
    flops: float              # dense bf16 FLOP/s (peak)


LINKS = {
    "nvlink4": Link("NVLink 4 (H100 SXM)", 450e9, 5e-6),
    "nvlink3": Link("NVLink 3 (A100 SXM)", 300e9, 5e-6),
    "ib-ndr-400": Link("InfiniBand NDR 400 Gb/s per GPU", 50e9, 10e-6),
    "ib-hdr-200": Link("InfiniBand HDR 200 Gb/s per GPU", 25e9, 10e-6),
    "ethernet-100g": Link("100 Gb Ethernet", 12.5e9, 30e-6),
    "pcie4-x16": Link("PCIe 4.0 x16 (no NVLink)", 25e9, 10e-6),
    "pcie5-x16": Link("PCIe 5.0 x16", 50e9, 10e-6),
}

# The host's memory, shared by every GPU's CPU optimizer on the node (chapter 08): a two-socket
# server of DGX H100's kind, 2 sockets x 8 DDR5-4800 channels x 38.4 GB/s = 614 GB/s peak, of
# which a streaming kernel reaches about three quarters (docs/costmodel.md).
HOST_MEMORY_BANDWIDTH = 0.75 * 2 * 8 * 38.4e9
# CPU Adam per element: it reads the fp32 weight, gradient and two moments (16 bytes) and writes
# the weight and moments back (12)
CPU_ADAM_BYTES = 16 + 12

DEVICES = {
    "h100-80gb": Device("H100 SXM 80 GB", 80 * 2**30, 989e12),
    "h100-96gb": Device("H100 96 GB (Grand Teton)", 96 * 2**30, 989e12),
    "a100-80gb": Device("A100 SXM 80 GB", 80 * 2**30, 312e12),
    "a100-40gb": Device("A100 40 GB", 40 * 2**30, 312e12),
    "h200": Device("H200 141 GB", 141e9, 989e12),
    "rtx4090": Device("RTX 4090 24 GB", 24 * 2**30, 165e12),
}


@dataclass(frozen=True)
class Cluster:
    device: Device
    gpus_per_node: int
    nodes: int = 1
    intra: Link = LINKS["nvlink4"]
    inter: Link = LINKS["ib-ndr-400"]

    @property
    def world_size(self) -> int:
        return self.gpus_per_node * self.nodes


def ring_time(op: str, nbytes: float, n: int, link: Link) -> float:
    """Seconds for one ring collective over ``n`` ranks on ``link`` (alpha-beta)."""
    if n <= 1 or nbytes <= 0:
        return 0.0
    steps, volume = {"all_reduce": (2 * (n - 1), 2 * (n - 1) / n),
                     "reduce_scatter": (n - 1, (n - 1) / n),
                     "all_gather": (n - 1, (n - 1) / n)}[op]
    return steps * link.latency + volume * nbytes / link.bandwidth


@functools.lru_cache(maxsize=64)
def param_counts(cfg: GPTConfig) -> tuple[int, int, int]:
    """(all parameters, one block's, those in matrix multiplies) — counted once per config on
    the meta device (a 405B model builds in about a second)."""
    net = GPT(cfg, device="meta")
    return (sum(p.numel() for p in net.parameters()),
            sum(p.numel() for p in net.blocks[0].parameters()),
            sum(p.numel() for n, p in net.named_parameters() if p.dim() == 2 and "emb" not in n))


def train_flops_per_token(cfg: GPTConfig, seq_len: int, recompute: bool) -> float:
    """6 FLOPs per parameter per token (2 forward, 4 backward) for the matrix multiplies, plus
    attention's scores and weighted sum (12 L d T per token); recomputation adds a forward."""
    dense = param_counts(cfg)[2]
    attention = 12 * cfg.n_layer * cfg.d_model * seq_len / 2      # causal: half the scores
    per_pass = 2 * dense + attention / 3
    return per_pass * (4 if recompute else 3)


# A plan above this share of the device gets a warning: the planner does not model the CUDA
# context, NCCL's buffers, the allocator's fragmentation or the temporaries of each kernel
# (docs/costmodel.md, "What the planner leaves out").
HEADROOM = 0.9
UNMODELLED = "the CUDA context, NCCL's buffers, allocator fragmentation and kernel temporaries"


@dataclass
class Plan:
    """What the planner says about one configuration (bytes per rank, seconds per step)."""
    strategy: str
    world_size: int
    memory: dict[str, float]
    device_memory: float
    compute_s: float
    comm_s: float
    exposed_comm_s: float
    tokens_per_rank: int
    notes: list[str] = field(default_factory=list)
    transfer_bytes: float = 0.0               # offload: bytes crossing PCIe per step (both ways)
    offload_pcie_s: float = 0.0               # offload: seconds of PCIe per step
    offload_cpu_s: float = 0.0                # offload: seconds of the CPU optimizer step

    @property
    def total_memory(self) -> float:
        return sum(self.memory.values())

    @property
    def fits(self) -> bool:
        return self.total_memory <= self.device_memory

    @property
    def device_share(self) -> float:
        """The share of the device's memory the plan uses."""
        return self.total_memory / self.device_memory

    @property
    def tight(self) -> bool:
        """Above :data:`HEADROOM` of the device: what the plan leaves out can tip it over."""
        return self.total_memory > HEADROOM * self.device_memory

    @property
    def step_s(self) -> float:
        return self.compute_s + self.exposed_comm_s

    @property
    def exposed_share(self) -> float:
        """The share of the step spent waiting on the network (or PCIe)."""
        return self.exposed_comm_s / self.step_s

    @property
    def tokens_per_s_per_rank(self) -> float:
        return self.tokens_per_rank / self.step_s

    def verdict(self) -> str:
        use = self.total_memory / 2**30
        cap = self.device_memory / 2**30
        if not self.fits:
            return f"does not fit: {use:.1f} GiB per GPU > {cap:.0f} GiB"
        return (f"fits: {use:.1f} of {cap:.0f} GiB per GPU; {self.step_s:.2f} s/step, "
                f"{self.tokens_per_s_per_rank:,.0f} tokens/s/GPU, "
                f"{self.exposed_share:.0%} of the step waiting on the network")


def warnings(p: Plan) -> list[str]:
    """What a plan that fits cannot promise: above :data:`HEADROOM` of the device, it leaves
    too little room for what the planner does not model."""
    if not p.fits or not p.tight:
        return []
    return [f"{p.device_share:.0%} of the device, and the plan leaves out {UNMODELLED}: "
            f"they can tip it over."]


@dataclass(frozen=True)
class _Sizes:
    """What the formulas need of a model sharded ``shard_n`` ways: parameters in all, in one
    block and in the root (embeddings, final norm, head); bytes of a working weight (``x``) and
    of a reduced gradient (``g``)."""
    n_params: int
    block: int
    root: int
    n_layer: int
    shard_n: int
    x: int
    g: int


def plan(model: str | GPTConfig, cluster: Cluster, strategy: str = "fsdp", *,
         micro_batch: int = 1, seq_len: int | None = None, precision: str | None = None,
         optimizer: str = "adamw", prefetch: int = 1, recompute: bool = False,
         offload: str | None = None, hybrid: bool = False, mfu: float = 0.4, bucket_cap_mb: float = 25.0,
         flash_attention: bool = True, overlap: bool = True, wrap: str = "block",
         reshard_after_forward: int | None = None) -> Plan:
    """Per-GPU memory by ledger category and step time for one configuration.

    ``strategy``: ddp, zero1, zero2, zero3/fsdp. ``hybrid``: shard inside a node, replicate across
    nodes (HSDP). ``offload``: the tier the sharded state lives in, named as a run names it
    (``TrainConfig.offload``): ``"host"`` (its bytes leave the device; PCIe traffic is added to
    the exposed time) or None; the disk tier is not modelled. ``overlap=False``: communication
    cannot hide behind compute (e.g. CPU ranks with every core busy computing). ``wrap``: FSDP's
    units, one per transformer block plus the root (``"block"``) or one for the whole model
    (``"model"``, see :func:`_one_unit`). ``reshard_after_forward=k`` (ZeRO-3): blocks keep 1/k
    gathered after forward; backward gathers over k ranks (a node: NVLink). None: FSDP2's True.

    ``precision=None`` is each strategy's usual mixed precision (docs/costmodel.md): for ZeRO-3 /
    FSDP, FSDP2's and torchtitan's ``MixedPrecisionPolicy(param_dtype=bf16, reduce_dtype=fp32)``
    (``"bf16_fsdp"``: bf16 gathers, fp32 reduce-scatters, the fp32 shards are the master); for
    DDP and ZeRO-1/2, bf16 weights and gradients with an fp32 master (``"bf16_mixed"``: gradients
    reduced in bf16, as DeepSpeed does by default)."""
    cfg = config(model) if isinstance(model, str) else model
    T = seq_len or cfg.seq_len
    _check_job(micro_batch, T, mfu, wrap, offload)
    stage = strategies.get(strategy).stage            # (fsdp and zero3 are one: stage 3)
    strategy = strategies.STAGES[stage]
    if precision is None:
        precision = "bf16_fsdp" if stage == 3 else "bf16_mixed"
    sizes = _sizes(cfg, precision, cluster.gpus_per_node if hybrid else cluster.world_size)
    k = _post_forward_ranks(reshard_after_forward, stage, sizes.shard_n)
    acts = activation_bytes(cfg, micro_batch, T, sizes.x, flash_attention, recompute)
    memory, notes = memory_per_gpu(sizes, stage, precision, optimizer, acts, prefetch=prefetch,
                                   offload=offload, bucket_cap_mb=bucket_cap_mb, post_forward=k)
    compute, backward = compute_seconds(cfg, T, micro_batch, recompute, cluster.device, mfu)
    link = ring_link(cluster, hybrid)
    comm, exposed = collective_seconds(sizes, stage, link, prefetch, compute, backward,
                                       (k, cluster.intra if k <= cluster.gpus_per_node else link) if k else None)
    if stage == 3:
        notes.append(f"{cfg.n_layer + 1} units, {3 * (cfg.n_layer + 1)} collectives per step")
    if not overlap:
        exposed = comm
    if hybrid and cluster.nodes > 1:
        cross = cross_node_seconds(sizes, cluster, sizes.g)
        comm, exposed = comm + cross, exposed + cross
        notes.append("hybrid: shard within a node, replicate across nodes")
    moved_in = moved_out = pcie_s = cpu_s = 0.0
    if offload:
        moved_in, moved_out, pcie_s, cpu_s = offload_seconds(sizes, cluster.gpus_per_node)
        exposed += pcie_s + cpu_s
        notes.append(f"offload: {moved_in / 1e9:.1f} GB in and {moved_out / 1e9:.1f} GB out over PCIe "
                     f"per step, {pcie_s:.2f} s; CPU Adam {cpu_s:.2f} s")
    offload_s = pcie_s + cpu_s
    p = Plan(strategy, cluster.world_size, memory, cluster.device.memory, compute, comm, exposed,
             micro_batch * T, notes, moved_in + moved_out, pcie_s, cpu_s)
    if stage == 3 and wrap == "model":
        p = _one_unit(p, sizes, cluster, link, hybrid=hybrid, activations=acts, offload_s=offload_s)
    return p


def _post_forward_ranks(k: int | None, stage: int, shard_n: int) -> int | None:
    """``reshard_after_forward``'s ranks, checked; None for every shard rank (FSDP2's True)."""
    if k is not None and (stage != 3 or isinstance(k, bool) or not isinstance(k, int) or k < 1
                          or shard_n % k):
        raise ValueError(f"reshard_after_forward={k!r}: a number of ranks dividing the {shard_n} "
                         f"a unit shards over (ZeRO-3 / FSDP only)")
    return None if k == shard_n else k


def logits_bytes(cfg: GPTConfig, micro_batch: int, seq_len: int, dtype_bytes: int = 2) -> int:
    """The ``[batch, seq, vocab]`` log-probabilities the loss keeps for backward (bf16 by
    default): one tensor a chunked loss can shrink to one chunk."""
    return micro_batch * seq_len * cfg.vocab_size * dtype_bytes


def _sizes(cfg: GPTConfig, precision: str, shard_n: int) -> _Sizes:
    n_params, block, _ = param_counts(cfg)
    if shard_n > n_params:
        raise ValueError(f"{shard_n} ranks cannot each hold a shard of {n_params} parameters")
    x = 2 if precision.startswith("bf16") else 4
    g = 4 if precision in ("bf16_fsdp", "bf16_mixed_fp32_grads") else x
    return _Sizes(n_params, block, n_params - cfg.n_layer * block, cfg.n_layer, shard_n, x, g)


def activation_bytes(cfg: GPTConfig, micro_batch: int, seq_len: int, dtype_bytes: int,
                     flash_attention: bool, recompute: bool) -> int:
    """Every layer's saved tensors (:func:`~minishard.planner.analytic.gpt_activation_bytes`), or with
    recomputation only each block's input plus one block's worth recomputed at a time."""
    args = (micro_batch, seq_len, dtype_bytes, flash_attention)
    acts = gpt_activation_bytes(cfg, *args)
    if recompute:
        one_layer = gpt_activation_bytes(replace(cfg, n_layer=1), *args) - \
            gpt_activation_bytes(replace(cfg, n_layer=0), *args)
        acts = acts - cfg.n_layer * one_layer + cfg.n_layer * micro_batch * seq_len * cfg.d_model \
            * dtype_bytes + one_layer
    return acts


def memory_per_gpu(s: _Sizes, stage: int, precision: str, optimizer: str, acts: int, *,
                   prefetch: int, offload: str | None, bucket_cap_mb: float,
                   post_forward: int | None = None) -> tuple[dict[str, float], list[str]]:
    """Bytes on one GPU by ledger category at the step's peak, and notes on how it was read:
    the training state (:func:`~minishard.planner.analytic.estimate`, less what is offloaded), what the
    strategy gathers or buffers, the activations."""
    memory = dict(estimate(n_params=s.n_params, world_size=s.shard_n, strategy=strategies.STAGES[stage],
                           precision=precision, optimizer=optimizer).per_rank)
    notes = []
    if offload:
        for cat in [c for c in memory if c != "params" or stage == 3]:
            memory.pop(cat)
        notes.append("sharded state offloaded to host memory")
    if stage == 3:
        # the peak is one of two moments (the live runs show both):
        # end of forward / start of backward: every activation, the root gathered, and
        #   `prefetch` blocks already gathered for backward;
        # inside a block's backward: the root and 1 + prefetch blocks gathered, the block's
        #   full gradients and their reduce-scatter buffer, all but one block's activations.
        # (reshard_after_forward=k: every block not yet gathered again holds 1/k of itself)
        kept = s.x * s.block / post_forward if post_forward else 0
        gathered_at_end = s.x * (s.root + prefetch * s.block) + kept * (s.n_layer - prefetch)
        gathered_inside = s.x * (s.root + (1 + prefetch) * s.block) + kept * max(0, s.n_layer - 1 - prefetch)
        if acts + gathered_at_end >= acts * (1 - 1 / s.n_layer) + gathered_inside + 2 * s.g * s.block:
            memory["unsharded"] = gathered_at_end
        else:
            memory["unsharded"] = gathered_inside
            memory["comm_buffers"] = 2 * s.g * s.block
            acts = int(acts * (1 - 1 / s.n_layer))
            notes.append("peak inside backward")
    elif stage == 2:                 # buckets of gradients waiting for their reduce-scatter
        memory["comm_buffers"] = min(2 * bucket_cap_mb * 2**20, s.g * s.n_params)
    memory["activations"] = acts
    return memory, notes


def compute_seconds(cfg: GPTConfig, seq_len: int, micro_batch: int, recompute: bool,
                    device: Device, mfu: float) -> tuple[float, float]:
    """(seconds of compute per step, of which backward) at ``mfu`` of the device's peak."""
    tokens = micro_batch * seq_len
    compute = train_flops_per_token(cfg, seq_len, recompute) * tokens / (device.flops * mfu)
    return compute, compute * (2 / 3 if not recompute else 2 / 4)


def ring_link(cluster: Cluster, hybrid: bool) -> Link:
    """The link the sharding collectives run on: a ring is as fast as its slowest link, so
    across nodes the slower of the two, unless hybrid sharding keeps them inside a node."""
    if cluster.nodes == 1 or hybrid:
        return cluster.intra
    a, b = cluster.intra, cluster.inter
    return a if a.bandwidth < b.bandwidth else b


def collective_seconds(s: _Sizes, stage: int, link: Link, prefetch: int, compute: float,
                       backward: float, back: tuple[int, Link] | None = None) -> tuple[float, float]:
    """(seconds of the strategy's collectives per step, the part compute does not hide);
    ``back``: (ranks, link) of backward's all-gathers when they run in smaller groups."""
    S = s.n_params * s.x
    if stage == 0:
        comm = ring_time("all_reduce", S, s.shard_n, link)
        return comm, max(0.0, comm - backward)
    if stage in (1, 2):
        gather = ring_time("all_gather", S, s.shard_n, link)
        comm = ring_time("reduce_scatter", S, s.shard_n, link) + gather
        # the reduce-scatter runs under backward; the updated parameters are gathered after the
        # step (ZeRO-1 and ZeRO-2 alike: DeepSpeed's step ends with that all-gather), with no
        # compute left to hide it behind
        return comm, gather + max(0.0, comm - gather - backward)
    units = [s.root] + [s.block] * s.n_layer
    n, on = back or (s.shard_n, link)
    gather = sum(ring_time("all_gather", s.x * u, s.shard_n, link) + ring_time("all_gather", s.x * u, n, on)
                 for u in units)
    scatter = sum(ring_time("reduce_scatter", s.g * u, s.shard_n, link) for u in units)
    comm = gather + scatter
    # with prefetch, unit i+1 travels while unit i computes; without, every gather waits
    return comm, max(0.0, comm - compute) if prefetch else gather + max(0.0, scatter - backward)


def cross_node_seconds(s: _Sizes, cluster: Cluster, grad_bytes: int) -> float:
    """Hybrid sharding: the gradient shards all-reduced across the nodes."""
    return ring_time("all_reduce", grad_bytes * s.n_params / s.shard_n, cluster.nodes, cluster.inter)


def _check_job(micro_batch: int, seq_len: int, mfu: float, wrap: str, offload) -> None:
    """A clear error for a job the planner cannot read. It asks which offload tier as a run
    does (``TrainConfig.offload``), and models host memory over PCIe alone."""
    if not isinstance(micro_batch, int) or micro_batch < 1 or seq_len < 1:
        raise ValueError(f"micro_batch and seq_len must be positive (got {micro_batch}, {seq_len})")
    if not 0 < mfu <= 1:
        raise ValueError(f"mfu is a fraction of peak FLOP/s in (0, 1], got {mfu}")
    if wrap not in ("block", "model"):
        raise ValueError(f"wrap is 'block' or 'model', got {wrap!r}")
    if offload == "disk":
        raise ValueError("offload='disk': the planner models host memory over PCIe only (memory-"
                         "mapped files on NVMe are not modelled); plan with offload='host' or None")
    if offload not in (None, "host"):
        raise ValueError(f"offload names the tier the sharded state lives in: 'host' or None, "
                         f"got {offload!r}")


def offload_seconds(s: _Sizes, gpus_per_node: int) -> tuple[float, float, float, float]:
    """(bytes in, bytes out over one GPU's PCIe link per step, the seconds of PCIe, the seconds
    of the CPU optimizer step), as chapter 08 counts them. What the engine moves
    (tests/test_offload.py): every unshard fetches the fp32 shard — each block twice (forward,
    backward), the root once — and every reduced gradient shard goes back. PCIe carries both
    directions at once, so the larger one is the time. The CPU Adam step streams its state
    through the host's memory, which the node's GPUs share."""
    fetched = 4 * (2 * s.n_layer * s.block + s.root) / s.shard_n
    returned = 4 * s.n_params / s.shard_n
    pcie_s = max(fetched, returned) / LINKS["pcie5-x16"].bandwidth
    cpu_s = gpus_per_node * CPU_ADAM_BYTES * s.n_params / s.shard_n / HOST_MEMORY_BANDWIDTH
    return fetched, returned, pcie_s, cpu_s


def _one_unit(per_block: Plan, s: _Sizes, cluster: Cluster, link: Link, *, hybrid: bool,
              activations: float, offload_s: float) -> Plan:
    """FSDP with one unit for the whole model (``wrap="model"``), from the per-block plan.

    The one unit is the root: gathered whole before the first layer computes, kept gathered
    until backward is done (FSDP never reshards the root after forward), its full gradients
    reduce-scattered after the last one is computed. So a GPU holds the whole model's working
    weights at the peak, and nothing overlaps: compute waits for the whole gather, and the
    reduce-scatter waits for the whole backward. ``activations``: the full forward's (the
    per-block plan may hold fewer at its in-backward peak); ``offload_s``: the time offload adds,
    PCIe and the CPU step (it does not depend on the wrapping). The gradients are counted in the working
    dtype (``x``), as this estimate always has."""
    n, x = s.n_params, s.x
    g = x
    memory = {k: v for k, v in per_block.memory.items()
              if k not in ("unsharded", "comm_buffers", "activations")}
    memory["unsharded"] = x * n
    # the two candidate peaks: end of forward (every activation) or end of backward (the full
    # gradients waiting for their reduce-scatter)
    if activations >= g * n:
        memory["activations"] = activations
    else:
        memory["comm_buffers"] = g * n
    comm = ring_time("all_gather", x * n, s.shard_n, link) + ring_time("reduce_scatter", g * n, s.shard_n, link)
    exposed = comm + offload_s
    if hybrid and cluster.nodes > 1:                   # as per block: gradient shards across nodes
        cross = cross_node_seconds(s, cluster, g)
        comm, exposed = comm + cross, exposed + cross
    notes = [n_ for n_ in per_block.notes if "units" not in n_] + ["1 unit (the whole model), 2 collectives per step"]
    return replace(per_block, memory=memory, comm_s=comm, exposed_comm_s=exposed, notes=notes)


def choose(model: str | GPTConfig, cluster: Cluster, **kw) -> list[Plan]:
    """Every strategy for one model and cluster, fitting ones first, fastest first."""
    plans = [plan(model, cluster, s, **kw) for s in strategies.STAGES]
    return sorted(plans, key=lambda p: (not p.fits, p.step_s))
