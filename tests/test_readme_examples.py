"""Every example a reader is shown runs: each ```python block and each command line of each
```bash block of the README and of ``tutorial/00-how-to-run.md``, in the order a reader meets
them, in one working folder per document.

A Python block runs as a reader runs it: pasted into a file (named as its first comment names it,
``# mine.py: ...``) and run as a script — it must print what it computes (a value it leaves as a
bare expression, which a notebook shows and a script drops, fails), and a block that starts ranks
is also imported as each rank imports the script again (``__mp_main__``), which must start none.

What a reader would run on many ranks, many nodes or a GPU runs here at the smallest size that
exercises it, and the Markdown says so in a comment right above the block, which this test reads
(a stand-in the page does not state is a stand-in nobody checks)::

    <!-- test: on 2 ranks where it says 4, with `--model nano --steps 2` -->

Its clauses, each optional:

* ``on N ranks where it says M`` — a ``torchrun --nproc-per-node M`` line runs on N ranks;
* ``with `ARGS` `` — added at the end of each ``demo`` line (argparse: the last ``--steps`` wins);
* ``replace `A` with `B` `` — in a Python block (``A`` must be there: a stale comment fails);
* ``runs on N warm ranks`` — a Python block written for torchrun runs as a task on N ranks;
* ``tests/test_x.py::name`` — another test runs these lines (it has the formulas to check them
  against); here the test must exist, and nothing runs twice;
* ``the README's lines`` — each command is one of the README's, run where the README's are;
* ``the code of PATH's NAME`` — an excerpt: the block must be that function's code (its
  docstring left out), and that function runs.

Speed: ranks are the session's warm pools (``tests/conftest.py``): ``torchrun ... demo ARGS``
runs as ``minishard.cli.main(["demo", *ARGS, "--world-size", N, ...], pools=pools)`` — the same
command line, parsed and checked the same way, on ranks already started; ``python -m minishard
...`` as ``main([...])``. Only a line with its own collective timeout (``--timeout``) starts
ranks of its own, as the command does.
"""
import ast
import contextlib
import inspect
import io
import os
import re
import runpy
import shlex
from contextlib import nullcontext
from pathlib import Path

import pytest

from minishard.cli import main

ROOT = Path(__file__).resolve().parents[1]
DOCUMENTS = ("README.md", "tutorial/00-how-to-run.md")

# Lines a reader runs that this test does not, and why. A line of any other kind that no rule
# below runs fails the test until someone decides how to run it (or adds it here, with a reason).
NOT_RUN = {
    "make ": "sets up .venv and opens the course or runs the whole suite, which runs this test",
    "python3 -m venv ": "creates and installs the environment this test already runs in",
    "DS_BUILD_OPS=0 .venv/bin/pip install ": "installs DeepSpeed into the environment this test already runs in",
    ".venv/bin/pip install ": "installs minishard into the environment this test already runs in",
    ".venv/bin/python -m pytest ": "the whole suite, which runs this test",
}
# flags whose value is a folder: resolved in the test's working folder, because the warm ranks'
# working folder is the session's, not this test's
PATH_FLAGS = ("--trace", "--save", "--resume", "--export", "--offload-dir")


# --------------------------------------------------------------------------- reading the pages

def blocks(doc: str) -> list[dict]:
    """The fenced python and bash blocks of ``doc``, in order: language, code, the ``<!-- test:
    ... -->`` comment on the line above the fence ("" if none) and the line number."""
    lines = (ROOT / doc).read_text().splitlines()
    out, i = [], 0
    while i < len(lines):
        m = re.fullmatch(r"```(\w+)", lines[i].strip())
        if m and m.group(1) in ("python", "bash"):
            end = lines.index("```", i + 1)
            above = lines[i - 1].strip() if i else ""
            note = re.fullmatch(r"<!-- test: (.*) -->", above)
            out.append({"lang": m.group(1), "code": "\n".join(lines[i + 1:end]), "line": i + 1,
                        "doc": doc, "note": note.group(1) if note else ""})
            i = end
        i += 1
    return out


def commands(code: str) -> list[str]:
    """A bash block's commands: continuation lines joined, comment lines dropped (a trailing
    comment stays: it may say the exit status)."""
    out, held = [], ""
    for line in code.splitlines():
        line = held + line.strip()
        held = ""
        if line.endswith("\\"):
            held = line[:-1].rstrip() + " "
        elif line and not line.startswith("#"):
            out.append(line)
    return out


def split(line: str) -> tuple[list[str], int]:
    """A command's words and the exit status its comment states (``# exit status 1``; else 0)."""
    words = shlex.split(line, comments=True)
    status = re.search(r"#.*\bexit status (\d+)", line)
    return words, int(status.group(1)) if status else 0


