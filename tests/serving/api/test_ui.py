"""`/ui`: its state matches the engine's own counters; a request opened with the ui flag shows
the logit lens and the attention weights of the lens API and run_with_cache on the same tokens;
and the page renders both in a headless Chromium without console errors or any request beyond
the server itself."""

import colorsys
import io
import json
import os

import httpx
import pytest
import torch
from conftest import serving

from glassformer.interpret.lens import logit_lens
from glassformer.interpret.trace import run_with_cache

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
    pool = engine.blocks
    assert len(state["blocks"]) == engine.blocks.n_blocks
    assert counts["cached"] == pool.cached > 0 and counts["used"] == 0
    assert state["prefix_hit_tokens"] == pool.hit_tokens > 0
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
            assert page.locator("#blocks .block.cached").count() == engine.blocks.cached
            assert page.locator("#timeline .step").count() == len(engine.trace)
            assert page.locator("#timeline .row.prefill").count() > 0
            assert page.locator("#timeline .row.decode").count() == 3 * 19
            assert errors == []
            assert all(r.startswith(url) for r in requests), requests
        finally:
            browser.close()


WATCHED = {"model": MODEL, "prompt": "a cat and a dog", "max_tokens": 12, "temperature": 0,
           "glassformer": {"ignore_eos": True, "ui": True}}


def _read(language_model, answer_text: str, prompt: str) -> list[int]:
    """The tokens the model read: the prompt and every generated token but the last."""
    return language_model.encode(prompt) + language_model.tokenizer.encode(answer_text)[:-1]


@pytest.fixture(scope="module")
def watching(language_model):
    with serving(language_model) as (url, _):
        yield url


def test_watched_request_shows_the_lens_and_the_attention_of_its_tokens(watching, language_model):
    url = watching
    with httpx.Client(base_url=url, timeout=30) as http:
        plain = http.post("/v1/completions", json={**WATCHED, "glassformer": {"ignore_eos": True}}).json()
        answer = http.post("/v1/completions", json=WATCHED).json()
        listed = http.get("/ui/requests").json()["requests"]
        assert len(listed) == 1 and listed[0]["generated"] == 12 and listed[0]["status"] == "max_new_tokens"
        view = http.get(f"/ui/requests/{listed[0]['id']}", params={"layer": 1, "head": 2}).json()
        assert http.get(f"/ui/requests/{listed[0]['id']}", params={"layer": 9}).status_code == 400
        assert http.get("/ui/requests/nobody").status_code == 404
    assert "glassformer" not in answer and answer["choices"][0]["text"] == plain["choices"][0]["text"]
    read = _read(language_model, answer["choices"][0]["text"], WATCHED["prompt"])
    ids = torch.tensor([read])
    lens = logit_lens(language_model.model, ids, top_k=1)
    positions = [c["position"] for c in view["columns"]]
    assert positions == list(range(len(read)))
    assert [c["ids"] for c in view["columns"]] == lens.ids[:, 0, :, 0].T.tolist()
    torch.testing.assert_close(torch.tensor([c["probs"] for c in view["columns"]]), lens.probs[:, 0, :, 0].T,
                               atol=1e-5, rtol=1e-5)
    _, cache = run_with_cache(language_model.model, ids, ["blocks.1.attn.pattern"])
    attention = view["attention"]
    assert attention["query"] == len(read) - 1 and len(attention["tokens"]) == len(read)
    torch.testing.assert_close(torch.tensor(attention["weights"]), cache["blocks.1.attn.pattern"][0, 2, -1],
                               atol=1e-5, rtol=1e-5)
    assert view["steer"] == [] and view["params"]["glassformer"]["ui"] is True


def _color(p: float) -> tuple[int, int, int]:
    """The page's heat colour for probability p: hsl(215, 70%, 95 - 55p %)."""
    r, g, b = colorsys.hls_to_rgb(215 / 360, round(95 - 55 * p, 1) / 100, 0.7)
    return round(255 * r), round(255 * g), round(255 * b)


@pytest.mark.slow
def test_live_page_draws_a_streamed_request(watching, language_model):
    sync_api = pytest.importorskip("playwright.sync_api", reason="the playwright package is not installed")
    image = pytest.importorskip("PIL.Image", reason="Pillow reads the screenshot")
    if not os.access(CHROMIUM, os.X_OK):
        pytest.skip(f"no Chromium at {CHROMIUM}: run scripts/setup-browser.sh")
    url = watching
    body = {**WATCHED, "prompt": "the dog ran", "max_tokens": 20, "stream": True}
    with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=30) as reply:
        chunks = [json.loads(line[6:]) for line in reply.iter_lines() if line.startswith("data: {")]
    text = "".join(c["choices"][0]["text"] for c in chunks)
    request_id = next(r["id"] for r in httpx.get(f"{url}/ui/requests").json()["requests"]
                      if r["prompt"] == "the dog ran")
    read = _read(language_model, text, "the dog ran")
    lens = logit_lens(language_model.model, torch.tensor([read]), top_k=1)
    with sync_api.sync_playwright() as p:
        browser = p.chromium.launch(executable_path=CHROMIUM, args=ARGS)
        try:
            page = browser.new_page(viewport={"width": 1400, "height": 1000})
            errors, requests = [], []
            page.on("console", lambda m: errors.append(m.text) if m.type == "error" else None)
            page.on("pageerror", lambda e: errors.append(str(e)))
            page.on("request", lambda r: requests.append(r.url))
            page.goto(f"{url}/ui")
            page.wait_for_selector(f"#watch option[value='{request_id}']", state="attached", timeout=10_000)
            page.select_option("#watch", request_id)
            page.wait_for_selector("#lens[data-cells]", state="attached", timeout=10_000)
            page.select_option("#layer", "1")
            page.select_option("#head", "3")
            title = "document.getElementById('attention-title').textContent"
            page.wait_for_function(f"{title}.includes('head 3')", timeout=10_000)
            cells = json.loads(page.get_attribute("#lens", "data-cells"))
            weights = json.loads(page.get_attribute("#attention", "data-weights"))
            shot = image.open(io.BytesIO(page.locator("#lens").screenshot())).convert("RGB")
            full = page.screenshot(full_page=True)
            assert page.locator("#steer li").all_text_contents() == ["none"]
            assert '"ui": true' in page.text_content("#params")
            assert text in page.text_content("#generated")
            assert errors == []
            assert all(r.startswith(url) for r in requests), requests
        finally:
            browser.close()
    assert len(full) > 0
    sites = len(lens.sites)
    assert len(cells) == sites * len(read)  # every position of a short request, every layer
    for x, y, position, site, token, prob in cells:
        assert token == lens.ids[site, 0, position, 0].item()
        assert abs(prob - lens.probs[site, 0, position, 0].item()) < 1e-5
        drawn = shot.getpixel((x + 1, y + 1))
        assert max(abs(a - b) for a, b in zip(drawn, _color(prob), strict=True)) <= 2, (drawn, prob)
    white = sum(pixel == (255, 255, 255) for pixel in shot.get_flattened_data())
    assert white < 0.5 * shot.width * shot.height  # mostly drawn cells
    _, cache = run_with_cache(language_model.model, torch.tensor([read]), ["blocks.1.attn.pattern"])
    torch.testing.assert_close(torch.tensor(weights), cache["blocks.1.attn.pattern"][0, 3, -1],
                               atol=1e-5, rtol=1e-5)
