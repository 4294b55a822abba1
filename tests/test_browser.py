"""The course in a real browser: JupyterLab, headless Chromium, the notebooks as a reader runs them.

nbval proves that every cell computes what it claims; this proves that what a reader *sees*
works: that the widgets' front ends load, that the player draws, and that its buttons answer.

* A **tour** notebook is run in the browser ("Run All Cells", a real kernel, real ranks): every
  kind of widget the chapters build, from a small real run — a player fed live while 2 ranks
  train (chapter 00), a 4-rank player stopped inside a bucket's all-reduce, its offline player
  (``replay_html``, chapter 02), a kernel-free ``static_player_figure`` (chapter 00), the
  ledger calculator (chapter 01) and a ``PlayerPair`` (chapters 02 and 06). Then, in the page:
  the plotly charts exist and none is drawn empty; clicking a player's "step ▶" button changes
  its memory bars; stepping through the all-reduce advances the ring animation; the offline
  player steps; the static player's slider moves its figure; the calculator answers its
  dropdown. (The chapters 00–02 themselves were run here once; they build these same widgets
  from larger runs, which nbval executes anyway: the tour proves the same front ends in a fifth
  of the time.)
* Chapters are **opened** with their stored outputs: every stored plotly output renders as a
  chart, and a static player's slider moves its figure — in Lab for chapter 00 (its static
  player) and chapter 05 (the most charts); every chapter's stored figures are drawn from the
  same JSON by the same plotly.js on the static site (``tests/test_site.py``), so Lab's
  renderer is the one part these add, and two chapters prove it.

Lab runs on 127.0.0.1, port 0, with a token, in its own process group, runtime, settings and
workspace directories, on a *copy* of the notebooks (Lab must not autosave kernel output over
the committed files). Screenshots go to ``artifacts/browser/`` (git-ignored); the screenshot of
each chapter's player is the thing to look at when this test fails.
"""
from __future__ import annotations

import json
import os
import re
import secrets
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import nbformat
import pytest

from headless import ROOT, chromium, require_browser, screenshot_path

NOTEBOOKS = sorted((ROOT / "notebooks").glob("[0-9][0-9]-*.ipynb"))
RUN_TIMEOUT_S = 240                                # the tour runs in ~15 s; a hang must not eat the CI budget
STEP = "step ▶"

# Lab settings for a test run: no autosave, every cell in the DOM (no windowing), no news.
SETTINGS = {
    "@jupyterlab/docmanager-extension/plugin": {"autosave": False},
    "@jupyterlab/notebook-extension/tracker": {"windowingMode": "none", "autoStartDefaultKernel": True},
    "@jupyterlab/apputils-extension/notification": {"checkForUpdates": False, "fetchNews": "false"},
}


