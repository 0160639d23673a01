"""The ``uvaple`` command: ``doctor`` (can this machine run the UVA path?), ``bench`` (benchmarks) and
``shm`` (shared tables).
"""

from __future__ import annotations

import sys

COMMANDS = {
    "doctor": ("uvaple.doctor", "what this machine can run (UVA path, copy path, CPU), with a link measurement"),
    "bench": ("uvaple.perf.bench", "gather benchmarks: uva vs the copy ceiling and the peers"),
    "shm": ("uvaple.shm", "list the named shared tables in /dev/shm; remove the ones nobody uses"),
}


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help"):
        print("usage: uvaple {" + ",".join(COMMANDS) + "} [options]\n")
        for name, (_, helptext) in COMMANDS.items():
            print(f"  {name:8s} {helptext}")
        return 0 if argv else 2
    if argv[0] == "--version":
        from . import __version__

        print(__version__)
        return 0
    cmd, rest = argv[0], argv[1:]
    if cmd not in COMMANDS:
        print(f"uvaple: unknown command {cmd!r}; choose one of {', '.join(COMMANDS)}", file=sys.stderr)
        return 2
    import importlib

    module = importlib.import_module(COMMANDS[cmd][0])
    return int(module.main(rest) or 0)


if __name__ == "__main__":
    raise SystemExit(main())
