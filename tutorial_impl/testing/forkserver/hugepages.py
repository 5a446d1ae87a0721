"""The forkserver's memory in huge pages, so that a fork and a rank's exit cost little.

A process that has imported torch holds about 200 MB of anonymous memory (its C++ heap, the
Python objects of its modules), some 55,000 pages of 4 KiB. ``fork`` copies one page-table
entry per page, and the child's exit tears them down again: measured on the 2-core machine
this suite is timed on, 4-7 ms of CPU in the forkserver per fork and 5-8 ms in a rank that
does nothing but exit, about a third of what a fresh rank costs in all. Collapsed into huge
pages (2 MiB, ``MADV_COLLAPSE``, Linux 6.1+), the same memory is some 100 entries: the fork
cost 0.9 ms and the empty child's exit 1.9 ms. A rank that then writes to a page (CPython
writes to every object it touches) still copies 4 KiB, not 2 MiB: since Linux 5.8 a write to
a shared huge page splits the child's mapping of it and copies that one small page.

Only ``MADV_COLLAPSE`` is asked for, never ``MADV_HUGEPAGE``: memory a rank allocates later
stays in small pages (a huge page for every new allocation would cost each rank zeroing 2 MiB
at a time). Only a 2 MiB stretch whose pages are nearly all in memory already
(``/proc/self/pagemap``) is collapsed: a library's large reservation that it never touched
stays unbacked. Where the kernel cannot (older than 6.1, huge pages off, memory too
fragmented), the call fails and nothing changes: forks cost what they cost before.
"""

from __future__ import annotations

import ctypes
import struct
import sys

PAGE = 4096
HUGE = 2 << 20  # the size of a huge page on x86-64 and arm64 (4 KiB base pages)
MADV_COLLAPSE = 25  # <linux/mman.h>, Linux 6.1
MISSING = 32  # a stretch with more pages than this not in memory is left alone
_PRESENT = 1 << 63  # a pagemap entry's "page present" bit (readable without privileges)


def anonymous_ranges(maps: str) -> list[tuple[int, int]]:
    """The huge-page-aligned part of each private, writable, anonymous mapping (the heap
    included) in ``maps`` (the text of ``/proc/self/maps``): what may be collapsed."""
    ranges = []
    for line in maps.splitlines():
        fields = line.split()
        if len(fields) < 5 or not fields[1].startswith("rw") or fields[1][3] != "p":
            continue
        name = fields[5] if len(fields) > 5 else ""
        if name not in ("", "[heap]"):
            continue  # a file's pages, the stack, vdso...: not ours to move
        start, end = (int(x, 16) for x in fields[0].split("-"))
        start = (start + HUGE - 1) & ~(HUGE - 1)
        end &= ~(HUGE - 1)
        if end > start:
            ranges.append((start, end))
    return ranges


def populated(pagemap: bytes) -> bool:
    """Whether the pagemap entries of one stretch (8 bytes a page) say it is in memory
    but for at most ``MISSING`` pages."""
    entries = struct.unpack(f"<{len(pagemap) // 8}Q", pagemap)
    return sum(1 for e in entries if not e & _PRESENT) <= MISSING


def collapse() -> int:
    """Collapse this process's populated anonymous memory into huge pages where the kernel
    can; the bytes it collapsed (0 where it cannot, which changes nothing else)."""
    if not sys.platform.startswith("linux"):
        return 0
    try:
        with open("/proc/self/maps") as f:
            ranges = anonymous_ranges(f.read())
        madvise = ctypes.CDLL(None, use_errno=True).madvise
        pagemap = open("/proc/self/pagemap", "rb", buffering=0)  # noqa: SIM115 - closed below
    except (OSError, AttributeError):
        return 0
    madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    done = 0
    with pagemap:
        for start, end in ranges:
            for chunk in range(start, end, HUGE):
                pagemap.seek(chunk // PAGE * 8)
                if populated(pagemap.read(HUGE // PAGE * 8)):
                    if madvise(chunk, HUGE, MADV_COLLAPSE) == 0:
                        done += HUGE
    return done