# ------------------------------------------------------------------ JupyterLab
class Lab:
    def __init__(self, root: Path, tmp: Path):
        self.root, self.token = root, secrets.token_hex(16)
        runtime, settings, workspaces = (tmp / d for d in ("runtime", "settings", "workspaces"))
        for d in (runtime, settings, workspaces):
            d.mkdir()
        for plugin, values in SETTINGS.items():
            f = settings / f"{plugin}.jupyterlab-settings"
            f.parent.mkdir(parents=True, exist_ok=True)
            f.write_text(json.dumps(values))
        env = dict(os.environ, JUPYTER_RUNTIME_DIR=str(runtime), JUPYTERLAB_SETTINGS_DIR=str(settings),
                   JUPYTERLAB_WORKSPACES_DIR=str(workspaces), PYTHONUNBUFFERED="1")
        self.log = (tmp / "lab.log").open("w")
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "jupyterlab", "--no-browser", "--allow-root",
             "--ServerApp.ip=127.0.0.1", "--ServerApp.port=0",
             f"--IdentityProvider.token={self.token}", f"--ServerApp.root_dir={root}"],
            env=env, stdout=self.log, stderr=subprocess.STDOUT, start_new_session=True)
        deadline = time.monotonic() + 120
        while True:
            info = sorted(runtime.glob("jpserver-*.json"))
            if info:
                self.port = json.loads(info[0].read_text())["port"]
                break
            if self.proc.poll() is not None or time.monotonic() > deadline:
                self.stop()
                raise RuntimeError(f"JupyterLab did not start:\n{(tmp / 'lab.log').read_text()[-3000:]}")
            time.sleep(0.2)

    def url(self, name: str) -> str:
        """The notebook in a workspace of its own, reset: Lab must not reopen earlier tabs."""
        ws = Path(name).stem
        return f"http://127.0.0.1:{self.port}/lab/workspaces/{ws}/tree/{name}?reset&token={self.token}"

    def shutdown_kernels(self) -> None:
        """End every session (and its kernel: ranks, pools) so the next chapter starts clean."""
        import urllib.request

        def call(method, path):
            req = urllib.request.Request(f"http://127.0.0.1:{self.port}{path}", method=method,
                                         headers={"Authorization": f"token {self.token}"})
            with urllib.request.urlopen(req, timeout=60) as r:
                return json.loads(r.read() or b"null")

        for session in call("GET", "/api/sessions"):
            call("DELETE", f"/api/sessions/{session['id']}")

    def stop(self) -> None:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(15)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait(5)
        self.log.close()


@pytest.fixture(scope="module")
def lab(tmp_path_factory):
    require_browser()
    tmp = tmp_path_factory.mktemp("lab")
    root = tmp / "course"
    (root / "notebooks").mkdir(parents=True)
    for nb in NOTEBOOKS:
        shutil.copy(nb, root / "notebooks" / nb.name)
    server = Lab(root, tmp)
    yield server
    server.stop()


@pytest.fixture(scope="module")
def browser(lab):
    with chromium(viewport=(1400, 1000)) as ctx:
        yield ctx


# ------------------------------------------------------------------ what the page shows
# What a plotly chart in the page shows: its title, and the values plotly.js is drawing (the
# graph div's own data: exact, where SVG paths hide a change smaller than a pixel).
SIGNATURE_JS = """el => {
    const title = (el.querySelector('.gtitle') || {}).textContent || '';
    const traces = el.data || [];
    const bars = JSON.stringify(traces.filter(t => t.type === 'bar').map(t => Array.from(t.y || [])));
    const marks = JSON.stringify(traces.filter(t => t.type !== 'bar')
        .map(t => [Array.from(t.x || []), Array.from(t.y || [])]));
    return {title, bars, marks};
}"""


def signature(plot) -> dict:
    return plot.evaluate(SIGNATURE_JS)


def open_notebook(page, lab: Lab, name: str) -> None:
    """Open a notebook and wait until its kernel is up and idle (the status bar says so)."""
    page.goto(lab.url(f"notebooks/{name}"))
    page.wait_for_selector(".jp-NotebookPanel .jp-Cell", state="visible", timeout=180_000)
    page.wait_for_function(
        """() => [...document.querySelectorAll('.jp-StatusBar-TextItem')]
                 .some(e => /\\|\\s*Idle/.test(e.textContent))""", timeout=180_000, polling=250)


def run_all(page) -> float:
    """Run All Cells from the menu; wait until no cell is pending. Returns the seconds taken."""
    t0 = time.monotonic()
    page.get_by_role("menuitem", name="Run", exact=True).click()
    page.locator("li[data-command='runmenu:run-all']").click()
    page.wait_for_function(
        """() => {
            const prompts = [...document.querySelectorAll('.jp-CodeCell .jp-InputPrompt')]
                .map(p => p.textContent.trim());
            const errors = document.querySelectorAll(
                '.jp-OutputArea-output[data-mime-type="application/vnd.jupyter.error"]').length;
            // a failed cell ends Run All (the cells after it may keep their '*')
            return errors > 0 || (prompts.length > 0 && !prompts.some(p => p.includes('*'))
                && /\\d/.test(prompts[prompts.length - 1]));
        }""", timeout=RUN_TIMEOUT_S * 1000, polling=1000)
    wait_idle(page)
    return time.monotonic() - t0


