"""docs/sources.md cites the installed torch and deepspeed: every file it names is there, and the
code it quotes from them is in them.

The rules (stated at the top of docs/sources.md, so that whoever adds a row follows them):

* A backticked path that starts with ``torch/`` or ``deepspeed/`` names a file (or, ending in
  ``/``, a folder) of the installed package, relative to site-packages; ``:N`` after it is a line,
  which the file must have. A file of the upstream repository that the wheel does not ship is
  written with its repository in front (``pytorch/pytorch:torch/csrc/…``) and is not checked.
* In the source cell (the row's last) of a row that cites an installed text file, a backticked
  fragment is quoted code, and must be found in one of the row's cited files, whitespace
  ignored, when it looks like code: it contains one of ``( = [ . ; { " ::``, starts with
  ``class``, ``struct``, ``def`` or ``global``, or is a name with an underscore or an inner capital
  (``copy_grads_in_partition``, ``LossScaler``). ``…`` (or ``...``) elides: the pieces around it
  must appear in that order. A dotted name (``FSDPParamGroup._backward_prefetch``) is a qualified
  name: each part must be a word of the file. A fragment that starts with ``>>>`` or ``$`` was
  run here, not quoted, and is not searched.
* In the same cells, words in straight double quotes ("…") of 12 characters or more are quoted
  from those files too (a docstring, a comment, a message) and must be found the same way, with
  reST markup, comment markers and ``*`` ignored. A document's words (a web page, a paper, a
  post) and a run's output are set in curly quotes (“…”), which are not searched.
* The versions the page says it read (``installed torch 2.13``, ``DeepSpeed 0.19.8``) are the
  installed ones.

The checker is a function of the page's text, so the tests below also plant a wrong fragment
and a wrong path and watch it fail. No torch import: the files are found on disk (< 1 s).
"""
from __future__ import annotations

import importlib.metadata
import importlib.util
import re
from functools import lru_cache
from pathlib import Path

import pytest

DOC = Path(__file__).resolve().parents[1] / "docs" / "sources.md"
PACKAGES = ("torch", "deepspeed")
TEXT_SUFFIXES = {".py", ".pyi", ".h", ".hpp", ".cpp", ".cuh", ".txt", ".json", ".yaml", ".cfg"}

PATH = re.compile(r"^(?P<path>(?P<package>torch|deepspeed)(?:-[\w.+]+\.dist-info)?/[\w./+-]*?)"
                  r"(?::(?P<line>\d+))?$")
SPAN = re.compile(r"`([^`]+)`")
DOTTED = re.compile(r"^[A-Za-z_]\w*(?:\.[A-Za-z_]\w*)+$")
NAME = re.compile(r"^[A-Za-z_]\w*$")
ELISION = re.compile(r"…|\.\.\.")


def _root(package: str) -> Path | None:
    """site-packages of an installed package, found without importing it."""
    spec = importlib.util.find_spec(package)
    if spec is None or not spec.submodule_search_locations:
        return None
    return Path(list(spec.submodule_search_locations)[0]).parent


@lru_cache(maxsize=None)
def _text(path: Path) -> str:
    return path.read_text(encoding="utf-8", errors="replace")


@lru_cache(maxsize=None)
def _squeezed(path: Path) -> str:
    return re.sub(r"\s+", "", _text(path))


def _plain(text: str) -> str:
    """Prose as a quote and a file both read: no reST roles, backticks, emphasis, comment
    markers, string-literal quotes and continuations, or whitespace."""
    text = re.sub(r"(?m)^\s*(?://+|#+|\*(?!\*))", " ", text)
    text = re.sub(r":(?:meth|class|func|attr|ref|math):", "", text)
    return re.sub(r"[\s`*\"'\\]+", "", text)


@lru_cache(maxsize=None)
def _plain_file(path: Path) -> str:
    return _plain(_text(path))


def _quotes(cell: str) -> list[str]:
    """The straight-quoted passages of a cell, code spans inside them kept (without their
    backticks); a quote never starts inside a code span."""
    spans: list[str] = []

    def hide(m):
        spans.append(m.group(1))
        return f"\x00{len(spans) - 1}\x00"
    hidden = re.sub(r"`([^`]+)`", hide, cell)
    found = []
    for q in re.findall(r'"([^"]+)"', hidden):
        q = re.sub("\x00(\\d+)\x00", lambda m: spans[int(m.group(1))], q)
        if len(q) >= 12:
            found.append(q)
    return found


