"""The numbers the doctor's findings print, against a count made here from the files themselves —
never through the doctor's own reading: where a dead rank's trace ends (its line, its last step,
its last completed collective), the first seq a rank that stopped never issued (its ring cut to
its last few collectives, as a full ring drops the oldest), and how long ranks that gave up had
waited. Random runs (hypothesis): each is written as the ranks would have left it, then read by
``doctor.diagnose`` and by this file's plain ``json.loads`` of each line."""
import json
import re
import tempfile
from pathlib import Path

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from flight_dumps import Collective, WORLD_GROUP, dump, play, write
from minishard.core.words import fmt_bytes
from minishard.instruments import doctor

FAST = settings(max_examples=60, derandomize=True, deadline=None, database=None,
                suppress_health_check=[HealthCheck.too_slow])
OPS = ("all_reduce", "all_gather", "reduce_scatter", "broadcast")
DTYPES = {"float32": 4, "bfloat16": 2, "int64": 8}


# --------------------------------------------------------------------------- where a trace ends

@st.composite
def traces(draw):
    """A rank's trace (the text of rank{r}.jsonl) of a few steps — phases, allocations and
    collectives — and where its death cut it (any byte: mid-line or at a line's end)."""
    lines, seq = [], 0

    def event(kind, step, **fields):
        nonlocal seq
        lines.append(json.dumps({"v": 1, "rank": 1, "seq": seq, "t": 0.01 * seq, "kind": kind,
                                 **({"step": step} if step is not None else {}), **fields}))
        seq += 1
    event("alloc", None, category="params", bytes=draw(st.integers(1, 4096)), tag="param:w", device="device")
    for step in range(draw(st.integers(1, 5))):
        for phase in ("forward", "backward"):
            event("phase", step, name=phase, edge="begin")
            for _ in range(draw(st.integers(0, 2))):
                dtype = draw(st.sampled_from(sorted(DTYPES)))
                n = DTYPES[dtype] * draw(st.integers(1, 10_000))
                event("collective", step, op=draw(st.sampled_from(OPS)), payload=n, wire=n, dtype=dtype,
                      group=2, t_end=0.01 * seq, tag="bucket0")
            event("phase", step, name=phase, edge="end")
    text = "".join(line + "\n" for line in lines)
    if draw(st.booleans()):                     # killed between two lines (a whole line written)
        return "".join(line + "\n" for line in lines[:draw(st.integers(1, len(lines)))])
    return text[:draw(st.integers(1, len(text)))]


def counted(text: str) -> dict:
    """What a reader counts in the text itself: its lines, the first one that is no event (a
    strict prefix of a JSON object never parses), the last step and collective before it."""
    lines = text.split("\n")
    whole = lines[:-1] if lines[-1] == "" else lines
    out = {"lines": len(whole), "cut_at": None, "step": None, "last": None}
    for n, line in enumerate(whole, 1):
        try:
            ev = json.loads(line)
        except json.JSONDecodeError:
            out["cut_at"] = n
            break
        out["step"] = ev.get("step", out["step"])
        out["last"] = ev if ev["kind"] == "collective" else out["last"]
    return out


@FAST
@given(traces())
def test_where_a_dead_ranks_trace_ends_is_counted_from_the_file(text):
    """Rank 1 died and left only its trace, cut where its death cut it; rank 0 wrote its dump.
    The missing-dump finding says the line the trace ends (or stops) at, the step it was in and
    its last completed collective — each as this test counts them in the file's text."""
    with tempfile.TemporaryDirectory() as d:
        write(Path(d), [dump(0, [], world=2)])
        (Path(d) / "rank1.jsonl").write_text(text)
        (gone,) = [f for f in doctor.diagnose(d).findings if f.kind == "missing_dump"]
    said = gone.evidence[0]
    c = counted(text)
    where = (f"its trace rank1.jsonl stops at line {c['cut_at']} (" if c["cut_at"] else
             f"its trace rank1.jsonl ends at line {c['lines']}")
    assert where in said, (said, c)
    assert (f" in step {c['step']}," in said) == (c["step"] is not None), (said, c)
    last = c["last"]
    assert said.endswith(f"its last completed collective {last['op']} ({last['dtype']}, "
                         f"{fmt_bytes(last['payload'])})" if last else "with no collective"), (said, c)


