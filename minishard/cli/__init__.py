"""``python -m minishard ...`` and ``torchrun -m minishard ...``: the command line.

    torchrun --standalone --nproc-per-node 4 -m minishard demo --strategy zero3 --steps 3 --trace DIR
    python -m minishard demo --world-size 4 --strategy ddp --steps 3       # ranks started here
    python -m minishard ledger --config configs/llama3-8b.json --world-size 8 --strategy zero3
    python -m minishard plan --config configs/qwen2-7b.json --gpus-per-node 8 --nodes 2
    python -m minishard perfetto DIR out.json
    python -m minishard view DIR                 # DIR/player.html: step through it offline
    python -m minishard doctor DIR               # hangs and desyncs, from the ranks' flight dumps
    python -m minishard from-deepspeed DS_DIR CK # a DeepSpeed ZeRO checkpoint as minishard's

``demo`` trains (every knob a chapter teaches is a flag) and prints, per rank, the ledger by
category, the peak against the formula, the bytes sent per step and the time compute waited on
communication; ``ledger`` and ``plan`` answer for real model configs without training anything;
``view`` writes a trace's step-through player as one HTML file (no kernel, no network);
``from-deepspeed`` converts a DeepSpeed ZeRO-1/2/3 checkpoint (read weights-only) into minishard's.
Bad input stops with one line naming the problem (the flag, and what to do) and exit status 2,
before any rank starts where it can be known then; a run that fails inside a rank stops with one
line naming the rank and the cause, and exit status 1 (``--debug``: the rank's traceback too).
Under torchrun that line is also the root cause torchrun's failure summary shows.
"""
from __future__ import annotations

import argparse
import ast
import json
import os
import re
import sys
import time
import traceback

from . import convert, demo, doctor, plan, view

__all__ = ["main"]

DESCRIPTION = ("minishard's command line: train under a strategy on N ranks (demo), size real models "
               "without training (ledger, plan), and turn a trace into Perfetto JSON or a step-through "
               "player (perfetto, view), say what went wrong in a run (doctor), or read a DeepSpeed "
               "checkpoint (from-deepspeed). Run as: python -m minishard COMMAND ..., or under torchrun: "
               "torchrun --standalone --nproc-per-node N -m minishard demo ...")
BAD_INPUT, FAILED = 2, 1
# what a rank raises when the input was wrong (a bad checkpoint, a value found wrong only there)
BAD_INPUT_ERRORS = ("ValueError", "ConfigError", "CheckpointError", "TraceFormatError",
                    "FileNotFoundError", "NotADirectoryError", "IsADirectoryError", "FileExistsError")
# a rank that lost its peers because another failed first: a consequence, not the cause
PEER_LOST = re.compile(r"Connection (closed|reset) by peer|Broken pipe|connection refused|"
                       r"Socket Timeout|DistNetworkError|DistBackendError", re.I)


class _Parser(argparse.ArgumentParser):
    """argparse, with its refusals as one line (usage is behind --help) and on rank 0 only."""

    def error(self, message: str):
        line = f"{self.prog}: error: {message} (see {self.prog} --help)"
        demo.say_once(line, file=sys.stderr)
        if os.environ.get("RANK", "0") == "0":   # only the rank that speaks writes torchrun's error file
            _write_error_file(line, line)
        raise SystemExit(_leave(BAD_INPUT, wait=os.environ.get("RANK", "0") != "0"))


