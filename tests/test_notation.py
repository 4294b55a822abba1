"""One letter, one meaning: every letter a page defines means what the glossary's notation table
says, in both editions, the cheat sheets' legends and the notebooks' prose.

A definition is a letter followed by what it stands for — "with k the group size", "(β_h the
host link)", "P = the parameters of one unit", "其中 d 为预取深度" — and it must name one of the
words the table gives for that letter ("a definition names"). A number after a letter ("k = 2")
is a value, not a definition.
"""
from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
GLOSSARY = ROOT / "tutorial" / "glossary.md"
CHEATSHEETS = [ROOT / "tutorial" / "cheatsheet.md", ROOT / "tutorial" / "zh" / "cheatsheet.md"]
SYMBOL = r"(?P<sym>[A-Za-zΨβα](?:_[a-z]+)?)"
# "with k the …", "where k is the …", "(k: the …", "; k = one …" — a letter, then an article
# (also at a sentence's start, second in a list — "and d the …" — and "write Ψ for the …")
EN = re.compile(r"(?:(?:\b[Ww]ith|\b[Ww]here|\band|\b[Ww]rite|;)\s+|\(\s*)\$?" + SYMBOL
                + r"\$?(?:\s*=|\s+is|\s+for|:)?\s+"
                r"(?P<meaning>(?:the|one|a|an)\s+(?:(?!\s+and\s)[^,.;:)·\n]){3,60})")
# (also "用 Ψ 表示…", "设 k 为…"; the meaning ends before a parenthesis: "N 表示节点数（world size）"
# is defined as 节点数, whatever English name follows it)
ZH = re.compile(r"(?:其中|用|设|记|令|，|（|：|；)\s*\$?" + SYMBOL + r"\$?\s*(?:为|是|表示|指|代表)\s*"
                r"(?P<meaning>[^\s\d\[|，。；：）（(·\n][^，。；：）（(·\n]{1,40})")

# "prefetch depth k", "group size k": the noun first, then its letter
NAMED = re.compile(r"\b(?P<meaning>prefetch depth|depth|group size|bandwidth|latency|vocabulary size|"
                   r"micro-batch(?:es)?|hidden size|sequence length)\s+\$?" + SYMBOL + r"\$?(?=[\s,.;:)])", re.I)


def notation() -> dict[str, tuple[str, str, list[str]]]:
    """symbol -> (meaning, 含义, the words a definition of it must name one of)."""
    text = GLOSSARY.read_text(encoding="utf-8").split("## Notation", 1)[1].split("\n## ", 1)[0]
    rows = {}
    for line in text.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) == 4 and cells[0] not in ("symbol · 符号", "---"):
            rows[cells[0]] = (cells[1], cells[2], [w.strip().lower() for w in cells[3].split("·")])
    return rows


def pages() -> list[Path]:
    return (sorted((ROOT / "tutorial").glob("*.md")) + sorted((ROOT / "tutorial" / "zh").glob("*.md"))
            + sorted((ROOT / "notebooks").glob("[0-9][0-9]-*.py")))


def prose(path: Path) -> str:
    """The words a reader reads: Markdown without code blocks and inline code; a notebook
    source's comment lines (its Markdown cells)."""
    text = path.read_text(encoding="utf-8")
    if path.suffix == ".py":
        text = "\n".join(line[2:] for line in text.splitlines() if line.startswith("# "))
    text = re.sub(r"```.*?```", " ", text, flags=re.S)
    return re.sub(r"`[^`\n]*`", " ", text)


def definitions(text: str) -> list[tuple[str, str]]:
    return [(m.group("sym"), m.group("meaning").strip()) for rx in (EN, ZH, NAMED) for m in rx.finditer(text)]


def test_the_table_gives_each_letter_one_meaning():
    table = notation()
    assert {"Ψ", "N", "P", "k", "d", "b", "β", "β_h"} <= set(table)
    assert all(words and all(words) for _, _, words in table.values())


@pytest.mark.parametrize("page", [p for p in pages() if p != GLOSSARY], ids=lambda p: str(p.relative_to(ROOT)))
def test_every_letter_a_page_defines_means_what_the_table_says(page):
    table = notation()
    wrong = []
    for sym, meaning in definitions(prose(page)):
        if sym not in table:
            if len(sym) == 1 and sym in "aA":           # the article, not the letter
                continue
            wrong.append(f"{sym!r} defined as {meaning!r}: not in the glossary's notation table")
        elif not any(w in meaning.lower() for w in table[sym][2]):
            wrong.append(f"{sym!r} defined as {meaning!r}, but it means {table[sym][0]!r}")
    assert not wrong, f"{page.relative_to(ROOT)}: " + "; ".join(wrong)


@pytest.mark.parametrize("sheet", CHEATSHEETS, ids=lambda p: str(p.relative_to(ROOT)))
def test_the_cheat_sheets_legend_is_the_table(sheet):
    """The legend at the top of each cheat sheet lists the table's letters with their meanings."""
    table = notation()
    legend = sheet.read_text(encoding="utf-8").split("\n\n", 2)[1]
    entries = [e.strip(" *\n") for e in re.split(r"·(?![^()（）]*[)）])", legend.split(":", 1)[-1].split("：", 1)[-1])]
    said = {}
    for e in entries:
        if m := re.match(r"^(?P<sym>[A-Za-zΨβα](?:_[a-z]+)?)\s+(?P<meaning>.+)$", e.replace("\n", " "), re.S):
            said[m.group("sym")] = m.group("meaning")
    assert set(said) == set(table), f"legend {sorted(said)} vs table {sorted(table)}"
    for sym, meaning in said.items():
        assert any(w in meaning.lower() for w in table[sym][2]), (sym, meaning)


def test_a_second_meaning_is_caught():
    """The check itself: a page that defines d as something else fails."""
    table = notation()
    (sym, meaning), = definitions("Peak memory grows with d the number of data loaders.")
    assert sym == "d" and not any(w in meaning.lower() for w in table["d"][2])
    (sym, meaning), = definitions("每一步的时间（其中 k 为每个节点的 GPU 数）")
    assert sym == "k" and not any(w in meaning.lower() for w in table["k"][2])
    (sym, meaning), = definitions("It takes 8Ψ/(N·B) seconds (B the host link, bytes/s).")
    assert sym == "B" and sym not in table
    (sym, meaning), = definitions("The peak grows with prefetch depth k, one block per unit.")
    assert sym == "k" and not any(w in meaning.lower() for w in table["k"][2])


@pytest.mark.parametrize("text, sym", [
    ("With A the number of nodes, the same trade returns.", "A"),          # a sentence's start
    ("Where d is the number of nodes, the peak grows.", "d"),
    ("with N the world size and d the number of nodes", "d"),              # second in a list
    ("Write Ψ for the number of parameters and N for the number of nodes.", "N"),
    ("用 Ψ 表示层数（ZeRO 论文的记号）", "Ψ"),
    ("设 k 为每个节点的 GPU 数。", "k"),
    ("用 Ψ 表示参数量，N 表示节点数（world size）。", "N"),                       # the English name does not excuse it
])
def test_every_form_of_a_second_meaning_is_caught(text, sym):
    """The forms the pages write definitions in, each with a wrong meaning: caught."""
    table = notation()
    defs = [(s, m) for s, m in definitions(text) if s == sym]
    assert defs, f"{text!r}: no definition of {sym} read"
    assert any(not any(w in m.lower() for w in table[sym][2]) for _, m in defs), defs
