"""A run that left only traces, one of them cut short by a death, under hypothesis.

A trace holds a collective once it *completed*, written as it completed (``minishard.watch``
streams one line per event), and is numbered by the doctor in the order the collectives were
issued (``records.from_trace``). A rank that dies keeps what it had completed: its trace stops at
any byte — between lines or inside one — and the collectives it had issued but not completed are
not in it, while the others may complete a collective or two more before they notice it is gone.
Where collectives complete out of order (prefetched all-gathers, gloo's several threads) one of
them may be missing from the short trace while a later one is there.

None of that is a desync or a hang: a healthy program with one trace cut anywhere is no finding,
exit status 3 (not everything could be checked). A desync every rank's trace holds with all that
came before it — one rank issuing two collectives in the other order — is still named, with its
rank, exit status 1. (One a trace holds only past a gap may go unnamed: from traces alone a
collective is known by what it was, not by which one it was.) The rules of the lining up
(``minishard/instruments/cut_short.py``) are then checked one by one.
"""
from __future__ import annotations

import json
import tempfile
from pathlib import Path

import pytest

hypothesis = pytest.importorskip("hypothesis")
from hypothesis import HealthCheck, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

from minishard.cli import main  # noqa: E402
from minishard.core import run_id, trace  # noqa: E402
from minishard.instruments import cut_short, doctor  # noqa: E402

OPS = (("all_reduce", 4), ("all_gather", 8), ("reduce_scatter", 16), ("all_reduce", 32))
DRAWN = settings(max_examples=120, deadline=None, derandomize=True, database=None,
                 suppress_health_check=[HealthCheck.too_slow])


@st.composite
def runs(draw, swapped: bool = False):
    """(world, per-rank lines of each trace, the dying rank, None or (the swapped rank, the first
    of the two it swapped, the two))."""
    world = draw(st.integers(2, 4))
    n = draw(st.integers(3, 10))
    program = [draw(st.sampled_from(OPS)) for _ in range(n)]
    issued = [round(0.1 * k, 6) for k in range(n)]
    # when each collective completes, everywhere (within a jitter per rank): late ones overtake
    done = [issued[k] + draw(st.sampled_from((0.013, 0.051, 0.257))) for k in range(n)]
    swap = None
    if swapped:
        k = draw(st.integers(0, n - 2).filter(lambda k: program[k] != program[k + 1]))
        swap = (draw(st.integers(0, world - 1)), k, program[k:k + 2])
    dying = draw(st.integers(0, world - 1))
    # just after some collective completed (or before any did)
    death = draw(st.sampled_from([-1.0] + sorted(done))) + 0.004
    linger = draw(st.sampled_from((0.0, 0.02)))     # what the others complete after it died
    lines = {}
    for r in range(world):
        ops = list(program)
        if swap and swap[0] == r:
            k = swap[1]
            ops[k], ops[k + 1] = ops[k + 1], ops[k]
        jitter = [draw(st.sampled_from((0.0, 0.003))) for _ in range(n)]
        end = {k: done[k] + jitter[k] for k in range(n)}
        kept = [k for k in range(n) if end[k] <= (death if r == dying else death + linger)]
        t = trace.Tracer(r, world, origin=0.0)
        t.run = "0123456789ab"
        rows = [json.dumps(t.header())]
        for k in sorted(kept, key=lambda k: end[k]):    # a line as each completes
            op, numel = ops[k]
            ev = t.emit("collective", t=issued[k], t_end=end[k], op=op, payload=4 * numel,
                        wire=4 * numel, dtype="float32", group=world, tag="", step=0)
            rows.append(json.dumps(ev))
        text = "".join(row + "\n" for row in rows)
        if r == dying:                                  # and it died inside its last line, or after
            text = text[:len(text) - draw(st.integers(0, len(rows[-1]) + 1), label="cut")]
        lines[r] = text
    return world, lines, dying, swap


def _doctor(world, lines):
    d = Path(tempfile.mkdtemp())
    for r, text in lines.items():
        (d / f"rank{r}.jsonl").write_text(text)
    return d


@DRAWN
@given(runs())
def test_a_healthy_run_with_one_trace_cut_short_is_no_finding(run):
    world, lines, dying, _ = run
    d = _doctor(world, lines)
    report = doctor.diagnose(d)
    assert report.only_traces and report.world_size == world
    assert report.findings == [], [(f.kind, f.title) for f in report.findings]


