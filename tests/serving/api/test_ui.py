"""`/ui`: its state matches the engine's own counters, and the page renders it in a headless
Chromium without console errors or any request beyond the server itself."""

import os

import httpx
import pytest
from conftest import serving

MODEL = "tiny"
CHROMIUM = "/usr/bin/chromium"
ARGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking",
        "--disable-component-update", "--disable-sync", "--no-first-run"]


@pytest.fixture(scope="module")
def used_server(language_model):
    """A server that has run requests sharing a long prefix (so blocks are cached and hit)."""
    with serving(language_model) as (url, app):
        with httpx.Client(base_url=url, timeout=30) as http:
            for tail in ("a", "b", "c"):
                body = {"model": MODEL, "prompt": "the cat sat on the mat and the dog ran " + tail,
                        "max_tokens": 20, "temperature": 0, "glassformer": {"ignore_eos": True}}
                assert http.post("/v1/completions", json=body).status_code == 200
        yield url, app.state.server.engine


def test_state_agrees_with_the_engine(used_server):
    url, engine = used_server
    state = httpx.get(f"{url}/ui/state").json()
    counts = {kind: sum(b["state"] == kind for b in state["blocks"]) for kind in ("free", "cached", "used")}
    pool = engine.blocks.stats()
    assert len(state["blocks"]) == engine.blocks.n_blocks
    assert counts["cached"] == pool.cached > 0 and counts["used"] == 0
    assert state["prefix_hit_tokens"] == pool.prefix_hit_tokens > 0
    assert state["finished"] == 3 and state["requests"] == []
    rows = [row for step in state["steps"] for row in step["rows"]]
    assert sum(row["kind"] == "decode" for row in rows) == 3 * 19  # every token after the first
    assert sum(row["tokens"] for row in rows if row["kind"] == "prefill") == sum(
        t.n_tokens for t in engine.trace) - 3 * 19


@pytest.mark.slow
def test_page_renders_in_chromium(used_server):
    sync_api = pytest.importorskip("playwright.sync_api", reason="the playwright package is not installed")
    if not os.access(CHROMIUM, os.X_OK):
        pytest.skip(f"no Chromium at {CHROMIUM}: run scripts/setup-browser.sh")
    url, engine = used_server
    with sync_api.sync_playwright() as p:
        browser = p.chromium.launch(executable_path=CHROMIUM, args=ARGS)
        try:
            page = browser.new_page()
            errors, requests = [], []
            page.on("console", lambda m: errors.append(m.text) if m.type == "error" else None)
            page.on("pageerror", lambda e: errors.append(str(e)))
            page.on("request", lambda r: requests.append(r.url))
            page.goto(f"{url}/ui")
            page.wait_for_selector("#timeline .step")
            assert page.locator("#blocks .block").count() == engine.blocks.n_blocks
            assert page.locator("#blocks .block.cached").count() == engine.blocks.stats().cached
            assert page.locator("#timeline .step").count() == len(engine.trace)
            assert page.locator("#timeline .row.prefill").count() > 0
            assert page.locator("#timeline .row.decode").count() == 3 * 19
            assert errors == []
            assert all(r.startswith(url) for r in requests), requests
        finally:
            browser.close()