# --------------------------------------------------------------------------- the seq a hang reports

@st.composite
def stops(draw):
    """A world of 2 to 5 ranks issuing collectives in the world group; one rank stops before
    one of them; each rank's ring then keeps only its last few collectives (at least one)."""
    world = draw(st.integers(2, 5))
    members = tuple(range(world))
    program = [Collective(WORLD_GROUP, members, draw(st.sampled_from(OPS)), 8)
               for _ in range(draw(st.integers(2, 14)))]
    rank, k = draw(st.integers(0, world - 1)), draw(st.integers(1, len(program) - 1))
    keep = [draw(st.integers(1, len(program))) for _ in range(world)]
    return world, program, rank, k, keep


@FAST
@given(stops())
def test_the_first_seq_a_stopped_rank_never_issued_is_counted_from_its_ring(run):
    """The hang names the seq after the last one the stopped rank's ring holds, and the ranks that
    wait — both read here from the dumps' JSON; a ring that dropped its oldest collectives (each
    rank's a different number) changes neither."""
    world, program, rank, k, keep = run
    played = play(world, program, stop=(rank, k))
    with tempfile.TemporaryDirectory() as d:
        write(Path(d), [dump(r, played.entries[r][-keep[r]:], world=world, reason=played.reasons[r])
                        for r in range(world)])
        rings = {r: json.loads((Path(d) / f"flight_rank{r}.json").read_text())["entries"] for r in range(world)}
        (hang,) = doctor.diagnose(d).findings
    first = max(e["seq"] for e in rings[rank]) + 1
    waiting = [r for r in range(world) if rings[r][-1]["state"] == "issued"]
    assert (hang.kind, hang.ranks) == ("hang", [rank]), hang
    assert hang.title.startswith(f"rank {rank} never issued seq {first} of group 'world' "), hang.title
    assert hang.title.endswith(f"; {doctor.ranks_word(waiting)} wait{'s' if len(waiting) == 1 else ''} in it"), \
        hang.title
    assert first == k                             # (the program's k-th: what the rank stopped before)


# --------------------------------------------------------------------------- how long a wait lasted

@FAST
@given(st.lists(st.tuples(st.floats(0.0, 50.0), st.floats(0.0, 900.0)), min_size=1, max_size=4))
def test_how_long_ranks_waited_is_their_dumps_clock_against_the_collectives_issue(waits):
    """Ranks that gave up waiting in one collective: the title says how long, from each dump's
    time on the trace clock (``t``) and the collective's ``t_issued`` — the least and the most,
    as this test computes them from the files."""
    n = len(waits) + 1                             # (the last rank never issued it)
    with tempfile.TemporaryDirectory() as d:
        ranks = [dict(dump(r, [{**_entry(0), "state": "completed"}, {**_entry(1), "t_issued": issued}],
                           world=n, reason="exception", error="RuntimeError: timed out after 2 s"),
                      t=issued + waited) for r, (issued, waited) in enumerate(waits)]
        write(Path(d), ranks + [dump(n - 1, [{**_entry(0), "state": "completed"}], world=n)])
        read = [json.loads((Path(d) / f"flight_rank{r}.json").read_text()) for r in range(n - 1)]
        (timeout,) = [f for f in doctor.diagnose(d).findings if f.kind == "timeout"]
    seconds = [body["t"] - body["entries"][-1]["t_issued"] for body in read]
    lo, hi = f"{min(seconds):.1f}", f"{max(seconds):.1f}"
    after = f"after {lo} s" if lo == hi else f"after {lo} to {hi} s"
    assert re.search(rf"\(seq 1 of group 'world'\) {re.escape(after)}: timed out$", timeout.title), (timeout.title, seconds)


def _entry(seq: int) -> dict:
    from flight_dumps import entry
    return entry(seq, state="issued", t_issued=0.0)