def wait_idle(page, timeout_s: float = 180) -> None:
    page.wait_for_function(
        """() => [...document.querySelectorAll('.jp-StatusBar-TextItem')]
                 .some(e => /\\|\\s*Idle/.test(e.textContent))""", timeout=timeout_s * 1000, polling=250)


def errors_on(page) -> list[str]:
    return page.locator(
        ".jp-OutputArea-output[data-mime-type='application/vnd.jupyter.error']").all_inner_texts()


def players(page):
    """The step-through players on the page: (the widget, its memory figure, its ring figure)."""
    out = []
    for button in page.locator(".jp-OutputArea button.widget-button", has_text=STEP).all():
        box = button.locator("xpath=ancestor::div[contains(@class,'widget-vbox')][1]")
        plots = box.locator(".js-plotly-plot")
        out.append((box, plots.nth(0), plots.nth(1)))
    return out


def step_until_changed(box, plot, part: str, clicks: int = 40) -> tuple[dict, dict, int]:
    """Click "step ▶" until ``part`` ("bars" or "marks") of ``plot`` changes. After each click,
    wait for the memory figure's title ("… event i/n") to move: the kernel has answered."""
    button = box.locator("button", has_text=STEP)
    memory = box.locator(".js-plotly-plot").first
    before = signature(plot)
    shown = signature(memory)["title"]
    misses = 0
    for k in range(1, clicks + 1):
        button.click(timeout=30_000)
        if re.search(r"event (\d+)/\1$", shown):
            break                  # the player stands at the last event: nothing to step to
        try:
            memory.page.wait_for_function(f"([el, old]) => ({SIGNATURE_JS})(el).title !== old",
                                          arg=[memory.element_handle(), shown], timeout=60_000,
                                          polling=100)
        except Exception:          # a busy machine: the kernel has not answered yet, click again
            misses += 1
            if misses >= 3:
                break
            continue
        shown = signature(memory)["title"]
        now = signature(plot)
        if now[part] != before[part]:
            return before, now, k
    return before, signature(plot), k


def move_static_slider(page, figure_index: int | None = None):
    """Click a kernel-free animation slider's rail; return (figure, before, after).

    A click lands on the step nearest it, which may be the frame already shown (the slider opens
    at the first step's peak, wherever that falls): try a few places along the rail until the
    title moves. The click goes through the rail's locator, so Playwright scrolls it into view and
    checks that the rail itself receives it (Lab may still be laying out outputs above)."""
    sliders = page.locator(".js-plotly-plot:has(.slider-container)")
    assert sliders.count(), "no static player figure (plotly frames + slider) on the page"
    fig = sliders.nth(figure_index or 0)
    fig.scroll_into_view_if_needed()
    before = signature(fig)
    rail = fig.locator(".slider-rail-touch-rect").first
    for at in (0.9, 0.6, 0.3, 0.05):
        box = rail.bounding_box()
        rail.click(position={"x": box["width"] * at, "y": box["height"] / 2}, timeout=30_000)
        try:
            page.wait_for_function(f"([el, old]) => ({SIGNATURE_JS})(el).title !== old",
                                   arg=[fig.element_handle(), before["title"]], timeout=10_000)
            break
        except Exception:
            print(f"static player: a click at {at:.0%} of the rail left {before['title']!r}")
    return fig, before, signature(fig)


def stored_plotly_outputs(nb_path: Path) -> int:
    nb = nbformat.read(nb_path, as_version=4)
    return sum("application/vnd.plotly.v1+json" in o.get("data", {})
               for c in nb.cells if c.cell_type == "code" for o in c.outputs)


