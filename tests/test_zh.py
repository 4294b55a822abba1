"""The Chinese edition (``tutorial/zh/``) is the English course in Chinese, not a second course.

* every chapter and the cheat sheet exist in both languages, with the same sections in the same
  order (same heading levels, same section numbers), so the site gives both the same anchors;
* every number a Chinese chapter states also appears in its English chapter or in the output of
  the chapter's notebook (measured numbers are links, checked by ``test_prose_numbers.py``);
* the Chinese chapters use the glossary's words: where an English chapter uses a glossary term,
  its Chinese chapter uses one of the term's Chinese names (or the English one), and no chapter
  uses a word the glossary's "wording we keep" table rules out — a second word for one concept
  (播放器 for 回放器), or an English word where the table has the Chinese one (a bare "step");
* a word the course gives one sense where Chinese texts give it two (任务: the course's *task*,
  elsewhere also a *job*) is said no more often than the English edition says that sense;
* the doctor (``minishard doctor``) is a tool, 诊断工具: no sentence makes plain 诊断 (the act)
  the one that reads, finds or reports.
"""
import re
import sys
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


WORDING = "## Wording we keep"


def wording() -> list[tuple[str, str, list[str]]]:
    """(concept, the term we use, the variants we do not use) per row of the glossary's
    "wording we keep" table; variants are separated by 、."""
    text = GLOSSARY.read_text(encoding="utf-8").split(WORDING, 1)[-1]
    rows = []
    for m in re.finditer(r"^\| ([^|]+?) \| ([^|]+?) \| ([^|]+?) \|$", text, re.M):
        if m.group(1).startswith(("concept", "---")):
            continue
        rows.append((m.group(1), m.group(2), [v.strip() for v in m.group(3).split("、") if v.strip()]))
    return rows


def avoided() -> list[str]:
    return [v for _, _, variants in wording() for v in variants]


def not_variants() -> list[str]:
    """Longer words that contain a variant and mean something else (时间线上: "on the timeline"),
    from the line "Not variants · 不算变体：…" under the table."""
    text = GLOSSARY.read_text(encoding="utf-8").split(WORDING, 1)[-1]
    m = re.search(r"^Not variants · 不算变体：(.+)$", text, re.M)
    return [w.strip() for w in m.group(1).split("、") if w.strip()] if m else []


def test_the_glossary_rules_out_words_the_sources_do_not_use():
    assert {"包装粒度", "扁平参数", "聚合", "反分片", "分析型账本", "重新分片"} <= set(avoided())
    assert {"全局规模", "rank 数", "micro-batch", "切片", "线上"} <= set(avoided())
    names = {z for _, zh in glossary_rows() for z in zh}
    assert {"包裹粒度", "通信换显存", "启动开销", "自动包裹策略"} <= names
    assert {"进程总数", "实发字节", "诊断工具"} <= names
    assert {"时间线上", "rank 数据"} <= set(not_variants())
    assert {"step", "播放器", "实际发送的字节", "训练任务", "对齐（parity）", "同样的比特"} <= set(avoided())
    assert said_only_for() == {"任务": "task"}
    for concept, use, variants in wording():
        assert variants, f"{concept}: no variant to avoid"
        assert not any(v in use for v in variants), f"{concept}: {use} contains a variant it avoids"
    # one term per concept: no term we use is a variant we avoid for another concept
    uses_ = {u.strip() for _, use, _ in wording() for u in re.split(r"[、（）]", use) if u.strip()}
    assert not uses_ & set(avoided()), f"both used and avoided: {uses_ & set(avoided())}"


def uses(term: str, text: str) -> bool:
    return re.search(rf"(?<![\w-]){re.escape(term)}s?(?![\w-])", text, re.I) is not None


@pytest.mark.parametrize("page", PAGES, ids=lambda p: p.stem)
def test_chinese_pages_use_the_glossarys_words(page):
    if not zh_of(page).exists():
        pytest.skip("no Chinese edition yet")
    en_text, zh_text = prose(page.read_text()), prose(zh_of(page).read_text())
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


# ------------------------------------------------------------------ one word per concept
CJK = re.compile(r"[\u4e00-\u9fff]")


