"""``minishard.course.glue``: what a notebook records under a name, and what a reader gets back.

The prose-number check (``test_prose_numbers.py``) trusts ``figures()``; these tests hold it to
refusing what would let a chapter quote a figure nobody printed."""
import json

import pytest

from minishard.course.glue import MIME_PREFIX, TEXT, figures, glue, states_a_figure


def record(name, value, fmt="{}"):
    text = fmt.format(*value) if isinstance(value, tuple) else fmt.format(value)
    return {"output_type": "display_data", "data": {TEXT: text},
            "metadata": {"scrapbook": {"name": name, "mime_prefix": MIME_PREFIX},
                         "minishard": {"value": list(value) if isinstance(value, tuple) else value,
                                       "fmt": fmt, "tuple": isinstance(value, tuple)}}}


def stream(text):
    return {"output_type": "stream", "name": "stdout", "text": text}


def notebook(tmp_path, *cells):
    nb = {"cells": [{"cell_type": "code", "source": "", "metadata": {}, "outputs": list(outs),
                     "execution_count": 1} for outs in cells],
          "metadata": {}, "nbformat": 4, "nbformat_minor": 5}
    path = tmp_path / "nb.ipynb"
    path.write_text(json.dumps(nb))
    return path


def test_glue_returns_the_text_it_records_and_a_tuple_fills_the_fields():
    assert glue("wait", (42.4, 0.2012), "{:.0f} ms ({:.0%})") == "42 ms (20%)"
    assert glue("peaks", [483, 487], "{} MiB") == "[483, 487] MiB"
    assert glue("n", 1_234_567, "{:,}") == "1,234,567"


@pytest.mark.parametrize("name", ["Nano-ratio", "nano_ratio", "nano ratio", "-nano", "nano-", ""])
def test_a_name_that_is_not_a_fragment_is_refused(name, tmp_path):
    with pytest.raises(ValueError, match="figure name"):
        glue(name, 1)
    bad = record("ok", 1)
    bad["metadata"]["scrapbook"]["name"] = name
    with pytest.raises(ValueError, match="figure name"):
        figures(notebook(tmp_path, [bad, stream("1\n")]))


def test_a_figure_is_what_the_output_after_its_record_printed(tmp_path):
    figs = figures(notebook(tmp_path, [stream("before 2.66\n"), record("r", 2.65, "{:.2f}"),
                                       stream("ratio 2.65\n"), record("s", 7), stream("seven 7\n")]))
    assert figs["r"].text == "2.65" and figs["r"].printed == "ratio 2.65\n" and figs["r"].cell == 0
    assert figs["s"].printed == "seven 7\n"
    # the print after the record says something else; another line of the cell says 2.65
    moved = figures(notebook(tmp_path, [record("r", 2.65, "{:.2f}"), stream("ratio 2.66\n"),
                                        stream("again 2.65\n")]))
    assert "2.65" not in moved["r"].printed


def test_a_cell_that_only_records_prints_nothing(tmp_path):
    assert figures(notebook(tmp_path, [record("r", 3)]))["r"].printed == ""


@pytest.mark.parametrize("cells", [
    ([record("r", 1), stream("1\n")], [record("r", 1), stream("1\n")]),     # two cells
    ([record("r", 1), stream("1\n"), record("r", 2), stream("2\n")],),      # one cell, two texts
], ids=["two-cells", "two-texts"])
def test_a_name_recorded_twice_is_refused(cells, tmp_path):
    with pytest.raises(ValueError, match="recorded twice"):
        figures(notebook(tmp_path, *cells))


def test_a_loop_recording_the_same_figure_again_is_one_figure(tmp_path):
    figs = figures(notebook(tmp_path, [record("r", 1), stream("1\n"), record("r", 1), stream("1\n")]))
    assert list(figs) == ["r"]


def test_a_text_that_is_not_its_value_formatted_is_refused(tmp_path):
    forged = record("r", 2.95, "{:.2f}")
    forged["data"][TEXT] = "2.65"
    with pytest.raises(ValueError, match="2.95"):
        figures(notebook(tmp_path, [forged, stream("2.65\n")]))
    pair = record("w", (42.4, 0.2012), "{:.0f} ms ({:.0%})")
    assert figures(notebook(tmp_path, [pair, stream("42 ms (20%)\n")]))["w"].text == "42 ms (20%)"


@pytest.mark.parametrize("label,figure", [
    ("2.65", True), ("42 ms (20%)", True), ("§4 2.65", True), ("[483, 487] MiB", True),
    ("§2", False), ("05 §4", False), ("10 §4.8", False), ("05-zero3.ipynb", False), ("the table", False),
])
def test_a_link_states_a_figure_or_names_a_place(label, figure):
    assert states_a_figure(label) is figure
