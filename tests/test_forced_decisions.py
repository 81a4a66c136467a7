"""The promises of equal bits and of one function on every path, under each forced decision.

The rest of the suite runs with the choices measured on this machine (accel/decisions.py:
bfloat16 products, oneDNN products, the kernels' target) and the C++ kernels where they
build. A promise must hold whatever each choice picked, on any CPU, so the tests that carry
one run again here in a fresh process per choice forced by its environment variable:
the engine's batch invariance, each product row against the lone row, the cross-path
property test (on RERUN_EXAMPLES derandomized draws: the suite's own run takes
150), and training's fused passes against the module path. A forced choice that
would test nothing new here (the AVX2 target on a CPU whose native build is AVX2) is skipped.
"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

ENGINE = ("tests/serving/test_engine.py::"
          "test_fast_attention_gives_a_request_the_same_numbers_whatever_shares_its_steps")
PREEMPTED = "tests/serving/test_engine.py::test_on_the_fused_step_a_preempted_request_gets_the_same_numbers"
INFERENCE = [ENGINE, PREEMPTED, "tests/accel/test_row_invariance.py", "tests/test_paths_property.py"]
# bfloat16 and oneDNN products are training's (autocast, Muon, the fused passes): the engine reads neither
TRAINING = ["tests/accel/test_fast_training.py", "tests/accel/test_newton_schulz.py"]

RERUN_EXAMPLES = "40"

# the variables forced together, and the tests whose numbers they can change (bfloat16 and
# oneDNN products both ways in two runs: each reaches different products)
FORCED = [
    ({"GLASSFORMER_KERNELS": "torch"}, INFERENCE),
    ({"GLASSFORMER_KERNEL_TARGET": "avx2"}, INFERENCE),
    ({"GLASSFORMER_BF16": "0", "GLASSFORMER_ONEDNN": "0"}, TRAINING),
    ({"GLASSFORMER_BF16": "1", "GLASSFORMER_ONEDNN": "1"}, TRAINING),
]


@pytest.mark.parametrize(("forced", "tests"), FORCED,
                         ids=[",".join(f"{k}={v}" for k, v in forced.items()) for forced, _ in FORCED])
def test_the_promises_hold_under_a_forced_decision(forced, tests):
    avx2_only = torch.backends.cpu.get_cpu_capability() == "AVX2"
    if forced.get("GLASSFORMER_KERNEL_TARGET") == "avx2" and avx2_only:
        pytest.skip("this CPU has AVX2 only: the native build the suite tests is the AVX2 one")
    env = {**os.environ, "GLASSFORMER_PROPERTY_EXAMPLES": RERUN_EXAMPLES, **forced}
    done = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-x", *tests],
                          env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, f"{forced}:\n{done.stdout[-4000:]}{done.stderr[-2000:]}"