# ------------------------------------------------------------------ the tests
# Every kind of widget the chapters build, from small real runs on warm ranks.
TOUR = [
    '''from IPython.display import display
from minishard import Ranks
from minishard.training.loop import TrainConfig, train
from minishard.viz import (LedgerCalculator, Player, PlayerPair, replay_html,
                           static_player_figure)
R2, R4 = Ranks(2), Ranks(4)''',
    # chapter 00: a player that fills up while the ranks train
    '''live = Player(title="live: 2 ranks, DDP, nano model, 2 steps")
display(live.widget)
R2.run(train, TrainConfig(strategy="ddp", steps=2, model="nano"), on_event=live.feed)
live.flush()
two = R2.last_events''',
    # chapter 02: a 4-rank player stopped inside a bucket's all-reduce, on the ring
    '''R4.run(train, TrainConfig(strategy="ddp", steps=2, model="nano", bucket_cap_mb=0.25))
p4 = Player(R4.last_events, title="DDP, 4 ranks: one bucket's all-reduce on the ring")
p4.jump(next(i for i, e in enumerate(p4.replay.events)
             if e["kind"] == "collective" and e["op"] == "all_reduce" and e.get("step") == 1))
display(p4.widget)                           # (the ring's round follows the events' times)''',
    '''replay_html(p4.replay, title="DDP, 4 ranks (offline player)", start=p4.index)''',
    '''static_player_figure(two, max_frames=60).show()''',
    # chapter 01: the ledger calculator
    '''calc = LedgerCalculator(model="llama3-8b", world_size=8, strategy="ddp", device_gb=80)
calc.widget''',
    # chapters 02 and 06: two runs side by side under one slider
    '''pair = PlayerPair(two, two, titles=("left", "right"))
display(pair.widget)
R2.close(); R4.close()''',
]


