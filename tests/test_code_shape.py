"""The library stays readable: no file of ``minishard/`` over 500 lines, no function over 60.

(The numbers are the redesign's: a file reads as one chapter of one idea; a function fits on a
screen. Tests and notebooks are exempt.)"""
import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
FILES = sorted((ROOT / "minishard").rglob("*.py"))


def test_no_file_over_500_lines():
    long = {str(f.relative_to(ROOT)): n for f in FILES if (n := len(f.read_text().splitlines())) > 500}
    assert not long, f"split these by idea: {long}"


def test_no_function_over_60_lines():
    long = {}
    for f in FILES:
        for node in ast.walk(ast.parse(f.read_text())):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                n = node.end_lineno - node.lineno + 1
                if n > 60:
                    long[f"{f.relative_to(ROOT)}:{node.lineno} {node.name}"] = n
    assert not long, f"split these: {long}"


def test_the_reading_order_names_files_that_exist_and_their_lines():
    """``minishard/__init__.py`` tells a learner what to read for DDP, ZeRO and FSDP, with about how
    many lines each path is: the files exist, and each count is within 10% of today's."""
    import re
    doc = (ROOT / "minishard" / "__init__.py").read_text().split("What to read", 1)[1].split('"""')[0]
    paths = re.split(r"\n    (?=\S)", doc)[1:]                     # one per learner's path
    assert [p.split()[0] for p in paths] == ["DDP", "ZeRO-1/2", "FSDP"]
    for p in paths:
        folder = "strategies/fsdp/" if p.startswith("FSDP") else ""
        files = [folder + f for f in re.findall(r"[\w/]+\.py", p)]
        lines = sum(len((ROOT / "minishard" / f).read_text().splitlines()) for f in files)
        said = int(re.search(r"~([\d,]+)", p).group(1).replace(",", ""))
        assert abs(lines - said) <= 0.1 * lines, (p.split()[0], files, lines, said)


def test_the_architecture_maps_folder_sizes_as_they_are():
    """docs/architecture.md's folder table says how many lines each part of ``minishard/`` is: each
    count within 10% of today's, so the map a reader starts from does not drift from the code."""
    import re
    doc = (ROOT / "docs" / "architecture.md").read_text()
    rows = re.findall(r"^\| ((?:`[\w/]+/`(?:, )?)+) \| .* \| ([\d.]+)k \|$", doc, re.M)
    assert len(rows) >= 9, rows
    for folders, said in rows:
        names = re.findall(r"`([\w/]+)/`", folders)
        lines = sum(len(f.read_text().splitlines()) for n in names for f in (ROOT / "minishard" / n).rglob("*.py"))
        assert abs(lines - 1000 * float(said)) <= 0.1 * lines, (names, lines, said)
