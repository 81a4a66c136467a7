"""The C++ argmax of each row equals torch.argmax: random rows, ties, infinities and NaN, in
both builds, and the fallback for what the kernel does not take."""

import pytest
import torch

from glassformer.accel.greedy import argmax_rows


def _rows() -> torch.Tensor:
    g = torch.Generator().manual_seed(0)
    rows = torch.randn(9, 1003, generator=g)  # (R, V): V not a multiple of 8
    rows[1, 17] = rows[1, 900] = rows[1].max() + 1  # a tie: the first index wins
    rows[2, 1001] = rows[2].max() + 1  # the maximum in the scalar tail
    rows[3] = float("-inf")  # every value -inf: index 0
    rows[4, 5] = float("inf")
    rows[5, 300] = rows[5, 700] = float("nan")  # NaN counts as the maximum, the first one
    rows[6, 2] = float("nan")
    rows[6, 3] = float("inf")
    rows[7, 1002] = float("nan")  # a NaN only in the tail
    return rows


@pytest.mark.parametrize("build", ["kernels", "avx2_kernels"])
def test_argmax_rows_equals_torch(build, request):
    kernels = request.getfixturevalue(build)
    rows = _rows()
    assert torch.equal(kernels.argmax_rows(rows), rows.argmax(dim=-1))
    narrow = rows[:, :5].contiguous()  # V < 8: the scalar loop alone
    assert torch.equal(kernels.argmax_rows(narrow), narrow.argmax(dim=-1))


@pytest.mark.usefixtures("kernels")
def test_argmax_rows_takes_any_layout_and_falls_back_for_other_dtypes():
    rows = _rows()
    assert torch.equal(argmax_rows(rows.t().contiguous().t()), rows.argmax(dim=-1))
    assert torch.equal(argmax_rows(rows.double()), rows.double().argmax(dim=-1))
    assert argmax_rows(rows[:0]).shape == (0,)
