import os

import pytest
import torch

from glassformer.accel import build
from glassformer.formats import hub

# The command's thread policy samples the machine for 0.2 s and may change the count for the
# rest of the session: tests keep torch's count (tests/accel/test_thread_policy.py unsets this).
os.environ.setdefault("GLASSFORMER_THREADS", str(torch.get_num_threads()))
# The suite tests the native build wherever it runs (the avx2_kernels fixture tests the other):
# the measured choice (accel/decisions.py) would let a busy machine pick which build is tested.
os.environ.setdefault("GLASSFORMER_KERNEL_TARGET", "native")


@pytest.fixture(autouse=True)
def _deterministic():
    torch.manual_seed(0)
    yield


def _kernels(target):
    module = build.extension(target)
    if module is None:
        pytest.skip(f"the C++ kernels ({target}) are not available: {build.why_unavailable(target)}")
    return module


@pytest.fixture(scope="session")
def kernels():
    """The C++ kernels built for this CPU (once per session); skips the test where there are
    none, with the reason."""
    return _kernels("native")


@pytest.fixture(scope="session")
def avx2_kernels():
    """The C++ kernels built for AVX2 + FMA + F16C only: the path CPUs without AVX-512 take."""
    if torch.backends.cpu.get_cpu_capability() == "AVX2":
        pytest.skip("this CPU has AVX2 only: the native build is the AVX2 one")
    return _kernels("avx2")


@pytest.fixture(scope="session")
def smollm2_path():
    """SmolLM2-135M-Instruct's GGUF file (fetched once); skips where it cannot be had."""
    try:
        return hub.model_path("smollm2-135m-instruct", progress=False)
    except OSError as error:
        pytest.skip(f"SmolLM2 could not be downloaded: {error}")
