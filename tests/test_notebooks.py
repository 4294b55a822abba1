"""Each notebook's jupytext source (``notebooks/NN-topic.py``, the reviewed file) and its executed
``.ipynb`` (what nbval runs and readers open) hold the same cells: editing one and not the other
is caught here, before the two drift apart."""
from pathlib import Path

import jupytext
import nbformat
import pytest

NOTEBOOKS = Path(__file__).resolve().parents[1] / "notebooks"
PAIRS = sorted(NOTEBOOKS.glob("*.py"))


def _cells(nb) -> list[tuple[str, str]]:
    return [(c.cell_type, c.source.strip()) for c in nb.cells]


def test_every_notebook_has_a_jupytext_source():
    sources = {p.stem for p in PAIRS}
    for ipynb in NOTEBOOKS.glob("*.ipynb"):
        assert ipynb.stem in sources, f"{ipynb.name} has no {ipynb.stem}.py next to it"


@pytest.mark.parametrize("py", PAIRS, ids=lambda p: p.stem)
def test_py_and_ipynb_hold_the_same_cells(py):
    ipynb = py.with_suffix(".ipynb")
    assert ipynb.exists(), f"{py.name} has no {ipynb.name}: run `jupytext --to ipynb {py}`"
    from_py = jupytext.read(py)
    executed = nbformat.read(ipynb, as_version=4)
    assert _cells(from_py) == _cells(executed), (
        f"{py.name} and {ipynb.name} differ: run `jupytext --sync {py}` and re-execute")


@pytest.mark.parametrize("py", PAIRS, ids=lambda p: p.stem)
def test_ipynb_is_executed_and_small(py):
    ipynb = py.with_suffix(".ipynb")
    assert ipynb.exists(), f"{py.name} has no {ipynb.name}: execute it and commit the result"
    nb = nbformat.read(ipynb, as_version=4)
    code = [c for c in nb.cells if c.cell_type == "code"]
    assert code and all(c.execution_count is not None for c in code), (
        f"{ipynb.name} has unexecuted cells: nbval compares no output of those")
    assert "widgets" not in nb.metadata, f"{ipynb.name} stores widget state (MBs of plotly.js)"
    assert ipynb.stat().st_size < 2_000_000
