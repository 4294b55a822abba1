"""Every number the written course reports from a run is a figure a notebook recorded by name.

A measured number in ``tutorial/`` and ``tutorial/zh/`` is a link that names the figure:
``[2.53×](../notebooks/05-zero3.ipynb#nano-cpu-ratio)``. The notebook recorded it where it
printed it (``minishard.course.glue``: the name, the value, the printed text). Here:

* a link whose text holds a number must name a figure the executed notebook recorded;
* its text must be the recorded text *as written* — same numbers, same order, same unit;
* the recorded text must be in what its cell printed (the link lands on that cell);
* both editions of a chapter name the same figures, as often.

Numbers that are not one run's (a formula, a byte count the notebook asserts, a stable range the
notebook states and checks its run against) need no link; prose that says it quotes a run must
carry one. The site build writes the recorded text in place of each link's text, so a page built
from a re-executed notebook shows the new figures; ``scripts/refresh_prose_numbers.py`` brings
the Markdown's copies up to date.
"""
from __future__ import annotations

import re
from collections import Counter
from functools import cache
from pathlib import Path

import nbformat
import pytest

from minishard.course.glue import NUMBER, figures, states_a_figure

ROOT = Path(__file__).resolve().parents[1]
CHAPTERS = sorted((ROOT / "tutorial").glob("[0-9][0-9]-*.md"))
PAGES = sorted((ROOT / "tutorial").glob("*.md")) + sorted((ROOT / "tutorial" / "zh").glob("*.md"))
LINK = re.compile(r"\[((?:[^\[\]\n]|\[[^\[\]\n]*\])*)\]\((?:\.\./)*notebooks/([0-9][0-9]-[\w-]+)\.ipynb(?:#([^)\s]*))?\)")
PLACE_LABEL = re.compile(r"^(?:(\d\d) )?§([\d.]+?)\.?$")
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
            elif "data" in out and "text/plain" in out["data"]:
                text.append(out["data"]["text/plain"])
            elif out.get("output_type") == "error":
                text.append(f"{out['ename']}: {out['evalue']}")
        if text:
            cells.append("\n".join(text))
    return cells


@cache
def recorded(notebook: str) -> dict:
    return figures(ROOT / "notebooks" / f"{notebook}.ipynb")


@cache
def heading_anchors(notebook: str) -> set[str]:
    """The ids the site gives the notebook's Markdown headings (nbconvert: spaces become '-')."""
    nb = nbformat.read(ROOT / "notebooks" / f"{notebook}.ipynb", as_version=4)
    return {m.group(1).strip().replace(" ", "-")
            for c in nb.cells if c.cell_type == "markdown"
            for m in re.finditer(r"^#{1,6}\s+(.+)$", c.source, re.M)}


@cache
def sections(notebook: str) -> list[str]:
    """Per cell, the number of the nearest numbered heading at or above it ("4.8", "2"; "" before any)."""
    nb = nbformat.read(ROOT / "notebooks" / f"{notebook}.ipynb", as_version=4)
    out, current = [], ""
    for c in nb.cells:
        if c.cell_type == "markdown":
            for m in re.finditer(r"^#{1,6}\s+(\d+(?:\.\d+)*)[.\s]", c.source, re.M):
                current = m.group(1)
        out.append(current)
    return out


def links(text: str) -> list[tuple[str, str, str]]:
    """(text, notebook, fragment) of every link into a notebook (a link that merely names the
    notebook file, like each chapter's header, is left out)."""
    return [(t, nb, frag or "") for t, nb, frag in LINK.findall(text) if ".ipynb" not in t]


def problems(text: str) -> list[str]:
    """What is wrong with the links of one page's Markdown (empty: nothing)."""
    out = []
    for label, notebook, name in links(text):
        if not (ROOT / "notebooks" / f"{notebook}.ipynb").exists():
            out.append(f"[{label}]: no notebook {notebook}")
            continue
        figs = recorded(notebook)
        if not states_a_figure(label):               # a link to a place: a figure's cell or a heading
            if name and name not in figs and name not in heading_anchors(notebook):
                out.append(f"[{label}](#{name}): {notebook} records no figure and has no heading {name!r}")
            place = PLACE_LABEL.match(label)
            if place and name in figs:                # "[05 §4](…#fig)": the cell is in 05's §4
                section = sections(notebook)[figs[name].cell]
                if place.group(1) and place.group(1) != notebook[:2] or not (
                        section == place.group(2) or section.startswith(place.group(2) + ".")):
                    out.append(f"[{label}](#{name}): the figure's cell is in {notebook[:2]} §{section}")
            continue
        if not name:
            out.append(f"[{label}]: a measured number must name the figure its notebook recorded "
                       f"(…/{notebook}.ipynb#name; record it with minishard.course.glue)")
        elif name not in figs:
            out.append(f"[{label}](#{name}): {notebook} records no figure {name!r}")
        elif label != figs[name].text:
            out.append(f"[{label}](#{name}): {notebook} printed {figs[name].text!r}")
        elif figs[name].text not in figs[name].printed:
            out.append(f"#{name}: recorded {figs[name].text!r} but its cell printed something else")
    return out


