"""Every claim of the course (``docs/coverage.md``) has a notebook cell that shows it, checked by
nbval, and a test that checks it.

For each row of the table: the notebook exists (executed); its anchor is there — a
``# claim: ID`` comment in a code cell that prints checked output or asserts, or a markdown
heading whose section holds such a cell; and every test it names exists. A row still ``OPEN``
(its chapter not written yet) fails here, on purpose, and says so.
"""
from __future__ import annotations

import re
from pathlib import Path

import nbformat
import pytest

ROOT = Path(__file__).resolve().parents[1]
TABLE = ROOT / "docs" / "coverage.md"
CHECKED = re.compile(r"NBVAL_CHECK_OUTPUT|^\s*assert\b", re.M)


def rows() -> list[dict]:
    out = []
    for line in TABLE.read_text(encoding="utf-8").splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) != 5 or cells[0] in ("id", "") or set(cells[0]) <= {"-"}:
            continue
        ident, claim, notebooks, anchors, tests = cells
        out.append({"id": ident, "claim": claim, "notebooks": notebooks, "anchors": anchors,
                    "tests": [t.strip() for t in tests.split(";") if t.strip()]})
    return out


ROWS = rows()


def _is_heading(cell) -> bool:
    return cell.cell_type == "markdown" and cell.source.lstrip().startswith("#")


def find_anchor(nb, anchor: str) -> str | None:
    """None if ``anchor`` is in ``nb`` with checked output; otherwise why not."""
    if anchor.startswith("claim:"):
        ident = anchor.split(":", 1)[1].strip()
        tagged = [c for c in nb.cells if c.cell_type == "code" and any(
            ident in [i.strip() for i in m.split(",")]
            for m in re.findall(r"^#\s*claim:\s*(.+)$", c.source, re.M))]
        if not tagged:
            return f"no code cell with `# claim: {ident}`"
        if not any(CHECKED.search(c.source) for c in tagged):
            return f"the `# claim: {ident}` cell neither asserts nor has NBVAL_CHECK_OUTPUT"
        return None
    for i, cell in enumerate(nb.cells):
        if cell.cell_type == "markdown" and any(
                line.strip() == anchor for line in cell.source.splitlines()):
            section = []
            for c in nb.cells[i + 1:]:
                if _is_heading(c) and c.source.lstrip().startswith("## "):
                    break
                section.append(c)
            if not any(c.cell_type == "code" and CHECKED.search(c.source) for c in section):
                return f"section {anchor!r} has no cell that asserts or has NBVAL_CHECK_OUTPUT"
            return None
    return f"no markdown heading {anchor!r}"


def test_the_table_lists_every_claim_once():
    ids = [r["id"] for r in ROWS]
    assert len(ids) >= 30 and len(set(ids)) == len(ids), "claims missing or listed twice"
    for prefix in ("Q", "L", "Z", "F", "P", "O", "C", "D", "QA"):
        assert any(i.startswith(prefix) for i in ids), f"no claim of group {prefix}"


@pytest.mark.parametrize("row", ROWS, ids=[r["id"] for r in ROWS])
def test_claim_has_a_checked_cell_and_a_test(row):
    for t in row["tests"]:
        path, _, name = t.partition("::")
        f = ROOT / path
        assert f.exists(), f"{row['id']}: test file {path} does not exist"
        assert re.search(rf"^\s*def {re.escape(name)}\(", f.read_text(), re.M), \
            f"{row['id']}: {path} has no test {name}"
    assert row["tests"], f"{row['id']}: no test named"
    if row["notebooks"].startswith("OPEN"):
        pytest.fail(f"{row['id']} ({row['claim']}): no notebook cell shows it yet — "
                    f"{row['notebooks']}", pytrace=False)
    notebooks = [ROOT / n.strip() for n in row["notebooks"].split(";")]
    for nb_path in notebooks:
        assert nb_path.exists(), f"{row['id']}: {nb_path.relative_to(ROOT)} does not exist"
    nbs = [nbformat.read(p, as_version=4) for p in notebooks]
    for anchor in [a.strip().strip("`") for a in row["anchors"].split(";") if a.strip()]:
        why = [find_anchor(nb, anchor) for nb in nbs]
        assert None in why, f"{row['id']}: anchor {anchor!r} not found with checked output in " \
                            f"{row['notebooks']}: {'; '.join(w for w in why if w)}"


# ------------------------------------------------------------------ the glossary
GLOSSARY = ROOT / "tutorial" / "glossary.md"
TERMS = ["ZeRO-1", "ZeRO-2", "ZeRO-3", "all-gather", "reduce-scatter", "all-reduce", "分片", "预取",
         "卸载", "重分片", "混合精度", "激活重计算", "通信量", "显存账本", "单元", "flat parameter",
         "per-parameter sharding", "HSDP", "tensor parallelism", "FSDP", "DDP", "offload",
         "prefetch", "sharding", "unit", "memory ledger", "communication volume"]


def test_glossary_names_every_course_term_in_both_languages_with_its_chapter():
    rows = [[c.strip() for c in line.strip().strip("|").split("|")]
            for line in GLOSSARY.read_text(encoding="utf-8").split("## Notation")[0].splitlines()
            if line.startswith("| ") and not line.startswith("| English")
            and line.count("|") == 5]       # (the notation and wording tables come after the terms)
    assert len(rows) >= 60
    chapters = {p.name[:2] for p in (ROOT / "tutorial").glob("[0-9][0-9]-*.md")}
    for en, zh, what, ch in rows:
        assert en and what, f"glossary row without a term or meaning: {en!r}"
        assert re.search(r"[\u4e00-\u9fff]", zh), f"{en}: no Chinese name"
        assert ch in chapters, f"{en}: chapter {ch!r} is not a chapter of the course"
    text = " ".join(" ".join(r[:2]) for r in rows)
    missing = [t for t in TERMS if t.lower() not in text.lower()]
    assert not missing, f"the glossary lacks {missing}"
