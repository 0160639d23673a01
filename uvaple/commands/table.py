"""``uvaple table``: write a table file from a checkpoint's tensor, and look at or check one (the disk placement's
storage, :mod:`uvaple.uva.table_file`).

``write SOURCE --tensor NAME --out PATH`` streams a 2-D tensor of a safetensors file or checkpoint directory
(or several stacked on rows: a table saved as row shards, such as Qwen4Exp's n-gram tables) into a table file,
block by block on several threads (a table larger than host memory goes through), with its progress on stderr;
``--encoding fp8_row`` stores each row as fp8 codes and its own float32 scale (the bytes of
:func:`uvaple.kernels.encodings.quantize_fp8_rows`, the definition, made by the quantise-on-load kernel:
:func:`uvaple.integration.quantize.fp8_row_source`), half the bytes of bf16 rows. The file's size is checked
against the free space of its disk before any write; the file appears at ``PATH`` whole or not at all.
``info PATH`` prints the header (no data read); ``verify PATH`` reads every page and checks its sum.

``prune FOLDER --unused-days N`` removes the table files of a folder (the vLLM plugin's ``disk_dir``, a loader's
``table_dir``) that no loader has written or reused for ``N`` days (a load that reuses a file stamps its
modification time: :func:`uvaple.integration.file_embedding.reusable`) and that no other process holds open, and
the partial files of writers that no longer run; files that are not table files are left alone. A model whose
identity changed (other weights, another revision) writes new files beside the old ones: this is how the old
ones go. It holds the folder's lock (a loader at work there: refused), reads each candidate's header, then which
files processes hold open (``/proc/*/fd``, by device and inode: whatever path or mount namespace they reached the
file by; another user's processes are seen by root only, and a note says when some could not be read), and
checks each file again just before removing it (the same file at its path, not stamped meanwhile). A loader that
opens a file after that check keeps reading it (a removed file stays readable to whoever holds it, its blocks
freed when the last one closes it) and writes it again at its next start. ``--dry-run`` says what it would
remove.
"""

from __future__ import annotations

import argparse
import contextlib
import fnmatch
import json
import os
import re
import shutil
import stat
import sys
import time
from datetime import datetime

import torch

from uvaple.dtypes import fmt_bytes
from uvaple.perf import command
from uvaple.uva import CheckpointError, RowSource, TableFile, TableFileError, UvapleError, write_table_file
from uvaple.uva.table_file import FileLayout, fitting_source, remove_dead_partials

EXIT_DONE, EXIT_DAMAGED, EXIT_REFUSED, EXIT_FAILED = 0, 1, 2, 3
EXITS = (f"exit status: {EXIT_DONE} done; {EXIT_DAMAGED} verify found a page that does not match its sum; "
         f"{EXIT_REFUSED} a usage error, or a source, destination or file refused before any work; {EXIT_FAILED} "
         "the work failed part way (no file is left at --out)")
FP8 = {"e4m3fn": torch.float8_e4m3fn, "e5m2": torch.float8_e5m2}
MAX_THREADS = 256


class _Refused(Exception):
    pass


@contextlib.contextmanager
def _progress(total: int, desc: str, unit: str, quiet: bool):
    """The project's progress bar on stderr (``uvaple.perf.command.bar``; none under ``--quiet``), as the
    ``progress(done, total)`` callback the table file's writer and checker call."""
    with command.progress(not quiet), command.bar(total=total, desc=desc, unit=unit) as bar:
        seen = [0]

        def advance(done: int, _total: int) -> None:  # the writer calls it from its threads, under its lock
            bar.update(done - seen[0])
            seen[0] = done

        yield advance


def _names(pattern: str, names) -> list[str]:
    """The checkpoint's tensor names ``pattern`` matches (a name, or a pattern with ``*``, ``?`` or ``[...]``),
    in natural order (``shard_2`` before ``shard_10``)."""
    if not any(c in pattern for c in "*?["):
        return [pattern]
    found = [n for n in names if fnmatch.fnmatchcase(n, pattern)]
    if not found:
        raise _Refused(f"no tensor of the checkpoint matches --tensor {pattern!r}")
    return sorted(found, key=lambda n: [int(t) if t.isdigit() else t for t in re.split(r"(\d+)", n)])


