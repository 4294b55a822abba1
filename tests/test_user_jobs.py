"""A new user's own scripts under ``minishard.watch``, each with one of the six bugs users bring
(tests/user_jobs.py), under PyTorch's DDP, DDP with ``ZeroRedundancyOptimizer``, and FSDP2: the
doctor names the rank and the collective or step (and the line, where a line is the cause), and
exits 1 — or, where the planted difference cannot hurt under that strategy, finds nothing, says
what it compared, and exits 0.

The suite runs a subset that touches every bug and every strategy;
``MINISHARD_ALL_DEATHS=1`` runs all eighteen.
"""
import os
import re

import pytest

from minishard.cli import main
from minishard.core.launch import RankError, Ranks
from minishard.instruments import doctor

import user_jobs
from user_jobs import AT, ODD

ALL = os.environ.get("MINISHARD_ALL_DEATHS") == "1"
# what each bug is under each strategy: the finding's kind, or None where it is harmless
EXPECTED = {
    ("ddp", "lr"): "drift", ("zero", "lr"): "drift", ("fsdp", "lr"): "drift",
    ("ddp", "skip"): "drift", ("zero", "skip"): "desync", ("fsdp", "skip"): "drift",
    # a no-grad forward issues no collective under DDP; under FSDP2 it gathers every unit
    ("ddp", "eval_forward"): None, ("zero", "eval_forward"): None, ("fsdp", "eval_forward"): "desync",
    ("ddp", "raise"): "exception", ("zero", "raise"): "exception", ("fsdp", "raise"): "exception",
    ("ddp", "sigkill"): "died", ("zero", "sigkill"): "died", ("fsdp", "sigkill"): "died",
    # DDP broadcasts rank 0's weights when it wraps the model; FSDP2 broadcasts nothing
    ("ddp", "seeds"): None, ("zero", "seeds"): None, ("fsdp", "seeds"): "weights",
}
# (another lr and a skipped step under all three: tests/test_drift.py, every run)
DEFAULT = {("ddp", "eval_forward"), ("fsdp", "eval_forward"), ("zero", "raise"), ("zero", "sigkill"),
           ("zero", "seeds"), ("fsdp", "lr")}
CASES = [c for c in EXPECTED if ALL or c in DEFAULT]
# the bugs after which every rank ends its run: the warm pool survives them
ENDS = {c for c, kind in EXPECTED.items() if kind in (None, "drift", "weights")}
TIMEOUT_S = 6


def _run(pools, kind, bug, out):
    if (kind, bug) in ENDS or bug is None:
        return pools(2).run(user_jobs.user_job, kind, bug, str(out))
    with Ranks(2, timeout=120, collective_timeout=TIMEOUT_S) as own:
        with pytest.raises(RankError):
            own.run(user_jobs.user_job, kind, bug, str(out))


@pytest.mark.parametrize("kind,bug", CASES, ids=[f"{k}-{b}" for k, b in CASES])
def test_the_users_bug_is_named_or_found_harmless(pools, tmp_path, kind, bug, capsys):
    out = tmp_path / "run"
    _run(pools, kind, bug, out)
    findings = doctor.diagnose(out).findings
    text = "\n".join(f"{f.kind}: {f.title} | " + " | ".join(f.evidence) for f in findings)
    expected = EXPECTED[kind, bug]
    capsys.readouterr()
    rc = main(["doctor", str(out)])
    said = capsys.readouterr().out
    if expected is None:
        assert findings == [] and rc == 0, text
        assert "the ranks started from the same weights" in said, said
        return
    assert rc == 1, said
    first = findings[0]
    assert first.kind == expected and ODD in first.ranks, text
    words = " ".join([first.title, *first.evidence])
    if expected == "drift" and bug == "lr":     # from the start: both values named
        assert "another lr (0.2 against rank 0's 0.1)" in first.title, text
    if expected == "drift" and bug == "skip":   # the step it skipped
        assert re.search(rf"\bstep {AT}\b", words), text
    if expected == "exception":                  # the message, and where it was raised
        assert "the loss came out NaN" in first.title, text
    if expected in ("desync", "exception"):      # the user's own line
        assert "user_jobs.py:" in words, text
    if expected == "died":
        assert f"rank {ODD}, the last collective it recorded: seq " in first.evidence[0], text
    if expected == "weights":
        assert "built other weights than rank 0" in first.title, text


def test_the_healthy_jobs_find_nothing(pools, tmp_path, capsys):
    for kind in user_jobs.KINDS:
        out = tmp_path / kind
        pools(2).run(user_jobs.user_job, kind, None, str(out))
        assert doctor.diagnose(out).findings == [], kind
        capsys.readouterr()
        assert main(["doctor", str(out)]) == 0
        assert "nothing found" in capsys.readouterr().out