@DRAWN
@given(runs(swapped=True))
def test_a_swap_every_trace_holds_is_still_named_with_its_rank(run):
    world, lines, dying, (odd, k, swapped) = run
    report = doctor.diagnose(_doctor(world, lines))
    upto = {round(0.1 * j, 6) for j in range(k + 2)}          # the two swapped and all before
    if all(upto <= {round(e["t_issued"], 6) for e in report.dumps[r]["entries"]} for r in range(world)):
        found = report.findings                                # every trace holds them
        assert [f.kind for f in found] == ["desync"], [(f.kind, f.title) for f in found]
        # (numbered as the traces hold them: a collective none of them holds is not counted)
        said = [f"{op} [{numel}] float32, {4 * numel} B" for op, numel in swapped]
        assert odd in found[0].ranks and all(s in found[0].title for s in said), found[0].title


def test_the_command_line_says_3_for_a_cut_trace_and_1_for_a_swap(capsys):
    ops = [("all_gather", 8), ("all_reduce", 4)]
    one = {r: _lines(r, 2, ops if r else ops[::-1]) for r in range(2)}
    assert main(["doctor", str(_doctor(2, one))]) == 1
    cut = {0: _lines(0, 2, ops), 1: _lines(1, 2, ops)[:-7]}
    assert main(["doctor", str(_doctor(2, cut))]) == 3
    capsys.readouterr()


def _lines(rank, world, ops):
    t = trace.Tracer(rank, world, origin=0.0)
    t.run = "0123456789ab"
    out = json.dumps(t.header()) + "\n"
    for k, (op, numel) in enumerate(ops):
        out += json.dumps(t.emit("collective", t=0.1 * k, t_end=0.1 * k + 0.01, op=op,
                                 payload=4 * numel, wire=4 * numel, dtype="float32", group=world,
                                 tag="", step=0)) + "\n"
    return out


# --------------------------------------------------------------------------- the rules, one by one

def _held(*per_rank):
    """rank -> seq -> entry, each entry (op, issued, completed), as ``records.from_trace`` reads."""
    return {r: {s: {"seq": s, "op": op, "shapes": [[4]], "dtypes": ["float32"], "bytes": 16, "tag": "",
                    "step": 0, "state": "completed", "t_issued": t, "t_completed": end}
                for s, (op, t, end) in enumerate(entries)}
            for r, entries in enumerate(per_rank)}


def _lined_up(held):
    return cut_short.lined_up(held, sorted(held), doctor.sizes_agree_and_tag)


def test_a_collective_still_running_when_the_short_trace_ended_is_a_gap_it_is_renumbered_past():
    held = _held([("A", 0.0, 0.9), ("B", 0.1, 0.2), ("C", 0.3, 0.4)],     # A outlived rank 1
                 [("B", 0.1, 0.2), ("C", 0.3, 0.4)])
    assert sorted(_lined_up(held)[1]) == [1, 2]


def test_a_collective_complete_when_the_short_trace_ended_is_no_gap():
    """Rank 0 swapped A and B; rank 1's trace ends as the two complete, at the very moment rank
    0's next B does. That B was complete, not running, when rank 1's trace ended: no gap to
    renumber rank 1 past (which would pair rank 1's A and B with rank 0's later ones and hide
    the swap)."""
    held = _held([("A", 0.0, 0.1), ("B", 0.2, 0.5), ("A", 0.3, 0.5), ("B", 0.4, 0.5)],
                 [("A", 0.0, 0.1), ("A", 0.2, 0.5), ("B", 0.3, 0.5)])
    assert _lined_up(held)[1] == held[1]
    assert doctor.desync("world", _lined_up(held), [0, 1]).ranks == [0, 1]


def test_a_collective_is_never_matched_to_one_issued_after_it_completed():
    """Rank 1 swapped A and B and died; rank 0's next A was issued after rank 1's A completed:
    they cannot be one collective, so rank 1 is not renumbered and the swap is a desync."""
    held = _held([("A", 0.0, 5.0), ("B", 1.0, 1.5), ("A", 3.0, 3.5)],
                 [("B", 0.0, 1.4), ("A", 1.0, 2.2)])
    assert _lined_up(held)[1] == held[1]
    assert doctor.desync("world", _lined_up(held), [0, 1]).ranks == [0, 1]


def test_a_short_trace_is_lined_up_with_the_longest_whichever_rank_holds_it():
    held = _held([("B", 0.1, 0.2)], [("A", 0.0, 0.9), ("B", 0.1, 0.2)], [("A", 0.0, 0.9), ("B", 0.1, 0.2)])
    assert sorted(_lined_up(held)[0]) == [1]


def test_the_world_size_is_the_headers_when_no_trace_holds_a_collective_of_the_world():
    d = _doctor(4, {r: json.dumps(run_id.header("0123456789ab", r, 4)) + "\n" for r in (0, 1)})
    assert doctor.diagnose(d).world_size == 4