def stand_in(note: str) -> dict:
    """What a block's comment says the test changes."""
    return {"ranks": {int(m): int(n) for n, m in re.findall(r"on (\d+) (?:\w+ )?ranks where it says (\d+)", note)},
            "extra": [w for a in re.findall(r"(?<!` )with `([^`]+)`", note) for w in shlex.split(a)],
            "replace": re.findall(r"replace `([^`]+)` with `([^`]*)`", note),
            "warm": int(m.group(1)) if (m := re.search(r"runs on (\d+) warm ranks", note)) else None,
            "run_by": re.findall(r"(tests/\w+\.py)::(\w+)", note),
            "readmes": "the README's lines" in note,
            "code_of": re.search(r"the code of (\S+?)'s (\w+)", note)}


def kind(words: list[str], block: dict) -> str:
    """How the test runs a command: "demo" (on warm ranks), "cli" (in this process), "elsewhere"
    (the test the comment names runs it), or "not run" (``NOT_RUN``)."""
    line = " ".join(words)
    if any(line.startswith(prefix) for prefix in NOT_RUN):
        return "not run"
    s = stand_in(block["note"])
    if words[0] == "torchrun" and (s["run_by"] or s["readmes"]):
        return "elsewhere"
    if words[0] == "torchrun" and words[1:4] == ["--standalone", "--nproc-per-node", words[3]] \
            and words[4:7] == ["-m", "minishard", "demo"]:
        return "demo"
    if words[:3] == ["python", "-m", "minishard"]:
        return "cli"
    raise AssertionError(f"{block['doc']}:{block['line']}: a new kind of command, `{line}`: "
                         f"decide how the test runs it (or why it does not: NOT_RUN)")


# --------------------------------------------------------------------------- running them

def script(block: dict, folder: Path) -> Path:
    """The block pasted into a file, as a reader would: named as its first comment names it
    (``# mine.py: torchrun ...``), else after its line."""
    m = re.match(r"# ([\w.-]+\.py)\b", block["code"])
    path = folder / (m.group(1) if m else f"block{block['line']}.py")
    path.write_text(substituted(block) + "\n")
    return path


def run_script(path: Path, run_name: str = "__main__", **given) -> str:
    """``python path`` in this process (``run_name`` ``__mp_main__``: the script as each rank
    that ``Ranks`` starts imports it again); what it printed. ``given``: the test's stand-ins."""
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        runpy.run_path(str(path), init_globals=given, run_name=run_name)
    return printed.getvalue()


def rank_script(rank, path: str, folder: str) -> str:
    """A rank task: a script written for torchrun, run on this rank in ``folder``; what it printed."""
    here = os.getcwd()
    os.chdir(folder)
    try:
        return run_script(Path(path))
    finally:
        os.chdir(here)


def silent_lines(code: str) -> list[int]:
    """The lines of a script that compute a value and show it nowhere: an expression that is no
    call (a notebook cell shows its last one; a script drops it)."""
    return [node.lineno for node in ast.walk(ast.parse(code)) if isinstance(node, ast.Expr)
            and not isinstance(node.value, (ast.Call, ast.Await, ast.Yield, ast.YieldFrom, ast.Constant))]


def substituted(block: dict) -> str:
    code = block["code"]
    for old, new in stand_in(block["note"])["replace"]:
        assert old in code, f"{block['doc']}:{block['line']}: the comment replaces `{old}`, which the block lacks"
        code = code.replace(old, new)
    return code


def excerpted(block: dict):
    """The function a block's comment says it shows (``the code of PATH's NAME``), checked to be
    that function's code; None for a block that is not an excerpt."""
    s = stand_in(block["note"])
    if not s["code_of"]:
        return None
    path, name = s["code_of"].groups()
    fn = getattr(__import__(path.removesuffix(".py").replace("/", "."), fromlist=[name]), name)
    assert _code(block["code"]) == _code(inspect.getsource(fn)), \
        f"{block['doc']}:{block['line']}: the block is no longer the code of {path}'s {name}"
    return fn


