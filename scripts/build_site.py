"""Build the course as a static site that needs no kernel and no internet: ``make site``.

    python scripts/build_site.py [OUT_DIR] [--only 00,01,tutorial/glossary]

What it writes (``site/`` by default, git-ignored):

* ``notebooks/NN-topic.html`` — each *executed* notebook (the committed ``.ipynb``; nothing is
  re-run) converted with nbconvert. Every plotly output becomes a plain plotly.js figure drawn by
  the one vendored copy of plotly.js (``vendor/plotly.min.js``, from the plotly package), so the
  kernel-free players (``static_player_figure``: frames, a Play button, a slider) play in the
  page. The offline step-through players (``replay_html``: every event, ledger, ring, units,
  timeline) load their one shared script, ``vendor/minishard-replay.js``, instead of the copy
  each output carries. Live widgets (the Player, the calculator) need a kernel: their place says so.
* ``tutorial/*.md``, ``docs/*.md`` and the README rendered with Python-Markdown; math (``$…$``,
  ``$$…$$``) is typeset in the page by a vendored MathJax (the ``jupyter-server-mathjax``
  package), in the notebooks too.
* ``tutorial/zh/*.html`` — the Chinese edition (``tutorial/zh/*.md``; contents: ``README``)
  rendered the same way. Its headings get the ids of the English page's headings, in order (same
  sections: ``tests/test_zh.py``), so ``#anchor`` is the same section in both; a page whose
  heading count differs from its English page's stops the build.
* the cheat sheets (``tutorial/cheatsheet.html``, ``tutorial/zh/cheatsheet.html``) carry a print
  stylesheet (``CHEATSHEET_PRINT``): each prints on one page, A4 or Letter; printed, no page
  shows the navigation bar.
* ``index.html`` — the course's table of contents (``tutorial/README.md``) plus every page.
* the source files the pages link to (``minishard/core/ledger.py``, ``scripts/…``), copied as text.

A measured number in a chapter is a link that names a figure its notebook recorded
(``[2.53×](../notebooks/05-zero3.ipynb#nano-cpu-ratio)``, ``minishard.course.glue``): the page
shows the text the executed notebook recorded under that name, not the Markdown's copy, and the
link lands on the cell that printed it (each such cell carries an ``id`` per figure it recorded;
every cell keeps nbconvert's ``cell-id=…``). The records themselves are not drawn.

Links between the files are rewritten to the pages they became (``../tutorial/02-ddp.md`` →
``../tutorial/02-ddp.html``, ``notebooks/x.ipynb`` → ``notebooks/x.html``). No page loads
anything from the network: no CDN require.js, no CDN plotly.js, no CDN MathJax. Every page's
navigation bar has a language switch: "中文" to the Chinese page, "English" back; a page with no
counterpart (a notebook, docs, the glossary) links to the other edition's table of contents.
"""
from __future__ import annotations

import argparse
import copy
import html
import posixpath
import re
import shutil
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from minishard.course.glue import figures as _figures, is_record, states_a_figure  # noqa: E402  (what a notebook recorded)
from functools import cache  # noqa: E402

figures = cache(_figures)

FIGURE_LINK = re.compile(r"\[((?:[^\[\]\n]|\[[^\[\]\n]*\])*)\]\((?:\.\./)*notebooks/([0-9][0-9]-[\w-]+)\.ipynb#([^)\s]+)\)")
MARKER = ".minishard-site"                    # a directory we may wipe and rebuild
PLOTLY_MIME = "application/vnd.plotly.v1+json"
REPLAY_JS = "minishard-replay.js"             # the offline player's script (minishard/viewers/offline_player.js)
REPLAY_LIB = re.compile(r"<script data-minishard-replay-lib=\"\d+\">.*?</script>", re.S)
WIDGET_MIME = "application/vnd.jupyter.widget-view+json"
MATHJAX_CONFIG = """<script type="text/x-mathjax-config">
MathJax.Hub.Config({
  tex2jax: {inlineMath: [['$','$'], ['\\\\(','\\\\)']], displayMath: [['$$','$$'], ['\\\\[','\\\\]']],
            processEscapes: true, processEnvironments: true},
  "HTML-CSS": {availableFonts: [], preferredFont: null, webFont: null, imageFont: null},
  messageStyle: "none", showMathMenu: false
});
</script>"""