def _in_order(pieces: list[str], text: str) -> bool:
    at = 0
    for piece in pieces:
        at = text.find(piece, at)
        if at < 0:
            return False
        at += len(piece)
    return True


def _rows(markdown: str):
    """(line number, cells) of every table row that is not a header rule."""
    for n, line in enumerate(markdown.splitlines(), 1):
        if line.startswith("|") and not re.match(r"^\|[\s:|-]+\|$", line):
            cells = [c.strip().replace("\\|", "|") for c in re.split(r"(?<!\\)\|", line)[1:-1]]
            if len(cells) >= 2:
                yield n, cells


def _is_code(fragment: str) -> bool:
    if any(c in fragment for c in '(=[.;{"') or "::" in fragment:
        return True
    if fragment.startswith(("class ", "struct ", "def ", "global ")):
        return True
    return bool(NAME.match(fragment)) and ("_" in fragment or any(c.isupper() for c in fragment[1:]))


def _found(fragment: str, files: list[Path]) -> bool:
    if DOTTED.match(fragment):
        parts = fragment.split(".")
        return any(all(re.search(rf"\b{re.escape(p)}\b", _text(f)) for p in parts) for f in files)
    pieces = [p for p in (re.sub(r"\s+", "", p) for p in ELISION.split(fragment)) if p]
    return any(_in_order(pieces, _squeezed(f)) for f in files)


def _quoted(quote: str, files: list[Path]) -> bool:
    pieces = [p for p in (_plain(p) for p in ELISION.split(quote)) if p]
    return any(_in_order(pieces, _plain_file(f)) for f in files)


def problems(markdown: str, roots: dict[str, Path | None]) -> list[str]:
    """Every cited path that is not installed and every quoted fragment not found, one line each
    (``sources.md:LINE``). Rows citing a package that is not installed are skipped."""
    found: list[str] = []
    for n, cells in _rows(markdown):
        files: list[Path] = []
        for cell in cells:
            for span in SPAN.findall(cell):
                m = PATH.match(span)
                if not m:
                    continue
                root = roots.get(m["package"])
                if root is None:
                    continue
                target = root / m["path"]
                if not target.exists():
                    found.append(f"sources.md:{n}: `{m['path']}` is not in the installed package")
                    continue
                if target.is_file() and target.suffix in TEXT_SUFFIXES:
                    files.append(target)
                    if m["line"] and int(m["line"]) > _text(target).count("\n") + 1:
                        found.append(f"sources.md:{n}: `{span}`: the file has fewer lines")
        if not files:
            continue
        for span in SPAN.findall(cells[-1]):
            if PATH.match(span) or span.startswith((">>>", "$")) or not _is_code(span):
                continue
            if not _found(span, files):
                names = ", ".join(f.name for f in dict.fromkeys(files))
                found.append(f"sources.md:{n}: `{span}` is not in {names}")
        for quote in _quotes(cells[-1]):
            if not _quoted(quote, files):
                names = ", ".join(f.name for f in dict.fromkeys(files))
                found.append(f'sources.md:{n}: "{quote}" is not in {names}')
    return found


ROOTS = {p: _root(p) for p in PACKAGES}


def test_every_cited_file_is_installed_and_every_quoted_fragment_is_in_it():
    if not any(ROOTS.values()):
        pytest.skip("neither torch nor deepspeed is installed")
    assert problems(DOC.read_text(encoding="utf-8"), ROOTS) == []


def test_the_page_cites_both_packages_and_many_rows():
    """Not vacuous: the checker reads dozens of rows of each package."""
    text = DOC.read_text(encoding="utf-8")
    cited = [m["path"] for _, cells in _rows(text) for c in cells for s in SPAN.findall(c)
             if (m := PATH.match(s))]
    assert sum(p.startswith("torch") for p in cited) >= 80
    assert sum(p.startswith("deepspeed") for p in cited) >= 80


