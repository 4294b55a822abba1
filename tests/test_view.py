"""The offline player (``python -m minishard view``, ``minishard.viz.replay_html``) shows what the
live ``Player`` shows, at every event, and reads what it can of a damaged trace.

The encoded data is read back here the way the page's script reads it (:class:`Decoded`: the
ledger summed from per-event deltas, the units' states from their changes, the title and the
ring caption looked up in the string table), and compared with the live player's fold on a
recorded 4-rank FSDP trace. ``tests/test_site.py`` does the same in headless Chromium, reading
the drawn bars, unit table and ring.
"""
from __future__ import annotations

import json
import re

import pytest

from minishard.viewers import offline_player, playback
from minishard.core import trace
from minishard.cli import main
from minishard.cli.view import DEFAULT_NAME
from minishard.training.loop import TrainConfig, train
from minishard.viz import Player, replay_html
from minishard.viz.ring import ring_view

SAMPLES = (0, 1, 0.1, 0.25, 0.5, 0.61, 0.77, 0.9, -1)   # events to compare with the live widget


def record_fsdp4(pools) -> list[dict]:
    """Two steps of FSDP on 4 ranks (nano model): units, all-gathers, reduce-scatters."""
    R = pools(4)
    R.run(train, TrainConfig(strategy="fsdp", steps=2, model="nano", micro_batch=1))
    return R.last_events


@pytest.fixture(scope="module")
def fsdp4(pools, tmp_path_factory):
    directory = tmp_path_factory.mktemp("fsdp4")
    trace.write_dir(record_fsdp4(pools), directory)
    return directory


class Decoded:
    """The encoded replay read back as ``offline_player.js`` reads it."""

    def __init__(self, data: dict):
        self.d, self.S = data, data["S"]
        d = data
        self.ledger, at = [], 0
        for j in range(0, len(d["ledger"]), 4):
            at += d["ledger"][j]
            self.ledger.append((at, *d["ledger"][j + 1:j + 4]))
        self.units, at = [], 0
        for j in range(0, len(d["unit_changes"]), 4):
            at += d["unit_changes"][j]
            self.units.append((at, *d["unit_changes"][j + 1:j + 4]))

    def snapshot(self, i: int) -> dict[int, dict[str, int]]:
        d = self.d
        out = {r: dict.fromkeys(d["cats"], 0) for r in d["ranks"]}
        for at, a, b, nbytes in self.ledger:
            if at > i:
                break
            out[d["ranks"][a]][d["cats"][b]] += nbytes
        return out

    def unit_states(self, i: int) -> dict[int, dict[str, str]]:
        d = self.d
        out = {r: dict.fromkeys(d["units"], "sharded") for r in d["ranks"]}
        for at, a, u, s in self.units:
            if at > i:
                break
            out[d["ranks"][a]][d["units"][u]] = d["unit_states"][s]
        return out

    def title(self, i: int) -> str:
        d, S = self.d, self.S
        parts = [S[d["step"][i]], S[d["phase"][i]], S[d["what"][i]], f"event {i}/{d['n'] - 1}"]
        return " · ".join(p for p in parts if p)

    def ring_title(self, i: int) -> str:
        d, c = self.d, self.d["coll"][i]
        if c < 0:
            return self.S[d["ring_idle"]]
        sched = d["schedules"][d["colls"][3 * c + 1]]
        return self.S[d["coll_titles"][d["colls"][3 * c + 2] + (d["round"][i] if sched["sends"] else 0)]]


def events_at(n: int) -> list[int]:
    return sorted({int(x * (n - 1)) if isinstance(x, float) else x % n for x in SAMPLES})


def test_the_same_ledger_units_titles_and_ring_at_every_event(fsdp4):
    """Against the fold the live player draws (``Replay``) at every event, and against the live
    ``Player`` widget itself at several."""
    events = trace.load(fsdp4)
    data = offline_player.encode(events)
    got = Decoded(offline_player.unpack(offline_player.payload(data)))   # what the page carries
    live = Player(events)
    rp = live.replay
    assert data["n"] == rp.n == len(events) and got.d["ranks"] == [0, 1, 2, 3]
    assert rp.unit_names and rp.collectives, "not an FSDP trace"
    running = Decoded(data)
    for i in range(rp.n):
        assert got.title(i) == rp.title(i), i
        assert got.ring_title(i) == ring_view(4, rp.collective_at(rp.t[i]), None, rp.t[i]).title, i
    for i in events_at(rp.n):
        live.jump(i)
        assert got.snapshot(i) == live.snapshot(), f"ledger differs at event {i}"
        assert got.unit_states(i) == live.unit_states(), f"unit states differ at event {i}"
        assert live.memory_figure.layout.title.text == got.title(i)
        assert live.ring_figure.layout.title.text == got.ring_title(i)
    # the ledger at every event, by one pass (the snapshot above is quadratic)
    ledger = {r: dict.fromkeys(data["cats"], 0) for r in data["ranks"]}
    changes = iter(running.ledger)
    change = next(changes, None)
    for i in range(rp.n):
        while change is not None and change[0] == i:
            ledger[data["ranks"][change[1]]][data["cats"][change[2]]] += change[3]
            change = next(changes, None)
        want = rp.snapshot(i)
        assert all(ledger[r][c] == want[r].get(c, 0) for r in want for c in data["cats"]), i
    assert {data["unit_states"][s] for *_, s in got.units} >= {"unsharding", "unsharded", "sharded"}