STYLE = """
body.minishard-page { max-width: 980px; margin: 0 auto; padding: 0 24px 48px;
  font-family: -apple-system, "Segoe UI", Roboto, "Noto Sans", "Noto Sans CJK SC", "WenQuanYi Micro Hei",
  sans-serif; line-height: 1.55; color: #1f2328; }
body.minishard-page pre { background: #f6f8fa; padding: 10px 12px; overflow-x: auto; border-radius: 6px; }
body.minishard-page code { font-family: "DejaVu Sans Mono", Menlo, monospace; font-size: 0.92em; }
body.minishard-page table { border-collapse: collapse; margin: 12px 0; }
body.minishard-page th, body.minishard-page td { border: 1px solid #d0d7de; padding: 4px 10px; vertical-align: top; }
body.minishard-page blockquote { border-left: 4px solid #d0d7de; margin-left: 0; padding-left: 14px; color: #444; }
nav.minishard-nav { font: 14px/1.4 "Noto Sans", "Noto Sans CJK SC", "WenQuanYi Micro Hei", sans-serif; padding: 10px 0; margin-bottom: 8px;
  border-bottom: 1px solid #d0d7de; display: flex; gap: 18px; flex-wrap: wrap; }
nav.minishard-nav a { text-decoration: none; }
nav.minishard-nav a.minishard-lang { margin-left: auto; }
.minishard-widget { border: 1px dashed #9aa4ae; border-radius: 6px; padding: 8px 12px;
  color: #57606a; background: #f6f8fa; font: 13px/1.4 sans-serif; }
@media print { nav.minishard-nav { display: none; } }
"""

# The cheat sheets (``tutorial/cheatsheet.md``, ``tutorial/zh/cheatsheet.md``) promise one printable
# page: printed, each fits one sheet of A4 or Letter, portrait (tests/test_cheatsheet_print.py).
# The page size is the printer's; the margins are set here (10 mm, which any printer can reach).
# On screen the page reads like any other.
CHEATSHEET = "cheatsheet.html"
CHEATSHEET_PRINT = """
@page { margin: 10mm; }
@media print {
  html { font-size: 6.8pt; }
  body.minishard-cheatsheet { max-width: none; margin: 0; padding: 0; line-height: 1.2;
    font-family: "Liberation Sans", Arial, Helvetica, "Noto Sans CJK SC", "WenQuanYi Micro Hei",
    "Microsoft YaHei", "PingFang SC", sans-serif;
    column-count: 2; column-gap: 4mm; column-rule: 0.5pt solid #d0d7de; column-fill: balance;
    color: #000; -webkit-print-color-adjust: exact; print-color-adjust: exact; }
  body.minishard-cheatsheet h1 { column-span: all; font-size: 1.6rem; margin: 0 0 0.3rem; }
  body.minishard-cheatsheet h2 { font-size: 1.15rem; margin: 0.45rem 0 0.15rem;
    break-after: avoid; page-break-after: avoid; }
  body.minishard-cheatsheet p, body.minishard-cheatsheet ul, body.minishard-cheatsheet ol {
    margin: 0.15rem 0; }
  body.minishard-cheatsheet ul, body.minishard-cheatsheet ol { padding-left: 1.1em; }
  body.minishard-cheatsheet li { margin: 0; }
  body.minishard-cheatsheet table { margin: 0.2rem 0; font-size: 0.92em; break-inside: avoid; }
  body.minishard-cheatsheet th, body.minishard-cheatsheet td { padding: 0.05rem 0.25rem; line-height: 1.15; }
  body.minishard-cheatsheet code { font-size: 0.95em; }
  body.minishard-cheatsheet a { color: #0645ad; text-decoration: none; }
}
"""


