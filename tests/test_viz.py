"""The player shows exactly what the trace says, at any event, and moves the way it claims.

No ranks are launched: events are written by hand (a 2-rank step with one all-reduce in flight
across several events) or recorded by an in-process ``train(None, TrainConfig(strategy="single"))``.
"""
from __future__ import annotations

import json
import math

import ipywidgets as W
import pytest
import torch

from minishard.core import trace
from minishard.core.launch import RankContext
from minishard.training.loop import TrainConfig, train
from minishard.viz import (Player, ledger_bars, ring_figure, ring_schedule, static_player_figure,
                           timeline_figure)
from minishard.viz.figures import MiB
from minishard.viz.ring import ring_view


def make_events(spec: list[tuple]) -> list[dict]:
    """``(t, rank, kind, fields)`` rows -> schema-v1 events, seq numbered per rank."""
    seq: dict[int, int] = {}
    out = []
    for t, rank, kind, fields in spec:
        out.append({"v": trace.SCHEMA_VERSION, "rank": rank, "seq": seq.get(rank, 0), "t": t,
                    "kind": kind, **fields})
        seq[rank] = seq.get(rank, 0) + 1
    return trace.merge(out)


def phase(t, rank, name, edge, step=0):
    return (t, rank, "phase", {"name": name, "edge": edge, "step": step})


def alloc(t, rank, category, nbytes, tag, kind="alloc", step=0):
    return (t, rank, kind, {"category": category, "bytes": nbytes, "tag": tag, "device": "device",
                            "step": step})


@pytest.fixture
def ddp_step() -> list[dict]:
    """One DDP step on 2 ranks: params, forward saves activations, backward frees them while
    the gradient bucket's all-reduce runs from t=2.0 to t=3.0, then AdamW state appears."""
    spec = []
    for r in (0, 1):
        d = r * 0.01                                   # rank 1 runs a little behind
        spec += [alloc(0.1 + d, r, "params", 4_000_000, "param:w"),
                 alloc(0.2 + d, r, "grads", 4_000_000, "bucket0"),
                 phase(1.0 + d, r, "step", "begin"), phase(1.0 + d, r, "forward", "begin"),
                 alloc(1.2 + d, r, "activations", 1_000_000, "act1"),
                 alloc(1.4 + d, r, "activations", 2_000_000, "act2"),
                 phase(1.6 + d, r, "forward", "end"), phase(1.7 + d, r, "backward", "begin"),
                 alloc(2.1 + d, r, "activations", 2_000_000, "act2", kind="free"),
                 alloc(2.4 + d, r, "activations", 1_000_000, "act1", kind="free"),
                 (2.0, r, "collective", {"op": "all_reduce", "payload": 4_000_000, "wire": 4_000_000,
                                         "dtype": "float32", "group": 2, "tag": "bucket0",
                                         "t_end": 3.0, "step": 0}),
                 phase(3.1 + d, r, "backward", "end"), phase(3.2 + d, r, "optimizer", "begin"),
                 alloc(3.3 + d, r, "exp_avg", 4_000_000, "m:w"),
                 alloc(3.4 + d, r, "exp_avg_sq", 4_000_000, "v:w"),
                 phase(3.5 + d, r, "optimizer", "end"), phase(3.6 + d, r, "step", "end")]
    return make_events(spec)


@pytest.fixture(scope="module")
def single_run() -> list[dict]:
    """A real one-step run of the nano GPT, recorded in this process."""
    tracer = trace.Tracer()
    train(RankContext(0, 1, torch.device("cpu"), tracer, "none"), TrainConfig(strategy="single", steps=1, model="nano", micro_batch=1))
    return trace.load(tracer.events)


def bar_heights(p: Player) -> dict[str, tuple]:
    return {tr.name: tuple(tr.y) for tr in p.memory_figure.data}


# --------------------------------------------------------------------------- memory bars