def _source(a) -> tuple[RowSource, RowSource]:
    """(the checkpoint's rows, the rows to write: those, quantised on the way for ``--encoding fp8_row``)."""
    from uvaple.uva.loading import checkpoint_files, locate_tensor

    if not os.path.exists(a.source):
        raise _Refused(f"{a.source} does not exist: give a .safetensors file or a checkpoint directory")
    try:
        files = checkpoint_files(a.source)
        names = [n for pattern in a.tensor for n in _names(pattern, files)]
        twice = sorted({n for n in names if names.count(n) > 1})
        if twice:
            raise _Refused(f"--tensor names {', '.join(twice)} more than once: each tensor's rows are written once")
        infos = [locate_tensor(a.source, n) for n in names]
    except (CheckpointError, OSError, ValueError) as e:
        raise _Refused(str(e)) from None
    a.sources = {os.path.realpath(i.path) for i in infos}
    try:
        rows = RowSource.stacked(infos)  # each a 2-D tensor, all of one row layout
    except TableFileError as e:
        raise _Refused(str(e)) from None
    a.what = names[0] if len(names) == 1 else f"{len(names)} tensors ({names[0]} .. {names[-1]}, stacked)"
    if a.encoding == "raw":
        return rows, rows
    if rows.dtype not in (torch.float32, torch.float16, torch.bfloat16):
        raise _Refused(f"{a.what} holds {rows.dtype} values; fp8_row quantises float rows (bf16, fp16, fp32): "
                       "write it with --encoding raw")
    from uvaple.integration.quantize import fp8_row_source

    return rows, fp8_row_source(rows, FP8[a.fp8 or "e4m3fn"])


def _free_bytes(path: str) -> int:
    return shutil.disk_usage(os.path.dirname(os.path.realpath(path))).free  # a link's target is written


def write(a) -> int:
    if not a.out or a.out.endswith(os.sep) or os.path.isdir(a.out):
        raise _Refused(f"--out {a.out!r} is not a file's path: give the table file's own path (a directory's "
                       "file, such as DIR/emb.uvt)")
    if os.path.exists(a.out) and not a.overwrite:
        raise _Refused(f"--out {a.out} exists: pass --overwrite to replace it, or another path")
    folder = os.path.dirname(os.path.abspath(a.out))
    if not os.path.isdir(folder) or not os.access(folder, os.W_OK):
        raise _Refused(f"--out {a.out}: its folder {folder} is not a writable directory")
    given, src = _source(a)
    if os.path.realpath(a.out) in a.sources:
        raise _Refused(f"--out {a.out} is a file the rows are read from: write the table file elsewhere")
    try:
        layout = FileLayout.of(src.rows, src.cols, src.dtype, a.encoding)
    except TableFileError as e:
        raise _Refused(f"{a.what}: {e}; save the tensor as one of those") from None
    free = _free_bytes(a.out)  # an old file at --out stays until the new one is whole
    if layout.file_bytes > free:
        raise _Refused(f"--out {a.out}: the table file takes {fmt_bytes(layout.file_bytes)}, and its disk has "
                       f"{fmt_bytes(free)} free; free the difference or write it elsewhere")
    stored = "as stored" if a.encoding == "raw" else \
        f"as fp8_row ({a.fp8 or 'e4m3fn'} codes and a float32 scale a row)"
    if not a.quiet:
        print(f"writing {a.what} ({given.rows:,} rows of {given.cols:,} {str(given.dtype).replace('torch.', '')} "
              f"values, {stored}) to {a.out}: {fmt_bytes(layout.file_bytes)}", file=sys.stderr)
    t0 = time.monotonic()
    with _progress(src.rows, "rows written", "row", a.quiet) as progress:
        write_table_file(a.out, src, encoding=a.encoding, overwrite=a.overwrite, threads=a.threads,
                         progress=progress, source_id=_source_id(a))
    took = time.monotonic() - t0
    print(f"wrote {a.out}: {fmt_bytes(layout.file_bytes)} in {took:.1f} s "
          f"({layout.file_bytes / max(took, 1e-9) / 1e9:.2f} GB/s)")
    return EXIT_DONE