# ====================================================================== paths and links

SOURCE_SUFFIXES = (".py", ".toml", ".yml", ".yaml", ".cfg", ".txt", ".json", ".csv", ".sh")


def site_path(repo_rel: str) -> str | None:
    """Where a repository file lives in the site (``None``: not part of it). Notebooks and
    Markdown become pages; other text sources the pages link to are copied as they are."""
    p = posixpath.normpath(repo_rel)
    stem, ext = posixpath.splitext(p)
    if p.startswith("notebooks/") and ext in (".ipynb", ".py"):
        return stem + ".html"
    if ext == ".md":
        return stem + ".html"
    if ext in SOURCE_SUFFIXES or posixpath.basename(p) in ("Makefile", "run"):
        return p
    return None


def resolve(target: str, source: str) -> str:
    """The repository file a link in ``source`` names; a folder stands for its README or its
    ``__init__.py`` (``minishard/checkpoint/`` → ``minishard/checkpoint/__init__.py``)."""
    resolved = posixpath.normpath(posixpath.join(posixpath.dirname(source), target))
    if (ROOT / resolved).is_dir():
        for name in ("README.md", "__init__.py"):
            if (ROOT / resolved / name).is_file():
                return f"{resolved}/{name}"
    return resolved


def rewrite_link(href: str, source: str, page: str) -> str:
    """``href`` as written in repository file ``source``, for the site page ``page``."""
    if re.match(r"^[a-z][a-z0-9+.-]*:", href, re.I) or href.startswith(("#", "/")):
        return href
    target, _, anchor = href.partition("#")
    resolved = resolve(target, source)
    mapped = site_path(resolved)
    if mapped is None:
        return href
    rel = posixpath.relpath(mapped, posixpath.dirname(page) or ".")
    return rel + (f"#{anchor}" if anchor else "")


def rewrite_links(html_text: str, source: str, page: str, copies: set[str]) -> str:
    """Rewrite every ``href``. A link to a repository file that does not exist is left as it
    is and marked ``data-missing-in-repo`` (the site cannot mend the source's broken link)."""
    def one(m):
        href = html.unescape(m.group(1))
        target = href.split("#")[0]
        if (target and not re.match(r"^[a-z][a-z0-9+.-]*:", href, re.I) and not href.startswith("/")
                and not (ROOT / posixpath.dirname(source) / target).exists()):
            return f'href="{html.escape(href, quote=True)}" data-missing-in-repo'
        new = rewrite_link(href, source, page)
        resolved = resolve(target, source) if target else ""
        if resolved and site_path(resolved) == resolved:      # a source file: copy it as it is
            copies.add(resolved)
        return f'href="{html.escape(new, quote=True)}"'
    return re.sub(r'href="([^"]+)"', one, html_text)


def up(page: str) -> str:
    """The relative path from ``page`` to the site root (``""`` or ``"../"``)."""
    return "../" * page.count("/")


# ====================================================================== vendored scripts

def vendor(out: Path) -> None:
    """plotly.js (the version the plotly package renders with) and MathJax, once per site."""
    import plotly

    dst = out / "vendor"
    dst.mkdir(parents=True, exist_ok=True)
    shutil.copy(Path(plotly.__file__).parent / "package_data" / "plotly.min.js", dst / "plotly.min.js")
    shutil.copy(ROOT / "minishard" / "viewers" / "offline_player.js", dst / REPLAY_JS)
    try:
        import jupyter_server_mathjax
    except ImportError:
        print("warning: jupyter-server-mathjax is not installed: math shows as TeX source",
              file=sys.stderr)
        return
    src = Path(jupyter_server_mathjax.__file__).parent / "static"
    if not (dst / "mathjax" / "MathJax.js").exists():
        shutil.copytree(src, dst / "mathjax", dirs_exist_ok=True)


def shared_replay_script(body: str, page: str) -> str:
    """Every offline player in a notebook output carries its script inline (so that the notebook
    plays on its own); on the site the page loads the one shared copy instead, once."""
    tag = f'<script src="{up(page)}vendor/{REPLAY_JS}"></script>'
    parts = REPLAY_LIB.split(body)
    return parts[0] + "".join((tag if i == 0 else "") + rest for i, rest in enumerate(parts[1:]))


