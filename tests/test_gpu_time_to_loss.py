"""benchmarks/gpu_time_to_loss.py and gpu_check.py's budget, on the CPU: a contender is stopped
at the target, at its cap or at its exit; nanoGPT's data is written as its prepare.py writes
it; a quick race reads the Glassformer recipes' own evaluation lines (nothing here is timed)."""

from __future__ import annotations

import pickle
import sys
import textwrap
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "benchmarks"))
import gpu_check  # noqa: E402
import gpu_time_to_loss as race  # noqa: E402

from glassformer.training.config import RECIPES  # noqa: E402

# What nanoGPT's train.py prints at its evaluations, then a pause past any test's cap.
FAKE_TRAIN = textwrap.dedent("""
    import pickle, sys, time
    meta = pickle.load(open("data/shakespeare_char/meta.pkl", "rb"))
    assert sys.argv[1] == "config/train_shakespeare_char.py" and meta["vocab_size"] > 2
    for step, loss in ((0, 4.28), (250, 1.98), (500, 1.45)):
        print(f"step {step}: train loss {loss - 0.1:.4f}, val loss {loss:.4f}", flush=True)
        time.sleep(0.05)
    time.sleep(60)
""")


def _script(tmp_path: Path, body: str) -> list[str]:
    path = tmp_path / "contender.py"
    path.write_text(textwrap.dedent(body))
    return [sys.executable, str(path)]


def test_a_contender_stops_at_the_target_with_every_evaluation_before_it(tmp_path):
    command = _script(tmp_path, """
        import time
        for step, loss in ((100, 2.5), (200, 1.6), (300, 1.46), (400, 1.40)):
            print(f"step {step}: val loss {loss} (perplexity 4.0)", flush=True)
        time.sleep(60)
    """)
    start = time.perf_counter()
    result = race.time_to_target(command, tmp_path, 1.47, 30, {})
    assert time.perf_counter() - start < 20  # stopped there, not at its cap
    assert result["reached"] and result["stopped"] == "target" and result["step_at_target"] == 300
    assert [e[:2] for e in result["evaluations"]] == [[100, 2.5], [200, 1.6], [300, 1.46]]
    assert result["seconds_to_target"] == result["evaluations"][-1][2] <= result["seconds_run"]


def test_a_contender_that_misses_is_stopped_at_its_cap_or_its_exit(tmp_path):
    slow = _script(tmp_path, """
        import time
        print("step 250: train loss 1.9, val loss 2.0", flush=True)
        time.sleep(60)
    """)
    capped = race.time_to_target(slow, tmp_path, 1.47, 1.5, {})
    assert capped["stopped"] == "cap" and not capped["reached"] and capped["seconds_to_target"] is None
    assert 1.5 <= capped["seconds_run"] < 20 and capped["evaluations"][0][:2] == [250, 2.0]
    failed = race.time_to_target([sys.executable, "-c", "raise SystemExit(3)"], tmp_path, 1.47, 30, {})
    assert failed["stopped"] == "exit 3" and failed["evaluations"] == []


def test_nanogpt_data_is_prepared_as_its_prepare_script_does(tmp_path):
    source = tmp_path / "nanoGPT"
    (source / "config").mkdir(parents=True)
    (source / "train.py").write_text("")
    text = tmp_path / "input.txt"
    text.write_text("hello world, the quick brown fox\n" * 10)
    copy = race.prepare_nanogpt(source, text, tmp_path / "work")
    data = copy / "data" / "shakespeare_char"
    meta = pickle.loads((data / "meta.pkl").read_bytes())
    chars = sorted(set(text.read_text()))
    assert meta["vocab_size"] == len(chars) and meta["itos"][0] == chars[0]
    ids = np.concatenate([np.fromfile(data / "train.bin", dtype=np.uint16),
                          np.fromfile(data / "val.bin", dtype=np.uint16)])
    assert "".join(meta["itos"][int(i)] for i in ids) == text.read_text()
    assert len(np.fromfile(data / "train.bin", dtype=np.uint16)) == int(len(ids) * 0.9)


