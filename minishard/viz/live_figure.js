// The browser side of minishard.viz.LiveFigure (an anywidget module).
//
// Two rules keep every view right:
//   1. A view draws the figure's *state* (_widget_data, _widget_layout) and redraws whenever the
//      state changes. The kernel keeps the state current; no edit message can be missed.
//   2. This module is tiny, so the widget is ready at once. plotly.js (4.8 MB) arrives once per
//      kernel in a separate PlotlyLibrary widget and is evaluated once per page, when the first
//      view draws. (anywidget holds a model's messages until its module is loaded and drops them
//      if that takes over 2 s; plotly's own widget module is 5 MB, evaluated once per figure,
//      1.7 s for the first in headless Chromium here: a busy machine lost whole figures.)

const LOADED = Symbol.for("minishard.plotly");     // page-wide: plotly.js version -> Promise

async function plotly(model) {
  const ref = model.get("_library") || "";
  const library = await model.widget_manager.get_model(ref.replace(/^IPY_MODEL_/, ""));
  const version = library.get("version");
  const cache = (globalThis[LOADED] ??= new Map());
  if (!cache.has(version)) {
    const loading = Promise.resolve().then(() => evaluate(library.get("source")));
    loading.catch(() => cache.delete(version));      // a later view may try again
    cache.set(version, loading);
  }
  return cache.get(version);
}

function evaluate(source) {
  // plotly.min.js is a UMD bundle: given `module`, it exports there. It also sets window.Plotly,
  // which the page (another renderer, another version) may own: put back what was there.
  const before = Object.getOwnPropertyDescriptor(window, "Plotly");
  const module = { exports: {} };
  try {
    new Function("module", "exports", source)(module, module.exports);
  } finally {
    if (before) Object.defineProperty(window, "Plotly", before);
    else delete window.Plotly;
  }
  return module.exports;
}

// plotly's kernel side sends 1-D numeric numpy arrays as {buffer, dtype, shape} and
// plotly's Undefined as "_undefined_": turn them back into what plotly.js takes.
const ARRAYS = {
  int8: Int8Array, int16: Int16Array, int32: Int32Array, uint8: Uint8Array,
  uint16: Uint16Array, uint32: Uint32Array, float32: Float32Array, float64: Float64Array,
};

function revive(v) {
  if (Array.isArray(v)) return v.map(revive);
  if (v && typeof v === "object") {
    if (ArrayBuffer.isView(v.buffer) && ARRAYS[v.dtype]) {     // ipywidgets gives a DataView
      const b = v.buffer;
      return new ARRAYS[v.dtype](b.buffer.slice(b.byteOffset, b.byteOffset + b.byteLength));
    }
    const out = {};
    for (const [k, x] of Object.entries(v)) if (x !== "_undefined_") out[k] = revive(x);
    return out;
  }
  return v;
}

async function render({ model, el }) {
  let Plotly;
  try {
    Plotly = await plotly(model);
  } catch (error) {
    el.textContent = `minishard: could not load plotly.js for this figure (${error})`;
    throw error;
  }
  const draw = () => {
    const layout = revive(model.get("_widget_layout"));
    layout.height ??= 360;                  // plotly's widget default
    layout.uirevision ??= "minishard";      // a redraw keeps the reader's zoom and pan
    return Plotly.react(el, revive(model.get("_widget_data")), layout,
                        { ...model.get("_config"), responsive: true });
  };
  // state changes arrive one trait at a time: coalesce them into one redraw per frame
  let queued = false;
  const redraw = () => {
    if (queued) return;
    queued = true;
    requestAnimationFrame(() => { queued = false; draw(); });
  };
  model.on("change:_widget_data", redraw);
  model.on("change:_widget_layout", redraw);
  await draw();
  // drawn before the output was attached (width 0)? size it once it has a width
  const sized = new ResizeObserver(() => {
    if (el.clientWidth > 0) { sized.disconnect(); Plotly.Plots.resize(el); }
  });
  if (!el.clientWidth) sized.observe(el);
  return () => { sized.disconnect(); Plotly.purge(el); };
}

export default { render };