def head_scripts(page: str, math: bool = True) -> str:
    root = up(page)
    s = f'<script src="{root}vendor/plotly.min.js"></script>\n'
    if math:
        s += MATHJAX_CONFIG + f'\n<script src="{root}vendor/mathjax/MathJax.js?config=TeX-AMS-MML_HTMLorMML-full"></script>\n'
    return s


# ====================================================================== navigation

ZH = "tutorial/zh/"                          # the Chinese edition's folder, in the repo and the site


class Editions:
    """The site's pages in reading order, ``(page, title)``: the English edition (chapters and
    notebooks, then the other pages) and the Chinese one (``tutorial/zh/``)."""

    def __init__(self, en: list[tuple[str, str]], zh: list[tuple[str, str]]):
        self.en, self.zh = en, zh

    def zh_index(self) -> str | None:
        """The Chinese table of contents (its first page while ``README.md`` is not written)."""
        names = [p for p, _ in self.zh]
        return ZH + "README.html" if ZH + "README.html" in names else (names[0] if names else None)


def switch(page: str, ed: Editions) -> tuple[str, str, str] | None:
    """The language switch of ``page``: (target page, text, language), ``None`` with no Chinese
    edition. A page links to its counterpart (same file name), else to the other index."""
    built = {p for p, _ in ed.en + ed.zh} | {"index.html"}
    if page.startswith(ZH):
        name = page[len(ZH):]
        target = "tutorial/" + name if name != "README.html" else "index.html"
        return (target if target in built else "index.html"), "English", "en"
    name = page.split("/", 1)[1] if page.startswith("tutorial/") and page.count("/") == 1 else None
    target = ZH + name if name and ZH + name in built else ed.zh_index()
    return (target, "中文", "zh-CN") if target else None


def label(page: str, title: str) -> str:
    """Short name of a page for the navigation bar: ``02 · notebook``, ``02 · written chapter``."""
    folder, name = posixpath.split(page)
    if name[:2].isdigit() and folder in ("notebooks", "tutorial", ZH.rstrip("/")):
        kind = {"notebooks": "notebook", "tutorial": "written chapter"}.get(folder, "章节")
        return f"{name[:2]} · {kind}"
    return title


def nav(page: str, ed: Editions) -> str:
    """Top bar: the edition's index, the previous/next page in reading order, the glossary and
    the language switch."""
    here = posixpath.dirname(page) or "."

    def a(target, text, extra=""):
        return f'<a href="{posixpath.relpath(target, here)}"{extra}>{html.escape(text)}</a>'

    links = [a(ed.zh_index(), "⌂ 课程目录") if page.startswith(ZH) else a("index.html", "⌂ course index")]
    pages = ed.zh if page.startswith(ZH) else ed.en
    names = [p for p, _ in pages]
    if page in names:
        i = names.index(page)
        if i > 0:
            links.append(a(pages[i - 1][0], "← " + label(*pages[i - 1])))
        if i + 1 < len(pages):
            links.append(a(pages[i + 1][0], label(*pages[i + 1]) + " →"))
    links.append(a("tutorial/glossary.html", "glossary 术语表"))
    other = switch(page, ed)
    if other:
        links.append(a(other[0], other[1], f' class="minishard-lang" hreflang="{other[2]}" lang="{other[2]}"'))
    return '<nav class="minishard-nav">' + " ".join(links) + "</nav>"


# ====================================================================== notebooks