def chinese_lines(path: Path) -> list[tuple[int, str]]:
    """(line number, text) of the Chinese prose of a page or of a notebook's 中文 blocks (plus any
    other line of the notebook with Chinese in it), without code, inline code and link targets."""
    text = path.read_text(encoding="utf-8")
    # math, also over several lines, is blanked (its line numbers kept)
    text = re.sub(r"\$\$.*?\$\$", lambda m: re.sub(r"[^\n]", " ", m.group(0)), text, flags=re.S)
    if path.suffix == ".py":
        inside = set()
        for m in ZH_BLOCK.finditer(text):
            first = text[:m.start()].count("\n") + 1
            inside |= set(range(first, first + m.group(0).count("\n") + 1))
        keep = lambda n, line: n in inside or CJK.search(line)  # noqa: E731
    else:
        keep = lambda n, line: True  # noqa: E731
    out, fenced = [], False
    for n, line in enumerate(text.splitlines(), 1):
        if line.lstrip("# ").startswith("```"):
            fenced = not fenced
            continue
        if fenced or not keep(n, line):
            continue
        out.append((n, re.sub(r"`[^`]*`|\$\$.*?\$\$|\$[^$]*\$", " ", prose(line))))   # code, math
    return out


def variant_in(variant: str, line: str, not_variants_: list[str] | None = None) -> bool:
    if CJK.search(variant):
        for word in not_variants() if not_variants_ is None else not_variants_:   # "rank 数据"
            if variant in word:
                line = line.replace(word, " ")
        return variant in line
    # an English variant: a whole word, and not the English name in parentheses after a term,
    # alone or as the first item: 微批次（micro-batch）, 微批次（micro-batch，条序列）; nor a
    # quotation of English output or of a label (“… 3.12 s a step …”, "after forward")
    line = re.sub(r"（[\x20-\x7e]*）|\([\x20-\x7e]*\)|(?<=[（(])[\x20-\x7e]+(?=[，、；])", " ", line)
    line = re.sub(r"“[\x20-\x7e]*”|\"[\x20-\x7e]*\"", " ", line)
    # a whole word of English: a Chinese character beside it ("每个bucket的") does not make it part
    # of a longer word (\w would: CJK characters are word characters)
    return re.search(rf"(?<![A-Za-z0-9_-]){re.escape(variant)}s?(?![A-Za-z0-9_-])", line, re.I) is not None


ZH_PAGES = sorted(ZH.glob("*.md"))


def rejected_uses(path: Path) -> list[str]:
    """'file:line: variant → term' for every avoided variant, also where a line break splits it."""
    lines, rows, nv = chinese_lines(path), wording(), not_variants()     # the glossary read once
    bad = []
    for i, (n, line) in enumerate(lines):
        after = re.sub(r"^[#>\s]+", "", lines[i + 1][1]) if i + 1 < len(lines) else ""
        joined = line.rstrip() + after if CJK.search(line[-1:] or " ") else line.rstrip() + " " + after
        for _, use, variants in rows:
            for v in variants:
                if variant_in(v, line, nv) or (variant_in(v, joined, nv) and not variant_in(v, after, nv)):
                    bad.append(f"{path.relative_to(ROOT)}:{n}: {v!r} → {use}")
    return bad


@pytest.mark.parametrize("path", ZH_PAGES + NOTEBOOK_SOURCES, ids=lambda p: p.name)
def test_no_chinese_text_uses_a_variant_the_glossary_avoids(path):
    bad = rejected_uses(path)
    assert not bad, "the glossary's \"wording we keep\" table avoids these:\n" + "\n".join(bad)


def test_the_variant_check_catches_a_planted_variant(tmp_path, monkeypatch):
    monkeypatch.setattr(sys.modules[__name__], "ROOT", tmp_path)
    page = tmp_path / "05-zero3.md"
    page.write_text("每个单元在前向之前先聚合参数，`聚合` 在代码里不算。\n"
                    "```\n反分片\n```\n梯度桶（bucket）可以，bucket 不行。\n"
                    "折行也算：这里是反分\n片。\n", encoding="utf-8")
    lines = [(n, v) for n, line in chinese_lines(page) for _, _, vs in wording() for v in vs
             if variant_in(v, line)]
    assert lines == [(1, "聚合"), (5, "bucket")], lines
    assert [b.split(":")[1] for b in rejected_uses(page)] == ["1", "5", "6"]


