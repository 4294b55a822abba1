"""One letter, one meaning: every letter a page defines means what the glossary's notation table
says, in both editions, the cheat sheets' legends and the notebooks' prose.

A definition is a letter followed by what it stands for — "with k the group size", "(β_h the
host link)", "P = the parameters of one unit", "其中 d 为预取深度" — and it must name one of the
words the table gives for that letter ("a definition names"). A number after a letter ("k = 2")
is a value, not a definition.

Formulas are read too, letter by letter, in prose, inline code and math: every letter is the
table's or a placeholder of ``NOT_NOTATION`` (each with its reason), and a table letter is not
an index ("the k-th", a subscript), a function (∇L) or the value of another keyword
(`save_every=k`).
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


# ------------------------------------------------------------------ letters inside formulas
# The definitions above are sentences; a formula is read letter by letter: in prose
# ("4F/(3NTβ_h)"), in inline code ("`2(N−1)/N · 4Ψ`") and in math ("$\frac{4F}{3NT\beta_h}$").
# Every letter of a formula is a letter of the table, or one of these — placeholders a formula
# binds on the spot, never a quantity a reader carries from page to page:
NOT_NOTATION = {
    "r": "a rank's number, 0 … N−1 (rank r, chunk r, x_r, Σ_r): an index, as i is",
    "g": "a gradient: chapter 02's average g, chapter 04's norm ‖g‖ and rank r's part g_r",
    "x": "rank r's micro-batch x_r in chapter 02's gradient",
    "m": "Adam's first moment (the glossary's optimizer-state row)",
    "v": "Adam's second moment (the same row)",
    "n": "a number of elements: what a DeepSpeed bound is set to (`max_live_parameters=n`), "
         "what qgZ quantizes (⌈n/256⌉), what rank r saves of a tensor (n_r)",
    "c": "a shard's rows (⌈dim 0 / N⌉): FSDP2's shard r is rows r·c … (r+1)·c − 1",
    "t": "a time in seconds, named by its subscript (t_step, t_compute); T is tokens",
    "p": "a saved piece, the bound variable of chapter 09's union over pieces",
}
# An index (a subscript, "the i-th", "第 i 个") is the table's index letter or one of the above.
INDEX_WORDS = ("th", "第")
OPERATOR = "/·×+−=≈≤≥^²³‖Σ∇⌈⌉√"
LETTERS = "A-Za-zΨβα"
# names and units, not products of letters: C++, ZeRO++'s, R² (a fit's), GB/s, TFLOP/s, bytes/s
NAMES = re.compile(r"(?:C\+\+|ZeRO\+\+|R²|\b(?:[KMGT]i?B|Gb|T?FLOP)s?\b|\b[a-z]{2,}(?=/s\b))(?:/s\b)?|'s\b")
RUN = re.compile(rf"(?P<grad>∇\s*)?(?P<run>[{LETTERS}□]+)(?:_(?P<sub>\{{[^{{}}]*\}}|[A-Za-z0-9□]+))?")


def latex(src: str) -> str:
    """Math as plain formula text: words (\\text{…}) become □, Greek letters their characters,
    \\nabla ∇, sums and unions Σ, \\underbrace's label an ordinary part; other commands go."""
    s = re.sub(r"\\(?:text|texttt|mathrm|operatorname)\{[^{}]*\}", "□", src)
    for name, char in (("Psi", "Ψ"), ("beta", "β"), ("alpha", "α"), ("nabla", "∇"), ("sum", "Σ"),
                       ("bigcup", "Σ")):
        s = re.sub(rf"\\{name}(?![A-Za-z])", char, s)
    s = re.sub(r"\\underbrace\{", "{", s).replace("}_{", "} {")
    s = re.sub(r"_\{([a-z]{2,})\}", r"_\1", s)                   # h_{ff}: h_ff
    return re.sub(r"\\[A-Za-z]+|\\.", " ", s)