@pytest.mark.parametrize("which", ["ddp_step", "single_run"])
def test_bars_equal_the_ledger_fold_at_every_jumped_event(which, request):
    events = request.getfixturevalue(which)
    fold = trace.LedgerTimeline.build(events)
    p = Player(events)
    for i in sorted({0, 1, len(events) // 3, len(events) // 2, len(events) - 2, len(events) - 1}):
        p.jump(i)
        assert p.index == i and p._slider.value == i
        assert p.snapshot() == fold.at(i)
        heights = bar_heights(p)
        for a, r in enumerate(fold.ranks):
            for c in fold.categories:
                assert heights[c][a] == pytest.approx(fold.at(i)[r][c] / MiB)


def test_bars_show_only_categories_present_on_a_fixed_axis(ddp_step):
    p = Player(ddp_step)
    assert [tr.name for tr in p.memory_figure.data] == ["params", "grads", "exp_avg", "exp_avg_sq",
                                                       "activations"]
    peak = 4 * 4_000_000                             # params + grads + both Adam moments, per rank
    assert p.memory_figure.layout.yaxis.range[1] == pytest.approx(1.05 * peak / MiB)
    p.jump(-1)
    assert p.memory_figure.layout.yaxis.range[1] == pytest.approx(1.05 * peak / MiB)


def test_stepping_changes_the_bar_heights(ddp_step):
    p = Player(ddp_step)
    i = next(k for k, e in enumerate(ddp_step) if e["kind"] == "alloc" and e["category"] == "activations")
    p.jump(i - 1)
    before = bar_heights(p)
    p.step()
    after = bar_heights(p)
    rank = ddp_step[i]["rank"]
    assert after["activations"][rank] - before["activations"][rank] == pytest.approx(ddp_step[i]["bytes"] / MiB)
    p.step(-1)
    assert bar_heights(p) == before


def test_a_view_created_late_starts_from_the_current_figure(ddp_step):
    """The state a browser view is drawn from when it appears (``_widget_data`` /
    ``_widget_layout``) follows every redraw, for a player fed live and for one stepped: a view
    created after the edits went by (JupyterLab still loading plotly's JavaScript) must not
    draw the all-zero bars of construction time (plotly.py #4998)."""
    p = Player()
    for ev in ddp_step:
        p.feed(ev)
    p.flush()
    for i in (len(ddp_step) // 2, 5, -1):
        p.jump(i)
        shown = {tr["name"]: list(tr["y"]) for tr in p.memory_figure._widget_data}
        assert shown == {k: list(v) for k, v in bar_heights(p).items()}
        assert any(any(v) for v in shown.values())
        assert p.memory_figure._widget_layout["title"]["text"] == p.memory_figure.layout.title.text
        cursor = p.timeline_figure._widget_layout["shapes"][0]
        assert cursor["x0"] == p.timeline_figure.layout.shapes[0].x0
    assert len(p.timeline_figure._widget_data) == len(p.timeline_figure.data)


def test_title_names_step_phase_and_event(ddp_step):
    p = Player(ddp_step)
    i = next(k for k, e in enumerate(ddp_step) if e["kind"] == "collective")
    p.jump(i)
    assert p.memory_figure.layout.title.text == (
        f"step 0 · backward · rank {ddp_step[i]['rank']} all_reduce bucket0 · event {i}/{len(ddp_step) - 1}")


def test_step_stops_at_either_end(ddp_step):
    p = Player(ddp_step)
    p.step(-(p.index + 5))                            # five past the first event
    assert p.index == 0
    p.step(10_000)
    assert p.index == len(ddp_step) - 1
    with pytest.raises(IndexError):
        p.jump(len(ddp_step))


def test_a_trace_opens_at_the_first_steps_peak():
    """The live player, the offline one and the kernel-free figure open where rank 0 holds the
    most during the first step: not at event 0 (a nearly empty chart), nor at a later step's
    higher peak; a trace of one step opens at its highest."""
    from minishard.viewers import offline_player

    spec = []
    for r in (0, 1):
        d = 0.01 * r
        spec.append(alloc(0.1 + d, r, "params", 4_000_000, "param:w", step=None))
        for step, act in ((0, 1_000_000), (1, 3_000_000)):      # the second step holds more
            t = 1.0 + 2 * step + d
            spec += [phase(t, r, "step", "begin", step),
                     alloc(t + 0.1, r, "activations", act, "a1", step=step),
                     alloc(t + 0.2, r, "activations", act, "a2", step=step),
                     alloc(t + 0.3, r, "activations", act, "a2", kind="free", step=step),
                     alloc(t + 0.4, r, "activations", act, "a1", kind="free", step=step),
                     phase(t + 0.5, r, "step", "end", step)]
    events = make_events(spec)
    for trace_events in (events, [e for e in events if e.get("step") != 1]):
        fold = trace.LedgerTimeline.build(trace_events)
        held = [sum(fold.at(i)[0].values()) for i in range(len(trace_events))]
        first = [i for i, e in enumerate(trace_events) if e.get("step") == 0]
        peak = max(first, key=lambda i: (held[i], -i))          # the earliest, if several
        assert held[peak] > held[0]
        assert Player(trace_events).index == peak
        assert offline_player.encode(trace_events)["start"] == peak
        fig = static_player_figure(trace_events, max_frames=3)
        slider = fig.layout.sliders[0]
        assert len(fig.frames) <= 3 and slider.steps[slider.active].label == str(peak)
        assert fig.layout.title.text == Player(trace_events).memory_figure.layout.title.text
    fold = trace.LedgerTimeline.build(events)
    whole = [sum(fold.at(i)[0].values()) for i in range(len(events))]
    assert whole[Player(events).index] < max(whole)              # the later step's is higher
    assert offline_player.encode(events, start=0)["start"] == 0  # a chosen start still wins


# --------------------------------------------------------------------------- jumping to phases

def test_jump_to_phase_lands_on_the_phase_edge(ddp_step):
    p = Player(ddp_step)
    i = p.jump_to_phase("backward", step=0, rank=1)
    assert p.index == i
    e = ddp_step[i]
    assert (e["kind"], e["name"], e["edge"], e["rank"], e["step"]) == ("phase", "backward", "begin", 1, 0)
    j = p.jump_to_phase("optimizer", edge="end")
    e = ddp_step[j]
    assert (e["name"], e["edge"], e["rank"]) == ("optimizer", "end", 0) and j > i
    with pytest.raises(KeyError):
        p.jump_to_phase("backward", step=7)


def test_jump_to_phase_without_a_step_walks_forward_through_the_run(single_run):
    p = Player(single_run)
    f = p.jump_to_phase("forward")
    b = p.jump_to_phase("backward")
    o = p.jump_to_phase("optimizer")
    assert f < b < o
    assert p.jump_to_phase("forward") == f            # only one step: wraps round to the start


def test_controls_drive_the_player(ddp_step):
    p = Player(ddp_step, title="one DDP step")
    assert isinstance(p.widget, W.VBox)
    found = {type(w).__name__: w for box in p.widget.children if isinstance(box, W.HBox)
             for w in box.children}
    assert found["IntSlider"].description == "event" and found["Play"].max == len(ddp_step) - 1
    buttons = [w for box in p.widget.children if isinstance(box, W.HBox) for w in box.children
               if isinstance(w, W.Button)]
    assert [b.description for b in buttons] == ["◀ step", "step ▶"]
    opened = p.index
    buttons[1].click()
    assert p.index == opened + 1
    found["IntSlider"].value = 7                      # as if dragged in the browser
    assert p.index == 7 and p.snapshot() == trace.LedgerTimeline.build(ddp_step).at(7)
    menu = found["Dropdown"]
    assert menu.description == "jump to phase" and "backward" in menu.options
    menu.value = "backward"
    assert ddp_step[p.index]["name"] == "backward" and menu.value == "—"


# --------------------------------------------------------------------------- live mode

def test_feed_grows_the_slider_and_follows_the_newest_event(ddp_step):
    p = Player()
    assert p.index == -1 and p.snapshot() == {} and p.current_collective() is None
    for ev in ddp_step[:10]:
        p.feed(ev)
    p.flush()
    assert p._slider.max == 9 and p.index == 9
    for ev in ddp_step[10:]:
        p.feed(ev)
    p.flush()
    assert p._slider.max == len(ddp_step) - 1 and p.index == len(ddp_step) - 1
    fold = trace.LedgerTimeline.build(ddp_step)
    for i in (3, 15, len(ddp_step) - 1):
        p.jump(i)
        assert p.snapshot() == fold.at(i)
    assert [tr.name for tr in p.memory_figure.data] == ["params", "grads", "exp_avg", "exp_avg_sq",
                                                       "activations"]


def test_feed_throttles_redraws_and_keeps_a_moved_slider(ddp_step):
    p = Player()
    p.redraw_interval = 3600.0
    p.feed(ddp_step[0])                               # the first event always draws
    for ev in ddp_step[1:20]:
        p.feed(ev)
    assert p._slider.max == 0 and p.replay.n == 20    # stored, not drawn yet
    p.flush()
    assert p._slider.max == 19 and p.index == 19
    p.jump(5)                                         # the learner looks back ...
    for ev in ddp_step[20:]:
        p.feed(ev)
    p.flush()
    assert p._slider.max == len(ddp_step) - 1 and p.index == 5   # ... and stays there


def test_a_live_timeline_draws_the_phases_still_open_up_to_the_newest_event(ddp_step):
    p = Player()
    upto = next(i for i, e in enumerate(ddp_step) if e["kind"] == "alloc" and e["tag"] == "act2")
    for ev in ddp_step[:upto + 1]:                    # both ranks inside forward
        p.feed(ev)
    p.flush()
    forward = next(tr for tr in p.timeline_figure.data if tr.name == "forward")
    newest = ddp_step[upto]["t"]
    assert sorted(forward.y) == ["rank 0 · compute", "rank 1 · compute"]
    assert all(b + x == pytest.approx(newest * 1e3) for b, x in zip(forward.base, forward.x))
    assert all(h.endswith("forward …") for h in forward.hovertext)
    for ev in ddp_step[upto + 1:]:
        p.feed(ev)
    p.flush()
    forward = next(tr for tr in p.timeline_figure.data if tr.name == "forward")
    assert [x for x in forward.x] == pytest.approx([600.0, 600.0])   # closed: 1.0 -> 1.6 s
    assert not any("…" in h for h in forward.hovertext)


def test_feed_rejects_another_schema_version():
    p = Player()
    with pytest.raises(trace.TraceFormatError):
        p.feed({"v": 99, "rank": 0, "seq": 0, "t": 0.0, "kind": "unit", "name": "x", "state": "sharded"})


# --------------------------------------------------------------------------- the ring

def _four_rank_all_reduce() -> list[dict]:
    spec = [(0.0, r, "collective", {"op": "all_reduce", "payload": 4096, "wire": 6144, "dtype": "float32",
                                    "group": 4, "tag": "bucket0", "t_end": 1.0}) for r in range(4)]
    # events to stop at while it is in flight (and one after): a byte of a buffer, in and out
    spec += [(t, 0, kind, {"category": "comm_buffers", "bytes": 1, "tag": f"tick{t}", "device": "device"})
             for t, kind in zip((0.05, 0.2, 0.4, 0.55, 0.7, 0.9), ("alloc", "free") * 3)]
    spec += [(1.5, 0, "alloc", {"category": "comm_buffers", "bytes": 1, "tag": "after", "device": "device"})]
    return make_events(spec)


def test_ring_round_advances_with_time_within_one_collective():
    events = _four_rank_all_reduce()
    p = Player(events)
    rounds, labels = [], []
    for i, e in enumerate(events):
        if e.get("tag", "").startswith("tick"):
            p.jump(i)
            assert p.current_collective()["op"] == "all_reduce"
            rounds.append(ring_view(4, p.current_collective(), t=e["t"]).round)
            labels.append(p.ring_figure.layout.title.text.split("<br>")[1].split(" · ")[0])
    assert rounds == sorted(rounds) and rounds[0] == 0 and rounds[-1] == 5   # 2(N-1) rounds
    assert labels[0] == "reduce-scatter round 1/3" and labels[-1] == "all-gather round 3/3"
    assert len(p.ring_figure.data[3].x) == 4          # every rank sends one chunk per round
    p.jump(len(events) - 1)                           # after t_end: nothing in flight
    assert p.current_collective() is None and len(p.ring_figure.data[3].x) == 0


def test_ring_round_can_be_held_from_code():
    events = _four_rank_all_reduce()
    p = Player(events)
    p.jump(5)
    p.ring_round = 3
    assert "all-gather round 1/3" in p.ring_figure.layout.title.text
    p.step()
    assert "all-gather round 1/3" in p.ring_figure.layout.title.text
    p.ring_round = None
    assert "all-gather round 1/3" not in p.ring_figure.layout.title.text


def test_current_collective_picks_the_one_in_flight(ddp_step):
    p = Player(ddp_step)
    i = next(k for k, e in enumerate(ddp_step) if e["kind"] == "free")    # t = 2.1, inside 2.0..3.0
    p.jump(i)
    assert p.current_collective()["tag"] == "bucket0"
    p.jump(0)
    assert p.current_collective() is None


@pytest.mark.parametrize("N", [2, 3, 4, 5])
def test_ring_schedules_leave_every_rank_with_the_right_data(N):
    """Replay each schedule on sets of contributions: the ring really reduces / gathers."""
    def run(op, start):
        have = [dict(start(r)) for r in range(N)]
        for rnd in ring_schedule(op, N):
            sent = [(dst, name, set(have[src][name.lstrip("Σ")])) for src, dst, name in rnd.sends]
            assert all(name.lstrip("Σ") in have[src] for src, _, name in rnd.sends)
            for dst, name, parts in sent:             # all sends of a round happen at once
                have[dst][name.lstrip("Σ")] = have[dst].get(name.lstrip("Σ"), set()) | parts
        return have

    everyone = set(range(N))
    rs = run("reduce_scatter", lambda r: {f"c{j}": {r} for j in range(N)})
    assert all(rs[r][f"c{(r + 1) % N}"] == everyone for r in range(N))
    ar = run("all_reduce", lambda r: {f"c{j}": {r} for j in range(N)})
    assert all(ar[r][f"c{j}"] == everyone for r in range(N) for j in range(N))
    ag = run("all_gather", lambda r: {f"c{r}": {r}})
    assert all(set(ag[r]) == {f"c{j}" for j in range(N)} for r in range(N))
    bc = ring_schedule("broadcast", N)
    assert len(bc) == math.ceil(math.log2(N))
    reached = {0}
    for rnd in bc:
        assert {src for src, _, _ in rnd.sends} <= reached
        reached |= {dst for _, dst, _ in rnd.sends}
    assert reached == everyone


def test_ring_figure_shows_op_payload_and_wire():
    ev = _four_rank_all_reduce()[0]
    fig = ring_figure(4, ev, round=0)
    title = fig.layout.title.text
    payload, wire = (f"{ev[k] / 2**10:.3g} KiB" for k in ("payload", "wire"))   # binary, as the demo's
    assert "all_reduce bucket0" in title and f"payload {payload}" in title and f"wire {wire}" in title
    assert "reduce-scatter round 1/3" in title
    assert [tr.name for tr in fig.data] == ["ring", "sends", "ranks", "chunks"]
    assert list(fig.data[3].text) == ["Σc0", "Σc1", "Σc2", "Σc3"]
    assert len(ring_figure(4).data[3].x) == 0



def test_ring_title_says_each_sender_sends_a_1_over_N_chunk_of_the_payload():
    """In a ring all-reduce on 4 ranks the payload is cut into 4 chunks and every sender passes
    one chunk per round: 4096 B / 4 = 1 KiB. The wire total (2(N-1)/N x payload = 6144 B, what
    a rank sends over all 6 rounds) divided by 4 would claim 1.5 KiB per round, half again too
    much."""
    ev = _four_rank_all_reduce()[0]
    assert ev["wire"] == 2 * 3 * ev["payload"] // 4              # the ring's total, over 6 rounds
    title = ring_figure(4, ev, round=0).layout.title.text
    assert title.endswith("each sender sends 1 KiB"), title
    # a broadcast sends the whole payload along each tree edge
    bcast = dict(ev, op="broadcast", wire=2 * ev["payload"])
    assert ring_figure(4, bcast, round=0).layout.title.text.endswith("each sender sends 4 KiB")

def _covered_ranks(fig, view) -> list[str]:
    """Where a chunk's square or label (as plotly places it: ``textposition``, a gap of the
    marker's radius / 0.8 + 1 px) would cover a rank's disc (which holds its label), in the
    pixels of ``fig``'s plot."""
    lay, ranks, chunks = fig.layout, fig.data[2], fig.data[3]
    px = (lay.height - lay.margin.t - lay.margin.b) / (lay.yaxis.range[1] - lay.yaxis.range[0])
    disc, half, font = ranks.marker.size / 2, chunks.marker.size / 2, chunks.textfont.size
    gap = half / 0.8 + 1
    covered = []
    for x, y, text, side in zip(view.chunks_x, view.chunks_y, view.chunks_text, view.chunks_side):
        cx, cy, w, h = x * px, y * px, 0.62 * font * len(text), 1.25 * font
        vertical, horizontal = side.split()
        lx = {"left": cx - gap - w, "center": cx - w / 2, "right": cx + gap}[horizontal]
        ly = {"bottom": cy - gap - h, "middle": cy - h / 2, "top": cy + gap}[vertical]
        for what, (x0, y0, x1, y1) in (("square", (cx - half, cy - half, cx + half, cy + half)),
                                       ("label", (lx, ly, lx + w, ly + h))):
            for r, (nx, ny) in enumerate(zip(ranks.x, ranks.y)):
                nx, ny = nx * px, ny * px
                if math.hypot(max(x0 - nx, 0, nx - x1), max(y0 - ny, 0, ny - y1)) < disc:
                    covered.append(f"{text}'s {what} on rank {r}")
    return covered


@pytest.mark.parametrize("N", range(2, 9))
def test_no_chunk_covers_a_rank_label(N):
    """At every moment of every round of every collective drawn on N ranks, neither a chunk's
    square nor its label is drawn over a rank (whose disc holds its label)."""
    fig = ring_figure(N)
    collectives = [{"op": op, "payload": 4096, "wire": 4096, "group": N, "tag": "b", "rank": 0,
                    "t": 0.0, "t_end": 1.0, "src": src}
                   for op, src in [(op, 0) for op in ("reduce_scatter", "all_gather", "all_reduce")]
                   + [("broadcast", s) for s in range(N)]]
    seen = 0
    for ev in collectives:
        n_rounds = len(ring_schedule(ev["op"], N, ev["src"]))
        for j in range(8 * n_rounds + 1):            # eight moments per round, both ends too
            view = ring_view(N, ev, t=j / (8 * n_rounds))
            assert not _covered_ranks(fig, view), (ev["op"], ev["src"], view.title, _covered_ranks(fig, view))
            seen += len(view.chunks_x)
    assert seen


# --------------------------------------------------------------------------- timeline

def test_timeline_has_compute_and_comm_lanes_and_a_cursor(ddp_step):
    fig = timeline_figure(ddp_step, t_now=2.5)
    by_name = {tr.name: tr for tr in fig.data}
    assert set(by_name) == {"forward", "backward", "optimizer", "all_reduce"}
    assert set(by_name["backward"].y) == {"rank 0 · compute", "rank 1 · compute"}
    assert set(by_name["all_reduce"].y) == {"rank 0 · comm", "rank 1 · comm"}
    assert by_name["all_reduce"].base[0] == pytest.approx(2000.0)
    assert by_name["all_reduce"].x[0] == pytest.approx(1000.0)         # ms
    assert fig.layout.shapes[0].x0 == pytest.approx(2500.0)
    p = Player(ddp_step)
    p.jump(4)
    assert p.timeline_figure.layout.shapes[0].x0 == pytest.approx(ddp_step[4]["t"] * 1e3)


# --------------------------------------------------------------------------- files and formats

def test_player_reads_a_trace_directory(ddp_step, tmp_path):
    trace.write_dir(ddp_step, tmp_path)
    p = Player(tmp_path)
    p.jump(12)
    assert p.snapshot() == trace.LedgerTimeline.build(ddp_step).at(12)


def test_a_trace_of_another_schema_version_raises(ddp_step, tmp_path):
    with open(tmp_path / "rank0.jsonl", "w") as f:
        for ev in ddp_step:
            f.write(json.dumps({**ev, "v": 2}) + "\n")
    with pytest.raises(trace.TraceFormatError):
        Player(tmp_path)
    with pytest.raises(trace.TraceFormatError):
        Player([{**ddp_step[0], "v": 2}])


def test_ledger_bars_is_a_plain_figure():
    fig = ledger_bars({0: {"grads": 2 * MiB, "params": MiB}, 1: {"params": MiB}}, ymax=3 * MiB, title="t")
    assert [tr.name for tr in fig.data] == ["params", "grads"]        # the course's order
    assert list(fig.data[1].y) == [2.0, 0.0] and fig.layout.barmode == "stack"
    assert fig.layout.yaxis.range[1] == pytest.approx(3.15)


def test_static_player_figure_has_frames_and_a_slider(single_run):
    fig = static_player_figure(single_run, max_frames=50)
    assert 2 <= len(fig.frames) <= 50
    steps = fig.layout.sliders[0].steps
    assert [s.args[0][0] for s in steps] == [f.name for f in fig.frames]
    assert fig.layout.updatemenus[0].buttons[0].label == "Play"
    fold = trace.LedgerTimeline.build(single_run)
    last = fig.frames[-1]
    assert last.name == str(len(single_run) - 1)
    cats = [tr.name for tr in fig.data]
    for tr, c in zip(last.data, cats):
        assert tr.y[0] == pytest.approx(fold.at(len(single_run) - 1)[0][c] / MiB)
    html = fig.to_html(include_plotlyjs=False, auto_play=False)   # no widget, no kernel needed
    assert "Plotly.addFrames" in html and '"sliders"' in html


def test_player_shows_fsdp_unit_states_next_to_the_bars():
    from minishard.core.launch import RankContext
    from minishard.core.trace import Tracer
    from minishard.training.loop import TrainConfig, train
    from minishard.viz import Player

    ctx = RankContext(0, 1, torch.device("cpu"), Tracer(), "none")
    train(ctx, TrainConfig(strategy="fsdp", model="nano", steps=1, micro_batch=1, track_activations=False))
    p = Player(ctx.tracer.events)
    i = next(k for k, e in enumerate(p.replay.events)
             if e["kind"] == "unit" and e["name"] == "blocks.1" and e["state"] == "unsharded")
    p.jump(i)
    states = p.unit_states()[0]
    assert states["blocks.1"] == "unsharded" and states["root"] == "unsharded"
    assert states["blocks.2"] == "sharded"
    assert "blocks.1" in p.units_panel.value and "unsharded" in p.units_panel.value
    p.jump(len(p.replay.events) - 1)
    assert set(p.unit_states()[0].values()) == {"sharded"}
    # what each unit does after forward appears when the root decides it, at its first forward
    told = [k for k, e in enumerate(p.replay.events) if "after_forward" in e]
    decided = told[0]
    assert len(told) == 1 and p.replay.events[decided]["name"] == "root"      # told once, by the root
    assert p.replay.after_forward(decided - 1) == {} and p.replay.after_forward(decided) != {}
    p.jump(decided - 1)
    assert "after forward" in p.units_panel.value and "root&#x27;s rule" not in p.units_panel.value
    p.jump(len(p.replay.events) - 1)
    rule = " (None: the root's rule)"
    assert p.replay.after_forward(i) == {"root": "keep" + rule, **{f"blocks.{b}": "reshard" for b in range(3)}}
    assert "after forward" in p.units_panel.value and "keep (None: the root&#x27;s rule)" in p.units_panel.value
    ctx = RankContext(0, 1, torch.device("cpu"), Tracer(), "none")
    train(ctx, TrainConfig(strategy="fsdp", model="nano", steps=1, micro_batch=1, track_activations=False,
                           reshard_root=True))
    assert trace.Replay(ctx.tracer.events).after_forward(len(ctx.tracer.events) - 1)["root"] == "reshard"


def test_timeline_draws_waits_on_communication_and_offload_transfers():
    from minishard.core.launch import RankContext
    from minishard.core.trace import Tracer
    from minishard.training.loop import TrainConfig, train
    from minishard.viz import timeline_figure

    ctx = RankContext(0, 1, torch.device("cpu"), Tracer(), "none")
    train(ctx, TrainConfig(strategy="fsdp", model="nano", steps=1, micro_batch=1, offload="host", track_activations=False))
    names = {tr.name for tr in timeline_figure(ctx.tracer.events).data}
    assert {"transfer h2d", "transfer d2h"} <= names


def test_sizes_are_binary_like_the_demo_and_the_chapters():
    from minishard.viewers.playback import fmt_bytes
    assert fmt_bytes(870_656) == "850 KiB"
    assert fmt_bytes(3 * 2**20) == "3 MiB" and fmt_bytes(5 * 2**30) == "5 GiB"
    assert fmt_bytes(1000) == "1000 B"


def test_a_size_below_zero_is_written_in_the_unit_of_its_magnitude():
    from minishard.viewers.playback import fmt_bytes
    assert fmt_bytes(-3 * 2**30) == "-3 GiB" and fmt_bytes(-870_656) == "-850 KiB"
    assert fmt_bytes(-1000) == "-1000 B"


def test_a_size_at_a_units_edge_or_past_the_largest_is_written_without_an_exponent():
    """Three significant digits, unless that needs an exponent: just under the next unit, and
    past the largest (a planner's terabytes), the whole number of the unit is written."""
    from minishard.core.words import fmt_bytes
    assert fmt_bytes(1023 * 1024) == "1023 KiB"
    assert fmt_bytes(999.7 * 2 ** 20) == "1000 MiB"
    assert fmt_bytes(5 * 2 ** 40) == "5120 GiB"
    assert fmt_bytes(870656) == "850 KiB" and fmt_bytes(12.5 * 2 ** 30) == "12.5 GiB"
    assert not any("e+" in fmt_bytes(k * 2 ** e) for e in (10, 20, 30, 40) for k in range(990, 1030))
