import pytest
import torch

from glassformer.serving.sampler import broken_rows


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_non_finite_rows_are_those_the_full_mask_finds(dtype):
    g = torch.Generator().manual_seed(0)
    logits = (torch.randn(16, 300, generator=g) * 30).to(dtype)  # (R, V)
    for row, value in ((1, float("nan")), (4, float("inf")), (7, float("-inf")), (9, float("nan")),
                       (9, float("inf")), (12, float("-inf")), (12, float("inf"))):
        logits[row, int(torch.randint(300, (1,), generator=g))] = value
    oracle = set((~torch.isfinite(logits).all(dim=-1)).nonzero().flatten().tolist())
    assert oracle == {1, 4, 7, 9, 12}
    assert broken_rows(logits) == oracle
    assert broken_rows(torch.finfo(dtype).max * torch.ones(3, 5, dtype=dtype)) == set()
