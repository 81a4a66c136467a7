"""The step's one read-out: every row whose logits the step wants, whatever path computed it,
through the model's final norm and head (`Transformer.read_out`) in calls of at most
LENS_ROWS rows: the lens requests' kept residuals, then the last row of each request that
reaches its end, unless its lens read that very residual (then its logits are its lens row's).
Through the row-invariant view every row reads the same numbers whatever is read beside it.
"""

from __future__ import annotations

import torch

from ..model.transformer import Transformer
from .capture import LensRows
from .step import StepBatch

# Rows read out per call: one pass over the head's weights (the kernels' panel of rows), and a
# few MB of logits at a time whatever the number of rows (a long prompt's lens).
LENS_ROWS = 64


def step_logits(model: Transformer, batch: StepBatch, hidden: torch.Tensor,
                lenses: list[LensRows]) -> torch.Tensor:
    """Next-token logits (R, V) of the batch's requests that reach their end, in batch order,
    from `hidden` (N, d), each row's residual stream after the last block; each lens request's
    top-k is kept on it."""
    kept, bases, total = [], [], 0
    for lens in lenses:
        rows = lens.rows()  # (M_i, d) or None
        bases.append(total)
        if rows is not None:
            kept.append(rows)
            total += rows.shape[0]
    source, extra = [], []  # each end's row among all rows read; the ends' own last rows
    for r in batch.requests:
        if not r.ends:
            continue
        row = next((base + own for base, lens in zip(bases, lenses, strict=True)
                    if (own := lens.output_row(r.seq)) is not None), None)
        if row is None:
            row = total + len(extra)
            extra.append(hidden[r.last])
        source.append(row)
    if extra:
        kept.append(torch.stack(extra))  # (E, d)
    if not kept:
        return hidden.new_zeros(0, model.config.vocab_size)
    rows = torch.cat(kept) if len(kept) > 1 else kept[0]  # (M, d)
    outputs = None
    for c0 in range(0, rows.shape[0], LENS_ROWS):
        logits = model.read_out(rows[c0 : c0 + LENS_ROWS])  # (≤ LENS_ROWS, V)
        for base, lens in zip(bases, lenses, strict=True):
            lens.take(logits, c0 - base)
        if c0 == 0 and source == list(range(logits.shape[0])):  # the ends' rows alone, in order
            outputs = logits  # (R, V), not copied
            continue
        if outputs is None:
            outputs = logits.new_empty(len(source), logits.shape[-1])  # (R, V)
        for j, row in enumerate(source):
            if c0 <= row < c0 + logits.shape[0]:
                outputs[j] = logits[row - c0]
    for lens in lenses:
        lens.store()
    return outputs
