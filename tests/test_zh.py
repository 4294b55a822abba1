"""The Chinese edition (``tutorial/zh/``) is the English course in Chinese, not a second course.

* every chapter and the cheat sheet exist in both languages, with the same sections in the same
  order (same heading levels, same section numbers), so the site gives both the same anchors;
* every number a Chinese chapter states also appears in its English chapter or in the output of
  the chapter's notebook (measured numbers are links, checked by ``test_prose_numbers.py``);
* the Chinese chapters use the glossary's words: where an English chapter uses a glossary term,
  its Chinese chapter uses one of the term's Chinese names (or the English one), and no chapter
  uses a word the glossary's "wording we keep" table rules out.
"""
import re
from pathlib import Path

import pytest

from test_prose_numbers import NUMBER, outputs

ROOT = Path(__file__).resolve().parents[1]
TUTORIAL = ROOT / "tutorial"
ZH = TUTORIAL / "zh"
PAGES = sorted(TUTORIAL.glob("[0-9][0-9]-*.md")) + [TUTORIAL / "cheatsheet.md"]
GLOSSARY = TUTORIAL / "glossary.md"


def prose(text: str) -> str:
    """The text without link targets (file names carry numbers: ``05-zero3.ipynb``)."""
    return re.sub(r"\]\([^)]*\)", "]", text)


def headings(text: str) -> list[tuple[int, str]]:
    """(level, section number or '') of every heading outside code blocks."""
    out, fenced = [], False
    for line in text.splitlines():
        if line.startswith("```"):
            fenced = not fenced
        m = None if fenced else re.match(r"(#{1,6})\s+(.*)", line)
        if m:
            number = re.match(r"(?:§\s*)?(\d+(?:\.\d+)*)[.:)\s]", m.group(2) + " ")
            out.append((len(m.group(1)), number.group(1) if number else ""))
    return out


def zh_of(page: Path) -> Path:
    return ZH / page.name


@pytest.mark.parametrize("page", PAGES, ids=lambda p: p.stem)
def test_every_page_exists_in_both_languages_with_the_same_sections(page):
    assert page.exists(), f"no English {page.name}"
    assert zh_of(page).exists(), f"no Chinese edition of {page.name} (tutorial/zh/{page.name})"
    en, zh = headings(page.read_text()), headings(zh_of(page).read_text())
    assert [lvl for lvl, _ in zh] == [lvl for lvl, _ in en], \
        f"{page.name}: heading levels differ\n en {en}\n zh {zh}"
    assert [n for _, n in zh] == [n for _, n in en], f"{page.name}: section numbers differ"


def notebook_of(page: Path) -> str | None:
    nb = ROOT / "notebooks" / f"{page.stem}.ipynb"
    return page.stem if nb.exists() else None


@pytest.mark.parametrize("page", PAGES, ids=lambda p: p.stem)
def test_every_number_in_a_chinese_page_is_in_its_english_page_or_notebook(page):
    if not zh_of(page).exists():
        pytest.skip("no Chinese edition yet (the test above fails)")
    known = set(NUMBER.findall(prose(page.read_text())))
    if page.name == "cheatsheet.md":                 # the cheat sheet quotes every chapter
        for p in PAGES[:-1]:
            known |= set(NUMBER.findall(prose(p.read_text())))
    nb = notebook_of(page)
    if nb:
        known |= {n for cell in outputs(nb) for n in NUMBER.findall(cell)}
    stray = sorted(set(NUMBER.findall(prose(zh_of(page).read_text()))) - known)
    assert not stray, f"zh/{page.name} states numbers its English page and notebook do not: {stray}"


# ------------------------------------------------------------------ the glossary's words
def glossary_rows() -> list[tuple[list[str], list[str]]]:
    """(English names, Chinese names) per row: "data parallelism, DDP" → both; parentheses give
    more names ("OOM (out of memory)"); Chinese names are split at 、 / ，and parentheses."""
    rows = []
    for line in GLOSSARY.read_text(encoding="utf-8").splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if not line.startswith("| ") or len(cells) != 4 or cells[0] in ("English", "---"):
            continue
        en = [t.strip(" `") for t in re.split(r",|\s/\s|[()]", cells[0]) if len(t.strip(" `")) > 1]
        zh = [t.strip() for t in re.split(r"[、/（）()，,；]", cells[1]) if len(t.strip()) > 1]
        rows.append((en, zh))
    return rows


def avoided() -> list[str]:
    text = GLOSSARY.read_text(encoding="utf-8").split("## Wording we keep", 1)[-1]
    return [m.group(1).strip() for m in re.finditer(r"^\| ([^|]+?) \| [^|]+ \| [^|]+ \|$", text, re.M)
            if not m.group(1).startswith(("avoid", "---"))]


def test_the_glossary_rules_out_words_the_sources_do_not_use():
    assert {"包装粒度", "扁平参数"} <= set(avoided())
    names = {z for _, zh in glossary_rows() for z in zh}
    assert {"包裹粒度", "通信换显存", "启动开销", "自动包裹策略"} <= names


def uses(term: str, text: str) -> bool:
    return re.search(rf"(?<![\w-]){re.escape(term)}s?(?![\w-])", text, re.I) is not None


@pytest.mark.parametrize("page", PAGES, ids=lambda p: p.stem)
def test_chinese_pages_use_the_glossarys_words(page):
    if not zh_of(page).exists():
        pytest.skip("no Chinese edition yet")
    en_text, zh_text = prose(page.read_text()), prose(zh_of(page).read_text())
    bad = [w for w in avoided() if w in zh_text]
    assert not bad, f"zh/{page.name} uses {bad}: the glossary says which word to use instead"
    missing = []
    for en, zh in glossary_rows():
        if any(uses(t, en_text) for t in en) and not any(z.lower() in zh_text.lower() for z in zh + en):
            missing.append(f"{en[0]} → {'/'.join(zh)}")
    assert not missing, f"zh/{page.name} leaves out the glossary's word for: {missing}"


# ------------------------------------------------------------------ the notebooks' Chinese blocks
NOTEBOOK_SOURCES = sorted((ROOT / "notebooks").glob("[0-9][0-9]-*.py"))
ZH_BLOCK = re.compile(r"^# <details><summary>中文</summary>\n(.*?)^# </details>", re.M | re.S)


@pytest.mark.parametrize("py", NOTEBOOK_SOURCES, ids=lambda p: p.stem)
def test_every_notebook_speaks_chinese_where_it_matters_without_doubling(py):
    """The opening question, the syntax line, the takeaways and the exercise: a 中文 block each."""
    text = py.read_text()
    blocks = ZH_BLOCK.findall(text)
    assert len(blocks) >= 4, f"{py.name}: {len(blocks)} 中文 blocks (question, syntax, takeaway, exercise)"
    assert all(re.search(r"[\u4e00-\u9fff]", b) for b in blocks), f"{py.name}: an empty 中文 block"
    zh_lines = sum(b.count("\n") + 2 for b in blocks)
    assert zh_lines < 0.25 * text.count("\n"), f"{py.name}: the Chinese blocks are {zh_lines} lines"
