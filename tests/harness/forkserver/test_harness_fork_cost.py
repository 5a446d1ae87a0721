"""What the forkserver does once so that every fresh rank costs less: huge pages, preloads.

A fresh rank is a fork of the forkserver, and a fork of a process that imported torch copies
one page-table entry per 4 KiB page of its ~200 MB, which the rank's exit tears down again;
the forkserver collapses that memory into 2 MiB pages first (``hugepages``), and does once
what every rank would otherwise do for itself (``forkserver.ready``, ``forkserver``'s
preloads). What that saves is measured, not tested (``docs/benchmarks.md``); proven here,
from inside one rank of one world (no group: nothing in it clears or imports on its own
behalf): its inherited memory is mapped in huge pages where this kernel can collapse at
all, none of its memory asks the kernel for huge pages on later faults, the module a
tensor's unpickling needs is there already, and dynamo's trace-rule caches are empty. And
which mappings ``hugepages`` picks, and which stretches it leaves alone, from text.
"""

from __future__ import annotations

import ctypes
import mmap
import struct
import sys

import pytest
import torch  # noqa: F401 - the rank's forkserver imported it; so do we, for pytester's sake

from tutorial_impl.testing.forkserver import hugepages


def memory_facts(rank: int) -> dict:
    """What this rank inherited, read before it does anything of its own."""
    with open("/proc/self/smaps") as f:  # one read: ~10 ms of CPU in a process this size
        lines = f.read().splitlines()
    huge_kb = sum(int(line.split()[1]) for line in lines if line.startswith("AnonHugePages:"))
    advised = [line for line in lines if line.startswith("VmFlags:") and " hg" in line]
    dynamo = sys.modules.get("torch._dynamo")
    rules = dynamo.trace_rules.get_torch_obj_rule_map.cache_info() if dynamo else None
    return {
        "huge_kb": huge_kb,
        "advised_huge": len(advised),
        "serialization": "torch.utils.serialization" in sys.modules,
        "dynamo_rules_cached": None if rules is None else rules.currsize,
    }


def kernel_collapses() -> bool:
    """Whether this kernel collapses memory into huge pages here: tried on a stretch of our
    own (Linux 6.1+, huge pages not turned off)."""
    if not sys.platform.startswith("linux"):
        return False
    private = mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS  # as a heap is (-1 alone: shared memory)
    area = mmap.mmap(-1, 2 * hugepages.HUGE, flags=private)  # one aligned 2 MiB stretch inside
    try:
        area.write(b"x" * len(area))  # every page in memory, as collapse() requires
        start = ctypes.addressof(ctypes.c_char.from_buffer(area))
        aligned = (start + hugepages.HUGE - 1) & ~(hugepages.HUGE - 1)
        madvise = ctypes.CDLL(None).madvise
        madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
        return madvise(aligned, hugepages.HUGE, hugepages.MADV_COLLAPSE) == 0
    finally:
        del start, aligned  # no buffer export may outlive the close
        area.close()


def test_a_fresh_rank_inherits_a_forkserver_that_did_its_work_once(run_ranks):
    [facts] = run_ranks(memory_facts, world_size=1, backend=None)
    if kernel_collapses():
        assert facts["huge_kb"] > 10 * 1024  # torch's heap, not one stray huge page
    assert facts["advised_huge"] == 0  # what the rank allocates itself stays in small pages
    assert facts["serialization"]  # preloaded: nothing here unpickled a tensor
    if facts["dynamo_rules_cached"] is not None:  # this suite preloads torch._dynamo
        assert facts["dynamo_rules_cached"] == 0


MAPS = """\
00400000-00420000 r-xp 00000000 08:01 1 /usr/bin/python3.11
00620000-00a00000 rw-p 00000000 00:00 0 [heap]
7f0000100000-7f0000500000 rw-p 00000000 00:00 0
7f0000600000-7f0000800000 rw-s 00000000 00:05 7 /dev/shm/segment
7f0000800000-7f0000c00000 rw-p 00000000 08:01 2 /usr/lib/libtorch_cpu.so
7f0000c00000-7f0000d00000 rw-p 00000000 00:00 0
7f0000e00000-7f0001000000 r--p 00000000 00:00 0
7ffd00000000-7ffd00400000 rw-p 00000000 00:00 0 [stack]
"""


def test_only_private_writable_anonymous_memory_is_picked_in_whole_huge_pages():
    assert hugepages.anonymous_ranges(MAPS) == [
        (0x800000, 0xA00000),  # the heap, its aligned middle: 0x620000 rounds up
        (0x7F0000200000, 0x7F0000400000),  # 0x...100000 up, 0x...500000 down
    ]  # shared, file-backed, read-only, the stack and a stretch under 2 MiB: left out


def test_a_stretch_is_collapsed_only_when_nearly_all_of_it_is_in_memory():
    def stretch(missing: int) -> bytes:
        present, absent = 1 << 63, 0
        entries = [absent] * missing + [present] * (hugepages.HUGE // hugepages.PAGE - missing)
        return struct.pack(f"<{len(entries)}Q", *entries)

    assert hugepages.populated(stretch(0))
    assert hugepages.populated(stretch(hugepages.MISSING))
    assert not hugepages.populated(stretch(hugepages.MISSING + 1))
    assert not hugepages.populated(stretch(hugepages.HUGE // hugepages.PAGE))


@pytest.mark.parametrize("maps", ["", "garbage\n", "00400000-00420000 rw-p 0 0 0\n"])
def test_maps_text_without_a_whole_huge_page_picks_nothing(maps):
    assert hugepages.anonymous_ranges(maps) == []