def test_the_variant_check_catches_the_words_of_one_term_per_concept(tmp_path, monkeypatch):
    """World size, micro-batch, shard and wire bytes: each planted variant is caught, and the
    words that only contain one (时间线上, rank 数据) or name the term in English are not."""
    monkeypatch.setattr(sys.modules[__name__], "ROOT", tmp_path)
    page = tmp_path / "11-when-it-breaks.md"
    page.write_text("全局规模太小时，FSDP 只省下一半。\n"                 # 1: world size
                    "进程总数（world size）太少时也一样；本 rank 数据不算。\n"
                    "N 表示 rank 数。\n"                                 # 3
                    "每个微批次（micro-batch，条序列）都做 reduce-scatter。\n"
                    "每个 micro-batch 都做 reduce-scatter。\n"           # 5
                    "训练的模型是四个模型的切片拼成的。\n"               # 6: shard
                    "在自己的时间线上看；实发字节更少。\n"
                    "线上的字节还更少。\n", encoding="utf-8")           # 8: wire bytes
    found = [(b.split(":")[1], b.split(": ", 1)[1].split(" → ")[0]) for b in rejected_uses(page)]
    assert found == [("1", "'全局规模'"), ("3", "'rank 数'"), ("5", "'micro-batch'"),
                     ("6", "'切片'"), ("8", "'线上'")], found


# ------------------------------------------------------------------ one word, two senses
# 任务 is the course's *task* (the function a rank runs, chapter 00), and Chinese texts also write
# it for a *job*. No list of substrings tells the two apart — "这个任务" is either — but the English
# edition does: each Chinese page translates its English page, so it says 任务 no more often than
# the English says "task". A 任务 that means a job is one too many, wherever it is; the phrases
# that can only mean a job (训练任务, 任务卡住…) are variants in the table besides.
def said_only_for() -> dict[str, str]:
    """{Chinese word: the English word it translates}, from the line "Said only for · 只用于：
    任务 = task" under the glossary's table."""
    text = GLOSSARY.read_text(encoding="utf-8").split(WORDING, 1)[-1]
    m = re.search(r"^Said only for · 只用于：(.+)$", text, re.M)
    pairs = [p.split("=") for p in m.group(1).split("、")] if m else []
    return {zh.strip(): en.strip() for zh, en in pairs}


def english_lines(path: Path) -> str:
    """The English a Chinese page translates: its English page, without code; for a notebook
    source, its comment lines with no Chinese in them."""
    if path.suffix == ".py":
        return "\n".join(line for line in path.read_text(encoding="utf-8").splitlines()
                         if line.startswith("#") and not CJK.search(line))
    english = TUTORIAL / path.name
    text = re.sub(r"```.*?```", " ", english.read_text(encoding="utf-8"), flags=re.S)
    return re.sub(r"`[^`\n]*`", " ", prose(text))


def overused_senses(path: Path) -> list[str]:
    chinese = " ".join(line for _, line in chinese_lines(path))
    english = english_lines(path)
    bad = []
    for zh, en in said_only_for().items():
        n_zh = chinese.count(zh)
        n_en = len(re.findall(rf"(?<![A-Za-z]){re.escape(en)}s?(?![A-Za-z])", english, re.I))
        if n_zh > n_en:
            lines = [n for n, line in chinese_lines(path) if zh in line]
            bad.append(f"{path.relative_to(ROOT)}: {zh} {n_zh}× (lines {lines}), but {en!r} only "
                       f"{n_en}× in English: the others mean something else (a job is 作业)")
    return bad


@pytest.mark.parametrize("path", ZH_PAGES + NOTEBOOK_SOURCES, ids=lambda p: p.name)
def test_a_word_with_two_senses_is_said_only_where_the_english_says_its_sense(path):
    bad = overused_senses(path)
    assert not bad, "\n".join(bad)


