import os
import subprocess
import sys
import time

import pytest
import torch

from glassformer.accel import kernels, threads
from glassformer.cli import build_parser, main


@pytest.fixture(autouse=True)
def _restore_threads(monkeypatch):
    before = torch.get_num_threads()
    for name in threads.ENVIRONMENT:
        monkeypatch.delenv(name, raising=False)
    yield
    torch.set_num_threads(before)


def test_asked_then_environment_then_none(monkeypatch):
    assert threads.requested_threads() is None
    monkeypatch.setenv("OMP_NUM_THREADS", "3")
    assert threads.requested_threads() == 3
    monkeypatch.setenv("GLASSFORMER_THREADS", "2")
    assert threads.requested_threads() == 2 and threads.requested_threads(5) == 5
    monkeypatch.setenv("GLASSFORMER_THREADS", "two")
    with pytest.raises(ValueError, match="GLASSFORMER_THREADS: must be a positive integer"):
        threads.requested_threads()


def test_free_cores_is_the_others_busy_time_taken_from_the_cores():
    # (seconds busy on the cores by anyone, seconds this process ran, wall time)
    assert threads.free_cores((0, 0, 0), (1.0, 0.0, 1.0), 2) == pytest.approx(1.0)
    assert threads.free_cores((0, 0, 0), (1.9, 1.9, 1.0), 2) == pytest.approx(2.0)  # all ours
    assert threads.free_cores((0, 0, 0), (2.0, 1.0, 1.0), 2) == pytest.approx(1.0)
    assert threads.free_cores((0, 0, 0), (6.0, 0.0, 1.0), 2) == 0.0


@pytest.mark.parametrize(("free", "expected"), [
    (2.0, 2), (1.8, 2), (1.5, 1), (1.0, 1), (0.0, 1), (4.0, 4), (3.6, 3)])
def test_one_thread_per_free_core(free, expected):
    assert threads.choose_threads(free, 4 if free > 2 else 2) == expected


def test_a_number_asked_for_is_kept(monkeypatch):
    monkeypatch.setattr(threads, "snapshot", lambda cores: pytest.fail("no sampling"))
    policy = threads.ThreadPolicy(1)
    assert policy.threads == torch.get_num_threads() == 1
    assert policy.revisit() == 1


def test_the_choice_follows_other_work_as_it_comes_and_goes(monkeypatch):
    cores = len(threads.allowed_cores())
    snapshots = iter([(0.0, 0.0, 0.0), (0.0, 0.0, 0.2),  # quiet at the start
                      (0.1 + (cores - 1) * 10, 0.1, 10.2),  # then others take cores - 1
                      (0.1 + (cores - 1) * 10, 0.1, 20.2)])  # then nothing again
    monkeypatch.setattr(threads, "snapshot", lambda c: next(snapshots))
    sleeps = []
    monkeypatch.setattr(threads.time, "sleep", sleeps.append)
    clock = iter([0.05, 5.0, 10.2, 20.2])
    monkeypatch.setattr(threads.time, "monotonic", lambda: next(clock))
    policy = threads.ThreadPolicy()
    assert policy.threads is None  # counting from here: nothing chosen before the command settles
    assert policy.settle() == cores == torch.get_num_threads()
    assert sleeps == [pytest.approx(0.15)]  # only what was left of the 0.2 s window
    assert policy.revisit() == cores  # 5 s after: not looked at again yet
    assert policy.revisit() == 1 == torch.get_num_threads()
    policy.revisit()
    assert policy.threads == torch.get_num_threads() == cores
    assert policy.settle() == cores and len(sleeps) == 1  # settled once


def test_a_window_filled_by_the_commands_own_work_costs_no_pause(monkeypatch):
    """Loading a model fills the window: after 0.3 s of the process's own work, settling
    waits no longer (that work is left out of the count: test_free_cores_...)."""
    cores = threads.allowed_cores()
    sleeps = []
    monkeypatch.setattr(threads.time, "sleep", sleeps.append)
    policy = threads.ThreadPolicy()
    end = time.process_time() + 0.3
    while time.process_time() < end:  # the command's own start-up
        pass
    assert 1 <= policy.settle() <= len(cores) and sleeps == [0.0]


def test_a_spinning_process_is_seen():
    cores = threads.allowed_cores()
    spinner = subprocess.Popen([sys.executable, "-c", "import time\nend = time.time() + 3\n"
                                "while time.time() < end: pass"])
    try:
        time.sleep(0.3)
        before = threads.snapshot(cores)
        time.sleep(0.5)
        free = threads.free_cores(before, threads.snapshot(cores), len(cores))
    finally:
        spinner.kill()
        spinner.wait()
    assert free <= len(cores) - 0.6


@pytest.mark.parametrize("command", ["train", "generate", "chat", "serve", "eval", "experiment"])
def test_every_computing_command_takes_threads(command):
    parser = build_parser()
    required = {"train": ["--data", "x", "--out", "y"], "generate": ["--model", "m", "p"],
                "chat": ["--model", "m"], "serve": ["--model", "m"], "eval": ["--model", "x", "--data", "y"],
                "experiment": ["ablation"]}[command]
    args = parser.parse_args([command, *required, "--threads", "3"])
    assert args.threads == 3


def test_main_configures_the_threads_before_the_command(monkeypatch, tmp_path, capsys):
    seen = []
    monkeypatch.setattr(threads, "ThreadPolicy", lambda asked: seen.append(asked))
    assert main(["eval", "--model", str(tmp_path / "missing"), "--data", str(tmp_path / "none.txt"),
                 "--threads", "1"]) != 0
    assert seen == [1]


@pytest.mark.parametrize(("code", "env", "spins"), [
    ("import glassformer", {}, "300000"),  # libgomp's default: a passive wait slows a quiet CPU
    ("import glassformer", {"OMP_WAIT_POLICY": "PASSIVE"}, "0"),  # the user's choice holds
])
def test_glassformer_leaves_openmp_wait_policy_to_the_environment(code, env, spins):
    environment = {k: v for k, v in os.environ.items() if k not in ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT")}
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                          env={**environment, **env, "OMP_DISPLAY_ENV": "VERBOSE"})
    assert f"GOMP_SPINCOUNT = '{spins}'" in done.stderr


def _os_threads() -> int:
    return len(os.listdir("/proc/self/task"))


@pytest.mark.skipif(not kernels.available() or not os.path.isdir("/proc/self/task"),
                    reason="needs the C++ kernels and /proc")
def test_hand_over_cores_ends_the_callers_openmp_threads():
    """A parallel region leaves the calling thread's OpenMP workers running; handing the cores
    over ends them (counted as the process's OS threads), and the next region starts them again
    with the same result."""
    torch.set_num_threads(2)  # (the fixture restores the count)
    a = torch.randn(512, 512)  # (512, 512)
    expected = a @ a  # a parallel region: this thread's team now has a worker
    before = _os_threads()
    threads.hand_over_cores()
    deadline = time.monotonic() + 5
    while _os_threads() >= before and time.monotonic() < deadline:
        time.sleep(0.01)
    assert _os_threads() < before
    assert torch.equal(a @ a, expected)