def static_outputs(nb):
    """A copy of ``nb`` whose outputs need no kernel and no network.

    * a recorded figure (``minishard.course.glue``) is not drawn: its cell gets its name as an
      anchor instead (``cell.metadata["minishard_figures"]``, read by ``figure_anchors``);
    * a plotly output (``application/vnd.plotly.v1+json``, with its frames) becomes plain HTML
      that draws it with the page's plotly.js — its Play button and slider work in the page;
    * the CDN loader that ``notebook_connected`` leaves behind is dropped;
    * a widget's view (the live player, the calculator: state is not stored) becomes a note.
    """
    import plotly.io as pio

    nb = copy.deepcopy(nb)
    counter = 0
    for cell in nb.cells:
        if cell.cell_type != "code":
            continue
        outputs, names = [], []
        for out in cell.outputs:
            data = out.get("data", {})
            if is_record(out):
                names.append(out["metadata"]["scrapbook"]["name"])
                continue
            if PLOTLY_MIME in data:
                counter += 1
                fig = data[PLOTLY_MIME]
                div = pio.to_html(fig, include_plotlyjs=False, full_html=False, auto_play=False,
                                  div_id=f"minishard-fig-{counter}", validate=False,
                                  config={"responsive": True})
                out["data"] = {"text/html": div}
            elif WIDGET_MIME in data:
                kind = data.get("text/plain", "widget").split("(", 1)[0]
                out["data"] = {"text/html": (
                    f'<div class="minishard-widget">▶ live widget ({html.escape(kind)}): it needs a '
                    f"running kernel — open this notebook in JupyterLab (<code>make course</code>). "
                    f"The kernel-free figures on this page play without one.</div>")}
            elif "text/html" in data and "cdn.plot.ly" in "".join(data["text/html"]):
                continue                       # notebook_connected's CDN loader
            outputs.append(out)
        cell.outputs = outputs
        if names:
            cell.metadata["minishard_figures"] = list(dict.fromkeys(names))
    return nb


def figure_anchors(body: str, nb) -> str:
    """Give each cell that recorded figures one anchor per name, at the top of the cell."""
    for cell in nb.cells:
        names = cell.get("metadata", {}).get("minishard_figures")
        if names and cell.get("id"):
            anchors = "".join(f'<span class="minishard-figure" id="{html.escape(n)}"></span>' for n in names)
            body = re.sub(rf'(<div class="jp-Cell [^"]*" id="cell-id={re.escape(cell.id)}">)',
                          lambda m: m.group(1) + anchors, body, count=1)
    return body


def named_figures(text: str) -> str:
    """The Markdown with each named figure's link text replaced by the text its notebook recorded."""
    def one(m):
        label, notebook, name = m.group(1), m.group(2), m.group(3)
        if not name or not states_a_figure(label):      # "[§2](…#name)" names a place: keep it
            return m.group(0)
        path = ROOT / "notebooks" / f"{notebook}.ipynb"
        fig = figures(path).get(name) if path.exists() else None
        if fig is None:
            return m.group(0)
        return m.group(0)[:m.start(1) - m.start(0)] + fig.text + m.group(0)[m.end(1) - m.start(0):]
    return FIGURE_LINK.sub(one, text)


def notebook_page(nb_path: Path, page: str, ed: Editions, copies: set[str]) -> str:
    import nbformat
    from nbconvert import HTMLExporter

    nb = static_outputs(nbformat.read(nb_path, as_version=4))
    nb.metadata.pop("widgets", None)
    for cell in nb.cells:            # nbconvert 7 writes a cell's id as its anchor; old cells lack one
        cell.setdefault("id", f"c{nb.cells.index(cell)}")
    exporter = HTMLExporter(template_name="lab")
    exporter.exclude_input_prompt = exporter.exclude_output_prompt = True
    body, _ = exporter.from_notebook_node(nb, resources={"metadata": {"name": nb_path.stem},
                                                          "language_code": "en"})
    # no CDN: drop require.js and the CDN MathJax/mermaid loaders; add the vendored scripts
    body = re.sub(r'<script src="https://cdnjs\.cloudflare\.com/ajax/libs/require\.js/[^"]*"></script>',
                  "", body)
    body = re.sub(r'<!-- Load mathjax -->.*?<!-- End of mathjax configuration -->', "", body, flags=re.S)
    body = re.sub(r'<script type="module">\s*document\.addEventListener\("DOMContentLoaded".*?</script>',
                  "", body, flags=re.S)
    body = figure_anchors(body, nb)
    body = shared_replay_script(rewrite_links(body, f"notebooks/{nb_path.name}", page, copies), page)
    body = body.replace("</head>", head_scripts(page) + f"<style>{STYLE}</style>\n</head>", 1)
    return re.sub(r"(<body[^>]*>)", lambda m: m.group(1) + nav(page, ed), body, count=1)