def named(text: str) -> Counter:
    return Counter((nb, name) for label, nb, name in links(text) if states_a_figure(label))


def paths_that_miss(page: Path) -> list[str]:
    """Links into notebooks/ whose relative path does not lead there from the page's own folder
    (a Chinese page sits one folder deeper: ``../../notebooks/``)."""
    text = page.read_text(encoding="utf-8")
    return [t for t in re.findall(r"\]\(((?:\.\./)*notebooks/[^)#\s]+)", text)
            if not (page.parent / t).resolve().is_file()]


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(ROOT / "tutorial")))
def test_every_link_into_a_notebook_leads_there_from_its_page(page):
    assert not paths_that_miss(page), f"{page.relative_to(ROOT)}: {paths_that_miss(page)}"


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(ROOT / "tutorial")))
def test_every_linked_number_is_a_recorded_figure_as_printed(page):
    bad = problems(page.read_text(encoding="utf-8"))
    assert not bad, f"{page.relative_to(ROOT)}:\n  " + "\n  ".join(bad) + (
        "\n(after re-executing a notebook: python scripts/refresh_prose_numbers.py, then re-read the prose)")


def test_the_chapters_name_their_measured_numbers():
    assert sum(sum(named(md.read_text()).values()) for md in CHAPTERS) >= 200


@pytest.mark.parametrize("md", CHAPTERS + [ROOT / "tutorial" / "cheatsheet.md"], ids=lambda p: p.stem)
def test_both_editions_name_the_same_figures(md):
    zh = ROOT / "tutorial" / "zh" / md.name
    en_names, zh_names = named(md.read_text()), named(zh.read_text(encoding="utf-8"))
    places = [Counter((label, nb, name) for label, nb, name in links(t) if not states_a_figure(label))
              for t in (md.read_text(), zh.read_text(encoding="utf-8"))]
    assert places[0] == places[1], f"{md.name}: the section links differ between the editions"
    assert en_names == zh_names, (f"{md.name}: only in English {sorted((en_names - zh_names).elements())}; "
                                  f"only in Chinese {sorted((zh_names - en_names).elements())}")


@pytest.mark.parametrize("sheet", ["cheatsheet.md", "zh/cheatsheet.md"])
def test_each_cheat_sheet_line_lands_on_the_cell_that_measures_it(sheet):
    places = [(nb, name) for label, nb, name in links((ROOT / "tutorial" / sheet).read_text(encoding="utf-8"))]
    assert len(places) >= 20
    off = [f"{nb}#{name}" for nb, name in places if name not in recorded(nb)]
    assert not off, f"{sheet}: these links land on a heading or the notebook's top, not a measuring cell: {off}"


@pytest.mark.parametrize("md", CHAPTERS, ids=lambda p: p.stem)
def test_prose_that_quotes_a_run_links_the_numbers(md):
    for paragraph in re.split(r"\n\s*\n", md.read_text()):
        if RUN_WORDS.search(paragraph) and NUMBER.search(paragraph):
            assert LINK.search(paragraph), (
                f"{md.name}: a paragraph quotes a run without linking its numbers to the notebook "
                f"that printed them: {paragraph[:160]!r}")


# The four slips a reader found while the check matched digits anywhere in a notebook's output.
# Each, written back into its chapter, must fail the check above.
PLANTED = [
    ("01-memory-ledger.md", "rank-peaks-mib", "483, 487, 487, 485 MiB"),
    ("05-zero3.md", "forward-wait", "16%"),
    ("05-zero3.md", "nano-cpu-range", "1.8–2.4"),
    ("10-choosing-and-debugging.md", "planner-hint", "ZeRO-1 … is about as fast (3.12 s against 4.86 s)"),
]


