"""The cheat sheet is "one printable page": each edition prints on one sheet, A4 and Letter.

The README and the site promise it; the print stylesheet the cheat sheet pages carry
(``CHEATSHEET_PRINT`` in ``scripts/build_site.py``: 10 mm margins, a smaller font, two columns, no
navigation bar) keeps it. Both cheat sheets are built into a temporary site (only those pages),
printed to PDF by headless Chromium (``page.pdf``, portrait, the paper size given, as a user's
"Save as PDF" would) and the PDF's pages counted. A cheat sheet that grows past one page fails
here: shorten it, or tighten the stylesheet, and check both editions.

Like the other browser tests this skips, saying what is missing, without Chromium or Playwright,
unless ``MINISHARD_REQUIRE_BROWSER=1``.
"""
from __future__ import annotations

import importlib.util
import re

import pytest

from headless import ROOT, chromium, require_browser

spec = importlib.util.spec_from_file_location("build_site", ROOT / "scripts" / "build_site.py")
build_site = importlib.util.module_from_spec(spec)
spec.loader.exec_module(build_site)

PAGES = ["tutorial/cheatsheet.html", "tutorial/zh/cheatsheet.html"]
PAPERS = ["A4", "Letter"]
PAGE_OBJECT = re.compile(rb"/Type\s*/Page(?![A-Za-z])")      # a page, not the /Pages tree


def pdf_pages(pdf: bytes) -> int:
    """The number of pages of a PDF Chromium wrote: its page objects, checked against the page
    tree's ``/Count`` (Chromium writes both uncompressed)."""
    n = len(PAGE_OBJECT.findall(pdf))
    counts = {int(c) for c in re.findall(rb"/Type\s*/Pages\b[^>]*?/Count\s+(\d+)", pdf)
              + re.findall(rb"/Count\s+(\d+)[^>]*?/Type\s*/Pages\b", pdf)}
    assert n >= 1 and (not counts or max(counts) == n), f"cannot read the PDF's pages ({n}, {counts})"
    return n


@pytest.fixture(scope="module")
def printed(tmp_path_factory) -> dict[tuple[str, str], int]:
    """{(page, paper): pages printed}, plus the same with the content doubled (the check's check)."""
    require_browser()
    out = tmp_path_factory.mktemp("cheatsheet-site")
    build_site.build(out, only={"tutorial/cheatsheet", "tutorial/zh/cheatsheet"})
    result = {}
    with chromium() as ctx:
        tab = ctx.new_page()
        for page in PAGES:
            assert (out / page).exists(), f"the build wrote no {page}"
            tab.goto((out / page).as_uri())
            tab.wait_for_load_state("load")
            for paper in PAPERS:
                result[page, paper] = pdf_pages(tab.pdf(format=paper))
            tab.emulate_media(media="print")           # what page.pdf lays out with
            result[page, "nav shown in print"] = tab.evaluate(
                "getComputedStyle(document.querySelector('nav.minishard-nav')).display") != "none"
        # a counter that always said 1 would prove nothing: twice the content must not fit
        tab.evaluate("document.body.insertAdjacentHTML('beforeend', document.body.innerHTML)")
        result["doubled"] = pdf_pages(tab.pdf(format="A4"))
    return result


@pytest.mark.parametrize("paper", PAPERS)
@pytest.mark.parametrize("page", PAGES, ids=["en", "zh"])
def test_the_cheat_sheet_prints_on_one_page(printed, page, paper):
    assert printed[page, paper] == 1, (
        f"{page} prints on {printed[page, paper]} {paper} pages, not 1: shorten the cheat sheet "
        f"or tighten CHEATSHEET_PRINT in scripts/build_site.py")


@pytest.mark.parametrize("page", PAGES, ids=["en", "zh"])
def test_the_printed_cheat_sheet_leaves_out_the_navigation(printed, page):
    assert not printed[page, "nav shown in print"], f"{page}: the navigation bar is printed"


def test_the_page_count_sees_a_second_page(printed):
    assert printed["doubled"] >= 2, "the cheat sheet with its content twice still printed on one page"
