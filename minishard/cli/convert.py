"""``minishard from-deepspeed DS_DIR OUT_DIR``: a DeepSpeed ZeRO checkpoint as minishard's.

    python -m minishard from-deepspeed ds_run/ ck/ --model nano
    torchrun --standalone --nproc-per-node 3 -m minishard demo --strategy fsdp --model nano --resume ck/

DS_DIR is the folder given to ``engine.save_checkpoint`` (its ``latest`` names the save; ``--tag``
another); one process reads it weights-only — no code from DeepSpeed's pickles runs — and writes
the fp32 masters, AdamW moments and step as a minishard checkpoint, which loads on any world size
and strategy (``minishard.checkpoint.from_deepspeed``). A file that is truncated, foreign, names a
type DeepSpeed does not store, or a rank that is missing: one line naming it, exit status 2.
"""
from __future__ import annotations

import argparse


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("ds_dir", help="the folder engine.save_checkpoint wrote (with its 'latest' file), "
                                  "or one save's global_stepN folder")
    p.add_argument("out_dir", help="the minishard checkpoint to write (replaced if it is one)")
    p.add_argument("--tag", default=None, help="the save to read (default: what DS_DIR/latest names)")
    p.add_argument("--model", default=None,
                   help="the minishard model config these are the parameters of (e.g. nano): checked "
                        "shape for shape and recorded, so that demo --resume accepts the checkpoint")


def run(args) -> int:
    from minishard.checkpoint import from_deepspeed
    out = from_deepspeed(args.ds_dir, args.out_dir, tag=args.tag, model=args.model)
    print(f"wrote {out['path']}: {len(out['files'])} files, {out['bytes']:,} bytes, step {out['step']}, "
          f"from DeepSpeed {out['ds_version']} ZeRO-{out['stage']} on {out['world_size']} ranks "
          f"({out['tensors']} tensors: fp32 masters and optimizer state)")
    return 0
