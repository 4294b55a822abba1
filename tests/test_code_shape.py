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
