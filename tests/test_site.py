"""The offline course (``make site``): every chapter readable with no kernel and no network.

The site is built into a temporary directory from the committed, executed notebooks and the
written chapters (``scripts/build_site.py``), then checked twice:

* as files: every page is there, every local link resolves, no page loads a script from the
  network (no CDN plotly.js, require.js or MathJax);
* in headless Chromium with the network cut off (every non-``file://`` request aborted, DNS
  disabled): each notebook page draws all its figures (``.js-plotly-plot``), moving a static
  player's slider moves its figure, math is typeset, and no page even tried the network;
* the offline step-through player: ``minishard view``'s file for a 4-rank FSDP trace shows, at
  every event it is moved to (slider, "step ▶", the jump menus), the bars, unit states and ring
  of the live ``Player`` at that event; chapters 02–09 carry one in their outputs, which the
  site loads from one shared script, and each plays.

Both editions: the Chinese pages (``tutorial/zh/``) are built and linked like the English ones,
carry their English page's heading ids, every page has a language switch that lands, and a
Chinese page is drawn with a real CJK font. While ``tutorial/zh/`` has no page yet, these run on
a stand-in repository whose Chinese pages are made from the English ones (``zh_fixture_root``).
"""
from __future__ import annotations

import html
import importlib.util
import json
import re
import shutil
import subprocess
from pathlib import Path

import nbformat
import pytest

from headless import ROOT, chromium, require_browser, screenshot_path

spec = importlib.util.spec_from_file_location("build_site", ROOT / "scripts" / "build_site.py")
build_site = importlib.util.module_from_spec(spec)
spec.loader.exec_module(build_site)

NOTEBOOKS = sorted((ROOT / "notebooks").glob("[0-9][0-9]-*.ipynb"))
TUTORIAL = sorted((ROOT / "tutorial").glob("*.md"))
ZH_PAGES = sorted((ROOT / "tutorial" / "zh").glob("*.md"))
CJK = re.compile(r"[\u4e00-\u9fff]")


