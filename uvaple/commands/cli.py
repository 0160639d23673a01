"""The ``uvaple`` command: ``doctor`` (can this machine run the UVA path?), ``bench`` (benchmarks), ``table``
(the disk placement's table files) and ``shm`` (shared tables). ``uvaple COMMAND --help`` gives each command's
options and exit statuses.
"""

from __future__ import annotations

import sys

COMMANDS = {
    "doctor": ("uvaple.commands.doctor", "what this machine can run (UVA path, copy path, CPU) and how fast it reads "
                                         "host memory; exit 0 usable, 3 no usable GPU, 1 the measurement failed"),
    "bench": ("uvaple.perf.bench", "benchmarks: --workload ple (default), ngram, hotset, host or disk; --smoke runs "
                                   "any of them small on a CPU; results in --out (default ./uvaple-results/...)"),
    "table": ("uvaple.commands.table", "table files for the disk placement: write one from a checkpoint's tensor "
                                       "(write), print its header (info), check every page (verify), remove the "
                                       "ones no load has used for days (prune)"),
    "shm": ("uvaple.commands.shm", "list the named shared tables in /dev/shm (list); remove the ones nobody uses "
                                   "(clean)"),
}

USAGE = "usage: uvaple {" + ",".join(COMMANDS) + "} [options]  |  uvaple --version"


def usage() -> str:
    lines = [USAGE, ""]
    lines += [f"  {name:8s} {helptext}" for name, (_, helptext) in COMMANDS.items()]
    lines += ["", "uvaple COMMAND --help: that command's options and exit statuses (2: a usage error)."]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv:
        print(usage(), file=sys.stderr)
        return 2
    if argv[0] in ("-h", "--help"):
        print(usage())
        return 0
    if argv[0] == "--version":
        from .. import __version__

        print(__version__)
        return 0
    cmd, rest = argv[0], argv[1:]
    if cmd not in COMMANDS:
        print(f"uvaple: unknown command {cmd!r}; choose one of {', '.join(COMMANDS)} (uvaple --help)", file=sys.stderr)
        return 2
    import importlib

    module = importlib.import_module(COMMANDS[cmd][0])
    return int(module.main(rest) or 0)


if __name__ == "__main__":
    raise SystemExit(main())
