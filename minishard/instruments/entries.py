"""A flight-recorder entry in the doctor's words, the same on every rank: what the collective
was (``all_reduce of bucket0 [8] float32, 32 B``), where it was issued, what became of it, and the
ranks a finding concerns (``ranks 0, 2``)."""
from __future__ import annotations

from minishard.core.words import fmt_bytes


def describe(e: dict) -> str:
    """``all_reduce [8] float32, 32 B`` — what a collective was, the same on every rank (``of
    blocks.0`` when it names the unit or bucket it moves)."""
    shapes = ", ".join("[" + ", ".join(map(str, s)) + "]" for s in e["shapes"])
    of = f" of {e['tag']}" if e.get("tag") else ""
    return f"{e['op']}{of} {shapes} {','.join(e['dtypes'])}, {fmt_bytes(e['bytes'])}"


def site(e: dict) -> str:
    where, caller = e.get("where") or "", e.get("caller") or ""
    if not where:
        return ""
    return f"; at {where}" + (f", called from {caller}" if caller and caller != where else "")


def state(e: dict) -> str:
    return {"completed": "completed", "retired": "ended (PyTorch's gloo recorder does not say "
            "whether it succeeded)"}.get(e["state"], "issued, never completed")


def entry_line(who: str, e: dict) -> str:
    extra = "".join(f", {k} {e[k]}" for k in ("step", "phase") if e.get(k) not in (None, ""))
    return f"{who}: seq {e['seq']} {describe(e)}{extra} — {state(e)}{site(e)}"


def ranks_word(ranks) -> str:
    ranks = sorted(ranks)
    return f"rank{'s' if len(ranks) > 1 else ''} {', '.join(map(str, ranks))}"


def op_of(e: dict) -> str:
    return e["op"] + (f" of {e['tag']}" if e.get("tag") else "")