def _source_id(a) -> str | None:
    """What ``info`` names as the file's source: the tensors, the checkpoint and the form they were written in (the
    tensors alone where the path is too long for the header)."""
    form = "as stored" if a.encoding == "raw" else f"as fp8_row {a.fp8 or 'e4m3fn'}"
    return fitting_source(f"{a.what} of {os.path.realpath(a.source)} {form}", f"{a.what} {form}")


def info(a) -> int:
    with _open(a.path) as f:
        lay = f.layout
        doc = {"path": f.path, "rows": lay.rows, "cols": lay.cols, "dtype": str(lay.dtype).replace("torch.", ""),
               "encoding": lay.encoding, "row_bytes": lay.row_bytes, "stride": lay.stride,
               "rows_per_page": lay.rows_per_page, "pages_per_row": lay.pages_per_row, "data_pages": lay.data_pages,
               "file_bytes": lay.file_bytes, "direct_io": f.direct, "source": f.source}
    if a.json:
        print(json.dumps(doc, indent=1))
    else:  # the packing in words: one of the two counts is 0 by design
        packing = (f"{lay.rows_per_page} rows a page" if lay.rows_per_page else f"{lay.pages_per_row} pages a row")
        doc = {("packing" if k == "rows_per_page" else k): (packing if k == "rows_per_page" else v)
               for k, v in doc.items() if k != "pages_per_row"}
        doc["source"] = doc["source"] or "not recorded"
        print("\n".join(f"{k:>14}: {v}" for k, v in doc.items()))
    return EXIT_DONE


def verify(a) -> int:
    with _open(a.path) as f:
        total = f.layout.data_pages
        with _progress(total, "pages checked", "page", a.quiet) as progress:
            try:
                f.verify(progress=progress)
            except TableFileError as e:
                print(f"uvaple table verify: {e}", file=sys.stderr)
                return EXIT_DAMAGED
    print(f"{a.path}: every one of its {total:,} data pages matches its sum")
    return EXIT_DONE


#: the files a writer of a table file keeps beside it while it works (``PATH.<kind>.<pid>``): the table file's own
#: writer's, and the vLLM plugin's staging file
PARTIAL_KINDS = ("partial", "loading")
#: the names the project gives table files (the vLLM plugin's, the transformers loaders'); a partial file is
#: pruned only beside a name of these
TABLE_SUFFIXES = (".uvt", ".uvtable")
DAY_S = 86400.0


def _open_files() -> tuple[dict[tuple[int, int], int], int]:
    """The files other processes hold open, by ``(device, inode)`` (the file itself, whatever path or mount
    namespace the process reached it by), each with one such process's pid; and how many processes' descriptors
    could not be read (another user's, unless this process is root's)."""
    held: dict[tuple[int, int], int] = {}
    unreadable = 0
    try:
        pids = [int(e) for e in os.listdir("/proc") if e.isdigit()]
    except OSError:
        return held, 0
    for pid in pids:
        if pid == os.getpid():  # this command's own (the candidates it holds open while it checks them)
            continue
        try:
            fds = os.listdir(f"/proc/{pid}/fd")
        except PermissionError:
            unreadable += 1
            continue
        except OSError:  # gone
            continue
        for fd in fds:
            try:
                st = os.stat(f"/proc/{pid}/fd/{fd}")
            except OSError:
                continue
            if stat.S_ISREG(st.st_mode):
                held.setdefault((st.st_dev, st.st_ino), pid)
    return held, unreadable


def _partial_of(name: str) -> tuple[str, str] | None:
    """``(table file's name, kind)`` where ``name`` is a writer's partial file (``NAME.<kind>.<pid>``, ``NAME`` a
    table file's name), else None."""
    base, _, pid = name.rpartition(".")
    base, _, kind = base.rpartition(".")
    return (base, kind) if base.endswith(TABLE_SUFFIXES) and kind in PARTIAL_KINDS and pid.isdigit() else None