def run_python(block: dict, pools, folder: Path) -> None:
    s = stand_in(block["note"])
    fn = excerpted(block)
    if fn is not None:                   # a task's code: the task itself runs
        assert all(pools(s["warm"] or 1).run(fn))
        return
    where = f"{block['doc']}:{block['line']}"
    assert not silent_lines(block["code"]), \
        f"{where}: a value no script shows at line(s) {silent_lines(block['code'])} of the block: print it"
    path = script(block, folder)
    if s["warm"]:                        # a torchrun script: every rank runs it
        printed = pools(s["warm"]).run(rank_script, str(path), str(folder))
    else:
        printed = [run_script(path, pools=pools, nullcontext=nullcontext)]

        def starts_ranks(*args, **kwargs):
            raise AssertionError(f"{where}: each rank imports the script again, and this one starts "
                                 f"ranks as it is imported: start them under if __name__ == \"__main__\":")
        run_script(path, "__mp_main__", pools=starts_ranks, nullcontext=nullcontext)
    assert all(p.strip() for p in printed), f"{where}: run as a script, it prints nothing: {printed}"


def _code(source: str) -> str:
    """A function's code without its docstring and comments (the block may say where it lives)."""
    fn = ast.parse(source).body[0]
    if ast.get_docstring(fn) is not None:
        fn.body = fn.body[1:]
    return ast.dump(fn)


def run_command(words: list[str], status: int, block: dict, pools, folder: Path) -> None:
    s = stand_in(block["note"])
    if words[0] == "torchrun":
        wanted = int(words[3])
        assert wanted in s["ranks"], (f"{block['doc']}:{block['line']}: `{' '.join(words)}` asks for "
                                      f"{wanted} ranks; its comment must say on how many it runs here")
        argv = ["demo", *_resolved(words[7:], folder), *s["extra"], "--world-size", str(s["ranks"][wanted]),
                "--json"]
        got = main(argv, pools=pools)
    else:
        got = main(words[3:])
    assert got == status, f"{block['doc']}:{block['line']}: `{' '.join(words)}` exited {got}, not {status}"


def _resolved(args: list[str], folder: Path) -> list[str]:
    return [str(folder / a) if i and args[i - 1] in PATH_FLAGS else a for i, a in enumerate(args)]


# --------------------------------------------------------------------------- the tests

@pytest.mark.parametrize("doc", DOCUMENTS)
def test_every_command_is_run_or_named_and_every_comment_holds(doc):
    """Without running anything: each command has a rule, each stand-in its comment, each
    delegated line its test. (Quick: a new kind of line fails here first.)"""
    readme_lines = {" ".join(split(c)[0]) for b in blocks("README.md") if b["lang"] == "bash"
                    for c in commands(b["code"])}
    assert blocks(doc)
    for block in blocks(doc):
        s = stand_in(block["note"])
        if block["note"]:
            assert any(v for v in s.values()), f"{doc}:{block['line']}: a test comment that says nothing the test reads"
        for path, name in s["run_by"]:
            assert re.search(rf"^def {name}\(", (ROOT / path).read_text(), re.M), f"{path}::{name} does not exist"
        if block["lang"] == "python":
            substituted(block)
            excerpted(block)
            continue
        for line in commands(block["code"]):
            words, _ = split(line)
            if s["readmes"]:
                assert " ".join(words) in readme_lines, f"{doc}: `{line}` is not one of the README's lines"
            if kind(words, block) == "demo":
                assert int(words[3]) in s["ranks"], f"{doc}:{block['line']}: `{line}`: on how many ranks here?"


@pytest.mark.parametrize("doc", DOCUMENTS)
def test_every_example_runs(doc, pools, tmp_path, monkeypatch):
    """Each block in order, in one folder (later lines read what earlier ones wrote: a trace,
    a checkpoint); the configs a line names are the repository's."""
    (tmp_path / "configs").symlink_to(ROOT / "configs")
    monkeypatch.chdir(tmp_path)
    for block in blocks(doc):
        if block["lang"] == "python":
            run_python(block, pools, tmp_path)
            continue
        for line in commands(block["code"]):
            words, status = split(line)
            if kind(words, block) in ("demo", "cli"):
                run_command(words, status, block, pools, tmp_path)


def test_every_file_the_documents_name_is_there():
    """A path the README, the docs, the tutorial or the package's map names (``minishard/x/y.py``,
    ``minishard/x/``) exists: a file moved without its mentions sends the reader nowhere."""
    root = Path(__file__).resolve().parent.parent
    documents = [root / "README.md", root / "minishard" / "__init__.py",
                 *(root / "docs").glob("*.md"), *(root / "tutorial").rglob("*.md")]
    missing = []
    for doc in documents:
        for m in re.finditer(r"(?<![\w./])(minishard/[\w/]+(?:\.py|\.js|/))", doc.read_text()):
            if not (root / m.group(1)).exists():
                missing.append(f"{doc.relative_to(root)}: {m.group(1)}")
    assert not missing, "named but not there:\n" + "\n".join(sorted(set(missing)))