def test_the_page_draws_the_ring_with_the_live_rings_geometry():
    """The page's script places chunks and their labels with ``minishard.viewers.playback``'s numbers
    (``tests/test_site.py`` compares the places drawn with the live ring's, event by event)."""
    js = offline_player.library()
    m = re.search(r"const RING_NODE = ([\d.]+), RING_CLEAR = ([\d.]+), LABEL_REACH = ([\d.]+);", js)
    assert m, "offline_player.js no longer names the ring's geometry"
    assert tuple(map(float, m.groups())) == (playback.RING_NODE, playback.RING_CLEAR, playback.LABEL_REACH)
    sides = json.loads(re.search(r"const LABEL_SIDES = (\[.*?\]);", js).group(1))
    assert [tuple(side) for side in sides] == list(playback.LABEL_SIDES.values())
    assert f"const MiB = {playback.MiB};" in js and not re.search(r"\bMB\b", js)   # as the live bars


def test_every_event_is_kept_and_the_page_needs_no_network(fsdp4, tmp_path):
    events = trace.load(fsdp4)
    html = str(replay_html(events, title="t"))
    assert "<script" in html and offline_player.LIB_MARK in html
    assert not re.search(r"(src|href)=\"https?:", html) and "cdn." not in html
    packed = re.search(r'MinishardReplay\.mount\("msr-\w+", "([^"]+)"\)', html).group(1)
    data = offline_player.unpack(packed)
    assert data["n"] == len(events) and len(data["t"]) == len(data["what"]) == len(events)
    spans = data["spans"]
    assert len(spans) % 5 == 0 and {data["span_names"][spans[j + 1]] for j in range(0, len(spans), 5)} >= {
        "forward", "backward", "all_gather", "reduce_scatter"}


def test_view_writes_one_file_and_says_where(fsdp4, capsys):
    assert main(["view", str(fsdp4)]) == 0
    out = capsys.readouterr()
    page = fsdp4 / DEFAULT_NAME
    n = len(trace.load(fsdp4))
    assert out.out.startswith(f"wrote {page}: {n:,} events, 4 ranks (0, 1, 2, 3)") and not out.err
    text = page.read_text()
    assert text.startswith("<!DOCTYPE html>") and text.count(offline_player.LIB_MARK) == 1
    assert main(["view", str(fsdp4), "-o", str(fsdp4 / "x" / "p.html"), "--title", "mine"]) == 0
    assert (fsdp4 / "x" / "p.html").exists() and "<title>mine</title>" in (fsdp4 / "x" / "p.html").read_text()


def damaged_copy(src, dst, lines_of) -> None:
    """``dst``: the trace in ``src`` with each rank's lines rewritten by ``lines_of(rank, lines)``."""
    dst.mkdir()
    for r in range(4):
        lines = (src / f"rank{r}.jsonl").read_text().splitlines()
        (dst / f"rank{r}.jsonl").write_text("\n".join(lines_of(r, lines)) + "\n")


def view_damaged(tmp_path, fsdp4, lines_of, capsys):
    bad = tmp_path / "bad"
    damaged_copy(fsdp4, bad, lines_of)
    assert main(["view", str(bad)]) == 0                 # the player is written all the same
    out = capsys.readouterr()
    page = (bad / DEFAULT_NAME).read_text()
    data = offline_player.unpack(re.search(r'mount\("msr-\w+", "([^"]+)"\)', page).group(1))
    warnings = out.err.strip().splitlines()
    assert all(w.startswith("minishard view: warning: ") for w in warnings)
    assert data["problems"] == [w[len("minishard view: warning: "):] for w in warnings]
    return bad, data, warnings, out.out


def test_a_truncated_line_is_named_and_skipped(tmp_path, fsdp4, capsys):
    def cut(r, lines):
        return lines[:-1] + [lines[-1][:37]] if r == 2 else lines
    bad, data, warnings, out = view_damaged(tmp_path, fsdp4, cut, capsys)
    n2 = len((fsdp4 / "rank2.jsonl").read_text().splitlines())
    assert len(warnings) == 1 and f"{bad / 'rank2.jsonl'}:{n2}: not JSON" in warnings[0], warnings
    assert "cut short" in warnings[0] and "(skipped)" in warnings[0]
    assert data["n"] == len(trace.load(fsdp4)) - 1 and "1 problem(s)" in out


