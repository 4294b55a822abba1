"""The offline course (``make site``): every chapter readable with no kernel and no network.

The site is built into a temporary directory from the committed, executed notebooks and the
written chapters (``scripts/build_site.py``), then checked twice:

* as files: every page is there, every local link resolves, no page loads a script from the
  network (no CDN plotly.js, require.js or MathJax);
* in headless Chromium with the network cut off (every non-``file://`` request aborted, DNS
  disabled): each notebook page draws all its figures (``.js-plotly-plot``), moving a static
  player's slider moves its figure, math is typeset, and no page even tried the network.
"""
from __future__ import annotations

import html
import importlib.util
import re
from pathlib import Path

import nbformat
import pytest

from headless import ROOT, chromium, require_browser, screenshot_path

spec = importlib.util.spec_from_file_location("build_site", ROOT / "scripts" / "build_site.py")
build_site = importlib.util.module_from_spec(spec)
spec.loader.exec_module(build_site)

NOTEBOOKS = sorted((ROOT / "notebooks").glob("[0-9][0-9]-*.ipynb"))
TUTORIAL = sorted((ROOT / "tutorial").glob("*.md"))


@pytest.fixture(scope="module")
def site(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("site")
    build_site.build(out)
    return out


def pages(site: Path) -> list[Path]:
    return sorted(p for p in site.rglob("*.html") if "vendor" not in p.parts)


def plotly_outputs(nb_path: Path) -> int:
    nb = nbformat.read(nb_path, as_version=4)
    return sum(build_site.PLOTLY_MIME in o.get("data", {})
               for c in nb.cells if c.cell_type == "code" for o in c.outputs)


# ------------------------------------------------------------------ as files
def test_every_chapter_and_page_is_built(site):
    for nb in NOTEBOOKS:
        assert (site / "notebooks" / f"{nb.stem}.html").exists(), nb.name
    for md in TUTORIAL:
        assert (site / "tutorial" / f"{md.stem}.html").exists(), md.name
    assert (site / "index.html").exists() and (site / "vendor" / "plotly.min.js").exists()
    index = (site / "index.html").read_text()
    for nb in NOTEBOOKS:                            # the index reaches every chapter
        assert f'notebooks/{nb.stem}.html' in index, f"index.html does not link {nb.stem}"


def test_no_page_loads_anything_from_the_network(site):
    for page in pages(site):
        text = page.read_text()
        remote = re.findall(r'<(?:script|link|img)[^>]+(?:src|href)="(https?:[^"]+)"', text)
        assert not remote, f"{page.relative_to(site)} loads {remote[:3]}"
        assert "cdn.plot.ly" not in text and "unpkg.com" not in text, page


def test_every_local_link_resolves(site):
    """Links between pages land on pages; a link whose target is missing from the repository
    itself is the source's bug (the builder marks it ``data-missing-in-repo``), reported here
    as a warning."""
    missing_in_repo = set()
    for page in pages(site):
        text = page.read_text()
        for href in re.findall(r'href="([^"]+)"(?! data-missing-in-repo)', text):
            href = html.unescape(href)
            if re.match(r"^[a-z][a-z0-9+.-]*:", href, re.I) or href.startswith("#"):
                continue
            target = (page.parent / href.split("#")[0]).resolve()
            assert target.exists(), f"{page.relative_to(site)}: broken link {href}"
        missing_in_repo |= {f"{page.relative_to(site)} -> {h}"
                            for h in re.findall(r'href="([^"]+)" data-missing-in-repo', text)}
    if missing_in_repo:
        import warnings
        warnings.warn("links to files missing from the repository: " + ", ".join(sorted(missing_in_repo)))


def test_figures_are_inlined_once_per_output(site):
    for nb in NOTEBOOKS:
        text = (site / "notebooks" / f"{nb.stem}.html").read_text()
        assert text.count("Plotly.newPlot(") == plotly_outputs(nb), nb.name
        assert "application/vnd.jupyter.widget-view+json" not in text


# ------------------------------------------------------------------ in the browser, offline
@pytest.fixture(scope="module")
def offline_browser():
    require_browser()
    with chromium(offline=True) as ctx:
        yield ctx


def _open(ctx, path: Path):
    page = ctx.new_page()
    errors = []
    page.on("pageerror", lambda e: errors.append(str(e)))
    page.goto(path.as_uri())
    page.wait_for_load_state("load")
    return page, errors


@pytest.mark.parametrize("nb", NOTEBOOKS, ids=lambda p: p.stem)
def test_notebook_page_draws_every_figure_offline(site, offline_browser, nb):
    want = plotly_outputs(nb)
    page, errors = _open(offline_browser, site / "notebooks" / f"{nb.stem}.html")
    try:
        if want:
            page.wait_for_function(
                "n => document.querySelectorAll('.js-plotly-plot .main-svg').length >= n",
                arg=want, timeout=60_000)
        assert page.locator(".js-plotly-plot").count() == want
        assert not errors, f"{nb.name}: script errors in the page: {errors[:3]}"
        assert not offline_browser.blocked, f"the page tried the network: {offline_browser.blocked[:3]}"
    finally:
        page.close()


def test_static_player_slider_moves_the_figure_offline(site, offline_browser):
    with_slider = [nb for nb in NOTEBOOKS
                   if '"sliders"' in (site / "notebooks" / f"{nb.stem}.html").read_text()]
    assert with_slider, "no chapter page has a kernel-free player (plotly frames + slider)"
    page, errors = _open(offline_browser, site / "notebooks" / f"{with_slider[0].stem}.html")
    try:
        fig = page.locator(".js-plotly-plot:has(.slider-container)").first
        fig.wait_for(timeout=60_000)
        fig.scroll_into_view_if_needed()
        state = """el => ({title: (el.querySelector('.gtitle') || {}).textContent,
                          bars: JSON.stringify((el.data || []).map(t => Array.from(t.y || []))),
                          svg: [...el.querySelectorAll('.barlayer path')].map(p => p.getAttribute('d')).join('|')})"""
        before = fig.evaluate(state)
        rail = fig.locator(".slider-rail-touch-rect").first.bounding_box()
        page.mouse.click(rail["x"] + rail["width"] * 0.6, rail["y"] + rail["height"] / 2)
        page.wait_for_function(f"([el, old]) => ({state})(el).title !== old",
                               arg=[fig.element_handle(), before["title"]], timeout=10_000)
        after = fig.evaluate(state)
        fig.screenshot(path=screenshot_path(f"site-{with_slider[0].stem}-slider.png"))
        assert after["bars"] != before["bars"], "the slider moved but the bars did not"
        assert after["svg"] != before["svg"], "the figure's data changed but nothing was redrawn"
        assert not errors and not offline_browser.blocked
    finally:
        page.close()


def test_math_and_index_render_offline(site, offline_browser):
    page, errors = _open(offline_browser, site / "index.html")
    try:
        assert page.locator("a[href$='.html']").count() >= len(NOTEBOOKS) + len(TUTORIAL) - 1
        page.screenshot(path=screenshot_path("site-index.png"))
    finally:
        page.close()
    page, errors = _open(offline_browser, site / "notebooks" / "01-memory-ledger.html")
    try:
        page.wait_for_function("() => document.querySelectorAll('span.MathJax').length > 0",
                               timeout=60_000)         # MathJax typeset the chapter's formulas
        page.screenshot(path=screenshot_path("site-01-top.png"))
        assert not errors and not offline_browser.blocked
    finally:
        page.close()
