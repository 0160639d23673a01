"""Thin, checked wrappers over the few libc calls host tables need (mmap, madvise, munmap).

Python's ``mmap`` module cannot map at an aligned address, cannot ask for ``MADV_POPULATE_WRITE`` on a
sub-range from several threads, and refuses to unmap while views exist; the table needs all three, so it
calls libc through ctypes. ctypes drops the GIL around foreign calls, which is what lets several threads
populate one mapping at once.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import errno
import os

PROT_READ = 0x1
PROT_WRITE = 0x2
MAP_SHARED = 0x01
MAP_PRIVATE = 0x02
MAP_FIXED = 0x10
MAP_ANONYMOUS = 0x20
MAP_NORESERVE = 0x4000
MADV_DONTFORK = 10
MADV_HUGEPAGE = 14
MADV_WIPEONFORK = 18  # Linux >= 4.14
MADV_POPULATE_READ = 22  # Linux >= 5.14
MADV_POPULATE_WRITE = 23  # Linux >= 5.14
MAP_FAILED = ctypes.c_void_p(-1).value

PAGE_SIZE = os.sysconf("SC_PAGE_SIZE")
HUGE_PAGE_SIZE = 2 << 20

_libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
_libc.mmap.restype = ctypes.c_void_p
_libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_long]
_libc.munmap.restype = ctypes.c_int
_libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
_libc.madvise.restype = ctypes.c_int
_libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
_libc.memset.restype = ctypes.c_void_p
_libc.memset.argtypes = [ctypes.c_void_p, ctypes.c_int, ctypes.c_size_t]


def round_up(x: int, multiple: int) -> int:
    return (x + multiple - 1) // multiple * multiple


def pread_full(fd: int, views: list[memoryview], offset: int) -> int:
    """Fill ``views`` (byte views, in order) from ``offset`` of ``fd`` with ``preadv``, as many calls as it takes;
    the bytes read: less than the views hold only where the file ended. An I/O error is the OSError."""
    want = sum(v.nbytes for v in views)
    got = 0
    while got < want:
        skip, rest = got, []  # the views past what was already read
        for v in views:
            if skip >= v.nbytes:
                skip -= v.nbytes
                continue
            rest.append(v[skip:])
            skip = 0
        n = os.preadv(fd, rest, offset + got)
        if n == 0:
            break
        got += n
    return got


def mmap(length: int, prot: int, flags: int, fd: int = -1, offset: int = 0, addr: int | None = None) -> int:
    """``mmap(2)``; returns the address or raises ``OSError`` with errno."""
    ptr = _libc.mmap(addr, length, prot, flags, fd, offset)
    if ptr is None or ptr == MAP_FAILED:
        e = ctypes.get_errno()
        raise OSError(e, f"mmap of {length} bytes failed: {os.strerror(e)}")
    return int(ptr)


def munmap(addr: int, length: int) -> None:
    if _libc.munmap(addr, length) != 0:
        e = ctypes.get_errno()
        raise OSError(e, f"munmap failed: {os.strerror(e)}")


def madvise(addr: int, length: int, advice: int) -> int:
    """``madvise(2)``; returns 0 or the errno (never raises: callers choose a fallback)."""
    if _libc.madvise(addr, length, advice) != 0:
        return ctypes.get_errno() or errno.EINVAL
    return 0


def populate_write_supported() -> bool:
    """Whether this kernel has ``MADV_POPULATE_WRITE`` (Linux >= 5.14): tried on one private page."""
    addr = mmap(PAGE_SIZE, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS)
    try:
        return madvise(addr, PAGE_SIZE, MADV_POPULATE_WRITE) == 0
    finally:
        munmap(addr, PAGE_SIZE)


def memset(addr: int, value: int, length: int) -> None:
    _libc.memset(addr, value, length)


def map_anonymous_aligned(length: int, alignment: int = HUGE_PAGE_SIZE) -> int:
    """Map ``length`` bytes of private anonymous memory starting on an ``alignment`` boundary.

    Over-maps by one alignment unit and trims head and tail, so transparent huge pages can back the
    whole table. ``MAP_NORESERVE``: pages are committed by the explicit populate step, where a shortage
    is reported as an error instead of a later OOM kill in the middle of a forward pass.
    """
    raw = mmap(length + alignment, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE)
    start = round_up(raw, alignment)
    head = start - raw
    tail = alignment - head
    if head:
        munmap(raw, head)
    if tail:
        munmap(start + length, tail)
    return start


def mem_available_bytes() -> int | None:
    """``MemAvailable`` from /proc/meminfo, or None where the file does not exist."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        return None
    return None


def memlock_limit() -> tuple[int, int]:
    import resource

    return resource.getrlimit(resource.RLIMIT_MEMLOCK)


def mapped(addr: int) -> bool:
    """Whether ``addr`` lies in a mapping of this process (``/proc/self/maps``)."""
    with open("/proc/self/maps") as f:
        for line in f:
            lo, hi = (int(x, 16) for x in line.split()[0].split("-"))
            if lo <= addr < hi:
                return True
    return False


class _Statfs(ctypes.Structure):  # struct statfs on 64-bit Linux: f_type first, then the counts
    _fields_ = [("f_type", ctypes.c_long), ("f_bsize", ctypes.c_long), ("f_blocks", ctypes.c_ulong),
                ("f_bfree", ctypes.c_ulong), ("f_bavail", ctypes.c_ulong), ("f_files", ctypes.c_ulong),
                ("f_ffree", ctypes.c_ulong), ("f_fsid", ctypes.c_int * 2), ("f_namelen", ctypes.c_long),
                ("f_frsize", ctypes.c_long), ("f_flags", ctypes.c_long), ("f_spare", ctypes.c_long * 4)]


def filesystem_type(path: str) -> int | None:
    """The ``statfs(2)`` magic of the filesystem holding ``path`` (``0x01021994``: tmpfs), or None where
    the call fails."""
    buf = _Statfs()
    if _libc.statfs(os.fsencode(path), ctypes.byref(buf)) != 0:
        return None
    return buf.f_type & 0xFFFFFFFF


def huge_pages_in(path: str) -> str | None:
    """The ``huge=`` option of the tmpfs mount holding ``path`` (``never`` when absent), from
    ``/proc/self/mounts``; None where that cannot be read."""
    try:
        with open("/proc/self/mounts") as f:
            mounts = [line.split() for line in f]
    except OSError:
        return None
    real = os.path.realpath(path)
    best = None
    for m in mounts:
        if len(m) >= 4 and m[2] == "tmpfs" and (real == m[1] or real.startswith(m[1].rstrip("/") + "/")):
            if best is None or len(m[1]) > len(best[1]):
                best = m
    if best is None:
        return None
    for opt in best[3].split(","):
        if opt.startswith("huge="):
            return opt[5:]
    return "never"