@contextlib.contextmanager
def _folder_held(folder: str):
    """The folder's lock (:func:`~uvaple.integration.file_embedding.folder_lock`, which a loader holds while it
    checks and writes a table file there), taken without waiting: refused while a loader is at work."""
    from uvaple.integration.file_embedding import folder_lock

    with contextlib.ExitStack() as stack:
        try:
            stack.enter_context(folder_lock(folder, wait=False))
        except BlockingIOError:
            raise _Refused(f"a process is checking or writing table files in {folder} (it holds the folder's "
                           "lock): run prune again when it is done") from None
        yield


def prune(a) -> int:
    """The table files of ``a.folder`` unused for ``a.unused_days`` and held by no other process removed, and the
    partial files of writers that no longer run. Each file's header is read first, then which files processes hold
    open, then each is checked again just before it goes: the same file (inode) still at its path, not stamped
    meanwhile, held by no process (a loader that opens it after that keeps reading it: its blocks are freed when
    it closes it)."""
    folder = os.path.abspath(a.folder)
    if not os.path.isdir(folder):
        raise _Refused(f"{a.folder}: no such folder; give the folder of the table files (the plugin's disk_dir, a "
                       "loader's table_dir)")
    cutoff = time.time() - a.unused_days * DAY_S
    verb = "would remove" if a.dry_run else "removed"
    freed = removed = kept = failed = 0

    def remove(path: str, name: str, size: int, why: str) -> None:
        nonlocal freed, removed, failed
        if not a.dry_run:
            try:
                os.unlink(path)
            except FileNotFoundError:
                return
            except OSError as e:
                print(f"could not remove {name}: {e.strerror or e}")
                failed += 1
                return
        print(f"{verb} {name} ({fmt_bytes(size)}): {why}")
        freed, removed = freed + size, removed + 1

    with _folder_held(folder):
        names = sorted(os.listdir(folder))
        dead = set()  # partial files whose writer no longer runs (in this pid namespace)
        for base, kind in {p for p in map(_partial_of, names) if p is not None}:
            dead.update(remove_dead_partials(os.path.join(folder, base), kind=kind, dry_run=True))
        tables, partials = [], []
        for name in names:
            path = os.path.join(folder, name)
            if os.path.islink(path) or not os.path.isfile(path):
                continue
            if _partial_of(name) is not None:
                if path in dead:
                    with contextlib.suppress(OSError):
                        partials.append((name, path, os.stat(path)))
                continue
            try:
                with TableFile.open(path) as f:
                    st = os.fstat(f.fileno())
                    tables.append((name, path, (st.st_dev, st.st_ino), f.source))
            except Exception:  # noqa: BLE001 - not a table file (or not readable): not this command's
                continue
        held, unreadable = _open_files()  # after the candidates were read: whoever opened one before is seen
        for name, path, st in partials:
            holder = held.get((st.st_dev, st.st_ino))
            if holder is not None:
                print(f"kept {name}: its writer runs (process {holder} holds it open)")
                kept += 1
            else:
                remove(path, name, st.st_size, "left by a writer that no longer runs")
        for name, path, file_id, source in tables:
            try:
                st = os.stat(path)  # now: a loader that reused it since it was read has stamped it
            except FileNotFoundError:
                continue
            if (st.st_dev, st.st_ino) != file_id:  # written again meanwhile: not the file read
                print(f"kept {name}: written again just now")
                kept += 1
                continue
            used = datetime.fromtimestamp(st.st_mtime).strftime("%Y-%m-%d %H:%M")
            holder = held.get(file_id)
            if holder is not None:
                print(f"kept {name}: in use (process {holder})")
                kept += 1
                continue
            if st.st_mtime >= cutoff:
                print(f"kept {name}: last written or reused {used}")
                kept += 1
                continue
            remove(path, name, st.st_size, f"last written or reused {used}; {source or 'source not recorded'}")
    print(f"{folder}: {verb} {removed} file{'s' * (removed != 1)} ({fmt_bytes(freed)}), kept {kept}"
          + (f", could not remove {failed}" if failed else ""))
    if unreadable:
        print(f"note: the open files of {unreadable} process{'es' * (unreadable != 1)} could not be read (another "
              "user's): a file only they hold counts as unused; run as root to see them")
    return EXIT_FAILED if failed else EXIT_DONE