def parser() -> argparse.ArgumentParser:
    p = _Parser(prog="minishard", description=DESCRIPTION)
    sub = p.add_subparsers(dest="cmd", required=True, metavar="{demo,ledger,plan,perfetto,view,doctor,from-deepspeed}")
    demo.add_arguments(sub.add_parser(
        "demo", help="train on N ranks: per-step progress, the ledger per rank, bytes, a trace",
        description="Train the course's GPT under a strategy, on the ranks torchrun started (or "
                    "--world-size ranks started here), and report what every rank measured."))
    plan.add_ledger_arguments(sub.add_parser(
        "ledger", help="the analytic ledger of a model: bytes per rank by category",
        description="Bytes per rank by ledger category for a model (a built-in name or a "
                    "Hugging Face config.json), a world size, a strategy and a precision."))
    plan.add_plan_arguments(sub.add_parser(
        "plan", help="the planner: memory and step time of every strategy on a cluster",
        description="Per-GPU memory by category, step time and whether it fits, for each "
                    "strategy, with the planner's warnings (chapter 10)."))
    pp = sub.add_parser("perfetto", help="convert a trace directory to Chrome/Perfetto JSON",
                        description="Write the trace of a demo run (DIR/rank*.jsonl) as one "
                                    "Chrome/Perfetto JSON file (open it in ui.perfetto.dev).")
    pp.add_argument("trace_dir", help="a directory with rank*.jsonl (demo --trace DIR)")
    pp.add_argument("out", help="the .json file to write")
    view.add_arguments(sub.add_parser(
        "view", help="a trace as one HTML file that steps through it (no kernel, no network)",
        description="Write the step-through player of a trace (DIR/rank*.jsonl, e.g. from "
                    "torchrun ... demo --trace DIR) as one self-contained HTML file: every rank's "
                    "ledger, the collective on the ring, the FSDP units, the timeline."))
    doctor.add_arguments(sub.add_parser(
        "doctor", help="what went wrong in a run: hangs and desyncs, from the ranks' flight dumps",
        description="Read the flight-recorder dumps (DIR/flight_rank*.json), the rings of ranks that "
                    "died without one (DIR/flight_rank*.ring) and the traces of a run and print what "
                    "went wrong, most important first, with the evidence and the fix. Exit status 0: "
                    "nothing found; 1: a problem found (a rank that died is one); 2: unreadable "
                    "input, or files that are not one run's (two run ids, two world sizes, a ring "
                    "most of whose records are scrambled: the files named, nothing diagnosed); 3: "
                    "nothing could be checked (no dump and no ring). Files written before run ids "
                    "are read as before, and named as not checked to be one run's."))
    convert.add_arguments(sub.add_parser(
        "from-deepspeed", help="a DeepSpeed ZeRO-1/2/3 checkpoint as a minishard checkpoint",
        description="Read the DeepSpeed ZeRO stage 1, 2 or 3 checkpoint engine.save_checkpoint wrote "
                    "(any world size; weights-only: no code from its pickles runs) and write it as a "
                    "minishard checkpoint — fp32 masters, AdamW moments, step — that loads on any world "
                    "size and strategy (demo --resume)."))
    for command in sub.choices.values():
        command.add_argument("--debug", action="store_true",
                             help="when something fails, print the full traceback too (of the rank that failed)")
    return p


def main(argv: list[str] | None = None, *, pools=None) -> int:
    """Run one command; its exit status. ``pools`` (a :class:`minishard.core.launch.Pools`) lends
    ``demo --world-size N`` warm ranks instead of starting N processes for this one run: a
    notebook or a test session runs many commands on the same ranks."""
    args = parser().parse_args(argv)
    try:
        return _dispatch(args, pools)
    except KeyboardInterrupt:
        demo.say_once(f"minishard {args.cmd}: interrupted", file=sys.stderr)
        return 130
    except Exception as e:                   # every failure is one line; the traceback on --debug
        status, line, where, tb = _explain(e)
        line = f"minishard {args.cmd}: error: {line}"
        if status == FAILED and not args.debug:
            line += "; --debug prints the traceback"
        if status == FAILED and getattr(args, "trace", None):    # each rank left its flight dump
            line += f"; python -m minishard doctor {args.trace} says what went wrong"
        rank = int(os.environ.get("RANK", "0"))
        if where == "peer":                  # let the rank that failed first speak first
            time.sleep(2.0)
        elif where == "rank" and rank != 0:  # several ranks failing alike: rank 0's line comes first
            time.sleep(1.0)                  # and is torchrun's root cause (the earliest error file)
        if where == "rank" or rank == 0:     # (every rank hit an "all" error: rank 0 says it)
            sys.stderr.write(line + "\n")   # one write: ranks' lines do not run together
            if args.debug:
                sys.stderr.write(tb or traceback.format_exc())
            sys.stderr.flush()
        if where != "all" or rank == 0:      # the rank that speaks is the root cause torchrun shows:
            _write_error_file(line, (tb or traceback.format_exc()) + line if args.debug else line)
        return _leave(status, wait=where == "all" and rank != 0)


def _leave(status: int, wait: bool) -> int:
    """Under torchrun, a rank that failed leaves at once: its process group may be stuck
    mid-collective, and gloo's threads abort an interpreter that shuts down around them
    ("terminate called without an active exception"). A rank that lets rank 0 speak for all
    waits for rank 0 to say it and leave — torchrun then stops the other ranks — however late
    rank 0 started: leaving first would make torchrun's "closing signal" the first line printed.
    (It cannot wait forever: rank 0 reaches the same error, the input being the same.)"""
    dist = sys.modules.get("torch.distributed")      # (not imported: no group to leave)
    if wait:
        time.sleep(60.0)
    if dist is not None and dist.is_available() and dist.is_initialized():
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(status)
    return status


