"""Headless Chromium for the browser tests (``test_browser.py``, ``test_site.py``).

The browser is Debian's ``/usr/bin/chromium`` driven by Playwright's Python client — never
``playwright install``, which downloads browsers of its own. ``make browser-deps`` installs both
(``make test`` depends on it). Without them the browser tests skip, saying what is missing,
unless ``MINISHARD_REQUIRE_BROWSER=1`` (set by ``.ci/run``): then a missing browser fails.
"""
from __future__ import annotations

import contextlib
import importlib.util
import os
import tempfile
from pathlib import Path

import pytest

CHROMIUM = "/usr/bin/chromium"
ROOT = Path(__file__).resolve().parents[1]
ARTIFACTS = ROOT / "artifacts" / "browser"        # screenshots (git-ignored)
ARGS = ["--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
        "--disable-background-networking", "--disable-component-update", "--disable-sync",
        "--disable-dev-shm-usage"]


def missing() -> str | None:
    """Why the browser tests cannot run here, or None."""
    if not os.access(CHROMIUM, os.X_OK):
        return f"{CHROMIUM} not found (run `make browser-deps`: apt-get install -y chromium)"
    if importlib.util.find_spec("playwright") is None:
        return "the playwright Python package is not installed (run `make browser-deps`)"
    return None


def require_browser() -> None:
    """Skip (or, under ``MINISHARD_REQUIRE_BROWSER=1``, fail) when the browser is missing."""
    reason = missing()
    if reason is None:
        return
    if os.environ.get("MINISHARD_REQUIRE_BROWSER") == "1":
        pytest.fail(f"MINISHARD_REQUIRE_BROWSER=1 but {reason}", pytrace=False)
    pytest.skip(reason)


@contextlib.contextmanager
def chromium(viewport=(1280, 900), offline: bool = False):
    """A fresh headless Chromium context (its own profile directory). ``offline=True`` aborts
    every request that is not a ``file://`` URL, so a page that needs the network shows it."""
    from playwright.sync_api import sync_playwright

    with tempfile.TemporaryDirectory(prefix="minishard-chromium-") as profile, \
            sync_playwright() as p:
        args = list(ARGS)
        if offline:     # no DNS either: a request that slips past the route below still fails
            args.append("--host-resolver-rules=MAP * ~NOTFOUND, EXCLUDE 127.0.0.1")
        ctx = p.chromium.launch_persistent_context(
            profile, executable_path=CHROMIUM, headless=True,
            viewport={"width": viewport[0], "height": viewport[1]}, args=args)
        ctx.blocked = []                                 # URLs the offline route refused
        if offline:
            def refuse(route):
                ctx.blocked.append(route.request.url)
                route.abort()
            ctx.route(lambda url: not url.startswith("file://"), refuse)
        try:
            yield ctx
        finally:
            ctx.close()


def screenshot_path(name: str) -> Path:
    ARTIFACTS.mkdir(parents=True, exist_ok=True)
    return ARTIFACTS / name