# ====================================================================== markdown

MATH = re.compile(r"\$\$.+?\$\$|(?<![\\$\w])\$(?=\S)[^$\n]+?(?<=\S)\$(?![\w$])", re.S)
CODE = re.compile(r"(^```.*?^```[^\n]*$|`[^`\n]+`)", re.S | re.M)


def markdown_to_html(text: str, unicode_ids: bool = False) -> str:
    """Python-Markdown (tables, fenced code, heading ids, ``<details>``) with math kept intact
    for MathJax: ``$…$``/``$$…$$`` outside code are set aside before and put back after.
    ``unicode_ids``: heading ids keep non-ASCII letters (Chinese headings get Chinese ids)."""
    import markdown
    from markdown.extensions.toc import slugify, slugify_unicode

    stash: list[str] = []

    def keep(m):
        stash.append(html.escape(m.group(0), quote=False))
        return f"\u0000MATH{len(stash) - 1}\u0000"

    parts = CODE.split(text)
    text = "".join(p if i % 2 else MATH.sub(keep, p) for i, p in enumerate(parts))
    out = markdown.markdown(text, extensions=["tables", "fenced_code", "toc", "md_in_html", "sane_lists"],
                            extension_configs={"toc": {"permalink": False,
                                                       "slugify": slugify_unicode if unicode_ids else slugify}},
                            output_format="html")
    return re.sub("\u0000MATH(\\d+)\u0000", lambda m: stash[int(m.group(1))], out)


HEADING = re.compile(r"<h([1-6])((?:\s[^>]*)?)>")


def heading_ids(html_text: str) -> list[str]:
    """The ``id`` of every heading (``<h1>``…``<h6>``) of a page, in order."""
    ids = (re.search(r'\sid="([^"]*)"', m.group(2)) for m in HEADING.finditer(html_text))
    return [m.group(1) if m else "" for m in ids]


def english_anchors(zh_html: str, en_md: Path, zh_name: str, strict: bool = True) -> str:
    """``zh_html`` with each heading given the id of the English page's heading at the same
    place: Chinese headings would get empty or Chinese slugs, and a link to ``#section`` must
    land on the same section in both editions. A different number of headings stops the build
    (``strict``) or leaves the page's own ids (not strict: the table of contents)."""
    en = heading_ids(markdown_to_html(en_md.read_text(encoding="utf-8")))
    n = len(HEADING.findall(zh_html))
    if n != len(en):
        if not strict:
            return zh_html
        raise SystemExit(f"build_site: {zh_name} has {n} headings but its English page "
                         f"{en_md.relative_to(ROOT).as_posix()} has {len(en)}: the Chinese page "
                         f"must have the same sections in the same order (tests/test_zh.py), "
                         f"or its sections cannot get the English anchors")
    ids = iter(en)

    def one(m):
        attrs = re.sub(r'\sid="[^"]*"', "", m.group(2))
        return f'<h{m.group(1)} id="{html.escape(next(ids), quote=True)}"{attrs}>'
    return HEADING.sub(one, zh_html)


CJK_PUNCT, CJK_CHAR = "\u3000-\u303f\uff00-\uffef", "\u2014\u2018-\u201d\u2026\u3000-\u9fff\uff00-\uffef"
CJK_BREAK = re.compile(rf"(?<=[{CJK_CHAR}])\n(?=[{CJK_CHAR}])|(?<=[{CJK_PUNCT}])\n|\n(?=[{CJK_PUNCT}])")


