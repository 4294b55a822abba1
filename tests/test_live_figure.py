"""LiveFigure's kernel side: every edit lands in the state its views draw, and nothing else is sent.

What the browser does with that state (draw it, redraw on change, load plotly.js once per page)
is tested in a real browser: ``tests/test_browser.py::test_live_figures_draw_their_latest_state``.
"""
from __future__ import annotations

import numpy as np
import plotly
import plotly.graph_objects as go
import pytest
from plotly.offline import get_plotlyjs_version

from minishard.viz.live_figure import LiveFigure, PlotlyLibrary, plotly_library

EDIT_MESSAGES = ["_py2js_addTraces", "_py2js_deleteTraces", "_py2js_moveTraces", "_py2js_restyle",
                 "_py2js_relayout", "_py2js_update", "_py2js_animate"]


@pytest.fixture
def sent():
    """The names of plotly edit messages the figure made (filled by ``figure``)."""
    return []


@pytest.fixture
def figure(sent):
    fig = LiveFigure(go.Figure([go.Bar(name="a", y=[1, 2, 3]), go.Bar(name="b", y=[4, 5, 6])],
                               layout=dict(title="start")))
    fig.observe(lambda change: sent.append(change["name"]), names=EDIT_MESSAGES)
    return fig


def assert_state_is_the_figure(fig):
    assert fig._widget_data == fig._data
    assert fig._widget_layout == fig._layout_obj._props


@pytest.mark.parametrize("edit", [
    "restyle", "relayout", "batch_update", "add_traces", "delete_traces", "move_traces", "numpy"])
def test_every_edit_lands_in_the_state_and_no_edit_message_is_sent(figure, sent, edit):
    before = (list(figure._widget_data), dict(figure._widget_layout))
    if edit == "restyle":
        figure.data[1].y = [7, 8, 9]
    elif edit == "relayout":
        figure.layout.title.text = "moved"
    elif edit == "batch_update":
        with figure.batch_update():
            figure.data[0].y = [0, 0, 1]
            figure.layout.yaxis.range = [0, 10]
    elif edit == "add_traces":
        figure.add_trace(go.Scatter(y=[1, 1, 1], name="c"))
    elif edit == "delete_traces":
        figure.data = figure.data[:1]
    elif edit == "move_traces":
        figure.data = figure.data[::-1]
    elif edit == "numpy":
        figure.data[0].y = np.arange(3, dtype=np.float32)
    if edit == "numpy":        # numpy arrays compare element-wise: check the values
        assert list(figure._widget_data[0]["y"]) == [0.0, 1.0, 2.0]
    else:
        assert (figure._widget_data, figure._widget_layout) != before
        assert_state_is_the_figure(figure)
    assert sent == [], "a one-shot edit message was sent"


def test_edits_complete_at_once(figure):
    """plotly waits for a view's reply to an edit message before running on_edits_completed
    callbacks; without edit messages there is nothing to wait for."""
    done = []
    figure.data[0].y = [3, 3, 3]
    figure.on_edits_completed(lambda: done.append(True))
    assert done == [True]


def test_one_library_per_kernel_named_in_the_first_state(figure):
    other = LiveFigure()
    library = plotly_library()
    assert isinstance(library, PlotlyLibrary)
    assert figure._library == other._library == f"IPY_MODEL_{library.model_id}"
    assert figure.get_state()["_library"] == figure._library
    assert library.version == get_plotlyjs_version()
    assert library.source.startswith("/**\n* plotly.js v" + get_plotlyjs_version())
    # the figure's own module is the small view, not plotly.js (4.8 MB, sent once in the library)
    assert len(figure.get_state()["_esm"]) < 10_000
    assert len(library.source) > 1_000_000


def test_a_closed_library_is_sent_again():
    first = plotly_library()
    first.close()
    second = plotly_library()
    assert second is not first and second.comm is not None
    assert LiveFigure()._library == f"IPY_MODEL_{second.model_id}"


def test_every_plotly_edit_message_is_replaced():
    """LiveFigure overrides plotly's private ``_send_*_msg`` methods. If a plotly release
    renames or adds one, an edit would go out as a message no view listens to: fail here."""
    sends = {name for name in dir(go.FigureWidget) if name.startswith("_send_") and name.endswith("_msg")}
    ours = {name for name in vars(LiveFigure) if name.startswith("_send_")}
    assert sends == ours, f"plotly {plotly.__version__}: {sorted(sends ^ ours)}"