def formula_symbols(formula: str, math: bool) -> list[tuple[str, str]]:
    """(symbol, use) of every letter of a formula; use is 'letter', 'index' (a subscript) or
    'function' (after ∇). Outside math a run of letters with a lower-case one in it is a word
    (root, block, GiB) unless it is up to three letters, two of them the table's (as²b, sbh), and an
    upper-case run a product (NT: N·T); in math every run is a product — math writes its words
    in \\text{}."""
    table, out = notation(), []
    s = NAMES.sub(" ", re.sub(r"\d+(?:\.\d+)?e[+-]?\d+", "0", formula))
    for m in RUN.finditer(s):
        run, sub = m.group("run"), (m.group("sub") or "").strip("{}")
        if not math and len(run) > 1 and re.search("[a-z]", run) and not (    # a word: root, GiB
                len(run) <= 3 and sum(x in table for x in run) >= 2):               # as²b: a·s²·b
            continue
        letters = list(run.replace("□", ""))
        if sub and letters and f"{letters[-1]}_{sub}" in table:
            letters[-1], sub = f"{letters[-1]}_{sub}", ""
        out += [(x, "function" if m.group("grad") and i == 0 else "letter") for i, x in enumerate(letters)]
        if not re.fullmatch(r"[a-z]{2,}|□|\d*", sub):             # t_step, N_shard: a label
            out += [(x, "index") for x in re.findall(f"[{LETTERS}]", sub.replace("□", ""))]
    return out


def is_formula(token: str) -> bool:
    """A formula has an operator and a letter, and no identifier, path or file name in it."""
    return (re.search(f"[{OPERATOR}]", token) is not None and re.search(f"[{LETTERS}]", token) is not None
            and not re.search(r"[A-Za-z]_[A-Za-z]{2}|[A-Za-z]{2}_|\.[a-z]{2,}\b|[{}]|/[a-z]{2}|[a-z]{2}/", token))


def formulas(path: Path) -> list[tuple[str, bool]]:
    """(formula, in math) for the math, the inline code and the prose of a page."""
    text = path.read_text(encoding="utf-8")
    if path.suffix == ".py":
        text = "\n".join(line[2:] for line in text.splitlines() if line.startswith("# "))
    text = re.sub(r"\]\([^)]*\)", "]", re.sub(r"```.*?```", " ", text, flags=re.S))
    math = r"\$\$(.*?)\$\$|\$([^$\n]+)\$"
    out = [(latex(m.group(1) or m.group(2)), True) for m in re.finditer(math, text, re.S)]
    text = re.sub(math, " ", text, flags=re.S)
    spans = [s for s in re.findall(r"`([^`\n]*)`", text) if is_formula(s)]
    for chunk in spans + [re.sub(r"`[^`\n]*`", " ", text)]:
        out += [(t, False) for t in re.findall(r"[^\s\u3000-\u303f\u4e00-\u9fff\uff00-\uffef“”]+", chunk)
                if is_formula(t.strip(",.;:!?*\"'"))]
    return out


def letter_uses(path: Path) -> list[tuple[str, str, str]]:
    """(symbol, use, where) for every letter in a formula, every ordinal ("the k-th", "第 k 次":
    an index) and every letter a keyword argument takes in inline code (`save_every=k`: a
    'keyword', checked against the table's words for the letter)."""
    out = [(sym, use, f) for f, math in formulas(path) for sym, use in formula_symbols(f, math)]
    text = prose(path) if path.suffix == ".md" else "\n".join(
        line[2:] for line in path.read_text(encoding="utf-8").splitlines() if line.startswith("# "))
    for m in re.finditer(r"\b([a-zA-Z])-th\b|第\s*\$?([A-Za-z])\$?\s*[个次块层步条组份]", text):
        out.append((m.group(1) or m.group(2), "index", m.group(0)))
    raw = path.read_text(encoding="utf-8")
    for span in re.findall(r"`([^`\n]*)`", raw):
        for m in re.finditer(rf"\b(\w+)=([{LETTERS}])(?![\w.(])", span):
            out.append((m.group(2), "keyword", span))
    return out


def keyword_fits(sym: str, span: str, row: tuple[str, str, list[str]]) -> bool:
    """`prefetch=d` names one of d's words; `reshard_after_forward=k` is the keyword the table
    itself gives k."""
    given = re.search(rf"\w+={re.escape(sym)}\b", row[0])
    return any(w in span.lower() for w in row[2]) or (given is not None and given.group(0) in span)


