/* minishard's step-through player without a kernel (minishard/offline_player.py writes the data).
 *
 * The trace was folded in Python (minishard.trace.Replay) and worded there (minishard.playback):
 * every title, ring caption and timeline span arrives as a string. This script only sums the
 * ledger's per-event deltas from the nearest keyframe, looks up the units' states the same way,
 * and draws: stacked ledger bars per rank, the collective on the ring, the FSDP unit states, the
 * timeline with its cursor. No dependencies, no network.
 *
 *   MinishardReplay.mount(id, data)      data: the encoded replay, or gzip'ed JSON in base64
 *   MinishardReplay.players[k].show(i)   show the state after event i (what the buttons call)
 */
(function () {
  "use strict";
  const VERSION = 1;
  if (window.MinishardReplay && window.MinishardReplay.version >= VERSION) return;
  const SVGNS = "http://www.w3.org/2000/svg";
  const KEY = 256;                       // a keyframe of the ledger and units every KEY events
  const MiB = 1048576;                    // memory in binary units, as everywhere in the course
  const SPEEDS = [1, 3, 10, 30, 60, 100, 300, 1000];
  const STYLE = `
.msr{font:13px/1.4 -apple-system,"Segoe UI",Roboto,"Noto Sans",sans-serif;color:#1f2328;max-width:1000px;outline:none}
.msr-head{font-weight:600;font-size:14px;margin:4px 0}
.msr-problems{background:#fff8c5;border:1px solid #d4a72c;border-radius:6px;padding:6px 10px;margin:6px 0;white-space:pre-wrap}
.msr-controls{display:flex;flex-wrap:wrap;gap:6px;align-items:center;margin:6px 0}
.msr-controls button,.msr-controls select{font:inherit;padding:2px 8px}
.msr-controls input[type=range]{flex:1 1 260px;min-width:160px}
.msr-title{font-size:13px;margin:4px 0;min-height:1.4em;font-variant-numeric:tabular-nums}
.msr-row{display:flex;flex-wrap:wrap;gap:12px;align-items:flex-start}
.msr-panel{flex:1 1 360px;max-width:560px}
.msr-panel svg{width:100%;height:auto;display:block}
.msr-ringtitle{font-size:12px;min-height:2.8em}
.msr-legend{display:flex;flex-wrap:wrap;gap:4px 10px;font-size:12px}
.msr-legend i{display:inline-block;width:10px;height:10px;margin-right:4px;vertical-align:-1px}
.msr-units{border-collapse:collapse;margin:8px 0;font-size:12px}
.msr-units th,.msr-units td{padding:2px 6px;border:1px solid #e5e5e5;white-space:nowrap}
.msr-timeline{position:relative;margin-top:8px}
.msr-timeline canvas{display:block;cursor:pointer}
.msr-cursor{position:absolute;top:0;width:0;border-left:1.5px dotted #000;pointer-events:none}
.msr-hover{font-size:12px;color:#57606a;min-height:1.4em}
.msr-plan{border-collapse:collapse;font-size:11px;margin:8px 0}
.msr-plan td,.msr-plan th{border:1px solid #e5e5e5;padding:2px 5px;text-align:right}
`;

  function el(tag, attrs, parent, text) {
    const e = document.createElement(tag);
    for (const k in attrs || {}) e.setAttribute(k, attrs[k]);
    if (text !== undefined) e.textContent = text;
    if (parent) parent.appendChild(e);
    return e;
  }
  function sv(tag, attrs, parent, text) {
    const e = document.createElementNS(SVGNS, tag);
    for (const k in attrs || {}) e.setAttribute(k, attrs[k]);
    if (text !== undefined) e.textContent = text;
    if (parent) parent.appendChild(e);
    return e;
  }
  function niceStep(span, count) {
    const raw = span / Math.max(count, 1), mag = Math.pow(10, Math.floor(Math.log10(raw || 1)));
    for (const m of [1, 2, 2.5, 5, 10]) if (raw <= m * mag) return m * mag;
    return 10 * mag;
  }
  async function inflate(b64) {
    if (typeof DecompressionStream === "undefined")
      throw new Error("this browser cannot decompress the trace (no DecompressionStream): use a recent Chrome, Firefox or Safari");
    const bytes = Uint8Array.from(atob(b64), c => c.charCodeAt(0));
    const stream = new Blob([bytes]).stream().pipeThrough(new DecompressionStream("gzip"));
    return JSON.parse(await new Response(stream).text());
  }

  // ------------------------------------------------------------------ the fold, decoded
  class Fold {
    constructor(d) {
      this.d = d;
      this.n = d.n; this.R = d.ranks.length; this.C = d.cats.length; this.U = d.units.length;
      this.t = new Float64Array(this.n);           // seconds, as in the trace
      let acc = 0;
      for (let i = 0; i < this.n; i++) { acc += d.t[i]; this.t[i] = d.t0 + acc / d.ticks; }
      this.ledger = this.changes(d.ledger, true);
      this.unitChanges = this.changes(d.unit_changes, false);
      this.keyLedger = this.keyframes(this.ledger, this.R * this.C, Float64Array);
      this.keyUnits = this.keyframes(this.unitChanges, this.R * this.U, Int16Array);
    }
    changes(flat, ledger) {                        // [Δevent, rank, column, value] quadruples
      const m = flat.length / 4, ev = new Int32Array(m), cell = new Int32Array(m);
      const val = ledger ? new Float64Array(m) : new Int16Array(m), width = ledger ? this.C : this.U;
      let at = 0;
      for (let j = 0; j < m; j++) {
        at += flat[4 * j]; ev[j] = at;
        cell[j] = flat[4 * j + 1] * width + flat[4 * j + 2]; val[j] = flat[4 * j + 3];
      }
      return {m, ev, cell, val, add: ledger};
    }
    keyframes(ch, size, Kind) {                   // the state before event k*KEY, and where its changes start
      const count = Math.ceil(this.n / KEY), state = new Kind(size);
      const frames = new Kind(count * size), start = new Int32Array(count);
      let p = 0;
      for (let k = 0; k < count; k++) {
        while (p < ch.m && ch.ev[p] < k * KEY) { this.apply(ch, p, state); p++; }
        frames.set(state, k * size); start[k] = p;
      }
      return {frames, start, size};
    }
    apply(ch, p, state) {
      if (ch.add) state[ch.cell[p]] += ch.val[p]; else state[ch.cell[p]] = ch.val[p];
    }
    at(ch, key, i, out) {                          // the state after event i
      const k = Math.floor(i / KEY);
      out.set(key.frames.subarray(k * key.size, (k + 1) * key.size));
      for (let p = key.start[k]; p < ch.m && ch.ev[p] <= i; p++) this.apply(ch, p, out);
      return out;
    }
    ledgerAt(i, out) { return this.at(this.ledger, this.keyLedger, i, out || new Float64Array(this.R * this.C)); }
    unitsAt(i, out) { return this.at(this.unitChanges, this.keyUnits, i, out || new Int16Array(this.R * this.U)); }
    title(i) {
      const S = this.d.S;
      return [S[this.d.step[i]], S[this.d.phase[i]], S[this.d.what[i]], `event ${i}/${this.n - 1}`]
        .filter(p => p).join(" · ");
    }
    ring(i) {                                      // {N, title, sends: [[src, dst, name]], ring, frac}
      const d = this.d, c = d.coll[i];
      if (c < 0) return {N: d.world, title: d.S[d.ring_idle], sends: [], ring: true, frac: 0, key: "idle"};
      const N = d.colls[3 * c], sched = d.schedules[d.colls[3 * c + 1]], first = d.colls[3 * c + 2];
      if (!sched.sends.length) return {N, title: d.S[d.coll_titles[first]], sends: [], ring: true, frac: 0, key: "c" + c};
      const k = d.round[i];
      return {N, title: d.S[d.coll_titles[first + k]], sends: sched.sends[k], ring: sched.ring,
              frac: d.frac[i] / 1000, key: `c${c}r${k}f${d.frac[i]}`};
    }
    firstAtOrAfter(t) {                            // the first event at time >= t
      let lo = 0, hi = this.n - 1;
      while (lo < hi) { const mid = (lo + hi) >> 1; if (this.t[mid] < t) lo = mid + 1; else hi = mid; }
      return lo;
    }
  }

  // ------------------------------------------------------------------ the ring's geometry
  // In ring radii, as minishard.playback reckons it (RING_NODE, RING_CLEAR, LABEL_SIDES,
  // LABEL_REACH there): a rank is a disc of RING_NODE; a chunk stays RING_CLEAR from the
  // centres of the ranks at either end of its link and puts its label on the side farthest from
  // every rank, so that neither covers a rank's label.
  const RING_NODE = 0.19, RING_CLEAR = 0.34, LABEL_REACH = 0.2;
  const LABEL_SIDES = [[0, 1], [1, 1], [1, 0], [1, -1], [0, -1], [-1, -1], [-1, 0], [-1, 1]];
  const angle = (r, N) => Math.PI / 2 - 2 * Math.PI * r / N;     // rank 0 at the top, clockwise
  const point = (r, N) => [Math.cos(angle(r, N)), Math.sin(angle(r, N))];
  function ringPoint(src, dst, N, along, f) {                     // the link, end to end
    if (along) return point(src + f, N);
    const [x0, y0] = point(src, N), [x1, y1] = point(dst, N);
    return [x0 + f * (x1 - x0), y0 + f * (y1 - y0)];
  }
  function chunkXY(src, dst, N, along, frac) {                    // playback.chunk_xy
    if (along) {
      const lo = Math.min(2 * Math.asin(Math.min(RING_CLEAR / 2, 1)) / (2 * Math.PI / N), 0.5);
      return point(src + lo + frac * (1 - 2 * lo), N);
    }
    const [x0, y0] = point(src, N), [x1, y1] = point(dst, N);
    const lo = Math.min(RING_CLEAR / Math.max(Math.hypot(x1 - x0, y1 - y0), 1e-12), 0.5), f = lo + frac * (1 - 2 * lo);
    return [x0 + f * (x1 - x0), y0 + f * (y1 - y0)];
  }
  function labelSide(x, y, N) {                                    // playback.label_side
    let best = -1, side = LABEL_SIDES[0];
    for (const [dx, dy] of LABEL_SIDES) {
      const norm = LABEL_REACH / Math.hypot(dx, dy), lx = x + dx * norm, ly = y + dy * norm;
      let room = Infinity;
      for (let r = 0; r < N; r++) { const [nx, ny] = point(r, N); room = Math.min(room, Math.hypot(lx - nx, ly - ny)); }
      if (room > best + 1e-6) { best = room; side = [dx, dy]; }
    }
    return side;
  }

  // ------------------------------------------------------------------ the player
  class Player {
    constructor(root, d) {
      if (d.format !== VERSION)
        throw new Error(`this replay is format ${d.format}; this script reads format ${VERSION} (re-run minishard view)`);
      this.root = root; this.d = d; this.fold = new Fold(d); this.n = d.n;
      this.index = -1; this.playing = false; this.speed = 30;
      this.row = new Float64Array(this.fold.R * this.fold.C);
      this.states = new Int16Array(this.fold.R * this.fold.U);
      root.classList.add("msr"); root.tabIndex = 0;
      if (d.title) el("div", {class: "msr-head"}, root, d.title);
      if (d.problems.length) el("div", {class: "msr-problems", role: "alert"}, root, d.problems.join("\n"));
      this.buildControls();
      this.titleEl = el("div", {class: "msr-title"}, root);
      const row = el("div", {class: "msr-row"}, root);
      this.buildBars(el("div", {class: "msr-panel msr-memory"}, row));
      this.buildRing(el("div", {class: "msr-panel msr-ring"}, row));
      if (this.fold.U) this.buildUnits(el("div", {class: "msr-unitpanel"}, root));
      this.buildTimeline(el("div", {class: "msr-timewrap"}, root));
      if (d.plan) this.buildPlan(el("div", {class: "msr-planpanel"}, root), d.plan);
      root.addEventListener("keydown", e => this.key(e));
      this.show(d.start || 0);
    }

    // ---- controls
    buildControls() {
      const bar = el("div", {class: "msr-controls"}, this.root);
      this.playBtn = el("button", {type: "button", class: "msr-play"}, bar, "▶ play");
      this.playBtn.onclick = () => this.toggle();
      const speed = el("select", {class: "msr-speed", title: "events per second"}, bar);
      for (const s of SPEEDS) el("option", {value: s}, speed, `${s}/s`);
      speed.value = String(this.speed);
      speed.onchange = () => { this.speed = +speed.value; };
      this.slider = el("input", {type: "range", min: 0, max: this.n - 1, step: 1, value: 0, class: "msr-slider",
                                 "aria-label": "event"}, bar);
      this.slider.oninput = () => this.show(+this.slider.value);
      el("button", {type: "button", class: "msr-back"}, bar, "◀ step").onclick = () => this.step(-1);
      el("button", {type: "button", class: "msr-forward"}, bar, "step ▶").onclick = () => this.step(1);
      this.menu(bar, "msr-jump-phase", "jump to phase", this.d.jump_phase);
      this.menu(bar, "msr-jump-collective", "jump to collective", this.d.jump_traffic);
    }
    menu(bar, cls, label, targets) {
      const names = Object.keys(targets);
      if (!names.length) return;
      const sel = el("select", {class: cls, "aria-label": label}, bar);
      el("option", {value: ""}, sel, label);
      for (const name of names) el("option", {value: name}, sel, name);
      sel.onchange = () => { if (sel.value) this.jumpNext(targets[sel.value]); sel.value = ""; };
    }
    jumpNext(hits) {                               // the next one after the current event, wrapping round
      if (!hits.length) return;
      const next = hits.find(i => i > this.index);
      this.show(next === undefined ? hits[0] : next);
    }
    step(k) { this.stop(); this.show(Math.min(Math.max(this.index + k, 0), this.n - 1)); }
    key(e) {
      const moves = {ArrowRight: 1, ArrowLeft: -1, PageDown: 100, PageUp: -100};
      const tag = e.target.tagName;                // menus, the slider and buttons keep their own keys
      if (tag === "SELECT" || (tag === "INPUT" && e.key !== " ") || (tag === "BUTTON" && e.key === " ")) return;
      if (e.key in moves) this.step(e.shiftKey ? 10 * moves[e.key] : moves[e.key]);
      else if (e.key === "Home") this.step(-this.n);
      else if (e.key === "End") this.step(this.n);
      else if (e.key === " ") this.toggle();
      else return;
      e.preventDefault();
    }
    toggle() { this.playing ? this.stop() : this.play(); }
    play() {
      if (this.index >= this.n - 1) this.show(0);
      this.playing = true; this.playBtn.textContent = "❚❚ pause";
      const run = this.run = (this.run || 0) + 1;    // a stop then a play in one frame: one loop
      let last = null, owed = 0;
      const frame = now => {
        if (!this.playing || run !== this.run) return;
        if (last !== null) owed += (now - last) / 1000 * this.speed;
        last = now;
        const k = Math.floor(owed);
        if (k > 0) { owed -= k; this.show(Math.min(this.index + k, this.n - 1)); }
        if (this.index >= this.n - 1) this.stop(); else requestAnimationFrame(frame);
      };
      requestAnimationFrame(frame);
    }
    stop() { this.playing = false; this.playBtn.textContent = "▶ play"; }

    // ---- memory: stacked bars per rank
    buildBars(panel) {
      const d = this.d, W = 560, H = 380, m = {l: 56, r: 10, t: 12, b: 30};
      const svg = sv("svg", {viewBox: `0 0 ${W} ${H}`, class: "msr-bars", role: "img"}, panel);
      const top = 1.05 * (d.ymax || MiB) / MiB, plotH = H - m.t - m.b, plotW = W - m.l - m.r;
      this.yOf = mb => m.t + plotH * (1 - mb / top);
      const step = niceStep(top, 6);
      for (let v = 0; v <= top + 1e-9; v += step) {
        const y = this.yOf(v);
        sv("line", {x1: m.l, x2: W - m.r, y1: y, y2: y, stroke: "#eee"}, svg);
        sv("text", {x: m.l - 6, y: y + 4, "text-anchor": "end", "font-size": 11, fill: "#555"}, svg,
           +v.toPrecision(6) + "");
      }
      sv("text", {x: 14, y: m.t + plotH / 2, transform: `rotate(-90 14 ${m.t + plotH / 2})`, "text-anchor": "middle",
                  "font-size": 12, fill: "#333"}, svg, "MiB");
      const band = plotW / this.fold.R;
      this.rects = [];
      d.ranks.forEach((r, a) => {
        const x = m.l + a * band + band * 0.15;
        sv("text", {x: x + band * 0.35, y: H - 10, "text-anchor": "middle", "font-size": 12}, svg, `rank ${r}`);
        d.cats.forEach((c, b) => {
          const rect = sv("rect", {x, width: band * 0.7, y: this.yOf(0), height: 0, fill: this.color(c),
                                   "data-rank": r, "data-cat": c, "data-bytes": 0}, svg);
          rect.tip = sv("title", {}, rect, "");
          rect.shown = [-1, -1];
          this.rects[a * this.fold.C + b] = rect;
        });
      });
      const legend = el("div", {class: "msr-legend"}, panel);
      for (const c of [...d.cats].reverse())
        el("i", {style: `background:${this.color(c)}`}, el("span", {}, legend, "")).after(c);
    }
    color(name) { return this.d.colors[name] || this.d.color_default; }
    drawBars(i) {
      const row = this.fold.ledgerAt(i, this.row), C = this.fold.C;
      for (let a = 0; a < this.fold.R; a++) {
        let below = 0;
        for (let b = 0; b < C; b++) {
          const bytes = row[a * C + b], rect = this.rects[a * C + b];
          const y0 = this.yOf(below / MiB), y1 = this.yOf((below + bytes) / MiB);
          below += bytes;
          if (rect.shown[0] !== y1 || rect.shown[1] !== bytes) {
            rect.setAttribute("y", Math.min(y0, y1)); rect.setAttribute("height", Math.abs(y0 - y1));
            rect.setAttribute("data-bytes", bytes);
            rect.tip.textContent = `rank ${this.d.ranks[a]} ${this.d.cats[b]}: ${(bytes / MiB).toFixed(3)} MiB (${bytes.toLocaleString("en")} bytes)`;
            rect.shown = [y1, bytes];
          }
        }
      }
    }

    // ---- the ring
    buildRing(panel) {
      this.ringTitle = el("div", {class: "msr-ringtitle"}, panel);
      this.ringSvg = sv("svg", {viewBox: "0 0 430 360", class: "msr-ringsvg", role: "img"}, panel);
      this.ringR = 130; this.ringC = [215, 185];
      sv("circle", {cx: 215, cy: 185, r: this.ringR, fill: "none", stroke: "#ddd"}, this.ringSvg);
      this.sendLayer = sv("g", {class: "msr-sends"}, this.ringSvg);
      this.nodeLayer = sv("g", {class: "msr-nodes"}, this.ringSvg);
      this.chunkLayer = sv("g", {class: "msr-chunks"}, this.ringSvg);
      this.ringN = 0; this.ringKey = null;
    }
    xy(p) { return [this.ringC[0] + this.ringR * p[0], this.ringC[1] - this.ringR * p[1]]; }
    drawRing(i) {
      const v = this.fold.ring(i);
      if (v.key === this.ringKey && v.N === this.ringN) return;   // e.g. stepping through allocs
      this.ringKey = v.key;
      this.ringTitle.textContent = "";
      v.title.split("<br>").forEach((line, k) => {
        if (k) el("br", {}, this.ringTitle);
        this.ringTitle.appendChild(document.createTextNode(line));
      });
      this.ringTitle.dataset.title = v.title;
      if (v.N !== this.ringN) {
        this.nodeLayer.textContent = ""; this.ringN = v.N;
        for (let r = 0; r < v.N; r++) {
          const [x, y] = this.xy([Math.cos(angle(r, v.N)), Math.sin(angle(r, v.N))]);
          sv("circle", {cx: x, cy: y, r: RING_NODE * this.ringR, fill: "#4C78A8"}, this.nodeLayer);
          sv("text", {x, y: y + 4, "text-anchor": "middle", "font-size": 11, fill: "white"}, this.nodeLayer, `rank ${r}`);
        }
      }
      this.sendLayer.textContent = ""; this.chunkLayer.textContent = "";
      for (const [src, dst, name] of v.sends) {
        const pts = [];
        for (let j = 0; j <= 16; j++) pts.push(this.xy(ringPoint(src, dst, v.N, v.ring, j / 16)).map(z => z.toFixed(1)).join(","));
        sv("polyline", {points: pts.join(" "), fill: "none", stroke: "#E45756", "stroke-width": 3}, this.sendLayer);
        const at = chunkXY(src, dst, v.N, v.ring, v.frac), [x, y] = this.xy(at), [sx, sy] = labelSide(at[0], at[1], v.N);
        const g = sv("g", {class: "msr-chunk", "data-x": at.join(",")}, this.chunkLayer);
        sv("rect", {x: x - 7, y: y - 7, width: 14, height: 14, fill: "#F58518"}, g);
        sv("text", {x: x + 10 * sx, y: y - (sy > 0 ? 11 : sy < 0 ? -19 : -4), "font-size": 11,
                    "text-anchor": sx > 0 ? "start" : sx < 0 ? "end" : "middle"}, g, this.d.S[name]);
      }
    }

    // ---- FSDP units
    buildUnits(panel) {
      const d = this.d, table = el("table", {class: "msr-units"}, panel), head = el("tr", {}, table);
      el("th", {}, head, "unit states");
      for (const u of d.units) el("th", {}, head, u);
      this.cells = [];
      d.ranks.forEach((r, a) => {
        const tr = el("tr", {"data-rank": r}, table);
        el("th", {}, tr, `rank ${r}`);
        d.units.forEach((u, b) => { const td = el("td", {"data-unit": u}, tr, ""); td.shown = -1; this.cells[a * this.fold.U + b] = td; });
      });
    }
    drawUnits(i) {
      const st = this.fold.unitsAt(i, this.states), names = this.d.unit_states;
      for (let j = 0; j < st.length; j++) {
        const td = this.cells[j];
        if (td.shown !== st[j]) {
          td.textContent = names[st[j]]; td.style.background = this.d.unit_colors[names[st[j]]] || "#f4f4f4"; td.shown = st[j];
        }
      }
    }

    // ---- the timeline
    buildTimeline(panel) {
      const d = this.d, f = this.fold, lanes = d.lanes.length;
      this.spans = [];
      for (let j = 0; j < d.spans.length; j += 5)
        this.spans.push({lane: d.spans[j], name: d.span_names[d.spans[j + 1]],
                         t0: d.t0 + d.spans[j + 2] / d.ticks, t1: d.t0 + d.spans[j + 3] / d.ticks, about: d.S[d.spans[j + 4]]});
      let lo = f.t[0], hi = f.t[f.n - 1];
      for (const s of this.spans) { lo = Math.min(lo, s.t0); hi = Math.max(hi, s.t1); }
      this.whole = [lo, hi > lo ? hi : lo + 1e-3];
      this.tl = {lo: this.whole[0], hi: this.whole[1], left: 118, laneH: 18, top: 4, axis: 26, lanes};
      const zoom = el("select", {class: "msr-zoom", "aria-label": "timeline range"}, panel);
      el("option", {value: "step"}, zoom, "timeline: the current step");
      el("option", {value: "whole"}, zoom, "timeline: the whole trace");
      this.windows = d.step_windows || {};
      this.zoom = Object.keys(this.windows).length ? "step" : "whole";
      zoom.value = this.zoom;
      zoom.onchange = () => { this.zoom = zoom.value; this.frameTimeline(this.index, true); };
      const legend = el("div", {class: "msr-legend"}, panel);
      for (const name of d.span_names) el("i", {style: `background:${this.color(name)}`}, el("span", {}, legend, "")).after(name);
      const box = el("div", {class: "msr-timeline"}, panel);
      this.canvas = el("canvas", {}, box);
      this.cursor = el("div", {class: "msr-cursor"}, box);
      this.hover = el("div", {class: "msr-hover"}, panel, "");
      this.canvas.addEventListener("click", e => { this.stop(); this.show(f.firstAtOrAfter(this.timeAt(e))); });
      this.canvas.addEventListener("mousemove", e => { this.hover.textContent = this.spanAt(e); });
      this.drawTimeline();
      if (window.ResizeObserver) new ResizeObserver(() => this.drawTimeline()).observe(this.root);
    }
    frameTimeline(i, force) {                      // the range shown: the whole trace, or i's step
      const w = this.zoom === "step" && this.windows[this.d.step[i]];
      const [lo, hi] = w ? [this.d.t0 + w[0] / this.d.ticks, this.d.t0 + w[1] / this.d.ticks] : this.whole;
      if (force || lo !== this.tl.lo || hi !== this.tl.hi) {
        this.tl.lo = lo; this.tl.hi = hi > lo ? hi : lo + 1e-3; this.drawTimeline(true);
      }
    }
    drawTimeline(force) {
      const tl = this.tl, width = Math.max(420, Math.min(1000, this.root.clientWidth || 1000));
      if (width === tl.width && !force) return;
      const height = tl.top + tl.lanes * tl.laneH + tl.axis, dpr = window.devicePixelRatio || 1;
      tl.width = width; tl.plotW = width - tl.left - 10;
      Object.assign(this.canvas, {width: width * dpr, height: height * dpr});
      Object.assign(this.canvas.style, {width: width + "px", height: height + "px"});
      this.cursor.style.height = (tl.top + tl.lanes * tl.laneH) + "px";
      const g = this.canvas.getContext("2d");
      g.setTransform(dpr, 0, 0, dpr, 0, 0);
      g.clearRect(0, 0, width, height);
      g.font = "11px sans-serif"; g.textBaseline = "middle";
      this.d.lanes.forEach((name, k) => {
        const y = tl.top + k * tl.laneH;
        g.fillStyle = k % 2 ? "#fafafa" : "#f3f3f3"; g.fillRect(tl.left, y, tl.plotW, tl.laneH);
        g.fillStyle = "#333"; g.textAlign = "right"; g.fillText(name, tl.left - 6, y + tl.laneH / 2);
      });
      g.save(); g.beginPath(); g.rect(tl.left, 0, tl.plotW, height); g.clip();
      for (const s of this.spans) {
        if (s.t1 < tl.lo || s.t0 > tl.hi) continue;
        const x0 = this.xOf(s.t0), x1 = this.xOf(s.t1);
        g.globalAlpha = 0.8; g.fillStyle = this.color(s.name);
        g.fillRect(x0, tl.top + s.lane * tl.laneH + 2, Math.max(x1 - x0, 1), tl.laneH - 4);
      }
      g.restore(); g.globalAlpha = 1; g.fillStyle = "#333"; g.textAlign = "center";
      const ms = (tl.hi - tl.lo) * 1e3, step = niceStep(ms, 8), base = tl.top + tl.lanes * tl.laneH;
      for (let v = Math.ceil(tl.lo * 1e3 / step) * step; v <= tl.hi * 1e3; v += step) {
        const x = this.xOf(v / 1e3);
        g.fillRect(x, base, 1, 4); g.fillText(+v.toPrecision(6) + "", x, base + 11);
      }
      g.fillText("time (ms)", tl.left + tl.plotW / 2, base + 22);
      if (this.index >= 0) this.drawCursor(this.index);
    }
    xOf(t) { const tl = this.tl; return tl.left + (t - tl.lo) / (tl.hi - tl.lo) * tl.plotW; }
    timeAt(e) {
      const tl = this.tl, x = e.clientX - this.canvas.getBoundingClientRect().left;
      return tl.lo + (x - tl.left) / tl.plotW * (tl.hi - tl.lo);
    }
    spanAt(e) {
      const tl = this.tl, t = this.timeAt(e);
      const lane = Math.floor((e.clientY - this.canvas.getBoundingClientRect().top - tl.top) / tl.laneH);
      const hit = this.spans.find(s => s.lane === lane && s.t0 <= t && t <= s.t1);
      return hit ? hit.about : "";
    }
    drawCursor(i) {
      const x = this.xOf(this.fold.t[i]), tl = this.tl;
      this.cursor.style.left = x.toFixed(1) + "px";
      this.cursor.style.display = x < tl.left - 1 || x > tl.left + tl.plotW + 1 ? "none" : "";
    }

    // ---- a checkpoint's read plan (chapter 09)
    buildPlan(panel, plan) {
      el("div", {class: "msr-head"}, panel, plan.title);
      const table = el("table", {class: "msr-plan"}, panel), head = el("tr", {}, table);
      el("th", {}, head, "new rank \\ saved rank");
      plan.matrix[0].forEach((_, j) => el("th", {}, head, `${j}`));
      el("th", {}, head, "read (MiB)");
      const top = Math.max(1, ...plan.matrix.flat());
      plan.matrix.forEach((row, r) => {
        const tr = el("tr", {}, table);
        el("th", {}, tr, `${r}`);
        for (const b of row)
          el("td", {style: `background:rgba(76,120,168,${(0.85 * b / top).toFixed(3)})`, "data-bytes": b}, tr,
             b ? (b / MiB).toFixed(2) : "");
        el("td", {}, tr, (plan.read[r] / MiB).toFixed(2));
      });
    }

    // ---- one event
    show(i) {
      i = Math.min(Math.max(Math.round(i), 0), this.n - 1);
      this.index = i;
      this.drawBars(i);
      this.drawRing(i);
      if (this.fold.U) this.drawUnits(i);
      this.frameTimeline(i, false);
      this.drawCursor(i);
      this.titleEl.textContent = this.fold.title(i);
      if (+this.slider.value !== i) this.slider.value = i;
      this.root.dataset.event = i;
    }
  }

  function mount(id, payload) {
    let note = document.currentScript;
    while (note && note.id !== id) note = note.previousElementSibling;
    note = note || document.getElementById(id);
    const anchor = note || document.currentScript;
    if (!anchor) throw new Error(`minishard replay: no element #${id} to draw the player at`);
    const root = document.createElement("div");
    root.className = "minishard-replay";
    anchor.parentNode.insertBefore(root, anchor);
    if (!document.getElementById("minishard-replay-style")) {
      const style = el("style", {id: "minishard-replay-style"}, document.head || document.documentElement, STYLE);
      style.textContent = STYLE;
    }
    const start = d => {
      if (note) note.remove();
      const player = new Player(root, d);
      window.MinishardReplay.players.push(player);
      return player;
    };
    const fail = e => { root.textContent = "minishard replay: " + e.message; root.className += " msr-failed"; };
    if (typeof payload !== "string") { try { return start(payload); } catch (e) { fail(e); throw e; } }
    return inflate(payload).then(start).catch(fail);
  }

  window.MinishardReplay = {version: VERSION, mount, players: [], Fold};
})();