@pytest.fixture(scope="module")
def site(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("site")
    build_site.build(out)
    return out


def zh_fixture_root(tmp: Path) -> Path:
    """A stand-in repository (the real one linked in) whose ``tutorial/zh/`` holds 04-zero2,
    05-zero3 and a README: each the English page with its headings and first line in Chinese."""
    for entry in ROOT.iterdir():
        if entry.name not in ("tutorial", "site", "artifacts", ".git"):
            (tmp / entry.name).symlink_to(entry)
    (tmp / "tutorial" / "zh").mkdir(parents=True)
    for md in (ROOT / "tutorial").glob("*.md"):
        (tmp / "tutorial" / md.name).symlink_to(md)
    links = "另见[上一章](04-zero2.md)、[本章的笔记本](../../notebooks/05-zero3.ipynb)和[术语表](../glossary.md)。"
    for name in ("04-zero2.md", "05-zero3.md", "README.md"):
        out, fenced, n = [], False, 0
        for line in (ROOT / "tutorial" / name).read_text(encoding="utf-8").splitlines():
            fenced ^= line.startswith("```")
            m = None if fenced else re.match(r"(#{1,6})\s+(.*)", line)
            if m:
                n += 1
                number = re.search(r"\(§\d+\)", line)
                out += [f"{m.group(1)} 第{n}节：分片的参数与显存{number.group(0) if number else ''}",
                        "", "每个秩只保存模型状态的一部分，需要时再收集。" + (links if n == 1 else ""), ""]
            else:
                out.append(line.replace("](../", "](../../"))
        (tmp / "tutorial" / "zh" / name).write_text("\n".join(out) + "\n", encoding="utf-8")
    return tmp


@pytest.fixture(scope="module")
def zh_site(site, tmp_path_factory) -> Path:
    """The built site with a Chinese edition: the real one once ``tutorial/zh/`` has pages."""
    if ZH_PAGES:
        return site
    root, out = zh_fixture_root(tmp_path_factory.mktemp("repo")), tmp_path_factory.mktemp("zh-site")
    real, build_site.ROOT = build_site.ROOT, root
    try:
        build_site.build(out)
    finally:
        build_site.ROOT = real
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


def local_links(site: Path, page: Path) -> list[tuple[str, Path]]:
    """Every local link of ``page`` and the file it lands on; links the builder marked
    ``data-missing-in-repo`` (the source's own broken link) are left out."""
    out = []
    for href in re.findall(r'href="([^"]+)"(?! data-missing-in-repo)', page.read_text()):
        href = html.unescape(href)
        if not (re.match(r"^[a-z][a-z0-9+.-]*:", href, re.I) or href.startswith("#")):
            out.append((href, (page.parent / href.split("#")[0]).resolve()))
    return out


def test_every_local_link_resolves(site):
    """Links between pages land on pages; a link whose target is missing from the repository
    itself is the source's bug (the builder marks it ``data-missing-in-repo``), reported here
    as a warning."""
    missing_in_repo = set()
    for page in pages(site):
        for href, target in local_links(site, page):
            assert target.exists(), f"{page.relative_to(site)}: broken link {href}"
        missing_in_repo |= {f"{page.relative_to(site)} -> {h}"
                            for h in re.findall(r'href="([^"]+)" data-missing-in-repo', page.read_text())}
    if missing_in_repo:
        import warnings
        warnings.warn("links to files missing from the repository: " + ", ".join(sorted(missing_in_repo)))


def test_a_named_figure_shows_the_recorded_text_and_lands_on_its_cell(site):
    """A chapter's link ``[…](../notebooks/05-zero3.ipynb#name)`` shows the text the notebook
    recorded under ``name`` — even when the Markdown's copy is stale, in both editions — and lands
    on an element with that id inside the cell that printed it, which shows the text; the record
    itself is not drawn."""
    from minishard.course.glue import figures, is_record
    checked = 0
    for nb in NOTEBOOKS:
        page = (site / "notebooks" / f"{nb.stem}.html").read_text()
        cells = nbformat.read(nb, as_version=4).cells
        # one block of HTML per cell, by nbconvert's cell-id anchor
        blocks = dict(re.findall(r'id="cell-id=([^"]+)">(.*?)(?=<div class="jp-Cell |</main>)', page, re.S))
        for name, fig in figures(nb).items():
            block = blocks.get(cells[fig.cell].get("id", ""), "")
            assert f'<span class="minishard-figure" id="{name}">' in block, \
                f"{nb.stem}.html: the anchor #{name} is not in the cell that recorded it"
            assert html.escape(fig.text, quote=False) in block, f"{nb.stem}.html: cell of #{name} does not show {fig.text!r}"
            checked += 1
        drawn = build_site.static_outputs(nbformat.read(nb, as_version=4))
        assert not any(is_record(o) for c in drawn.cells if c.cell_type == "code" for o in c.outputs)
    assert checked >= 100
    figs = figures(ROOT / "notebooks" / "05-zero3.ipynb")
    fig = figs["tiny-cpu-ratio"]
    for md in (ROOT / "tutorial" / "05-zero3.md", ROOT / "tutorial" / "zh" / "05-zero3.md"):
        up = "../../" if "zh" in md.parts else "../"
        stale = f"See [999.999]({up}notebooks/05-zero3.ipynb#{fig.name}).\n"
        body = build_site.markdown_body(md, text=md.read_text(encoding="utf-8") + "\n" + stale)
        assert f">{fig.text}</a>" in body and "999.999" not in body, f"{md.name}: the stale copy was shown"
    place = f"([05 §4](../notebooks/05-zero3.ipynb#{fig.name}))"   # a cheat sheet's section link
    assert build_site.named_figures(place) == place
    chapter = (site / "tutorial" / "05-zero3.html").read_text()
    landed = set(re.findall(r'href="\.\./notebooks/05-zero3\.html#([^"]+)"', chapter))
    assert landed & set(figs), "the chapter's measured numbers land on their cells"


# ------------------------------------------------------------------ both editions
def zh_pages(site: Path) -> list[Path]:
    return sorted((site / "tutorial" / "zh").glob("*.html"))


def lang_switch(page: Path) -> list[str]:
    return [html.unescape(h) for h in re.findall(r'<a href="([^"]+)" class="minishard-lang"', page.read_text())]


def test_every_chinese_page_is_built(site):
    for md in ZH_PAGES:
        assert (site / "tutorial" / "zh" / f"{md.stem}.html").exists(), f"tutorial/zh/{md.name}"
    index = (site / "index.html").read_text()
    for md in ZH_PAGES:                             # the index lists both editions
        assert f"tutorial/zh/{md.stem}.html" in index, f"index.html does not link zh/{md.stem}"


@pytest.mark.parametrize("which", ["site", "zh_site"])
def test_every_page_has_a_language_switch_that_lands(request, which):
    site = request.getfixturevalue(which)
    if not zh_pages(site):
        pytest.skip("no Chinese edition yet (tutorial/zh/ is empty): zh_site has one")
    for page in pages(site):
        rel = page.relative_to(site).as_posix()
        zh = rel.startswith("tutorial/zh/")
        switch = lang_switch(page)
        assert len(switch) == 1, f"{rel}: {len(switch)} language switches"
        target = (page.parent / switch[0]).resolve()
        assert target.exists(), f"{rel}: language switch {switch[0]} lands nowhere"
        assert f'<html lang="{"zh-CN" if zh else "en"}"' in page.read_text(), f"{rel}: wrong <html lang>"
        twin = site / ("tutorial/" + page.name if zh else "tutorial/zh/" + page.name)
        if rel.startswith("tutorial/") and page.name != "README.html" and twin.exists():
            assert target == twin.resolve(), f"{rel}: the switch goes to {switch[0]}, not its other edition"
    zh_index = site / "tutorial" / "zh" / "README.html"
    if not zh_index.exists():                       # being written: the switch takes the first page
        zh_index = (site / "tutorial" / "zh" / lang_switch(site / "index.html")[0].split("/")[-1])
    for nb in NOTEBOOKS:                            # no counterpart: the other edition's index
        page = site / "notebooks" / f"{nb.stem}.html"
        assert (page.parent / lang_switch(page)[0]).resolve() == zh_index.resolve()
    readme = site / "tutorial" / "zh" / "README.html"
    if readme.exists():
        assert (readme.parent / lang_switch(readme)[0]).resolve() == (site / "index.html").resolve()


def heading_ids(page: Path) -> list[str]:
    return build_site.heading_ids(page.read_text().split("</nav>", 1)[-1])


def zh_chapter(site: Path) -> Path:
    """tutorial/zh/05-zero3.html, or another Chinese page with an English twin."""
    named = [p for p in zh_pages(site) if p.name != "README.html" and (site / "tutorial" / p.name).exists()]
    assert named, "no Chinese chapter was built"
    return next((p for p in named if p.stem == "05-zero3"), named[0])


def test_chinese_headings_carry_the_english_ids(zh_site):
    for zh in zh_pages(zh_site):
        if zh.name == "README.html" or not (zh_site / "tutorial" / zh.name).exists():
            continue
        en_ids = heading_ids(zh_site / "tutorial" / zh.name)
        assert en_ids and all(en_ids), zh.name
        assert heading_ids(zh) == en_ids, f"zh/{zh.name}: its headings do not carry the English ids"
    page = zh_chapter(zh_site)
    assert CJK.search(re.search(r"<h1[^>]*>(.*?)</h1>", page.read_text(), re.S).group(1)), \
        f"{page.name}: its title is not in Chinese"


def test_chinese_lines_join_without_a_space(zh_site):
    """A line break inside a Chinese sentence of the source is no space on the page."""
    body = re.sub(r"<pre\b.*?</pre>", "", zh_chapter(zh_site).read_text(), flags=re.S)
    assert not re.search(r"[\u4e00-\u9fff，。]\n[\u4e00-\u9fff，。]", body)


def test_a_heading_count_that_differs_stops_the_build():
    en = ROOT / "tutorial" / "glossary.md"
    with pytest.raises(SystemExit, match=r"tutorial/zh/glossary\.md has 1 headings.*tutorial/glossary\.md"):
        build_site.english_anchors('<h1 id="_1">术语表</h1>', en, "tutorial/zh/glossary.md")
    assert build_site.english_anchors("<h1>目录</h1>", en, "tutorial/zh/README.md", strict=False) == "<h1>目录</h1>"


def test_chinese_pages_link_to_chapters_and_notebooks(zh_site):
    """A Chinese page's links land, one level deeper: to another Chinese chapter and to a notebook."""
    seen = set()
    for page in zh_pages(zh_site):
        for href, target in local_links(zh_site, page):
            assert target.exists(), f"zh/{page.name}: broken link {href}"
            if target.parent == page.parent and target.name[:2].isdigit() and target != page:
                seen.add("chapter")
            if target.parent.name == "notebooks" and target.suffix == ".html":
                seen.add("notebook")
    assert seen == {"chapter", "notebook"}, f"no Chinese page links to a {({'chapter', 'notebook'} - seen)}"


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


def cjk_families() -> set[str]:
    """The font families fontconfig says cover Chinese (every name a family goes by)."""
    if shutil.which("fc-list") is None:
        return set()
    listed = subprocess.run(["fc-list", ":lang=zh", "family"], capture_output=True, text=True).stdout
    return {name.strip() for line in listed.splitlines() for name in line.split(",") if name.strip()}


PROBE = "中文字体显示正常吗"                          # 9 ideographs, each one em wide in a CJK font


def test_chinese_page_is_drawn_with_a_cjk_font_offline(zh_site, offline_browser):
    """Chinese text is drawn by a font that has its glyphs — not boxes, not zero width. The
    renderer itself says which font drew the title (DevTools' ``CSS.getPlatformFontsForNode``),
    and a line of ideographs in the page's font is as wide as that many ems.
    (``document.fonts.check`` cannot tell: it answers true for a system font that is absent.)"""
    families = cjk_families()
    assert families, ("no CJK font: Chinese pages show boxes "
                      "(`make browser-deps`, or apt-get install -y fonts-wqy-microhei)")
    path = zh_chapter(zh_site)
    page, errors = _open(offline_browser, path)
    try:
        page.screenshot(path=screenshot_path(f"site-zh-{path.stem}.png"))
        cdp = offline_browser.new_cdp_session(page)
        cdp.send("DOM.enable")
        cdp.send("CSS.enable")
        root = cdp.send("DOM.getDocument")["root"]["nodeId"]
        h1 = cdp.send("DOM.querySelector", {"nodeId": root, "selector": "h1"})["nodeId"]
        fonts = cdp.send("CSS.getPlatformFontsForNode", {"nodeId": h1})["fonts"]
        drawn = {f["familyName"]: f["glyphCount"] for f in fonts}
        title = page.locator("h1").first.inner_text()
        assert any(name in families for name in drawn), \
            f"{path.name}: the title {title!r} is drawn with {drawn}, none of the CJK fonts {sorted(families)}"
        assert sum(n for name, n in drawn.items() if name in families) >= len(CJK.findall(title))
        width = page.evaluate("""text => {
            const s = document.createElement('span');
            s.textContent = text; s.style.fontSize = '20px'; s.style.whiteSpace = 'nowrap';
            document.querySelector('body.minishard-page').appendChild(s);
            const w = s.getBoundingClientRect().width; s.remove(); return w; }""", PROBE)
        assert abs(width - 20 * len(PROBE)) <= 0.1 * 20 * len(PROBE), \
            f"{len(PROBE)} ideographs at 20px are {width:.0f}px wide, not about {20 * len(PROBE)}px"
        assert page.evaluate("document.documentElement.lang") == "zh-CN"
        assert not errors and not offline_browser.blocked
    finally:
        page.close()


# ------------------------------------------------------------------ the offline player
# What an offline player (minishard/viewers/offline_player.js) draws: the event, its title, every bar's
# bytes (and height), every unit's state, the ring's caption and chunks.
REPLAY_STATE = """root => {
    const bars = {}, heights = {}, units = {};
    root.querySelectorAll('rect[data-cat]').forEach(r => {
        (bars[r.dataset.rank] = bars[r.dataset.rank] || {})[r.dataset.cat] = +r.dataset.bytes;
        (heights[r.dataset.rank] = heights[r.dataset.rank] || {})[r.dataset.cat] = +r.getAttribute('height');
    });
    root.querySelectorAll('.msr-units tr[data-rank]').forEach(tr => {
        units[tr.dataset.rank] = {};
        tr.querySelectorAll('td').forEach(td => { units[tr.dataset.rank][td.dataset.unit] = td.textContent; });
    });
    const chunks = [...root.querySelectorAll('.msr-chunk')];
    return {event: +root.dataset.event, title: root.querySelector('.msr-title').textContent,
            bars, heights, units, ring: root.querySelector('.msr-ringtitle').dataset.title,
            chunks: chunks.map(g => g.textContent), xy: chunks.map(g => g.dataset.x.split(',').map(Number))};
}"""


@pytest.fixture(scope="module")
def fsdp4_view(pools, tmp_path_factory):
    """``minishard view`` of a recorded 4-rank FSDP trace, and the trace's events."""
    from minishard.core import trace
    from minishard.cli import main
    from test_view import record_fsdp4

    directory = tmp_path_factory.mktemp("fsdp4-view")
    trace.write_dir(record_fsdp4(pools), directory)
    assert main(["view", str(directory)]) == 0
    return directory / "player.html", trace.load(directory)


def replay_state(page) -> dict:
    return page.locator(".msr").first.evaluate(REPLAY_STATE)


def assert_same_as_live(state: dict, live) -> None:
    """The page at ``state["event"]`` shows what the live ``Player`` shows there."""
    from minishard.viz.ring import ring_view

    i, rp = state["event"], live.replay
    live.jump(i)
    assert state["title"] == live.memory_figure.layout.title.text, i
    want = live.snapshot()
    assert {int(r): b for r, b in state["bars"].items()} == {
        r: {c: want[r].get(c, 0) for c in rp.categories} for r in want}, f"ledger differs at event {i}"
    assert all(set(b) == set(rp.categories) for b in state["bars"].values())
    px = [state["heights"][r][c] / b for r in state["bars"] for c, b in state["bars"][r].items() if b > 0]
    assert not px or max(px) - min(px) <= 1e-6 * max(px), f"bar heights not proportional to bytes at event {i}"
    assert {int(r): u for r, u in state["units"].items()} == live.unit_states(), i
    view = ring_view(4, live.current_collective(), None, rp.t[i])
    assert state["ring"] == view.title == live.ring_figure.layout.title.text, i
    assert state["chunks"] == list(view.chunks_text), i
    for (x, y), wx, wy in zip(state["xy"], view.chunks_x, view.chunks_y):
        assert abs(x - wx) <= 0.01 and abs(y - wy) <= 0.01, i


def slide_to(page, i: int) -> None:
    page.locator(".msr-slider").evaluate(
        "(el, i) => { el.value = i; el.dispatchEvent(new Event('input', {bubbles: true})); }", i)


def test_view_steps_like_the_live_player_offline(offline_browser, fsdp4_view):
    """``minishard view``'s file, opened with the network off: at events spread over the trace
    (inside all-gathers and reduce-scatters too), after "step ▶", after "jump to phase" and "jump
    to collective", the bars, the unit table and the ring are the live player's at that event —
    and they change from one event to the next as the live player's do."""
    from minishard.viz import Player

    path, events = fsdp4_view
    live = Player(events)
    rp = live.replay
    inside = {rp.collective_at(rp.t[i])["op"]: i for i in range(rp.n) if rp.collective_at(rp.t[i])}
    page, errors = _open(offline_browser, path)
    try:
        page.wait_for_selector(".msr-title", timeout=30_000)
        opened = replay_state(page)                     # both open at the first step's peak
        assert opened["event"] == live.index > 0
        assert_same_as_live(opened, live)
        seen = []
        for i in sorted({0, rp.n // 5, rp.n // 2, 3 * rp.n // 4, rp.n - 1, *inside.values()}):
            slide_to(page, i)
            state = replay_state(page)
            assert state["event"] == i
            assert_same_as_live(state, live)
            seen.append(state)
        assert {"all_gather", "reduce_scatter"} <= set(inside)
        for part in ("bars", "units", "ring"):          # the views move, as the live player's do
            assert len({json.dumps(s[part], sort_keys=True) for s in seen}) >= 3, part
        forward = page.get_by_role("button", name="step ▶")
        for _ in range(3):
            forward.click()
        state = replay_state(page)
        assert state["event"] == rp.n - 1               # the last event: stepping stops there
        slide_to(page, inside["all_gather"])
        for _ in range(3):
            forward.click()
        state = replay_state(page)
        assert state["event"] == inside["all_gather"] + 3
        assert_same_as_live(state, live)
        page.locator(".msr-jump-phase").select_option("backward")
        state = replay_state(page)
        live.jump(inside["all_gather"] + 3)
        assert state["event"] == live.jump_to_phase("backward")
        assert_same_as_live(state, live)
        page.locator(".msr-jump-collective").select_option("reduce_scatter")
        state = replay_state(page)
        after = [j for j in rp.collectives if j > live.index and rp.events[j]["rank"] == 0
                 and rp.events[j]["op"] == "reduce_scatter"]
        assert state["event"] == after[0] and "reduce_scatter" in state["ring"]
        assert_same_as_live(state, live)
        page.locator(".msr").first.screenshot(path=screenshot_path("view-fsdp4.png"))
        assert not errors, errors[:3]
        assert not offline_browser.blocked, offline_browser.blocked[:3]
    finally:
        page.close()


def ring_trace(N: int) -> list[dict]:
    """N ranks: an all-reduce (ring rounds) then a broadcast from the last rank (a tree), with
    rank 0 allocating and freeing a byte many times inside each, to stop at."""
    from minishard.core import trace
    seq, out = {}, []

    def add(t, rank, kind, **fields):
        out.append({"v": trace.SCHEMA_VERSION, "rank": rank, "seq": seq.setdefault(rank, 0), "t": t,
                    "kind": kind, **fields})
        seq[rank] += 1

    for r in range(N):
        add(0.0, r, "collective", op="all_reduce", payload=4096, wire=4096, dtype="float32", group=N,
            tag="b0", t_end=1.0)
        add(2.0, r, "collective", op="broadcast", payload=4096, wire=4096, dtype="float32", group=N,
            tag="w", t_end=3.0, src=N - 1)
    for j in range(97):                                  # ticks inside both, and between them
        add(3 * j / 96, 0, "alloc" if j % 2 == 0 else "free", category="comm_buffers", bytes=1,
            tag="tick", device="device")
    return trace.merge(out)


# Where a chunk's square or label lies over a rank's disc (which holds the rank's label), at
# every event of every offline player on the page, as the browser lays them out.
COVERED_JS = """() => MinishardReplay.players.flatMap((p, k) => {
    const box = e => e.getBoundingClientRect(), bad = [];
    for (let i = 0; i < p.n; i++) {
        p.show(i);
        const discs = [...p.nodeLayer.querySelectorAll('circle')].map(box);
        for (const t of [...p.chunkLayer.querySelectorAll('rect, text')].map(box))
            for (const [r, d] of discs.entries()) {
                const cx = d.x + d.width / 2, cy = d.y + d.height / 2;
                const dx = Math.max(t.left - cx, 0, cx - t.right), dy = Math.max(t.top - cy, 0, cy - t.bottom);
                if (Math.hypot(dx, dy) < d.width / 2) bad.push(`player ${k} event ${i}: over rank ${r}`);
            }
        const texts = [...p.nodeLayer.querySelectorAll('text')].map(box);
        texts.forEach((t, r) => { if (t.width > discs[r].width) bad.push(`player ${k}: rank ${r}'s label is wider than its disc`); });
    }
    return bad;
})"""


def test_no_chunk_covers_a_rank_label_offline(offline_browser, tmp_path):
    """The offline player's ring on 2 to 8 ranks, at every event of an all-reduce and a tree
    broadcast: no chunk's square or label lies over a rank's disc, and each rank's label fits
    its disc (``tests/test_viz.py`` checks the live ring by geometry)."""
    from minishard.viewers import offline_player
    body = "".join(offline_player.fragment(offline_player.encode(ring_trace(N), title=f"{N} ranks"))
                   for N in range(2, 9))
    page_path = tmp_path / "rings.html"
    page_path.write_text(f"<!DOCTYPE html><html><head><meta charset='utf-8'></head><body>{body}</body></html>")
    page, errors = _open(offline_browser, page_path)
    try:
        page.wait_for_function("() => (window.MinishardReplay || {players: []}).players.length === 7",
                               timeout=30_000)
        chunks = page.evaluate("() => MinishardReplay.players.map(p => { let n = 0; for (let i = 0; i < p.n; i++) "
                               "{ p.show(i); n += p.chunkLayer.querySelectorAll('rect').length; } return n; })")
        assert all(chunks), f"a player drew no chunk: {chunks}"
        covered = page.evaluate(COVERED_JS)
        assert not covered, covered[:5]
        assert not errors, errors[:3]
    finally:
        page.close()


REPLAY_CHAPTERS = [nb for nb in NOTEBOOKS if "02" <= nb.name[:2] <= "09"]


def replays_in(nb_path: Path) -> int:
    nb = nbformat.read(nb_path, as_version=4)
    return sum("MinishardReplay.mount(" in "".join(o.get("data", {}).get("text/html", ""))
               for c in nb.cells if c.cell_type == "code" for o in c.outputs)


@pytest.mark.parametrize("nb", REPLAY_CHAPTERS, ids=lambda p: p.stem)
def test_chapter_replays_play_offline(site, offline_browser, nb):
    """Chapters 02–09 carry the offline player in their executed outputs; on the site each loads
    the one shared script, opens past event 0 (at the first step's peak, or where the chapter
    chose) and plays with the network off."""
    want = replays_in(nb)
    assert want >= 1, f"{nb.name} has no offline player in its outputs (replay_html)"
    path = site / "notebooks" / f"{nb.stem}.html"
    text = path.read_text()
    assert text.count(f'src="../vendor/{build_site.REPLAY_JS}"') == 1 and "data-minishard-replay-lib" not in text
    page, errors = _open(offline_browser, path)
    try:
        page.wait_for_function("n => (window.MinishardReplay || {players: []}).players.length === n",
                               arg=want, timeout=60_000)
        for k in range(want):
            root = page.locator(".msr").nth(k)
            root.scroll_into_view_if_needed()
            start = int(root.get_attribute("data-event"))
            assert start > 0, f"{nb.name}: replay {k} opens at event 0, a nearly empty chart"
            root.locator(".msr-speed").select_option("100")
            root.locator(".msr-play").click()
            end = int(root.locator(".msr-slider").get_attribute("max"))
            page.wait_for_function("([el, s]) => +el.dataset.event >= s", timeout=20_000,
                                   arg=[root.element_handle(), min(start + 5, end) if start < end else 5])
            root.locator(".msr-play").click()
            assert int(root.get_attribute("data-event")) != start
        page.locator(".msr").first.screenshot(path=screenshot_path(f"site-{nb.stem}-replay.png"))
        assert not errors, f"{nb.name}: script errors in the page: {errors[:3]}"
        assert not offline_browser.blocked
    finally:
        page.close()