def markdown_body(md_path: Path, text: str | None = None) -> str:
    """The page's HTML (of ``text`` in place of the file's, if given). A Chinese page's headings
    get its English page's ids, and a line break between two Chinese characters or next to
    Chinese punctuation goes (outside ``<pre>``)."""
    rel = md_path.relative_to(ROOT).as_posix()
    text = named_figures(md_path.read_text(encoding="utf-8") if text is None else text)
    if not rel.startswith(ZH):
        return markdown_to_html(text)
    body = markdown_to_html(text, unicode_ids=True)
    parts = re.split(r"(<pre\b.*?</pre>)", body, flags=re.S)
    body = "".join(p if i % 2 else CJK_BREAK.sub("", p) for i, p in enumerate(parts))
    en = ROOT / "tutorial" / md_path.name
    return english_anchors(body, en, rel, strict=md_path.name != "README.md") if en.exists() else body


def markdown_page(md_path: Path, page: str, ed: Editions, title: str,
                  copies: set[str], extra: str = "") -> str:
    body = rewrite_links(markdown_body(md_path), md_path.relative_to(ROOT).as_posix(), page, copies)
    lang = "zh-CN" if page.startswith(ZH) else "en"
    style, cls = STYLE, "minishard-page"
    if posixpath.basename(page) == CHEATSHEET:            # one printed page: CHEATSHEET_PRINT
        style, cls = STYLE + CHEATSHEET_PRINT, cls + " minishard-cheatsheet"
    return (f'<!DOCTYPE html>\n<html lang="{lang}"><head><meta charset="utf-8">\n'
            f'<meta name="viewport" content="width=device-width, initial-scale=1">\n'
            f"<title>{html.escape(title)}</title>\n{head_scripts(page)}<style>{style}</style>\n</head>\n"
            f'<body class="{cls}">{nav(page, ed)}\n{body}\n{extra}</body></html>\n')


def title_of(path: Path) -> str:
    if path.suffix == ".ipynb":
        import nbformat
        nb = nbformat.read(path, as_version=4)
        first = next((c.source for c in nb.cells if c.cell_type == "markdown"), path.stem)
    else:
        first = path.read_text(encoding="utf-8")
    m = re.search(r"^#\s+(.+)$", first, re.M)
    return re.sub(r"[`*]", "", m.group(1)).strip() if m else path.stem


# ====================================================================== the site

def sources(only: set[str] | None = None) -> list[tuple[Path, str]]:
    """Every English page of the site in reading order: ``(repository file, site page)``.
    ``only`` keeps the chapters ``"NN"`` and pages ``"tutorial/glossary"`` it names."""
    out = []
    chapters = sorted({p.name[:2] for p in (ROOT / "notebooks").glob("[0-9][0-9]-*.ipynb")}
                      | {p.name[:2] for p in (ROOT / "tutorial").glob("[0-9][0-9]-*.md")})
    for ch in chapters:
        if only is not None and ch not in only:
            continue
        for md in sorted((ROOT / "tutorial").glob(f"{ch}-*.md")):
            out.append((md, f"tutorial/{md.stem}.html"))
        for nb in sorted((ROOT / "notebooks").glob(f"{ch}-*.ipynb")):
            out.append((nb, f"notebooks/{nb.stem}.html"))
    tutorial = ROOT / "tutorial"
    others = sorted(p for p in tutorial.glob("*.md") if not p.name[:2].isdigit())
    extras = [tutorial / "glossary.md", tutorial / "cheatsheet.md", *others, tutorial / "README.md",
              *sorted((ROOT / "docs").glob("*.md")), ROOT / "README.md",
              *sorted((ROOT / "benchmarks").glob("*.md"))]
    return out + [(md, site_path(md.relative_to(ROOT).as_posix()))
                  for md in dict.fromkeys(extras) if md.exists() and kept(md, only)]