def _dispatch(args, pools=None) -> int:
    if args.cmd == "demo":
        return demo.run(args, pools)
    if args.cmd == "ledger":
        return plan.ledger(args)
    if args.cmd == "plan":
        return plan.plan(args)
    if args.cmd == "view":
        return view.run(args)
    if args.cmd == "doctor":
        return doctor.run(args)
    if args.cmd == "from-deepspeed":
        return convert.run(args)
    from minishard.viewers.perfetto import write_chrome
    from minishard.core.trace import load
    write_chrome(load(args.trace_dir), args.out)
    print(f"wrote {args.out}")
    return 0


def _explain(e: BaseException) -> tuple[int, str, str, str | None]:
    """(exit status, the one line, who prints it: "all" ranks alike (rank 0 speaks) or this
    "rank", or a "peer" that lost a rank that failed first, the traceback for --debug)."""
    from minishard.core.launch import RankError
    if isinstance(e, RankError):
        kind, message = _parse_repr(e.error)
        status = BAD_INPUT if kind in BAD_INPUT_ERRORS else FAILED
        if kind == "CheckpointError":        # every rank raises the one all agreed on
            return status, _cause(kind, message), "all", e.rank_traceback
        if PEER_LOST.search(f"{kind} {message}"):
            return (FAILED, f"rank {e.rank} stopped: it lost its peers ({_one_line(message)[:160]}); "
                            f"the rank that failed first says why", "peer", e.rank_traceback)
        return status, f"rank {e.rank} {_cause(kind, message)}", "rank", e.rank_traceback
    if isinstance(e, OSError) and e.filename is not None:
        status = BAD_INPUT if isinstance(e, (FileNotFoundError, NotADirectoryError, IsADirectoryError,
                                             PermissionError, FileExistsError)) else FAILED
        return status, f"{e.filename}: {e.strerror or e}", "all", None
    if isinstance(e, (ValueError, LookupError, FileNotFoundError)) or type(e).__name__ in BAD_INPUT_ERRORS:
        return BAD_INPUT, _one_line(str(e)), "all", None
    return FAILED, f"{type(e).__name__}: {_one_line(str(e))}", "all", None


def _cause(kind: str, message: str) -> str:
    """What went wrong on a rank, in the command line's words."""
    message = _one_line(message)
    if kind == "DeviceOutOfMemory":
        return (f"ran out of device memory: {message}; give it more (--device-budget MIB) or hold "
                f"less (a strategy that shards more, --recompute, --offload host)")
    if kind == "CheckpointError":
        message = message.replace("pass optimizer=None to load the weights only",
                                  "resume with the --optimizer that saved it")
        return f"could not use the checkpoint: {message}"
    if kind == "OffloadError":
        return f"could not offload: {message}; choose another --offload-dir"
    return f"failed: {kind}: {message}"


def _parse_repr(error: str) -> tuple[str, str]:
    """``DeviceOutOfMemory('allocating ...')`` (a rank reports its exception's repr) as
    ``("DeviceOutOfMemory", "allocating ...")``."""
    m = re.fullmatch(r"([\w.]+)\((.*)\)", error.strip(), re.S)
    if not m:
        return "Error", error
    try:
        args = ast.literal_eval(m.group(2) + ",") if m.group(2) else ()
    except (ValueError, SyntaxError):
        return m.group(1), m.group(2)
    return m.group(1), ": ".join(str(a) for a in args)


def _one_line(text: str) -> str:
    return " ".join(text.split())


def _write_error_file(message: str, callstack: str) -> None:
    """Under torchrun: the error file torchrun reads (``TORCHELASTIC_ERROR_FILE``, the layout of
    torch.distributed.elastic's ErrorHandler), so that its failure summary shows this line as
    the root cause, not "To enable traceback see ..."."""
    path = os.environ.get("TORCHELASTIC_ERROR_FILE")
    if not path:
        return
    try:
        with open(path, "w") as f:
            json.dump({"message": {"message": message, "extraInfo": {
                "py_callstack": callstack, "timestamp": str(int(time.time()))}}}, f)
    except OSError:
        pass
