"""The step's one read-out: every row whose logits the step wants, whatever path computed it,
through the model's final norm and head (`Transformer.read_out`) in calls of at most
LENS_ROWS rows: the lens requests' kept residuals, then the last row of each request that
reaches its end, unless its lens read that very residual (then its logits are its lens row's).
Through the row-invariant view every row reads the same numbers whatever is read beside it.
"""

from __future__ import annotations

import torch

from ..interpret.lens import lens_sites, top_of
from ..model.transformer import Transformer
from .sequence import Sequence
from .step import RequestRows, StepBatch

# Rows read out per call: one pass over the head's weights (the kernels' panel of rows), and a
# few MB of logits at a time whatever the number of rows (a long prompt's lens).
LENS_ROWS = 64


def output_row(rows: RequestRows, sites: list[str], last: str) -> int | None:
    """Which of a lens request's rows (site by site) holds its output: its `last` residual (the
    one the final norm and head read) at its last position, where it reads that one and
    reaches its end in this step; else None."""
    return sites.index(last) * rows.n + rows.n - 1 if rows.ends and last in sites else None


def step_logits(model: Transformer, batch: StepBatch, hidden: torch.Tensor,
                lens: dict[Sequence, dict[str, torch.Tensor]]) -> torch.Tensor:
    """Next-token logits (R, V) of the batch's requests that reach their end, in batch order,
    from `hidden` (N, d), each row's residual stream after the last block; `lens`: each lens
    request's kept residuals by site, (n, d) each, whose top-k is kept on it."""
    config, last = model.config, lens_sites(model.config)[-1]
    # each lens request's rows, site by site: (rows, first row read, its top-k: ids, probabilities)
    reads, chunks, own, total = [], [], {}, 0  # reads; rows read; each end's lens row
    for r in batch.requests:
        if r.seq in lens:
            sites = lens_sites(config, r.seq.params.lens_layers)
            m, k = len(sites) * r.n, min(r.seq.params.lens, config.vocab_size)
            reads.append((r, total, torch.empty(m, k, dtype=torch.long), torch.empty(m, k)))  # (m, k) each
            chunks += [lens[r.seq][site] for site in sites]  # (n, d) each
            if (row := output_row(r, sites, last)) is not None:
                own[r.seq] = total + row
            total += m
    source = []  # each end's row among all rows read
    for r in batch.requests:
        if r.ends and r.seq in own:
            source.append(own[r.seq])
        elif r.ends:  # its own last row
            source.append(total)
            chunks.append(hidden[r.rows][-1:])  # (1, d)
            total += 1
    if not chunks:
        return hidden.new_zeros(0, config.vocab_size)
    rows = torch.cat(chunks)  # (M, d)
    outputs = None
    for c0 in range(0, rows.shape[0], LENS_ROWS):
        logits = model.read_out(rows[c0 : c0 + LENS_ROWS])  # (≤ LENS_ROWS, V)
        for _, first, ids, probs in reads:
            lo, hi = max(first, c0), min(first + ids.shape[0], c0 + logits.shape[0])
            if lo < hi:
                ids[lo - first : hi - first], probs[lo - first : hi - first] = top_of(
                    logits[lo - c0 : hi - c0], ids.shape[1])
        if c0 == 0 and source == list(range(logits.shape[0])):  # the ends' rows alone, in order
            outputs = logits  # (R, V), not copied
            continue
        if outputs is None:
            outputs = logits.new_empty(len(source), logits.shape[-1])  # (R, V)
        for j, row in enumerate(source):
            if c0 <= row < c0 + logits.shape[0]:
                outputs[j] = logits[row - c0]
    for r, _, ids, probs in reads:
        ids, probs = ids.view(-1, r.n, ids.shape[1]), probs.view(-1, r.n, ids.shape[1])  # (sites, n, k)
        for i in range(r.n):  # kept by position (a request recomputed after preemption overwrites its own)
            r.seq.lens[r.seq.num_computed + i] = (ids[:, i], probs[:, i])  # (sites, k) each
    return outputs
