"""Figures the written course quotes, recorded by name in the executed notebook.

A chapter that reports a measured number does not copy its digits: it names the figure,
``[2.53×](../notebooks/05-zero3.ipynb#nano-cpu-ratio)``, and the notebook records it where it
prints it::

    print(f"FSDP / DDP in CPU time: {glue('nano-cpu-ratio', ratio, '{:.2f}×')}")

``glue`` stores the figure as MyST-NB's ``glue(name, value, display=False)`` does — a
``display_data`` output whose only data is ``application/papermill.record/text/plain`` and
whose metadata says ``{"scrapbook": {"name": ..., "mime_prefix": ...}}`` (so MyST-NB and
scrapbook read the same notebook) — with the raw value beside it in the metadata, and returns
the text, so what the cell prints is what it recorded. Outside a kernel it only returns the text.

The site build (``scripts/build_site.py``) writes each recorded text in place of the link's
text and lands the link on the cell that printed it; ``tests/test_prose_numbers.py`` fails when
a chapter names a figure no notebook recorded, or writes it differently from the printed text;
``scripts/refresh_prose_numbers.py`` rewrites the chapters' copies after a re-execution.
"""
from __future__ import annotations

import json
import re
from dataclasses import dataclass
from pathlib import Path

MIME_PREFIX = "application/papermill.record/"
TEXT = MIME_PREFIX + "text/plain"
NAME = re.compile(r"^[a-z0-9]+(?:-[a-z0-9]+)*$")    # a URL fragment and an HTML id as it is
NUMBER = re.compile(r"\d[\d,]*(?:\.\d+)?")
PLACE = re.compile(r"^(?:\d\d )?§[\d.]+$")          # "[§2](…)", "[05 §4](…)": a section, not a figure


def glue(name: str, value, fmt: str = "{}") -> str:
    """Record ``value`` under ``name`` with the text ``fmt.format(value)`` (a tuple fills the
    format's fields in order: ``glue("wait", (ms, share), "{:.0f} ms ({:.0%})")``); return the text."""
    if not NAME.match(name):
        raise ValueError(f"figure name {name!r}: use lowercase words joined by '-' "
                         f"(it is the link's #fragment and the cell's anchor)")
    text = fmt.format(*value) if isinstance(value, tuple) else fmt.format(value)
    try:
        from IPython import get_ipython
        from IPython.display import display
    except ImportError:
        return text
    if get_ipython() is None:
        return text
    display({TEXT: text}, raw=True,
            metadata={"scrapbook": {"name": name, "mime_prefix": MIME_PREFIX},
                      "minishard": {"value": _plain(value), "fmt": fmt, "tuple": isinstance(value, tuple)}})
    return text


def _plain(value):
    """The value as JSON holds it (numbers, strings, lists of them); anything else as its text."""
    try:
        json.dumps(value)
        return value
    except TypeError:
        return repr(value)


# ---------------------------------------------------------------- reading an executed notebook

def states_a_figure(label: str) -> bool:
    """Does a link's text state a figure (a number), rather than name a place (``§2``) or a file?"""
    return bool(NUMBER.search(label)) and not PLACE.match(label) and ".ipynb" not in label


@dataclass(frozen=True)
class Figure:
    name: str
    text: str          # as recorded (and as the chapters must write it)
    value: object
    cell: int          # index of the cell that recorded it, among all the notebook's cells
    printed: str       # the output that printed it: the first one after the record that is not a record


def _join(text) -> str:
    return "".join(text) if isinstance(text, list) else text


def shown(out: dict) -> str:
    """What one output shows as text (a stream, a text/plain result, an error; a record: nothing)."""
    if is_record(out):
        return ""
    if out.get("output_type") == "stream":
        return _join(out["text"])
    if out.get("output_type") == "error":
        return f"{out['ename']}: {out['evalue']}"
    return _join(out.get("data", {}).get("text/plain", ""))


def is_record(out: dict) -> bool:
    return TEXT in out.get("data", {}) and "scrapbook" in out.get("metadata", {})


def figures(notebook: Path) -> dict[str, Figure]:
    """Every figure an executed notebook recorded, by name.

    Refuses what would let a chapter quote a figure nobody printed: a name recorded twice (two
    cells, or one cell twice with different texts: a link must land on one place), a name that is
    not a URL fragment, a text that is not the recorded value in the recorded format."""
    nb = json.loads(Path(notebook).read_text(encoding="utf-8"))
    found: dict[str, Figure] = {}
    where = Path(notebook).name
    for i, cell in enumerate(nb["cells"]):
        outs = cell.get("outputs", []) if cell["cell_type"] == "code" else []
        for k, out in enumerate(outs):
            if not is_record(out):
                continue
            name, meta = out["metadata"]["scrapbook"]["name"], out["metadata"].get("minishard", {})
            if not NAME.match(name):
                raise ValueError(f"{where}: figure name {name!r} is not lowercase words joined by '-'")
            printed = next((shown(o) for o in outs[k + 1:] if not is_record(o)), "")
            fig = Figure(name, _join(out["data"][TEXT]), meta.get("value"), i, printed)
            again = _formatted(meta) if "fmt" in meta else None
            if again is not None and again != fig.text:
                raise ValueError(f"{where}: figure {name!r} records the text {fig.text!r}, but its value "
                                 f"{meta['value']!r} in its format {meta['fmt']!r} reads {again!r}")
            old = found.get(name)
            if old is not None and (old.cell, old.text) != (fig.cell, fig.text):
                raise ValueError(f"{where}: figure {name!r} recorded twice "
                                 f"(cells {old.cell} and {i}: {old.text!r}, {fig.text!r})")
            found.setdefault(name, fig)
    return found


def _formatted(meta: dict) -> str | None:
    value, fmt = meta.get("value"), meta["fmt"]
    try:
        return fmt.format(*value) if meta.get("tuple") else fmt.format(value)
    except (TypeError, ValueError, IndexError, KeyError):
        return None      # a value JSON could not hold (kept as its repr): the text is all there is