def test_a_quick_race_reads_each_recipes_own_evaluations(tmp_path):
    nanogpt = tmp_path / "nanoGPT"
    (nanogpt / "config").mkdir(parents=True)
    (nanogpt / "config" / "train_shakespeare_char.py").write_text("")
    (nanogpt / "train.py").write_text(FAKE_TRAIN)
    (nanogpt / "configurator.py").write_text("")
    text = tmp_path / "input.txt"
    text.write_text("First Citizen: before we proceed any further, hear me speak.\n" * 100)
    record = race.race(tmp_path / "race", text, nanogpt, target=1.5, quick=True)
    anchor = record["contenders"]["nanoGPT compiled"]
    assert anchor["stopped"] == "target" and anchor["step_at_target"] == 500
    assert record["nanogpt_reached"]
    for preset in ("shakespeare-char-gpu", "shakespeare-char-gpu-fast"):
        result = record["contenders"][preset]
        # two steps from a random start: evaluations printed, the target far off
        assert [e[0] for e in result["evaluations"]] == [1, 2], result.get("tail")
        assert all(2.0 < e[1] < 6.0 for e in result["evaluations"]) and result["stopped"] == "exit 0"
        assert record["ratio_to_nanogpt"][preset] is None


def test_the_ratios_take_nanogpts_time_to_target_or_else_its_whole_run(tmp_path, monkeypatch):
    runs = {"train.py": {"reached": False, "seconds_to_target": None, "seconds_run": 130.0},
            "shakespeare-char-gpu": {"reached": True, "seconds_to_target": 100.0},
            "shakespeare-char-gpu-fast": {"reached": False, "seconds_to_target": None}}
    monkeypatch.setattr(race, "prepare_nanogpt", lambda source, text, folder: folder)
    monkeypatch.setattr(race, "time_to_target", lambda command, cwd, target, cap, env: dict(
        next(run for key, run in runs.items() if key in command)))
    nanogpt = tmp_path / "nanoGPT"
    nanogpt.mkdir()
    (nanogpt / "train.py").write_text("")
    record = race.race(tmp_path, tmp_path / "input.txt", nanogpt, 1.47, quick=False)
    assert not record["nanogpt_reached"]  # so 100 / 130 is an upper bound
    assert record["ratio_to_nanogpt"] == {"shakespeare-char-gpu": round(100 / 130, 3),
                                          "shakespeare-char-gpu-fast": None}
    runs["train.py"] = {"reached": True, "seconds_to_target": 120.0, "seconds_run": 120.0}
    record = race.race(tmp_path, tmp_path / "input.txt", nanogpt, 1.47, quick=False)
    assert record["nanogpt_reached"]
    assert record["ratio_to_nanogpt"]["shakespeare-char-gpu"] == round(100 / 120, 3)
    missing = race.race(tmp_path, tmp_path / "input.txt", tmp_path / "absent", 1.47, quick=False)
    assert str(tmp_path / "absent") in missing["contenders"]["nanoGPT compiled"]["error"]
    assert missing["ratio_to_nanogpt"] == {"shakespeare-char-gpu": None, "shakespeare-char-gpu-fast": None}


def test_the_gpu_check_fits_two_ten_minute_calls_and_races_the_gpu_recipes():
    """Its two calls (`--steps training`, and the rest) each fit a device command's 10 minutes,
    and both, with a minute or two to start the machine, a session's 15 minutes of device time."""
    budget = gpu_check.BUDGET
    rest = sum(seconds for step, seconds in budget.items() if step != "training")
    assert rest <= 10 * 60 and budget["model_folder"] + budget["training"] <= 10 * 60
    assert sum(budget.values()) + 2 * 60 <= 15 * 60
    assert gpu_check.BUDGET["training"] == sum(race.CAPS.values())
    assert {"shakespeare-char-gpu", "shakespeare-char-gpu-fast"} <= RECIPES.keys() & race.CAPS.keys()
    # the fast recipe's cap is the goal: half of what the anchor may take
    assert race.CAPS["shakespeare-char-gpu-fast"] <= race.CAPS["nanoGPT compiled"] / 2
