
import pytest
import torch

from glassformer.data import tinyshakespeare


@pytest.fixture(autouse=True, scope="session")
def _one_thread():
    """Timing on a shared 2-core machine: one thread each, as the experiments' own runs."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="session")
def corpus(tmp_path_factory):
    """The first 40,000 characters of tinyshakespeare (enough for windows of 1024)."""
    path = tmp_path_factory.mktemp("data") / "shakespeare-head.txt"
    path.write_text(tinyshakespeare().read_text(encoding="utf-8")[:40_000], encoding="utf-8")
    return path