def test_the_checks_catch_a_second_word_for_job_step_player_wire_bytes_and_parity(tmp_path, monkeypatch):
    """Each kind planted — a variant phrase, an English word left in Chinese, 任务 for a job —
    is caught; the words the table keeps, step in code, math, parentheses and quoted English, and
    任务 where the English says task, are not."""
    monkeypatch.setattr(sys.modules[__name__], "ROOT", tmp_path)
    page = tmp_path / "02-ddp.md"
    page.write_text("训练任务卡住了，诊断工具读它的记录器。\n"                          # 1: job
                    "每个 step 都归约一次；第一步、每步、`opt.step()`、$t_\\text{step}$ 都可以。\n"   # 2: step
                    "单步耗时（step time）；规划器说“3.12 s a step against 4.86 s”。\n"
                    "用一个滑块带着两个播放器。\n"                                      # 4: player
                    "实际发送的字节更少；实发字节更少。\n"                              # 5: wire bytes
                    "对齐（parity）说明两者得到同样的比特。\n"                          # 6: parity, bits
                    "逐位比对说明两者逐位相同；诊断工具把各 rank 对齐。\n", encoding="utf-8")
    found = [(b.split(":")[1], b.split(": ", 1)[1].split(" → ")[0]) for b in rejected_uses(page)]
    assert found == [("1", "'训练任务'"), ("1", "'任务卡住'"), ("2", "'step'"), ("4", "'播放器'"),
                     ("5", "'实际发送的字节'"), ("6", "'对齐（parity）'"), ("6", "'同样的比特'")], found
    # 任务 for a job, in words no variant lists: one more 任务 than the English has tasks
    monkeypatch.setattr(sys.modules[__name__], "TUTORIAL", tmp_path / "en")
    (tmp_path / "en").mkdir()
    (tmp_path / "en" / "00-how-to-run.md").write_text(
        "A rank runs a *task*: a plain function. The task must be importable. A job hangs.\n")
    zh = tmp_path / "00-how-to-run.md"
    zh.write_text("rank 执行的是*任务（task）*：一个普通函数。任务必须可导入。作业卡住了。\n"
                  "`任务` 在代码里不算。\n", encoding="utf-8")
    assert not overused_senses(zh)
    zh.write_text("rank 执行的是*任务（task）*：一个普通函数。任务必须可导入。这个任务卡死了。\n",
                  encoding="utf-8")
    assert [b.split(":")[0] for b in overused_senses(zh)] == ["00-how-to-run.md"], overused_senses(zh)
    nb = tmp_path / "08-offload.py"
    nb.write_text("# Use it to get a job running on scarce hardware.\n"
                  "# <details><summary>中文</summary>\n# 用它让任务在紧缺的硬件上跑起来。\n# </details>\n",
                  encoding="utf-8")
    assert overused_senses(nb), "a notebook's Chinese block that says 任务 for a job"


# ------------------------------------------------------------------ the doctor is a tool
# 诊断 right before what only the tool does (reads, finds, names, reports, stops, exits …), or
# named beside the flight recorder: the sentence's subject is the tool, 诊断工具. 诊断 as the act
# ("再诊断它", "诊断出来", "做一次诊断") is followed by none of these.
DOCTOR_AS_SUBJECT = re.compile(
    r"诊断(?=(?:就|才|会|也|都|再|只|还|先|不再|不先)?"
    r"(?:读|说|给出|找|指出|点出|比较|看到|报告|认为|停|把|按|排|分得出|对齐|什么|从|发现|列出|返回|输出|最先)"
    r"|的(?:发现|结论|退出码|输出|答案))"
    r"|记录器\s*[+＋与和]\s*\**诊断(?!工具)|[（(]诊断[）)]")


def doctor_as_subject(path: Path) -> list[str]:
    return [f"{path.relative_to(ROOT)}:{n}: …{line[max(0, m.start() - 12):m.end() + 8]}…"
            for n, line in chinese_lines(path) for m in DOCTOR_AS_SUBJECT.finditer(line)]


@pytest.mark.parametrize("path", ZH_PAGES + NOTEBOOK_SOURCES, ids=lambda p: p.name)
def test_the_doctor_is_named_as_a_tool(path):
    bad = doctor_as_subject(path)
    assert not bad, ("the doctor is 诊断工具 (or `minishard doctor`); 诊断 is what it does:\n"
                     + "\n".join(bad))


def test_the_doctor_check_catches_the_tool_called_plain_diagnosis(tmp_path, monkeypatch):
    monkeypatch.setattr(sys.modules[__name__], "ROOT", tmp_path)
    page = tmp_path / "11-when-it-breaks.md"
    page.write_text("诊断不先读报错信息，而是读四个记录器。\n"             # 1
                    "诊断工具不先读报错信息；`诊断什么也没找到` 在代码里不算。\n"
                    "所以不用 notebook 也能把一次运行弄坏、再诊断它。\n"
                    "诊断工具给出的结论是 `precision`；诊断的退出码是 1。\n"  # 4
                    "把这一切读出来的是**飞行记录器 + 诊断**这一对。\n"     # 5
                    "从各 rank 的飞行记录器诊断出来，修好后再跑一遍。\n"
                    "去掉这条分支，诊断就什么也找不到。\n", encoding="utf-8")  # 7
    assert [b.split(":")[1] for b in doctor_as_subject(page)] == ["1", "4", "5", "7"], \
        doctor_as_subject(page)


