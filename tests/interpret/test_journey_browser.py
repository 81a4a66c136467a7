"""Open the journey report in a real headless Chromium (Debian's, driven by playwright)."""

import os
from pathlib import Path

import pytest
import torch

from glassformer import Transformer, get_preset
from glassformer.formats.tokenizers import CharTokenizer
from glassformer.interpret.journey import collect_journey, write_html

CHROMIUM = "/usr/bin/chromium"
ARGS = [
    "--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking",
    "--disable-component-update", "--disable-sync", "--no-first-run",
]
ARTIFACTS = Path(__file__).resolve().parents[2] / "artifacts"

pytestmark = pytest.mark.slow
sync_api = pytest.importorskip("playwright.sync_api", reason="the playwright package is not installed")
if not os.access(CHROMIUM, os.X_OK):
    pytest.skip(f"no Chromium at {CHROMIUM}: run scripts/setup-browser.sh", allow_module_level=True)


@pytest.fixture(scope="module")
def report(tmp_path_factory):
    torch.manual_seed(0)
    # the SmolLM2 grid: 30 layers × 9 heads
    config = get_preset("tiny-llama").replace(n_layers=30, n_heads=9, n_kv_heads=3, d_model=72)
    model = Transformer(config).eval()
    tokenizer = CharTokenizer("".join(chr(c) for c in range(32, 127)))
    data = collect_journey(model, tokenizer, "The cat sat on the", top_k=5, ig_steps=2)
    return write_html(data, tmp_path_factory.mktemp("journey") / "journey.html"), config


@pytest.fixture(scope="module")
def page(report):
    with sync_api.sync_playwright() as p:
        browser = p.chromium.launch(executable_path=CHROMIUM, args=ARGS)
        page = browser.new_page(viewport={"width": 1280, "height": 900})
        errors = []
        page.on("console", lambda m: errors.append(m.text) if m.type == "error" else None)
        page.on("pageerror", lambda e: errors.append(str(e)))
        requests = []
        page.on("request", lambda r: None if r.url.startswith(("file:", "data:")) else requests.append(r.url))
        page.goto(report[0].as_uri())
        page.wait_for_selector("#heatmap")
        yield page, errors, requests
        browser.close()


def test_renders_without_console_errors_or_network(page):
    page, errors, requests = page
    assert errors == []
    assert requests == []
    assert page.locator(".chip").count() == len("The cat sat on the")
    assert page.locator("#layer-steps .step").count() == 15  # every step of a pre-norm layer
    assert page.locator("#lens tr").count() == 1 + 1 + 30  # header, embedding, 30 layers


def test_one_heatmap_per_layer_and_head_on_request(page, report):
    page, errors, _ = page
    config = report[1]
    assert page.locator("canvas.heatmap-thumb").count() == 0  # nothing drawn before it is asked for
    page.click("#show-all")
    page.wait_for_selector("canvas.heatmap-thumb")
    thumbs = page.locator("canvas.heatmap-thumb")
    assert thumbs.count() == config.n_layers * config.n_heads
    pairs = {(t.get_attribute("data-layer"), t.get_attribute("data-head")) for t in thumbs.all()}
    assert len(pairs) == config.n_layers * config.n_heads
    thumbs.nth(2 * config.n_heads + 4).click()  # layer 2, head 4 opens in the layer view
    heatmap = page.locator("#heatmap")
    assert (heatmap.get_attribute("data-layer"), heatmap.get_attribute("data-head")) == ("2", "4")
    assert errors == []


def test_hover_shows_the_weight_and_a_screenshot_is_saved(page):
    page, errors, _ = page
    page.select_option("#layer-select", "1")
    heatmap = page.locator("#heatmap")
    box = heatmap.bounding_box()
    heatmap.hover(position={"x": box["width"] - 3, "y": box["height"] - 3})  # last query, last key
    tip = page.locator("#tooltip")
    assert tip.is_visible()
    assert "α = " in tip.inner_text() and "layer 1" in tip.inner_text()
    ARTIFACTS.mkdir(exist_ok=True)
    page.screenshot(path=str(ARTIFACTS / "journey.png"), full_page=False)
    assert (ARTIFACTS / "journey.png").stat().st_size > 10_000
    assert errors == []
