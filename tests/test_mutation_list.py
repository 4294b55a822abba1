"""The planted bugs of ``scripts/mutation_check.py`` still apply to the code as it is: each names
a line of the engine that occurs exactly once, and a selection of tests that exists. (Running the
mutants takes minutes and lives outside this suite: ``python scripts/mutation_check.py``.)"""
import importlib.util
import shlex
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
spec = importlib.util.spec_from_file_location("mutation_check", ROOT / "scripts" / "mutation_check.py")
mutation_check = sys.modules["mutation_check"] = importlib.util.module_from_spec(spec)
spec.loader.exec_module(mutation_check)


@pytest.mark.parametrize("bug", mutation_check.BUGS, ids=lambda b: b.name)
def test_every_planted_bug_still_applies(bug):
    mutation_check.check_applies(bug)
    assert bug.planted != bug.original
    for word in shlex.split(bug.tests):
        if word.startswith("tests/"):
            assert (ROOT / word.split("::")[0]).exists(), word


def test_the_list_covers_the_bugs_the_course_is_about():
    names = " ".join(b.name for b in mutation_check.BUGS)
    for must in ("ddp: only the first bucket", "zero-1: only the first bucket", "last bucket",
                 "master never copied back", "ddp: 1/N missing", "fsdp: 1/N applied twice",
                 "checksums", "prefetch depth", "ring pass", "ZeRO-2 does not shard"):
        assert must in names, must