def heading_titles(text: str) -> list[str]:
    """Every heading outside code, without its '#', its chapter number and its (§n)."""
    out, fenced = [], False
    for line in text.splitlines():
        if line.startswith("```"):
            fenced = not fenced
        m = None if fenced else re.match(r"#{1,6}\s+(.*)", line)
        if m:
            title = re.sub(r"\s*[（(]§[\d.]+[）)]\s*$", "", m.group(1))
            out.append(re.sub(r"^\d\d\s*·\s*", "", title).strip())
    return out


def blocks(text: str) -> list[str]:
    """The recurring labels: a bold line (**Questions**), a short bold label opening a quote
    (> **Takeaway.**), an answer's summary."""
    out = re.findall(r"^\*\*([^*]{1,20})\*\*\s*$", text, re.M)
    out += re.findall(r"^> \*\*([^*]{1,12})\*\*", text, re.M)
    out += re.findall(r"<summary>([^<]+)</summary>", text)
    return out


def test_the_same_heading_has_the_same_chinese_wording_in_every_chapter():
    seen: dict[str, dict[str, set[str]]] = {}
    for page in PAGES[:-1]:
        en, zh = heading_titles(page.read_text()), heading_titles(zh_of(page).read_text())
        assert len(en) == len(zh), page.name                       # (the section test says more)
        pairs = list(zip(en, zh))
        pairs += [(e.split(": ", 1)[0], re.split(r"[：:]", z, maxsplit=1)[0].strip())
                  for e, z in zip(en, zh) if ": " in e]
        eb, zb = blocks(page.read_text()), blocks(zh_of(page).read_text())
        assert len(eb) == len(zb), f"{page.name}: {eb} against {zb}"
        pairs += list(zip(eb, zb))
        for e, z in pairs:
            seen.setdefault(e, {}).setdefault(z, set()).add(page.name[:2])
    differ = {e: zs for e, zs in seen.items() if len(zs) > 1}
    assert not differ, "one English heading, several Chinese ones:\n" + "\n".join(
        f"  {e!r}: " + "; ".join(f"{z!r} in {sorted(chs)}" for z, chs in zs.items())
        for e, zs in differ.items())


def notebook_labels(py: Path) -> list[str]:
    """The short bold labels opening a notebook's 中文 blocks: one-line syntax, takeaway, exercise."""
    labels = []
    for block in ZH_BLOCK.findall(py.read_text()):
        labels += re.findall(r"^# (?:> )?\*\*([^*：]{1,8})(?:\*\*|：)", block, re.M)
    return labels


def test_every_notebook_labels_its_chinese_blocks_alike():
    labels = {py.name: notebook_labels(py) for py in NOTEBOOK_SOURCES}
    kinds = {tuple(v) for v in labels.values()}
    assert len(kinds) == 1, "the notebooks' 中文 labels differ:\n" + "\n".join(
        f"  {k}: {v}" for k, v in labels.items())


def test_the_checks_catch_a_variant_written_against_chinese_and_the_doctor_reading_traces(tmp_path, monkeypatch):
    """An English variant with no space before the Chinese beside it is still the variant; the
    doctor that reads the traces, finds or lists something is the tool (诊断工具)."""
    monkeypatch.setattr(sys.modules[__name__], "ROOT", tmp_path)
    page = tmp_path / "02-ddp.md"
    page.write_text("每个bucket的 all-reduce 都在反向期间开始。\n"                  # 1
                    "梯度桶（bucket）可以；bucketing 不是变体。\n"
                    "诊断从轨迹里的显存账本把它们都读了出来。\n"                  # 3
                    "诊断发现 rank 1 的梯度范数不同。\n"                           # 4
                    "诊断工具从轨迹里读出来，再诊断一次。\n", encoding="utf-8")
    assert [b.split(":")[1] for b in rejected_uses(page)] == ["1"], rejected_uses(page)
    assert [b.split(":")[1] for b in doctor_as_subject(page)] == ["3", "4"], doctor_as_subject(page)
