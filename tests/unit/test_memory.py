"""Freed memory goes back to the system: the controller's resident size tracks what it holds."""

import platform

import psutil
import pytest

from islands.orchestrator import memory

GLIBC = platform.system() == "Linux" and platform.libc_ver()[0] == "glibc"


@pytest.mark.skipif(not GLIBC, reason="malloc_trim is glibc's; elsewhere there is nothing to do")
def test_memory_freed_in_holes_is_handed_back():
    process = psutil.Process()
    # 100k blocks of 2 KiB (malloc, not Python's small-object arenas); keeping every 50th pins
    # the heap's top, so the allocator alone gives back almost nothing.
    blocks = [bytearray(2048) for _ in range(100_000)]
    kept = blocks[::50]
    del blocks
    before = process.memory_info().rss
    assert memory.release_free_memory() is True
    released = before - process.memory_info().rss
    assert released > 100 * 2 ** 20, f"released only {released / 2 ** 20:.1f} MiB"
    assert len(kept) == 2000


def test_without_glibc_it_says_so(monkeypatch):
    monkeypatch.setattr(memory, "_looked", True)
    monkeypatch.setattr(memory, "_trim", None)
    assert memory.release_free_memory() is False
