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
                      "minishard": {"value": _plain(value)}})
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
    printed: str       # everything that cell printed (streams and text/plain), without records


def _join(text) -> str:
    return "".join(text) if isinstance(text, list) else text


def printed_text(cell: dict) -> str:
    """What a code cell shows as text: its streams, text/plain results and errors."""
    parts = []
    for out in cell.get("outputs", []):
        if out.get("output_type") == "stream":
            parts.append(_join(out["text"]))
        elif out.get("output_type") == "error":
            parts.append(f"{out['ename']}: {out['evalue']}")
        elif "data" in out and "text/plain" in out["data"]:
            parts.append(_join(out["data"]["text/plain"]))
    return "\n".join(parts)


def is_record(out: dict) -> bool:
    return TEXT in out.get("data", {}) and "scrapbook" in out.get("metadata", {})


def figures(notebook: Path) -> dict[str, Figure]:
    """Every figure an executed notebook recorded, by name. Refuses a name recorded twice
    (two cells, or one cell twice with different texts): a link must land on one place."""
    nb = json.loads(Path(notebook).read_text(encoding="utf-8"))
    found: dict[str, Figure] = {}
    for i, cell in enumerate(nb["cells"]):
        if cell["cell_type"] != "code":
            continue
        shown = printed_text(cell)
        for out in cell.get("outputs", []):
            if not is_record(out):
                continue
            name = out["metadata"]["scrapbook"]["name"]
            fig = Figure(name, _join(out["data"][TEXT]), out["metadata"].get("minishard", {}).get("value"),
                         i, shown)
            old = found.get(name)
            if old is not None and (old.cell, old.text) != (fig.cell, fig.text):
                raise ValueError(f"{Path(notebook).name}: figure {name!r} recorded twice "
                                 f"(cells {old.cell} and {i}: {old.text!r}, {fig.text!r})")
            found[name] = fig
    return found
