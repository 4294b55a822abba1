"""Every number the written course reports from a run is the number the notebook printed.

A measured number in ``tutorial/*.md`` is written as a link to the notebook that printed it:
``[1.25×](../notebooks/05-zero3.ipynb)``. Each such link's numbers must appear in one output of
that executed notebook, so re-executing a notebook without updating the prose fails here. Numbers
that are not one run's (a formula, a stable range stated as such, a byte count the notebook
asserts) need no link; prose that says it quotes a run must carry one.
"""
import re
from pathlib import Path

import nbformat
import pytest

ROOT = Path(__file__).resolve().parents[1]
CHAPTERS = sorted((ROOT / "tutorial").glob("[0-9][0-9]-*.md"))
MEASURED = re.compile(r"\[([^\[\]\n]*\d[^\[\]\n]*)\]\((?:\.\./)*notebooks/([0-9][0-9]-[\w-]+)\.ipynb(?:#[^)]*)?\)")
NUMBER = re.compile(r"\d[\d,]*(?:\.\d+)?")
RUN_WORDS = re.compile(r"committed run|run committed|in one run|this run|our run", re.I)


def outputs(notebook: str) -> list[str]:
    """The text of every output of the executed notebook, one string per cell."""
    nb = nbformat.read(ROOT / "notebooks" / f"{notebook}.ipynb", as_version=4)
    cells = []
    for cell in nb.cells:
        text = []
        for out in cell.get("outputs", []):
            if out.get("output_type") == "stream":
                text.append(out["text"])
            elif "data" in out:
                text.append(out["data"].get("text/plain", ""))
            elif out.get("output_type") == "error":
                text.append(f"{out['ename']}: {out['evalue']}")
        if text:
            cells.append("\n".join(text))
    return cells


def printed(number: str, text: str) -> bool:
    return re.search(rf"(?<![\d.,]){re.escape(number)}(?![\d]|\.\d|,\d)", text) is not None


def measured_links(md: Path) -> list[tuple[str, str]]:
    """The (number text, notebook) of every link that marks a measured number (a link that
    merely names the notebook file, like each chapter's header, marks none)."""
    return [(text, nb) for text, nb in MEASURED.findall(md.read_text()) if ".ipynb" not in text]


def test_the_chapters_mark_their_measured_numbers():
    assert sum(len(measured_links(md)) for md in CHAPTERS) >= 30


@pytest.mark.parametrize("md", CHAPTERS, ids=lambda p: p.stem)
def test_every_measured_number_is_in_its_notebooks_output(md):
    stale = []
    for text, notebook in measured_links(md):
        assert (ROOT / "notebooks" / f"{notebook}.ipynb").exists(), f"{md.name}: no notebook {notebook}"
        numbers = NUMBER.findall(text)
        if not any(all(printed(n, cell) for n in numbers) for cell in outputs(notebook)):
            stale.append(f"[{text}]({notebook})")
    assert not stale, (f"{md.name}: no output of the executed notebook shows {', '.join(stale)}: "
                       f"re-read the outputs and update the prose")


@pytest.mark.parametrize("md", CHAPTERS, ids=lambda p: p.stem)
def test_prose_that_quotes_a_run_links_the_numbers(md):
    for paragraph in re.split(r"\n\s*\n", md.read_text()):
        if RUN_WORDS.search(paragraph) and NUMBER.search(paragraph):
            assert MEASURED.search(paragraph), (
                f"{md.name}: a paragraph quotes a run without linking its numbers to the notebook "
                f"that printed them: {paragraph[:160]!r}")


def test_the_check_fails_on_a_number_no_output_shows():
    cells = outputs("05-zero3")
    assert any(printed("41,213,952", c) for c in cells)
    assert not any(printed("41,213,953", c) for c in cells)
    assert printed("1.5", "ratio 1.5x") and printed("70", "waited 70 ms")
    assert not printed("1.5", "ratio 1.51") and not printed("5", "25%") and not printed("1,2", "1,234")
