"""The side-by-side tables and the pair of players on hand-made traces (no ranks): each row says
what differs, and the moments line up by step, phase and edge — the rules the real-rank tests
rely on, each pinned where an outsider's planted change went unseen."""
import pytest

from minishard.course import side_by_side as sbs
from minishard.strategies.torch_native import torch_prefetch
from minishard.viz.pair import PlayerPair, shared_moments


def ev(seq, kind, t, rank=0, step=1, **f):
    return {"v": 1, "rank": rank, "seq": seq, "t": t, "kind": kind, "step": step, **f}


def job(payload=400, dtype="float32", backward=("b1", "b0"), rank=0, steps=(1,)):
    """One step of a two-unit FSDP-like trace on ``rank``: phases, gathers, a reduce-scatter,
    memory; each field a test may change."""
    out, seq, t = [], 0, 0.0

    def add(kind, **f):
        nonlocal seq, t
        out.append(ev(seq, kind, t, rank=rank, **f))
        seq, t = seq + 1, t + 1.0
    for s in steps:
        add("phase", name="step", edge="begin", step=s)
        add("phase", name="forward", edge="begin", step=s)
        for u in ("b0", "b1"):
            add("collective", op="all_gather", tag=u, payload=payload, wire=payload // 2, dtype=dtype,
                group=2, t_end=t, step=s)
        add("alloc", category="activations", bytes=100, tag="a", step=s)
        add("phase", name="forward", edge="end", step=s)
        add("phase", name="backward", edge="begin", step=s)
        for u in backward:
            add("collective", op="all_gather", tag=u, payload=payload, wire=payload // 2, dtype=dtype,
                group=2, t_end=t, step=s)
        add("free", category="activations", bytes=100, tag="a", step=s)
        add("phase", name="backward", edge="end", step=s)
        add("phase", name="optimizer", edge="begin", step=s)
        add("phase", name="optimizer", edge="end", step=s)
        add("phase", name="step", edge="end", step=s)
    return out


def test_a_collective_differing_in_bytes_or_dtype_is_not_the_same():
    same = sbs.compare_fsdp(job(), job())["collectives"]
    assert {r["difference"] for r in same} == {"same"}
    for other in (job(payload=404), job(dtype="bfloat16")):
        rows = sbs.compare_fsdp(job(), other)["collectives"]
        assert all(r["difference"] is None for r in rows), sbs.render(rows)


def test_gathers_compare_backward_too_and_peaks_say_theirs_minus_mine():
    t = sbs.compare_fsdp(job(), job(backward=("b0", "b1")))
    assert {r["phase"] for r in t["gathers"]} == {"forward", "backward"}
    by = {r["phase"]: r["difference"] for r in t["gathers"]}
    assert by == {"forward": "same", "backward": None}
    mine = job()
    theirs = [dict(e, bytes=e["bytes"] + 20) if e["kind"] in ("alloc", "free") else e for e in job()]
    rows = sbs.compare_fsdp(mine, theirs)["peaks"]
    assert all(r["theirs_minus_mine"] == r["theirs"] - r["mine"] for r in rows)
    assert {(r["phase"], r["theirs_minus_mine"]) for r in rows if r["category"] == "activations"} >= {
        ("forward", 20), ("all", 20)}


def test_an_event_at_a_phases_end_belongs_to_it_and_live_at_keeps_to_its_step():
    evs = job(steps=(0, 1))
    fwd_end = next(e for e in evs if e["kind"] == "phase" and e["name"] == "forward"
                   and e["edge"] == "end" and e["step"] == 1)
    at_end = ev(999, "collective", fwd_end["t"], op="all_gather", tag="late", payload=4, wire=2,
                dtype="float32", group=2, t_end=fwd_end["t"])
    rows = sbs.collectives(evs + [at_end], step=1)
    assert next(r["phase"] for r in rows if r["tag"] == "late") == "forward"
    hits = sbs.live_at(evs, 0, 1, "activations", lambda e: e["kind"] == "alloc")
    assert len(hits) == 1 and hits[0][0]["step"] == 1          # step 0's alloc is not step 1's


def test_render_draws_its_rule_under_the_header():
    lines = sbs.render([{"a": 1, "bb": [2, 3]}]).splitlines()
    assert lines[0].split() == ["a", "bb"] and set(lines[1]) == {"-", " "} and lines[2].split() == ["1", "2", "3"]


def test_the_pair_opens_at_the_first_shared_moment_on_its_rank_and_matches_whole_moments():
    mine = job(steps=(0, 1)) + job(steps=(0, 1), rank=1)
    theirs = job(steps=(0, 1)) + job(steps=(0, 1), rank=1)
    pair = PlayerPair(mine, theirs, rank=1)
    for p in (pair.left, pair.right):                     # opened at (0, forward, begin), rank 1
        e = p.replay.events[p.index]
        assert (e["rank"], e["step"], e["name"], e["edge"]) == (1, 0, "forward", "begin")
    i, j = pair.show("backward", step=1)
    assert pair.right.replay.events[j]["rank"] == 1 and pair.left.replay.events[i]["rank"] == 1
    # a phase missing in one step only: that step's moment is not shared, the other step's is
    cut = [e for e in theirs if not (e["kind"] == "phase" and e["name"] == "backward" and e["step"] == 1)]
    shared = shared_moments(mine, cut)
    assert (1, "backward", "begin") not in shared and (0, "backward", "begin") in shared


class Unit:
    """A stand-in for an FSDP2 module: records the prefetch lists it is given."""

    def __init__(self, name):
        self.name, self.forward, self.backward = name, None, None

    def set_modules_to_forward_prefetch(self, ms):
        self.forward = [m.name for m in ms]

    def set_modules_to_backward_prefetch(self, ms):
        self.backward = [m.name for m in ms]


@pytest.mark.parametrize("depth", [0, 1, 2, 3])
def test_torch_fsdp_prefetch_lists_are_minishards_schedule(depth):
    root, units = Unit("root"), [Unit(f"u{i}") for i in range(4)]
    torch_prefetch(root, units, depth)
    order = [root] + units
    for i, m in enumerate(order):          # forward: the next `depth` units, the root first
        want = [u.name for u in units[i:i + depth]]
        assert m.forward == (want or None), (depth, m.name, m.forward)
    for i, u in enumerate(units):          # backward: FSDP2's own one ahead, deeper by lists
        want = [x.name for x in units[max(0, i - depth):i][::-1]] if depth > 1 and i else None
        assert u.backward == want, (depth, u.name, u.backward)
    if depth == 2:
        assert units[3].backward == ["u2", "u1"] and units[2].forward == ["u3"]