@pytest.mark.parametrize("page,name,wrong", PLANTED, ids=[p[1] for p in PLANTED])
def test_the_check_fails_on_each_slip_a_reader_found(page, name, wrong):
    for md in (ROOT / "tutorial" / page, ROOT / "tutorial" / "zh" / page):
        text = md.read_text(encoding="utf-8")
        right = [m for m in LINK.finditer(text) if m.group(3) == name]
        assert right, f"{md.name} no longer names {name!r}; update PLANTED"
        assert not problems(text)
        m = right[0]
        planted = text[:m.start(1)] + wrong + text[m.end(1):]
        assert any(f"#{name}" in p for p in problems(planted)), f"{md.name}: planting {wrong!r} passed"


def test_a_number_without_a_name_or_printed_otherwise_fails():
    fig = next(iter(recorded("05-zero3").values()))
    ok = f"[{fig.text}](../notebooks/05-zero3.ipynb#{fig.name})"
    assert problems(ok) == []
    assert problems(f"[{fig.text}](../notebooks/05-zero3.ipynb)")            # no name
    assert problems(f"[{fig.text}](../notebooks/05-zero3.ipynb#no-such-figure)")
    assert problems(f"[{fig.text} ](../notebooks/05-zero3.ipynb#{fig.name})")  # not as written
    assert problems(f"[[{fig.text}]](../notebooks/05-zero3.ipynb#{fig.name})")  # brackets are text too


def test_refresh_rewrites_a_stale_figure_and_nothing_else(tmp_path):
    """``scripts/refresh_prose_numbers.py`` after a re-execution: a stale copy becomes the recorded
    text; the link's target, a section link to a figure's cell and an unknown name stay as written."""
    import importlib.util
    spec = importlib.util.spec_from_file_location("refresh", ROOT / "scripts" / "refresh_prose_numbers.py")
    refresh = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(refresh)
    fig = recorded("05-zero3")["tiny-cpu-ratio"]                 # a figure of 05's §4
    target = f"../notebooks/05-zero3.ipynb#{fig.name}"
    page = tmp_path / "page.md"
    page.write_text(f"Stale [999]({target}), a place ([05 §4]({target})), "
                    f"unknown [7](../notebooks/05-zero3.ipynb#no-such-figure).\n", encoding="utf-8")
    changed, unresolved = refresh.refresh(page, dry_run=False)
    assert (changed, len(unresolved)) == (1, 1)
    assert page.read_text(encoding="utf-8") == (
        f"Stale [{fig.text}]({target}), a place ([05 §4]({target})), "
        f"unknown [7](../notebooks/05-zero3.ipynb#no-such-figure).\n")
    assert problems(page.read_text(encoding="utf-8").split(", unknown")[0]) == []


@cache
def ignored_cells(notebook: str) -> set[int]:
    """Cells whose output is this run's alone (``# NBVAL_IGNORE_OUTPUT``: timings, rates)."""
    nb = nbformat.read(ROOT / "notebooks" / f"{notebook}.ipynb", as_version=4)
    return {i for i, c in enumerate(nb.cells) if c.cell_type == "code" and "NBVAL_IGNORE_OUTPUT" in c.source}


def unlinked_run_figures(text: str, notebook: str) -> list[str]:
    """Figures of this run (from a cell whose output is ignored on other machines) that the page
    writes as bare digits: the next re-execution would leave them stale without a failing test."""
    bare = re.sub(r"`[^`\n]*`", " ", LINK.sub(" ", text))
    out = []
    for fig in recorded(notebook).values():
        if fig.cell in ignored_cells(notebook) and re.search(r"\d[.,]\d", fig.text):
            if re.search(rf"(?<![\d.,]){re.escape(fig.text)}(?![\d]|[.,]\d)", bare):
                out.append(f"{fig.text} (#{fig.name})")
    return out


@pytest.mark.parametrize("md", CHAPTERS, ids=lambda p: p.stem)
def test_a_timing_of_this_run_is_never_written_without_its_name(md):
    for page in (md, ROOT / "tutorial" / "zh" / md.name):
        bare = unlinked_run_figures(page.read_text(encoding="utf-8"), md.stem)
        assert not bare, f"{page.relative_to(ROOT)} writes this run's {bare} without linking the figure"


def test_the_bare_timing_check_fails_on_an_unlinked_copy():
    fig = recorded("05-zero3")["nano-cpu-ratio"]
    assert fig.cell in ignored_cells("05-zero3")
    assert unlinked_run_figures(f"CPU time {fig.text}× here", "05-zero3")
    assert not unlinked_run_figures(f"CPU time [{fig.text}](../notebooks/05-zero3.ipynb#{fig.name})×", "05-zero3")