def _open(path: str) -> TableFile:
    try:
        return TableFile.open(path)
    except TableFileError as e:
        raise _Refused(f"{e} (table files are written by uvaple table write)") from None


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="uvaple table", description=__doc__.split("\n\n")[0], epilog=EXITS)
    sub = p.add_subparsers(dest="cmd", metavar="{write,info,verify,prune}")
    w = sub.add_parser("write", help="write a table file from a checkpoint's 2-D tensor", epilog=EXITS)
    w.add_argument("source", help="a .safetensors file or a checkpoint directory (sharded or not)")
    w.add_argument("--tensor", required=True, action="append",
                   help="the tensor's name in the checkpoint; a pattern (*, ?, [...]) or the flag again stacks "
                        "several on rows, in natural order (a table saved as row shards: '...ngram_embedding."
                        "shard_*.weight')")
    w.add_argument("--out", required=True, help="the table file to write (on the disk the lookups will read)")
    w.add_argument("--encoding", choices=("raw", "fp8_row"), default="raw",
                   help="raw: the rows as stored (default); fp8_row: fp8 codes and a float32 scale per row")
    w.add_argument("--fp8", choices=tuple(FP8), help="fp8_row's code format (default e4m3fn)")
    w.add_argument("--threads", type=int, help=f"writing threads, 1 to {MAX_THREADS} (default: one per core, at "
                                               "most 16)")
    w.add_argument("--overwrite", action="store_true", help="replace an existing --out")
    w.add_argument("--quiet", action="store_true", help="no progress on stderr")
    i = sub.add_parser("info", help="print a table file's header (nothing else is read)", epilog=EXITS)
    i.add_argument("path")
    i.add_argument("--json", action="store_true", help="print JSON")
    v = sub.add_parser("verify", help="read every page of a table file and check it against its sum", epilog=EXITS)
    v.add_argument("path")
    v.add_argument("--quiet", action="store_true", help="no progress on stderr")
    r = sub.add_parser("prune", help="remove a folder's table files unused for some days and held by no process",
                       epilog=EXITS)
    r.add_argument("folder", help="the folder of the table files (the vLLM plugin's disk_dir, a loader's table_dir)")
    r.add_argument("--unused-days", type=float, required=True,
                   help="remove the table files no load has written or reused for this many days (0: every one no "
                        "process holds open)")
    r.add_argument("--dry-run", action="store_true", help="say what would be removed; remove nothing")
    a = p.parse_args(argv)
    if a.cmd is None:
        p.error("say what to do: write, info, verify or prune (uvaple table --help)")
    if a.cmd == "prune" and not (a.unused_days >= 0 and a.unused_days < float("inf")):
        r.error(f"--unused-days {a.unused_days:g}: give a number of days, 0 or more")
    if a.cmd == "write" and a.threads is not None and not 1 <= a.threads <= MAX_THREADS:
        w.error(f"--threads {a.threads}: give a count of threads from 1 to {MAX_THREADS}")
    if a.cmd == "write" and a.encoding == "raw" and a.fp8 is not None:
        w.error(f"--fp8 {a.fp8} is fp8_row's code format; add --encoding fp8_row, or drop --fp8")
    return a


def main(argv: list[str] | None = None) -> int:
    a = parse_args(argv)
    try:
        return {"write": write, "info": info, "verify": verify, "prune": prune}[a.cmd](a)
    except _Refused as e:
        print(f"uvaple table {a.cmd}: {e}", file=sys.stderr)
        return EXIT_REFUSED
    except (TableFileError, UvapleError, OSError) as e:
        print(f"uvaple table {a.cmd}: {e}", file=sys.stderr)
        return EXIT_FAILED
    except KeyboardInterrupt:
        left = " (no file is left at --out)" if a.cmd == "write" else ""
        print(f"uvaple table {a.cmd}: interrupted{left}", file=sys.stderr)
        return EXIT_FAILED