def test_a_newer_schema_version_is_named_and_skipped(tmp_path, fsdp4, capsys):
    def newer(r, lines):                                  # rank 1 from line 101 on: version 2
        return [l.replace('"v": 1,', '"v": 2,') if r == 1 and k >= 100 else l for k, l in enumerate(lines)]
    bad, data, warnings, _ = view_damaged(tmp_path, fsdp4, newer, capsys)
    n1 = len((fsdp4 / "rank1.jsonl").read_text().splitlines())
    mine = [w for w in warnings if "schema version" in w]
    assert len(mine) == 1 and f"{bad / 'rank1.jsonl'}:101: trace schema version 2, but this minishard reads version 1" in mine[0]
    assert "upgrade" in mine[0] and f"{n1 - 100} lines skipped, the last at line {n1}" in mine[0]
    assert sum(e == data["ranks"].index(1) for e in data["ledger"][1::4]) > 0   # rank 1's first 100 lines are there


def test_ranks_with_different_step_counts_are_named(tmp_path, fsdp4, capsys):
    def stop_early(r, lines):                             # rank 3 never reaches step 1
        return [l for l in lines if json.loads(l).get("step") in (None, 0)] if r == 3 else lines
    bad, data, warnings, _ = view_damaged(tmp_path, fsdp4, stop_early, capsys)
    kept = len([l for l in (fsdp4 / "rank3.jsonl").read_text().splitlines() if json.loads(l).get("step") in (None, 0)])
    assert len(warnings) == 1, warnings
    assert data["problems"][0].startswith(f"{bad / 'rank3.jsonl'}:{kept}: this rank's trace ends in step 0, the others' "
                                  "(rank0.jsonl, rank1.jsonl, rank2.jsonl) in step 1")
    assert data["ranks"] == [0, 1, 2, 3]


def test_nothing_readable_is_one_error(tmp_path, capsys):
    (tmp_path / "rank0.jsonl").write_text('{"v": 9, "rank": 0, "seq": 0, "t": 0, "kind": "phase"}\n')
    assert main(["view", str(tmp_path)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert "rank0.jsonl:1: trace schema version 9" in err[0]
    assert err[-1] == f"minishard view: error: {tmp_path}: no event could be read, nothing to replay"
    assert not (tmp_path / DEFAULT_NAME).exists()
    assert main(["view", str(tmp_path / "nowhere")]) == 2
    assert "no such trace directory or file" in capsys.readouterr().err


# --------------------------------------------------------------------------- jumps and zoom, by hand

def _two_rank_two_steps() -> list[dict]:
    """Two steps on two ranks; rank 1 starts and ends every phase later than rank 0 (it is the
    straggler: its step 0 runs 0.1 s .. 1.3 s, rank 0's 0.0 s .. 1.0 s)."""
    rows = []
    for rank, lag, tail in ((0, 0.0, 0.0), (1, 0.1, 0.3)):
        for step, base in ((0, 0.0), (1, 2.0)):
            rows += [(base + lag, rank, "step", "begin", step),
                     (base + lag + 0.2, rank, "forward", "begin", step),
                     (base + lag + 0.5, rank, "forward", "end", step),
                     (base + lag + 0.6, rank, "backward", "begin", step),
                     (base + lag + 0.9, rank, "backward", "end", step),
                     (base + 1.0 + tail, rank, "step", "end", step)]
    seq: dict[int, int] = {}
    evs = []
    for t, rank, name, edge, step in rows:
        evs.append({"v": trace.SCHEMA_VERSION, "rank": rank, "seq": seq.setdefault(rank, 0), "t": t,
                    "kind": "phase", "name": name, "edge": edge, "step": step})
        seq[rank] += 1
    return trace.merge(evs)


def test_jump_to_phase_lands_where_the_phase_begins_like_the_live_player():
    """Choosing "forward" in the page's jump menu must show the moment rank 0's forward begins
    (0.2 s, 2.2 s), as the live ``Player.jump_to_phase`` does, not the moment it is already over."""
    events = _two_rank_two_steps()
    data = offline_player.unpack(offline_player.payload(offline_player.encode(events)))
    live = Player(events)
    for name, began in (("forward", (0.2, 2.2)), ("backward", (0.6, 2.6))):
        hits = data["jump_phase"][name]
        assert [events[i]["t"] for i in hits] == pytest.approx(began), name
        assert [(events[i]["rank"], events[i]["edge"]) for i in hits] == [(0, "begin")] * 2
        assert hits == [live.jump_to_phase(name, step=s) for s in (0, 1)]


def test_step_zoom_spans_the_step_on_every_rank_up_to_the_last_to_finish():
    """Zoomed to "the current step", the timeline must show all of step 0: from rank 0's start
    (0.0 s) to the straggler rank 1's end (1.3 s). Ending it where rank 0 ends (1.0 s) would cut
    off the last 0.3 s of rank 1's step."""
    events = _two_rank_two_steps()
    data = offline_player.unpack(offline_player.payload(offline_player.encode(events)))
    seconds = {data["S"][int(k)]: [x / data["ticks"] + data["t0"] for x in w]
               for k, w in data["step_windows"].items()}
    assert seconds == {"step 0": pytest.approx([0.0, 1.3]), "step 1": pytest.approx([2.0, 3.3])}
    # the page picks the window by the step of the event shown (d.step[i])
    last = max(i for i, e in enumerate(events) if e["step"] == 0)
    assert data["S"][data["step"][last]] == "step 0"
