"""A plotly FigureWidget whose browser views always start from its *current* state.

A FigureWidget talks to the browser in two ways: its state (``_widget_data``,
``_widget_layout``), which ipywidgets keeps in step, and edit messages (restyle, relayout, ...)
that plotly sends once and forgets. A view draws from the state when it is created, then
follows the messages. plotly 7 refreshes that state only when the figure itself is displayed
(``_repr_mimebundle_``). A figure *inside* a VBox is never displayed itself, so its state stays
what it was at construction — and a view created after an edit message went by (the widget's
JavaScript still loading in JupyterLab, the notebook reopened, a second view of the output)
draws the construction-time figure: the player's memory bars all at zero, an empty chart
(plotly.py issue #4998). :class:`LiveFigure` mirrors every edit into the state as well, so a
late view starts where the kernel is.

The mirror copies only what an edit touched (data, layout or both) and ipywidgets sends a state
only when it differs, so following a trace stays cheap.
"""
from __future__ import annotations

from copy import deepcopy

import plotly.graph_objects as go


def _mirrored(message: str, data: bool, layout: bool):
    """An edit message plotly sends, followed by the same change to the state views start from."""
    def send(self, *args, **kwargs):
        getattr(super(LiveFigure, self), message)(*args, **kwargs)
        if data:
            self._widget_data = deepcopy(self._data)
        if layout:
            self._widget_layout = deepcopy(self._layout_obj._props)
    send.__name__ = message
    return send


class LiveFigure(go.FigureWidget):
    """``go.FigureWidget`` for figures nested in other widgets and edited after construction."""

    # every message plotly's BaseFigureWidget sends to the browser, and what it touches
    _send_restyle_msg = _mirrored("_send_restyle_msg", data=True, layout=False)
    _send_relayout_msg = _mirrored("_send_relayout_msg", data=False, layout=True)
    _send_update_msg = _mirrored("_send_update_msg", data=True, layout=True)
    _send_animate_msg = _mirrored("_send_animate_msg", data=True, layout=True)
    _send_addTraces_msg = _mirrored("_send_addTraces_msg", data=True, layout=False)
    _send_deleteTraces_msg = _mirrored("_send_deleteTraces_msg", data=True, layout=False)
    _send_moveTraces_msg = _mirrored("_send_moveTraces_msg", data=True, layout=False)
