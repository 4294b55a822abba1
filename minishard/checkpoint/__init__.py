"""Checkpoints after sharding: every rank saves its own shards, and any layout can load them back.

A sharded run has no rank that holds the whole training state, so the state is saved the way it
is held: each rank writes the part it owns, all ranks in parallel. The package, one idea a file,
in the order chapter 9 tells it:

* :mod:`.regions` — what a rank holds, as regions of global tensors; the one protocol a strategy
  answers (``checkpoint_regions(holdings)``: ``ZeroOptimizer``, ``strategies.MasterWeights`` and
  each FSDP unit — whichever torch optimizer steps its shards — do); :func:`describe`.
* :mod:`.format` — the files: safetensors written by hand, an XXH3-64 checksum per block,
  metadata.json.
* :mod:`.agreement` — every rank fails alike: the ranks agree whether all succeeded, and all
  raise the first error.
* :mod:`.saving` — :func:`save`: every rank its own file, atomically.
* :mod:`.background` — ``save(..., background=True)``: copied to host memory, written while
  training goes on (:class:`PendingSave`, :func:`wait_for_saves`).
* :mod:`.reads` — which checksum blocks deliver what a rank needs (:func:`overlap`: what of a
  saved piece a region needs), read verified.
* :mod:`.loading` — :func:`load`: under any world size and strategy; read and verify, agree,
  then copy.
* :mod:`.resharding` — :func:`plan`: the reads of a load on M ranks, from metadata alone.
* :mod:`.exporting` — :func:`export`: per-layer files for inference, streamed.
* :mod:`.from_deepspeed` — :func:`from_deepspeed`: a DeepSpeed ZeRO-1/2/3 checkpoint of any world
  size read weights-only (no code from its pickles runs) and written as minishard's.

No pickle on any load path: loading runs no code from the files.
"""
from .background import PendingSave, wait_for_saves
from .exporting import export, load_exported
from .from_deepspeed import from_deepspeed
from .format import (BLOCK_BYTES, CHECKSUM, FORMAT, METADATA, READABLE_VERSIONS, STATE_KINDS, VERSION,
                     CheckpointError, read_metadata)
from .loading import load
from .reads import Read, overlap, plan_reads, read_full
from .regions import CheckpointRegions, Holdings, Region, ShardedState, describe, local_state
from .resharding import ReshardPlan, layout, layout_metadata, plan
from .saving import save

__all__ = ["CheckpointError", "CheckpointRegions", "Holdings", "Region", "ShardedState", "describe",
           "local_state", "save", "PendingSave", "wait_for_saves", "load", "read_metadata", "read_full",
           "Read", "overlap", "plan_reads",
           "ReshardPlan", "plan", "layout", "layout_metadata", "export", "load_exported", "from_deepspeed",
           "FORMAT", "VERSION", "READABLE_VERSIONS", "METADATA", "BLOCK_BYTES", "CHECKSUM", "STATE_KINDS"]