def test_every_kind_of_widget_runs_in_the_browser_and_answers(lab, browser):
    nb = nbformat.v4.new_notebook(cells=[nbformat.v4.new_code_cell(c) for c in TOUR])
    nb.metadata["kernelspec"] = {"name": "python3", "display_name": "Python 3", "language": "python"}
    nbformat.write(nb, lab.root / "notebooks" / "tour.ipynb")
    page = browser.new_page()
    try:
        open_notebook(page, lab, "tour.ipynb")
        seconds = run_all(page)
        print(f"the tour ran in the browser in {seconds:.0f} s")
        page.screenshot(path=screenshot_path("tour-top.png"))
        assert not errors_on(page), "a cell failed in the browser:\n" + "\n".join(errors_on(page))
        assert page.locator(".jp-OutputArea .js-plotly-plot").count() >= 2, "no plotly chart rendered"
        assert page.locator(".jp-OutputArea .js-plotly-plot .bars, .jp-OutputArea .js-plotly-plot .trace").count()

        found = players(page)
        assert len(found) >= 3, f"{len(found)} player widgets ('{STEP}' buttons) in the outputs, not 3"
        responded, empty = [], []
        for i, (box, memory, ring) in enumerate(found):
            box.scroll_into_view_if_needed()
            if signature(memory)["bars"] in ("[]", "[[]]") or not signature(memory)["title"]:
                # the figure never got its state: what plotly's own FigureWidget did on a busy
                # machine (see minishard/viz/live_figure.py); LiveFigure must never
                empty.append(i)
                box.screenshot(path=screenshot_path(f"tour-player{i}-EMPTY.png"))
                print(f"player {i}: its memory figure is EMPTY in the browser")
                continue
            before, after, clicks = step_until_changed(box, memory, "bars", clicks=40)
            if after["bars"] == before["bars"]:
                print(f"player {i}: bars unchanged after {clicks} click(s) at {after['title']!r}")
            else:
                responded.append(i)
                print(f"player {i}: memory bars changed after {clicks} click(s): "
                      f"{before['title']!r} -> {after['title']!r}")
                box.screenshot(path=screenshot_path(f"tour-player{i}.png"))
        assert responded, f"clicking '{STEP}' never changed a player's memory bars"
        assert not empty, (f"the memory figure of player(s) {empty} is drawn empty in the browser "
                           f"although the kernel's figure has bars — see artifacts/browser/tour-player*-EMPTY.png")

        # the 4-rank player stands inside a bucket's all-reduce: step through its rounds (the
        # other players have 2 ranks: its bars, one per rank, say which)
        box, memory, ring = next(p for p in found if len(json.loads(signature(p[1])["bars"])[0]) == 4)
        box.scroll_into_view_if_needed()
        before, after, clicks = step_until_changed(box, ring, "marks", clicks=60)
        print(f"ring: {before['title']!r} -> {after['title']!r} after {clicks} click(s)")
        assert after["marks"] != before["marks"], "the collective animation did not advance"
        assert "all_reduce" in before["title"] + after["title"]
        box.screenshot(path=screenshot_path("tour-ring.png"))
        # the offline player next to it (replay_html): its output's script ran in Lab too
        replay = page.locator(".jp-OutputArea .msr").first
        replay.scroll_into_view_if_needed(timeout=30_000)
        at = int(replay.get_attribute("data-event"))
        assert "all_reduce" in replay.locator(".msr-ringtitle").inner_text()   # it opens there
        replay.locator(".msr-forward").click()
        assert int(replay.get_attribute("data-event")) == at + 1
        replay.screenshot(path=screenshot_path("tour-offline-player.png"))

        fig, before, after = move_static_slider(page)
        print(f"static player: {before['title']!r} -> {after['title']!r}")
        assert after["bars"] != before["bars"]
        fig.screenshot(path=screenshot_path("tour-static-player.png"))

        box = page.locator(".jp-OutputArea .widget-vbox").filter(
            has=page.locator(".widget-dropdown:has(label:text-is('model'))")).filter(
            has=page.locator(".js-plotly-plot")).last
        box.scroll_into_view_if_needed()
        calc = box.locator(".js-plotly-plot").first
        before = signature(calc)
        model = box.locator(".widget-dropdown:has(label:text-is('model')) select")
        model.select_option("gpt2-small")                 # the calculator answers the browser
        page.wait_for_function(f"([el, old]) => ({SIGNATURE_JS})(el).bars !== old",
                               arg=[calc.element_handle(), before["bars"]], timeout=30_000)
        print(f"calculator: {before['title']!r} -> {signature(calc)['title']!r}")
        box.screenshot(path=screenshot_path("tour-calculator.png"))
    finally:
        page.close()
        lab.shutdown_kernels()


STORED_IN_LAB = ("00", "05")     # a static player; the most stored charts


@pytest.mark.parametrize("nb", [p for p in NOTEBOOKS if p.name[:2] in STORED_IN_LAB], ids=lambda p: p.stem)
def test_chapter_stored_outputs_render(lab, browser, nb):
    want = stored_plotly_outputs(nb)
    page = browser.new_page()
    try:
        open_notebook(page, lab, nb.name)
        plots = page.locator(".jp-OutputArea .js-plotly-plot")
        if want:
            page.wait_for_function(
                "n => document.querySelectorAll('.jp-OutputArea .js-plotly-plot .main-svg').length >= n",
                arg=want, timeout=120_000)
        page.screenshot(path=screenshot_path(f"{nb.stem}-top.png"))
        assert plots.count() >= want, f"{nb.name}: {plots.count()} of {want} stored charts rendered"
        if page.locator(".js-plotly-plot:has(.slider-container)").count():
            fig, before, after = move_static_slider(page)
            assert after["bars"] != before["bars"] or after["marks"] != before["marks"]
            fig.screenshot(path=screenshot_path(f"{nb.stem}-static-player.png"))
        print(f"{nb.name}: {plots.count()} stored charts rendered")
    finally:
        page.close()
        lab.shutdown_kernels()


