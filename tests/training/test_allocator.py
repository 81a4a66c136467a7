"""keep_freed_memory: a large block freed during a step stays in the heap for the next one.

Checked in a fresh process that imports only the allocator module (no torch, so no other
thread allocates meanwhile), by glibc's own counts (mallinfo2), which do not depend on the
machine: a block above the mmap threshold is one more mmapped block (hblks); a block from
the heap is not, and once freed it stays in the arena rather than being trimmed away. The
block is larger than the highest threshold glibc accepts (32 MiB), as a chunk of logits over
a large vocabulary is.
"""

from __future__ import annotations

import platform
import subprocess
import sys

import pytest

import glassformer.training.allocator as allocator

SCRIPT = """
import ctypes, importlib.util, sys
spec = importlib.util.spec_from_file_location("allocator", sys.argv[1])
allocator = importlib.util.module_from_spec(spec)
spec.loader.exec_module(allocator)

class Info(ctypes.Structure):
    _fields_ = [(name, ctypes.c_size_t) for name in (
        "arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks", "uordblks",
        "fordblks", "keepcost")]

libc = ctypes.CDLL(None)
libc.mallinfo2.restype = Info
libc.malloc.restype, libc.malloc.argtypes = ctypes.c_void_p, [ctypes.c_size_t]
libc.free.argtypes = [ctypes.c_void_p]
libc.mallopt.argtypes = [ctypes.c_int, ctypes.c_int]
M_MMAP_THRESHOLD = -3
# glibc's defaults, set explicitly: unset, they move with the process's history
assert libc.mallopt(M_MMAP_THRESHOLD, 128 * 1024)
assert libc.mallopt(allocator._M_TRIM_THRESHOLD, 128 * 1024)
if sys.argv[2] == "keep":
    assert allocator.keep_freed_memory()
SIZE = 64 * 2**20  # a large temporary, above any mmap threshold glibc allows
before = libc.mallinfo2()
first = libc.malloc(SIZE)
during = libc.mallinfo2()
libc.free(first)
after = libc.mallinfo2()
second = libc.malloc(SIZE)
libc.free(second)
print(during.hblks - before.hblks, after.arena >= before.arena + SIZE, first == second)
"""


def run(mode):
    done = subprocess.run([sys.executable, "-c", SCRIPT, allocator.__file__, mode],
                          capture_output=True, text=True, check=True)
    mapped, kept, same = done.stdout.split()
    return int(mapped), kept == "True", same == "True"


def glibc_with_mallinfo2():
    name, version = platform.libc_ver()
    return name == "glibc" and tuple(int(v) for v in version.split(".")[:2]) >= (2, 33)


@pytest.mark.skipif(not glibc_with_mallinfo2(), reason="needs glibc 2.33 or later (mallinfo2)")
def test_a_freed_large_block_stays_in_the_heap_and_is_reused():
    assert run("default")[:2] == (1, False)  # mmapped, and handed back to the kernel when freed
    assert run("keep") == (0, True, True)  # from the heap, kept, and the same block next time
