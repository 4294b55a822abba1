"""Resharding plans without ranks: what a load on M ranks reads of a checkpoint saved by N.

Can a checkpoint saved by N ranks under one strategy be loaded by M ranks under another (64 ->
32 after losing a node; ZeRO-1 -> FSDP)? Yes, because the checkpoint records *which elements of
which tensor* each file holds, not "rank r's state". And because a strategy's layout is pure
arithmetic, what each new rank would hold can be computed on the meta device — no ranks, no
memory — and so can the reads that would load it (:func:`plan`: of each saved piece, the
:func:`.reads.overlap` with each region the new rank would hold, in whole checksum blocks), and
even the metadata a save that never ran would write (:func:`layout_metadata`).
"""
from __future__ import annotations

from dataclasses import dataclass

from minishard.core.comm import Comm
from .format import BLOCK_BYTES, build_metadata, dtype_name, plan_file
from .reads import Read, plan_reads
from .regions import ShardedState, describe


class _LayoutComm(Comm):
    """Rank ``rank`` of a world that need not exist: enough to build a strategy's layout on the
    meta device (the broadcast from rank 0 does nothing: meta tensors have no values)."""

    def __init__(self, rank: int, world_size: int):
        super().__init__(None)
        self.rank, self.world_size, self.backend = rank, world_size, "none"

    def broadcast(self, tensor, src: int = 0, **kw):
        return None

    def all_gather_object(self, obj):
        raise RuntimeError("a layout-only comm cannot communicate")


def layout(strategy: str, rank: int, world_size: int, model_config, *, optimizer: str = "adamw",
           **build_options) -> ShardedState:
    """What rank ``rank`` of ``world_size`` would hold under ``strategy`` — computed on the meta
    device, from the layout math alone (no ranks, no memory)."""
    from minishard.training.config import TrainConfig
    from minishard.core.model import GPT, GPTConfig
    from minishard.strategies.registry import build
    cfg = GPTConfig(**model_config) if isinstance(model_config, dict) else model_config
    comm = _LayoutComm(rank, world_size)
    built = build(GPT(cfg, device="meta"), TrainConfig(strategy, optimizer=optimizer, **build_options), comm)
    return describe(built.model, built.optimizer, comm)


def _optimizer_name(meta: dict) -> str:
    kinds = {n.split("/", 1)[0] for n in meta["tensors"]}
    return "adamw" if "exp_avg" in kinds else "sgd_momentum" if "momentum_buffer" in kinds else "sgd"


def layout_metadata(strategy: str, world_size: int, model_config, *, optimizer: str = "adamw",
                    step: int = 0, block_bytes: int = BLOCK_BYTES, **build_options) -> dict:
    """The metadata a save by ``world_size`` ranks under ``strategy`` would write — files, pieces,
    byte offsets — without running it (no checksums: nothing to hash). For planning what
    resharding a 64-rank run would read, on a laptop."""
    infos = []
    for r in range(world_size):
        st = layout(strategy, r, world_size, model_config, optimizer=optimizer, **build_options)
        _, _, records, size = plan_file(st)
        infos.append({"rank": r, "bytes": size, "records": records, "strategy": st.strategy,
                      "model": st.model_config, "optimizer": {"class": type(st.optimizer).__name__,
                                                              "step": step, "param_groups": []},
                      "tensors": {n: (list(s), dtype_name(d)) for n, (s, d) in st.tensors.items()}})
    return build_metadata(infos, step=step, block_bytes=block_bytes)


@dataclass
class ReshardPlan:
    """For each new rank, the reads that load it: which byte ranges of which saved files."""
    saved_world_size: int
    world_size: int
    reads: list[list[Read]]
    file_rank: dict[str, int]
    needed_bytes: list[int]         # bytes each new rank needs (the reads add whole blocks)

    def bytes_matrix(self) -> list[list[int]]:
        """``m[new][saved]``: bytes new rank ``new`` reads from saved rank ``saved``'s file."""
        m = [[0] * self.saved_world_size for _ in range(self.world_size)]
        for new, rs in enumerate(self.reads):
            for rd in rs:
                m[new][self.file_rank[rd.file]] += rd.nbytes
        return m

    def bytes_read(self) -> list[int]:
        return [sum(rd.nbytes for rd in rs) for rs in self.reads]

    def files_read(self) -> list[list[int]]:
        return [sorted({self.file_rank[rd.file] for rd in rs}) for rs in self.reads]


def plan(metadata: dict, strategy: str, world_size: int, model_config=None,
         **build_options) -> ReshardPlan:
    """What loading this checkpoint on ``world_size`` ranks under ``strategy`` reads, per new
    rank — the same reads :func:`.loading.load` executes, computed without launching anything."""
    cfg = model_config if model_config is not None else metadata["model"]
    reads, needed = [], []
    for r in range(world_size):
        st = layout(strategy, r, world_size, cfg, optimizer=_optimizer_name(metadata), **build_options)
        regions = [g for g in st.regions if g.load]
        reads.append(plan_reads(metadata, [(g.name, g.start, g.numel) for g in regions]))
        needed.append(sum(g.numel * g.view.element_size() for g in regions if not g.cast))
    return ReshardPlan(metadata["world_size"], world_size, reads,
                       {f: info["rank"] for f, info in metadata["files"].items()}, needed)