# Eight LiveFigures edited before their views exist, while they are being created, and after;
# then a second view of one of them. Every view must show the figure's last state.
LIVE_FIGURES = [
    '''import ipywidgets as W, numpy as np, plotly.graph_objects as go
from IPython.display import display
from minishard.viz.live_figure import LiveFigure
figs = [LiveFigure(go.Figure(go.Bar(y=np.zeros(3, dtype=np.float32)),
                             layout=dict(title=f"figure {k} at construction", width=300, height=240)))
        for k in range(8)]
for k, f in enumerate(figs):
    f.data[0].y = np.arange(3, dtype=np.float32) + k
display(W.VBox([W.HBox(figs[:4]), W.HBox(figs[4:])]))
for k, f in enumerate(figs):
    f.layout.title.text = f"figure {k} final"''',
    '''figs[0].add_trace(go.Scatter(y=[3, 1, 2], name="late"))
display(figs[1])''',
]


# A slow machine: evaluating plotly.js takes 3 s more than it does (besides the 4x slower CPU).
# The first view waits for it while the kernel goes on editing the figures; every view must
# still end at the figures' last state.
SLOW_PLOTLY_JS = """
window.Function = new Proxy(window.Function, { construct(target, args) {
    if (String(args[args.length - 1]).length > 1e6) {
        const t0 = performance.now();
        while (performance.now() - t0 < 3000) {}
    }
    return Reflect.construct(target, args);
}});"""


def test_live_figures_draw_their_latest_state(lab, browser):
    """The transport of :class:`minishard.viz.live_figure.LiveFigure`, on a page whose CPU is
    slowed 4× and whose plotly.js takes 3 s more to evaluate: views draw the latest state,
    whenever they are created; plotly.js is evaluated once for the page, not once per figure."""
    nb = nbformat.v4.new_notebook(cells=[nbformat.v4.new_code_cell(c) for c in LIVE_FIGURES])
    nb.metadata["kernelspec"] = {"name": "python3", "display_name": "Python 3", "language": "python"}
    nbformat.write(nb, lab.root / "notebooks" / "live-figures.ipynb")
    page = browser.new_page()
    page.add_init_script(SLOW_PLOTLY_JS)
    try:
        open_notebook(page, lab, "live-figures.ipynb")
        page.context.new_cdp_session(page).send("Emulation.setCPUThrottlingRate", {"rate": 4})
        run_all(page)
        assert not errors_on(page), "\n".join(errors_on(page))
        plots = page.locator(".jp-OutputArea .js-plotly-plot")
        page.wait_for_function(
            "() => [...document.querySelectorAll('.jp-OutputArea .js-plotly-plot')]"
            ".filter(el => / final$/.test((el.querySelector('.gtitle') || {}).textContent)).length >= 9",
            timeout=120_000, polling=500)
        page.screenshot(path=screenshot_path("live-figures.png"))
        shown = [signature(plots.nth(i)) for i in range(plots.count())]
        assert len(shown) == 9
        for k, sig in enumerate(shown[:8]):
            assert sig["title"] == f"figure {k} final"
            assert json.loads(sig["bars"]) == [[k, k + 1, k + 2]]
        assert json.loads(shown[0]["marks"]) == [[[], [3, 1, 2]]]          # the trace added late
        assert shown[8] == shown[1]                                          # the second view
        assert page.evaluate("globalThis[Symbol.for('minishard.plotly')].size") == 1
    finally:
        page.close()
        lab.shutdown_kernels()


def test_a_missing_browser_is_a_clear_skip(monkeypatch):
    import headless

    monkeypatch.setattr(headless, "CHROMIUM", "/nonexistent/chromium")
    monkeypatch.delenv("MINISHARD_REQUIRE_BROWSER", raising=False)
    with pytest.raises(pytest.skip.Exception, match="chromium not found.*make browser-deps"):
        headless.require_browser()
    monkeypatch.setenv("MINISHARD_REQUIRE_BROWSER", "1")     # CI: the same is a failure
    with pytest.raises(pytest.fail.Exception, match="MINISHARD_REQUIRE_BROWSER=1"):
        headless.require_browser()
