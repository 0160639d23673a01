"""``uvaple shm``: list the named shared tables of this machine, and remove those nobody uses.

``list`` shows every ``/dev/shm/uvaple.*`` segment: the table's size (rows x row stride: the bytes it
holds), the file's (what it maps: a 2 MiB header and page rounding more), state (``ready``, ``building``, ``failed``,
``stale``: its creator died before it was ready, ``foreign``: not a uvaple file), the creator's pid, the
table's shape and tag, and the processes that have it mapped. ``clean`` removes the segments no process
has open (stale, failed, or ready and orphaned by a killed process); ``--dry-run`` only says which.
``--dir`` looks in another tmpfs directory (the ``directory=`` the tables were made with).
"""

from __future__ import annotations

import argparse
import json
from dataclasses import asdict

from uvaple.dtypes import fmt_bytes
from uvaple.uva import segments


def _size(n: int | None) -> str:
    return "-" if n is None else fmt_bytes(n)


def format_list(infos: list[segments.SegmentInfo], directory: str = segments.SHM_DIR) -> str:
    """One line per segment: ``table`` is the table's bytes (rows x row stride), ``mapped`` the file's."""
    if not infos:
        return f"no uvaple shared tables in {directory}"
    lines = [f"{'name':<28} {'table':>10} {'mapped':>10} {'state':<9} {'creator':>8} {'shape':<18} {'dtype':<8} "
             f"{'open by':<16} tag"]
    for i in infos:
        shape = f"{i.rows}x{i.cols}" if i.rows is not None else "-"
        users = ",".join(map(str, i.pids)) or ("yes" if i.attached else "-")
        lines.append(f"{i.name:<28} {_size(i.table_bytes):>10} {_size(i.size_bytes):>10} {i.state:<9} "
                     f"{i.creator_pid or '-':>8} {shape:<18} {i.dtype or '-':<8} {users:<16} {i.tag or ''}")
    return "\n".join(lines)


def _as_json(info: segments.SegmentInfo) -> dict:
    return dict(asdict(info), table_bytes=info.table_bytes)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="uvaple shm",
                                description="List the named shared tables of this machine, and remove those "
                                            "nobody uses.",
                                epilog="exit status: 0 done; 2 a usage error or a --dir that is not a tmpfs "
                                       "directory")
    sub = p.add_subparsers(dest="cmd", metavar="{list,clean}")
    lst = sub.add_parser("list", help="show the segments: the table's bytes (rows x row stride), the file's "
                                      "(mapped), state, creator, shape, dtype, who has it open, tag")
    lst.add_argument("--json", action="store_true", help="print JSON (table_bytes and size_bytes, the file's, in "
                                                         "bytes)")
    lst.add_argument("--dir", help=f"the segments' directory (default {segments.SHM_DIR})")
    cl = sub.add_parser("clean", help="remove the segments no process has open")
    cl.add_argument("names", nargs="*", help="only these segments (default: every unused one)")
    cl.add_argument("--dry-run", action="store_true", help="say what would be removed, remove nothing")
    cl.add_argument("--dir", help=f"the segments' directory (default {segments.SHM_DIR})")
    a = p.parse_args(argv)
    if a.cmd is None:
        p.error("say what to do: 'uvaple shm list' shows the shared tables, 'uvaple shm clean' removes those no "
                "process has open (uvaple shm --help)")
    try:
        directory = segments.segment_dir(a.dir)
    except segments.SharedSegmentError as e:
        p.error(str(e))
    if a.cmd == "list":
        infos = segments.list_segments(directory)
        print(json.dumps([_as_json(i) for i in infos], indent=2) if a.json else format_list(infos, directory))
        return 0
    removed = segments.clean(a.names or None, dry_run=a.dry_run, directory=directory)
    verb = "would remove" if a.dry_run else "removed"
    for i in removed:
        print(f"{verb} {i.path} (table {_size(i.table_bytes)}, mapped {_size(i.size_bytes)}, {i.state})")
    if not removed:
        print("nothing to remove: every uvaple segment is in use" if segments.list_segments(directory)
              else f"no uvaple shared tables in {directory}")
    return 0