def misused_letters(path: Path) -> list[str]:
    table = notation()
    index = {s for s, (_, _, words) in table.items() if any(w in words for w in INDEX_WORDS)}
    bad = []
    for sym, use, where in letter_uses(path):
        if sym not in table and sym not in NOT_NOTATION:
            bad.append(f"{sym!r} in {where.strip()!r}: in neither the notation table nor NOT_NOTATION")
        elif use == "index" and sym in table and sym not in index:
            bad.append(f"{sym!r} as an index in {where.strip()!r}, but it means {table[sym][0]!r}")
        elif use == "function" and sym in table:
            bad.append(f"{sym!r} as a function in {where.strip()!r}, but it means {table[sym][0]!r}")
        elif use == "keyword" and sym in table and not keyword_fits(sym, where, table[sym]):
            bad.append(f"{sym!r} given to {where.strip()!r}, but it means {table[sym][0]!r}")
    return bad


@pytest.mark.parametrize("page", pages(), ids=lambda p: str(p.relative_to(ROOT)))
def test_every_letter_in_a_formula_means_what_the_table_says(page):
    bad = misused_letters(page)
    assert not bad, f"{page.relative_to(ROOT)}:\n  " + "\n  ".join(bad)


def test_a_letter_in_a_formula_is_read_wherever_it_is_written(tmp_path):
    """The check itself: an undefined letter or a second meaning, planted in prose, inline code
    and math, in both languages — each caught; the course's own ways of writing are not."""
    planted = {
        "the ratio 4F/(3NTB) halves": "'B' in",                              # prose
        "比值 4F/(3NTB) 也减半": "'B' in",
        "transfer/compute ≈ `4F/(3NTB)`": "'B' in",                          # inline code
        r"$$\frac{4F}{3\,N\,T\,B}$$": "'B' in",                              # math
        r"$$g = \nabla L(x_r)$$": "'L' as a function",                      # L is layers
        "the gradient ∇L(x_r) of rank r": "'L' as a function",
        r"$\text{collective}_k(\text{rank } r)$": "'k' as an index",
        "the k-th collective": "'k' as an index",
        "第 k 次集合通信": "'k' as an index",
        "save with `save_every=k`": "'k' given to",                          # k is the hpZ group
        r"$$2\,sbh + 5\,as^2q$$": "'q' in",
        "activations of 19·sbq bytes": "'q' in",                            # a product in prose
    }
    for text, expected in planted.items():
        page = tmp_path / "page.md"
        page.write_text(text + "\n", encoding="utf-8")
        bad = misused_letters(page)
        assert len(bad) == 1 and bad[0].startswith(expected), (text, bad)
    kept = ("the ratio 4F/(3NTβ_h) halves at 16Ψ/N; 8 GB/s, 989 TFLOP/s, C++, R² ≥ 0.997, ZeRO++'s "
            "hpZ with `reshard_after_forward=k`, `train(..., prefetch=d)`, the i-th unit, 第 i 个单元, "
            "rank r's chunk r·c … (r+1)·c − 1, ‖g‖² = Σ_r ‖g_r‖², 5·as²b, d·block, h_ff, Ψ_p/N\n"
            r"$$t_\text{step} = \frac{\text{sharded}}{N_\text{shard}},\ \sqrt{v},\ "
            r"\underbrace{4}_{\text{Adam } m},\ \text{collective}_i(\text{rank } r)$$" "\n")
    page = tmp_path / "kept.md"
    page.write_text(kept, encoding="utf-8")
    assert not misused_letters(page), misused_letters(page)


def test_every_placeholder_is_used_and_none_is_a_table_letter():
    """The allow-list stays short: each placeholder is in some formula, none shadows the table."""
    used = {sym for page in pages() for sym, _, _ in letter_uses(page)}
    assert not set(NOT_NOTATION) & set(notation()), "a placeholder that is also a table letter"
    assert set(NOT_NOTATION) <= used, f"placeholders no formula uses: {set(NOT_NOTATION) - used}"
