"""Execute chapter notebooks from their jupytext sources and write the executed ``.ipynb``.

    python scripts/execute_notebooks.py                 # every chapter
    python scripts/execute_notebooks.py 05 06           # chapters whose name starts with these

Each ``notebooks/NN-topic.py`` (the reviewed source) becomes ``NN-topic.ipynb`` executed in a
fresh kernel in ``notebooks/``, with the stored widget state dropped (megabytes of plotly.js;
``tests/test_notebooks.py`` refuses it). The time each notebook took is printed.

Before committing, compare the result under another CPU kernel path (``make test-nb-second``):
a checked cell must print the same text there.
"""
from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import jupytext
import nbformat
from nbclient import NotebookClient

ROOT = Path(__file__).resolve().parents[1]
NOTEBOOKS = ROOT / "notebooks"


def execute(py: Path, timeout: int = 600) -> float:
    nb = jupytext.read(py)
    nb.metadata.setdefault("kernelspec", {"name": "python3", "display_name": "Python 3",
                                          "language": "python"})
    t0 = time.perf_counter()
    NotebookClient(nb, timeout=timeout, kernel_name="python3",
                   resources={"metadata": {"path": str(NOTEBOOKS)}}).execute()
    seconds = time.perf_counter() - t0
    nb.metadata.pop("widgets", None)
    nbformat.write(nb, py.with_suffix(".ipynb"))
    return seconds


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("chapters", nargs="*", help="name prefixes, e.g. 05 06 (default: every chapter)")
    args = ap.parse_args(argv)
    sources = sorted(NOTEBOOKS.glob("[0-9][0-9]-*.py"))
    if args.chapters:
        sources = [p for p in sources if p.name.startswith(tuple(args.chapters))]
        if not sources:
            ap.error(f"no notebook starts with {args.chapters}; there are "
                     f"{[p.stem for p in NOTEBOOKS.glob('[0-9][0-9]-*.py')]}")
    total = 0.0
    for py in sources:
        seconds = execute(py)
        total += seconds
        print(f"{py.stem:<34}{seconds:7.1f} s", flush=True)
    print(f"{'all':<34}{total:7.1f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
