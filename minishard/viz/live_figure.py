"""A plotly FigureWidget whose browser views always show its *current* state.

plotly's FigureWidget keeps a browser view up to date with one-shot edit messages (restyle,
relayout, ...). Two things went wrong with that in the course, both seen as blank or stale
players in JupyterLab:

* A view created after an edit went by — the widget's JavaScript still loading, a second view
  of the output, a reopened notebook — draws from the widget's state, and plotly refreshes that
  state only when the figure itself is displayed, never for a figure inside a VBox
  (plotly.py #4998): the player's memory bars stood at zero.
* anywidget holds a model's messages until the model's JavaScript module has loaded, and
  drops them, silently, if that takes more than 2 s. plotly's module is 5 MB, sent and
  evaluated once *per figure*: in headless Chromium on the course machine the first took 1.7 s
  and each further one about 1 s more, one after another. On a busy machine a player's three
  figures never received their traces or title.

:class:`LiveFigure` keeps plotly's Python API (``fig.data[0].y = ...``, ``batch_update``,
``layout.title.text = ...``) and changes the transport. Every edit is written into the
widget's state (``_widget_data``, ``_widget_layout``), which ipywidgets keeps in step and sends
only when it differs; the view (``live_figure.js``) draws that state and redraws it whenever it
changes. Its module is a few kilobytes, so the widget is ready at once; plotly.js itself travels
once per kernel in a :class:`PlotlyLibrary` widget and is evaluated once per page.
"""
from __future__ import annotations

from copy import deepcopy
from pathlib import Path

import ipywidgets as W
import plotly.graph_objects as go
import traitlets as T
from plotly.offline import get_plotlyjs, get_plotlyjs_version


class PlotlyLibrary(W.Widget):
    """plotly.js, sent to the browser once per kernel for every :class:`LiveFigure` to share.

    A plain widget model with no view: the browser keeps its state, and figures find it by
    reference (``LiveFigure._library``).
    """
    source = T.Unicode().tag(sync=True)
    version = T.Unicode().tag(sync=True)


_library: PlotlyLibrary | None = None


def plotly_library() -> PlotlyLibrary:
    """The kernel's :class:`PlotlyLibrary` (a new one if the last was closed)."""
    global _library
    if _library is None or _library.comm is None:
        _library = PlotlyLibrary(source=get_plotlyjs(), version=get_plotlyjs_version())
    return _library


def _into_state(data: bool, layout: bool):
    """Replaces one of plotly's edit messages: the edit goes into the state views draw from."""
    def edit(self, *args, **kwargs):
        if data:
            self._widget_data = deepcopy(self._data)
        if layout:
            self._widget_layout = deepcopy(self._layout_obj._props)
    return edit


class LiveFigure(go.FigureWidget):
    """``go.FigureWidget`` whose views draw its current state (see the module docstring)."""

    _esm = Path(__file__).with_name("live_figure.js")
    _library = T.Unicode().tag(sync=True)     # "IPY_MODEL_<id>" of the PlotlyLibrary

    @T.default("_library")
    def _shared_library(self) -> str:         # in the widget's first state, before any view
        return f"IPY_MODEL_{plotly_library().model_id}"

    # every edit message plotly's BaseFigureWidget sends, and what it touches
    _send_restyle_msg = _into_state(data=True, layout=False)
    _send_relayout_msg = _into_state(data=False, layout=True)
    _send_update_msg = _into_state(data=True, layout=True)
    _send_animate_msg = _into_state(data=True, layout=True)
    _send_addTraces_msg = _into_state(data=True, layout=False)
    _send_deleteTraces_msg = _into_state(data=True, layout=False)
    _send_moveTraces_msg = _into_state(data=True, layout=False)
