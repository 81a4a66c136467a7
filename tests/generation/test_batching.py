import torch

from glassformer import Transformer, get_preset
from glassformer.generation.batching import left_pad, select_rows
from glassformer.generation.core import decode_one_token, prefill
from glassformer.model.kv_cache import KVCache


def test_left_pad_positions_count_real_tokens_only():
    ids, positions, mask = left_pad([[5, 6, 7], [8]], torch.device("cpu"))
    assert ids.tolist() == [[5, 6, 7], [0, 0, 8]]
    assert mask.tolist() == [[True, True, True], [False, False, True]]
    assert positions.tolist() == [[0, 1, 2], [0, 0, 0]]
    assert left_pad([[1, 2], [3, 4]], torch.device("cpu"))[1:] == (None, None)


def test_selected_cache_rows_decode_like_a_cache_of_just_those_rows():
    torch.manual_seed(0)
    model = Transformer(get_preset("tiny-llama").replace(init_std=0.3)).eval()
    ids = torch.randint(0, 96, (3, 6), generator=torch.Generator().manual_seed(0))  # (3, T)
    rows = torch.tensor([2, 0, 0])  # reorder and repeat, as beam search does
    with torch.no_grad():
        cache = KVCache(model.config, 3)
        prefill(model, ids[:, :5], cache)
        select_rows(cache, rows)
        step = decode_one_token(model, ids[rows, 5], cache)
        fresh = KVCache(model.config, 3)
        prefill(model, ids[rows, :5], fresh)
        expected = decode_one_token(model, ids[rows, 5], fresh)
    torch.testing.assert_close(step, expected)