def zh_sources(only: set[str] | None = None) -> list[tuple[Path, str]]:
    """The Chinese edition (``tutorial/zh/*.md``) in reading order: the chapters, the cheat
    sheet, any other page, its table of contents (``README.md``) last. ``only`` as above
    (``"05"`` keeps ``tutorial/zh/05-*.md``; ``"tutorial/zh/README"`` the contents)."""
    zh = ROOT / ZH
    chapters = sorted(zh.glob("[0-9][0-9]-*.md"))
    others = sorted(p for p in zh.glob("*.md") if not p.name[:2].isdigit() and p.name != "README.md")
    return [(md, site_path(md.relative_to(ROOT).as_posix()))
            for md in chapters + others + [zh / "README.md"] if md.exists() and kept(md, only)]


def kept(md: Path, only: set[str] | None) -> bool:
    rel = md.relative_to(ROOT).with_suffix("").as_posix()
    return only is None or rel in only or (md.name[:2].isdigit() and md.name[:2] in only)


def prepare(out: Path) -> None:
    """Make ``out`` empty (wiped only if an earlier build made it), keeping ``vendor/``."""
    if out.exists():
        if not (out / MARKER).exists() and any(out.iterdir()):
            raise SystemExit(f"{out} exists and was not made by this script: refusing to wipe it")
        for child in out.iterdir():
            if child.name != "vendor":
                shutil.rmtree(child) if child.is_dir() else child.unlink()
    out.mkdir(parents=True, exist_ok=True)
    (out / MARKER).write_text("built by scripts/build_site.py; safe to delete\n")


def index_extra(ed: Editions) -> str:
    """What the index adds under the table of contents: every page of the site, both editions."""
    def listing(pages):
        return "\n".join(f'<li><a href="{page}">{html.escape(title)}</a> '
                         f'<small>({page.split("/")[0]})</small></li>' for page, title in pages)
    zh = (f'<h2 lang="zh-CN">中文版 · the Chinese edition</h2>\n<ul lang="zh-CN">\n{listing(ed.zh)}\n</ul>\n'
          if ed.zh else "")
    return (f"<h2>Every page of this site</h2>\n<ul>\n{listing(ed.en)}\n</ul>\n{zh}"
            f"<p><small>Built offline from the repository by <code>make site</code>: no kernel, "
            f"no network. Live widgets need JupyterLab (<code>make course</code>); the kernel-free "
            f"figures play here.</small></p>\n")


def build(out: Path, only: set[str] | None = None) -> list[Path]:
    """Build the site into ``out`` (wiped first if an earlier build made it). Returns the pages."""
    out = Path(out)
    prepare(out)
    vendor(out)

    en, zh = sources(only), zh_sources(only)
    ed = Editions([(page, title_of(src)) for src, page in en], [(page, title_of(src)) for src, page in zh])
    written, copies = [], set()
    for src, page in en + zh:
        dst = out / page
        dst.parent.mkdir(parents=True, exist_ok=True)
        if src.suffix == ".ipynb":
            text = notebook_page(src, page, ed, copies)
        else:
            text = markdown_page(src, page, ed, title_of(src), copies)
        dst.write_text(text, encoding="utf-8")
        written.append(dst)

    # the index: the course's table of contents, then every page of this site
    index = markdown_page(ROOT / "tutorial" / "README.md", "index.html", ed,
                          "minishard — how training shards its state", copies, index_extra(ed))
    (out / "index.html").write_text(index, encoding="utf-8")
    written.append(out / "index.html")
    for rel in sorted(copies):                 # the sources the pages link to, as plain text
        dst = out / rel
        dst.parent.mkdir(parents=True, exist_ok=True)
        shutil.copy(ROOT / rel, dst)
    return written


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("out", nargs="?", default=str(ROOT / "site"))
    ap.add_argument("--only", default=None,
                    help="comma-separated chapters (00,01: both editions) and pages (tutorial/glossary, "
                         "tutorial/zh/README) to build")
    args = ap.parse_args(argv)
    only = set(args.only.split(",")) if args.only else None
    pages = build(Path(args.out), only)
    size = sum(p.stat().st_size for p in pages)
    print(f"site: {len(pages)} pages, {size / 1e6:.1f} MB of HTML in {args.out} "
          f"(open {Path(args.out) / 'index.html'})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