def test_the_versions_the_page_read_are_the_installed_ones():
    text = DOC.read_text(encoding="utf-8")
    for package, pattern in (("torch", r"installed torch (\d+\.\d+)"),
                             ("deepspeed", r"DeepSpeed (\d+\.\d+\.\d+)")):
        if ROOTS[package] is None:
            continue
        said = set(re.findall(pattern, text))
        assert said, f"the page never names the {package} it read"
        installed = importlib.metadata.version(package)
        assert all(installed.startswith(v) for v in said), (package, said, installed)


ABSENT = [  # the page's two claims of absence, each a grep of the installed torch
    ("torch/distributed/checkpoint", r"checksum|\bcrc|digest|hashlib"),   # chapter 09: DCP checks nothing
    ("torch/distributed/fsdp/_fully_shard", r"broadcast"),               # chapter 11 §4: fully_shard syncs nothing
]


@pytest.mark.parametrize("folder, words", ABSENT)
def test_what_the_page_says_is_absent_is_absent(folder, words):
    if ROOTS["torch"] is None:
        pytest.skip("torch is not installed")
    assert f"`{folder}/`" in DOC.read_text(encoding="utf-8")
    hits = [p.name for p in (ROOTS["torch"] / folder).rglob("*.py")
            if re.search(words, _text(p), re.IGNORECASE)]
    assert hits == []


# --- the checker itself, on planted rows ------------------------------------------------------

def _planted(row: str) -> list[str]:
    return problems("| claim | source |\n|---|---|\n" + row + "\n", ROOTS)


@pytest.mark.skipif(ROOTS["torch"] is None, reason="torch is not installed")
def test_a_planted_wrong_fragment_fails():
    good = ("| DDP's default bucket | `torch/nn/parallel/distributed.py`: "
            "`_DEFAULT_BUCKET_CAP_MB = 25` |")
    assert _planted(good) == []
    bad = good.replace("= 25", "= 24")
    assert _planted(bad) == [
        "sources.md:3: `_DEFAULT_BUCKET_CAP_MB = 24` is not in distributed.py"]


@pytest.mark.skipif(ROOTS["torch"] is None, reason="torch is not installed")
def test_a_planted_wrong_path_fails():
    bad = "| a file | `torch/distributed/fsdp/_fully_shard/_fsdp_apis.py`: `class OffloadPolicy` |"
    assert _planted(bad) == [
        "sources.md:3: `torch/distributed/fsdp/_fully_shard/_fsdp_apis.py` is not in the installed package"]


@pytest.mark.skipif(ROOTS["torch"] is None, reason="torch is not installed")
def test_a_planted_wrong_quote_fails():
    good = ('| DDP\'s no_sync | `torch/nn/parallel/distributed.py`: "Context manager to disable '
            'gradient synchronizations across DDP processes" |')
    assert _planted(good) == []
    assert len(_planted(good.replace("disable", "enable"))) == 1
    # a document's words, in curly quotes, are not searched
    assert _planted(good.replace('"Context', "“Context").replace('processes"', "processes”")
                    .replace("disable", "enable")) == []


@pytest.mark.skipif(ROOTS["torch"] is None, reason="torch is not installed")
def test_the_rules_for_elisions_names_runs_and_lines():
    path = "`torch/nn/parallel/distributed.py`"
    ok = [f"| x | {path}: `def no_sync(self): … self.require_backward_grad_sync = False` |",
          f"| x | {path}, `DistributedDataParallel.no_sync` |",
          f"| x | {path}; run here: `>>> torch.device('cpu') == 'cpu'` is `False` |",
          f"| x | {path}: a plain word `bucket` is not quoted code |",
          "| x | `torch/nn/parallel/distributed.py:31` |"]
    for row in ok:
        assert _planted(row) == [], row
    wrong = [f"| x | {path}: `self.require_backward_grad_sync = False … def no_sync(self):` |",  # order
             f"| x | {path}, `DistributedDataParallel.no_such_method` |",
             f"| x | {path}: `NoSuchClassName` |",
             "| x | `torch/nn/parallel/distributed.py:999999` |",
             "| x | `pytorch/pytorch:torch/csrc/nowhere.cpp` and `torch/nowhere.py` |"]
    for row in wrong:
        assert len(_planted(row)) == 1, row
