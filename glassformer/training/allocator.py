"""Keep freed memory inside the process, so that a training step's large temporaries are
reused rather than mapped from the kernel afresh each time.

PyTorch's CPU tensors come from the C library's malloc. glibc serves blocks above a threshold
(128 KiB to start, 32 MiB at most) with a fresh mmap, and returns the top of its heap to the
kernel when more than a threshold lies free there; either way the next step's tensors of the
same size touch new pages, one page fault per 4 KiB. A small model's step allocates and frees
several MB of activations and gradients, and those faults cost about a quarter of it; a
pretrained model's step also makes blocks above any threshold (a chunk of logits over a large
vocabulary, a token table's gradient: 100 MB each at SmolLM2's sizes). Serving every block
from the heap (no mmap) and trimming only above 1 GiB keeps that memory for reuse; the
process's peak grows a little (a freed block stays in the heap, and a larger one may not fit
in its place: 5,093 → 5,138–5,362 MB fine-tuning SmolLM2 in full). glibc still maps memory
where the heap cannot grow.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools

_M_TRIM_THRESHOLD = -1
_M_MMAP_MAX = -4
TRIM_THRESHOLD = 2**30


@functools.cache
def keep_freed_memory() -> bool:
    """Serve every block from glibc's heap and raise its trim threshold, for this process
    (once); False where the C library is not glibc or refuses."""
    name = ctypes.util.find_library("c")
    if name is None:
        return False
    try:
        mallopt = ctypes.CDLL(name).mallopt
    except (OSError, AttributeError):
        return False
    mallopt.argtypes, mallopt.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
    return bool(mallopt(_M_MMAP_MAX, 0)) and bool(mallopt(_M_TRIM_THRESHOLD, TRIM_THRESHOLD))
