"""Execute chapter notebooks from their jupytext sources and write the executed ``.ipynb``.

    python scripts/execute_notebooks.py                 # every chapter
    python scripts/execute_notebooks.py 05 06           # chapters whose name starts with these
    python scripts/execute_notebooks.py --sources-only  # new cell sources, outputs kept (see below)

Each ``notebooks/NN-topic.py`` (the reviewed source) becomes ``NN-topic.ipynb`` executed in a
fresh kernel in ``notebooks/``, with the stored widget state dropped (megabytes of plotly.js;
``tests/test_notebooks.py`` refuses it). The time each notebook took is printed.

Before committing, compare the result under another CPU kernel path (``make test-nb-second``):
a checked cell must print the same text there.

``--sources-only`` copies the cell sources into the executed notebook and keeps its outputs,
for a change that renames things or edits the text without changing any output (nbval re-runs
the notebook and compares every checked cell, so a change that does alter an output still fails
there). Markdown cells may be added or removed; code cells must match one to one (re-execute
otherwise).
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


def update_sources(py: Path) -> None:
    nb, old = jupytext.read(py), nbformat.read(py.with_suffix(".ipynb"), as_version=4)
    code = [c for c in old.cells if c.cell_type == "code"]
    if sum(c.cell_type == "code" for c in nb.cells) != len(code):
        raise SystemExit(f"{py.name}: code cells were added or removed; execute the notebook instead")
    ran = iter(code)
    texts = {}                       # an unchanged markdown cell keeps its id (a quiet diff)
    for c in old.cells:
        if c.cell_type == "markdown":
            texts.setdefault(c.source, []).append(c)
    cells = []
    for cell in nb.cells:            # markdown cells from the source; code cells keep their outputs
        if cell.cell_type == "code":
            kept = next(ran)
            kept.source = cell.source
            cell = kept
        elif texts.get(cell.source):
            cell = texts[cell.source].pop(0)
        cells.append(cell)
    old.cells = cells
    nbformat.write(old, py.with_suffix(".ipynb"))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("chapters", nargs="*", help="name prefixes, e.g. 05 06 (default: every chapter)")
    ap.add_argument("--sources-only", action="store_true",
                    help="update the cell sources of the executed notebooks, keep their outputs")
    args = ap.parse_args(argv)
    sources = sorted(NOTEBOOKS.glob("[0-9][0-9]-*.py"))
    if args.chapters:
        sources = [p for p in sources if p.name.startswith(tuple(args.chapters))]
        if not sources:
            ap.error(f"no notebook starts with {args.chapters}; there are "
                     f"{[p.stem for p in NOTEBOOKS.glob('[0-9][0-9]-*.py')]}")
    if args.sources_only:
        for py in sources:
            update_sources(py)
        return 0
    total = 0.0
    for py in sources:
        seconds = execute(py)
        total += seconds
        print(f"{py.stem:<34}{seconds:7.1f} s", flush=True)
    print(f"{'all':<34}{total:7.1f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
