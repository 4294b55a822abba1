"""benchmarks/bench_scaling.py's arithmetic: the byte formulas, the check that holds every
measured byte count to them, and the least-squares fits — on synthetic results and on the
committed run (benchmarks/scaling.json). No ranks start and nothing is timed."""
import json
import math
import sys
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parents[1] / "benchmarks"
sys.path.insert(0, str(BENCH))

import bench_scaling as bs  # noqa: E402

TINY = bs.SIZES["S"]                                  # the course's tiny GPT
PSI, ROOT = 6_868_992, 2_130_432                      # docs/reference-figures.md; the root unit


def test_the_fits_recover_known_laws():
    xs = [1.0, 2.0, 5.0, 9.0]
    f = bs.linfit(xs, [3 * x + 2 for x in xs])
    assert f["slope"] == pytest.approx(3) and f["intercept"] == pytest.approx(2) and f["r2"] == pytest.approx(1)
    noisy = bs.linfit(xs, [3 * x + 2 + e for x, e in zip(xs, (0.5, -0.5, 0.5, -0.5))])
    assert 0.9 < noisy["r2"] < 1 and noisy["slope"] == pytest.approx(3, abs=0.2)
    p = bs.propfit(xs, [2.5 * x for x in xs])
    assert p["c"] == pytest.approx(2.5) and p["r2"] == pytest.approx(1)


def test_the_byte_formulas_on_the_tiny_gpt():
    sh = bs.shapes(TINY)
    assert sum(map(math.prod, sh["all"])) == PSI and sum(map(math.prod, sh["root"])) == ROOT
    assert bs.formula("ddp", TINY, 2)[0] == bs.formula("torch_ddp", TINY, 2)[0] == 4 * PSI   # 2(N-1)/N·4Ψ
    assert bs.formula("zero1", TINY, 4)[0] == 2 * 3 * 4 * PSI // 4
    assert bs.formula("fsdp", TINY, 2)[0] == 4 * (3 * PSI - ROOT) // 2
    assert bs.formula("torch_fsdp", TINY, 2)[0] == 4 * (4 * PSI - ROOT) // 2
    assert sum(bs.zero_partition(sh["all"], 4)) == PSI
    # DDP + ZeroRedundancyOptimizer at 2 ranks: the all-reduce, then rank 0 sends its own share
    assert bs.formula("torch_zero1", TINY, 2)[0] == 4 * PSI + 4 * bs.zero_partition(sh["all"], 2)[0]
    assert all(bs.formula(s, TINY, 1)[0] == 0 for s in bs.STRATEGIES)          # one rank sends nothing
    assert bs.formula_constant("fsdp", TINY) == pytest.approx(3 - ROOT / PSI)


def test_the_byte_check_fails_when_a_count_is_off():
    expected = bs.formula("fsdp", TINY, 2)[0]
    assert bs.bytes_match(expected + 2_000, expected)                 # gloo's headers
    assert not bs.bytes_match(expected * 1.01, expected)              # 1% more: a different algorithm
    assert not bs.bytes_match(expected - 4 * ROOT // 2, expected)     # the root's gather missing
    assert bs.bytes_match(0, 0) and not bs.bytes_match(10**6, 0)


def _synthetic() -> dict:
    """A result as run() writes it, its bytes from the formulas (+ headers) and its times
    from known laws: 2 ms per million parameters plus 50 ms, and t(N) = 0.3 N + 0.1 s."""
    sizes = {"S": dict(d_model=64, n_layer=2, n_head=4), "M": dict(d_model=128, n_layer=3, n_head=4),
             "L": dict(d_model=192, n_layer=4, n_head=4)}
    models = {m: {"overrides": o, "params": sum(map(math.prod, bs.shapes(o)["all"]))} for m, o in sizes.items()}
    conts = [{"label": s, "strategy": s, "baseline": None} for s in ("ddp", "torch_zero1", "fsdp")]
    points = []
    for c in conts:
        for m, n in [("S", 2), ("M", 2), ("L", 2), ("M", 1), ("M", 4), ("M", 8)]:
            f, _ = bs.formula(c["strategy"], sizes[m], n)
            psi = models[m]["params"]
            t = 2e-9 * psi + 0.05 if n == 2 else 0.3 * n + 0.1
            if m == "M" and n == 2:
                t = 0.3 * 2 + 0.1
            points.append({"contender": c["label"], "strategy": c["strategy"], "model": m, "params": psi,
                           "world_size": n, "p50": t, "sent": f + (600 if f else 0), "formula": f})
    ck = [{"bytes_per_rank": b, "save_s": b / 1e6 / 100 + 0.2, "load_s": b / 1e6 / 400 + 0.05}
          for b in (5e6, 50e6, 300e6)]
    return {"middle": "M", "cores": 2, "models": models, "contenders": conts, "points": points,
            "checkpoint": ck}


def test_fits_on_a_synthetic_result():
    data = _synthetic()
    f = bs.fits(data)
    assert f["bytes"]["ddp"]["c"] == pytest.approx(2, rel=1e-3) and f["bytes"]["ddp"]["all_match"]
    assert f["bytes"]["fsdp"]["vs_formula"] == pytest.approx(1, rel=1e-3)
    assert f["time_vs_ranks"]["ddp"]["slope"] == pytest.approx(0.3)
    assert f["time_vs_ranks"]["ddp"]["oversubscribed_only"][8] == pytest.approx(0.7 * 4)
    assert f["checkpoint"]["save"]["mb_per_s_per_rank"] == pytest.approx(100)
    assert f["checkpoint"]["load"]["intercept"] == pytest.approx(0.05)
    # one byte count 1% off: the relation fails for that contender only
    next(p for p in data["points"] if p["strategy"] == "fsdp" and p["world_size"] == 4)["sent"] *= 1.01
    f = bs.fits(data)
    assert not f["bytes"]["fsdp"]["all_match"] and f["bytes"]["ddp"]["all_match"]


@pytest.mark.skipif(not bs.OUT.exists(), reason="no committed run yet")
def test_the_committed_run_holds_to_the_formulas_and_its_fits():
    data = json.loads(bs.OUT.read_text())
    assert not data["quick"]
    sizes = {m: v["params"] for m, v in data["models"].items()}
    assert len(sizes) >= 3 and max(sizes.values()) >= 50_000_000
    assert {p["world_size"] for p in data["points"]} >= {1, 2, 4, 8}
    assert {c["strategy"] for c in data["contenders"]} == set(bs.STRATEGIES)
    for p in data["points"]:
        overrides = data["models"][p["model"]]["overrides"]
        assert p["formula"] == bs.formula(p["strategy"], overrides, p["world_size"])[0]
        assert bs.bytes_match(p["sent"], p["formula"]), f"{p['contender']}: {bs.relation(p)}"
    fresh = bs.fits(data)
    for label, b in data["fits"]["bytes"].items():
        assert b["c"] == pytest.approx(fresh["bytes"][label]["c"]) and b["all_match"]
    assert len(data["checkpoint"]) == len(sizes)
