import base64

from glassformer.experiments.report import fmt, save_figure, text_summary, write_html


def test_fmt():
    assert fmt(None) == fmt(float("nan")) == "—"
    assert fmt(46080) == "46,080" and fmt(12345.6) == "12,346"
    assert fmt(2.69612) == "2.7" and fmt(0.0123456) == "0.0123"
    assert fmt("mqa") == "mqa"


def test_html_is_self_contained(tmp_path):
    name = save_figure(tmp_path, "plot.png", lambda fig: fig.subplots().plot([1, 2], [3, 4]))
    summary = {"tables": [{"title": "T <1>", "columns": ["a", "b"], "rows": [["x", 1.5]],
                           "note": "n"}],
               "figures": [{"file": name, "caption": "c"}],
               "claims": [{"claim": "it holds", "held": False, "evidence": "e"}]}
    record = {"summary": summary, "settings": {"budget": 1},
              "machine": {"cpu": "cpu", "threads": 1, "cores": 2, "gpu": None, "torch": "x",
                          "load_average_5min": 0.5}}
    page = write_html(tmp_path, "Title", record).read_text(encoding="utf-8")
    inline = page.split("data:image/png;base64,")[1].split("'")[0]
    assert base64.b64decode(inline) == (tmp_path / "plot.png").read_bytes()
    assert "<h2>T &lt;1&gt;</h2>" in page and "<td>x</td><td>1.5</td>" in page
    assert "did not hold" in page and "src='http" not in page
    assert "[did not hold] it holds: e" in text_summary(summary)
    assert not list(tmp_path.glob("*.tmp"))  # written atomically, nothing left behind
