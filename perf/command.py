"""What every ``uvaple bench`` workload's command line shares.

* ``--out``: the results' directory, made and checked writable before any work (:func:`prepare_out`);
  by default ``./uvaple-results/<time>_<workload>_<device>/`` under the current directory.
* ``--smoke``: a small run on the CPU (interpreted kernels, correctness only) that any machine can make in
  about a minute.
* Refusals up front (:class:`Refused`, exit status :data:`EXIT_REFUSED`): what this machine cannot run (a
  table bigger than its free host memory, a GPU measurement without CUDA) is said before anything is built,
  with the flag that runs here.
* Progress on stderr (:func:`bar`, tqdm): stdout keeps the results. ``--quiet`` turns it off
  (:func:`progress`).
* The last line names where the results are (:func:`wrote`), or says that none were written and why.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import sys
import tempfile
import time
from collections.abc import Iterable, Iterator
from contextvars import ContextVar
from pathlib import Path
from typing import Any

from tqdm import tqdm

from uvaple.dtypes import fmt_bytes
from uvaple.uva import system

__all__ = ["EXIT_FAILED", "EXIT_MISMATCH", "EXIT_REFUSED", "WORKLOADS", "Refused", "refuse", "default_out_dir",
           "prepare_out", "check_fits", "needs_cuda", "positive_ints", "number", "progress", "bar", "say",
           "write_json", "wrote", "device_label", "EXIT_STATUSES"]

#: exit status of a run in which an output differed from its reference
EXIT_MISMATCH = 1
#: exit status of a run refused before any work (argparse's status for a usage error too)
EXIT_REFUSED = 2
#: exit status of a run that ran, in which a provider or a point failed (its rows say why)
EXIT_FAILED = 3
#: what every workload's ``--help`` says of its exit statuses
EXIT_STATUSES = (f"exit status: 0 every output agreed; {EXIT_MISMATCH} an output differed from its reference; "
                 f"{EXIT_REFUSED} refused before any work (a bad option, or what this machine cannot run: the message "
                 f"names the flag that runs here); {EXIT_FAILED} a provider or a point failed (its rows say why).")

#: ``--workload`` name -> what it measures
WORKLOADS = {
    "ple": "Gemma 3n-shaped PLE rows: every provider against the memcpy ceiling, and table readiness (default)",
    "ngram": "160-byte fp8 n-gram rows at random over a big table (24 GiB by default)",
    "hotset": "token-id rows: hot set, de-duplication and fp8 rows, each against the uncached lookup",
    "host": "the host's cost of one eager call, next to torch's index_select",
    "disk": "4 KiB random reads of a table file: the disk's rate by queue depth, and the reference reader's",
}

GIB = 1 << 30
# Progress lines on a log (stderr not a terminal): one every this many seconds, as a log wants them.
LOG_EVERY_S = 15.0
# A step shorter than this shows no bar at all (a bar is for a step a user would otherwise wait on).
BAR_DELAY_S = 1.0

_quiet: ContextVar[bool] = ContextVar("uvaple_bench_quiet", default=False)


class Refused(Exception):
    """A run this machine cannot make, refused before any work; the message names the flag that runs here."""


def positive_ints(text: str) -> list[int]:
    """An argparse type: comma-separated positive integers (``"1,64,1024"``)."""
    try:
        vals = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        vals = []
    if not vals or min(vals) < 1:
        raise argparse.ArgumentTypeError(f"expected comma-separated positive integers, got {text!r}")
    return vals


def number(kind: type = float, *, low: float = 0.0, inclusive: bool = False, meaning: str = "",
           noun: str = "a number", hint: str = ""):
    """An argparse type: one finite ``kind`` number above ``low`` (at or above, ``inclusive``); a bad value's
    message says what was typed and what is accepted (``noun`` and ``meaning``: what the value is and counts, e.g.
    "seconds"; ``hint``: what to do instead, after the value)."""
    bound = f"{'at least' if inclusive else 'above'} {low:g}"

    def parse(text: str):
        try:
            value = kind(text)
        except ValueError:
            value = None
        if value is None or not math.isfinite(value) or (value < low if inclusive else value <= low):
            raise argparse.ArgumentTypeError(f"expected {noun} {bound}{' (' + meaning + ')' if meaning else ''}, "
                                             f"got {text!r}{' (' + hint + ')' if hint else ''}")
        return value

    parse.__name__ = f"{kind.__name__} {bound}"
    return parse


def refuse(prog: str, error: Refused) -> int:
    """Say why ``prog`` was refused (stderr, with the line that no results were written); return the status."""
    print(f"{prog}: {error}", file=sys.stderr)
    print(f"{prog}: nothing was run; no results written", file=sys.stderr)
    return EXIT_REFUSED


def device_label(cuda: bool) -> str:
    """The device as a directory name: the GPU's name (``NVIDIA-H200``), or ``cpu``."""
    if not cuda:
        return "cpu"
    import torch

    name = torch.cuda.get_device_name(torch.cuda.current_device())
    return "".join(c if c.isalnum() else "-" for c in name).strip("-")[:40] or "gpu"


def default_out_dir(workload: str, device: str, stamp: str | None = None) -> Path:
    """``./uvaple-results/<UTC time>_<workload>_<device>/`` under the current directory (never inside the
    package). ``stamp``: ``YYYYmmdd_HHMMSS`` (default: now)."""
    stamp = stamp or time.strftime("%Y%m%d_%H%M%S", time.gmtime())
    return Path.cwd() / "uvaple-results" / f"{stamp}_{workload}_{device}"


def workload_out(workload: str, out: str | os.PathLike | None, cuda: bool) -> Path:
    """A workload's results directory: ``out``, else its default for this device, made and checked now."""
    return prepare_out(out, default_out_dir(workload, device_label(cuda)))


def prepare_out(out: str | os.PathLike | None, default: Path) -> Path:
    """The results' directory (``out``, else ``default``), made and checked writable now, before any work.

    Raises :class:`Refused` naming the path and the reason where it cannot be made or written."""
    path = Path(out) if out else default
    try:
        path.mkdir(parents=True, exist_ok=True)
        with tempfile.NamedTemporaryFile(dir=path, prefix=".uvaple-write-check-"):
            pass
    except OSError as e:
        where = f"--out {path}" if out else f"the default results directory {path}"
        raise Refused(f"{where} cannot be used: {e.strerror or e}. Pass --out with a directory you can "
                      "write") from None
    return path


def check_fits(nbytes: int, what: str, instead: str, *, trust_gib: float | None = None) -> None:
    """Refuse (:class:`Refused`) ``what``, ``nbytes`` of host memory, where this machine's free host memory
    (``MemAvailable``; ``trust_gib`` GiB where given) cannot hold it; ``instead`` says what runs here."""
    avail = int(trust_gib * GIB) if trust_gib else system.mem_available_bytes()
    if avail is not None and nbytes > avail:
        source = "--host-mem-gib" if trust_gib else "available here (MemAvailable)"
        raise Refused(f"{what} needs {fmt_bytes(nbytes)} of host memory; {fmt_bytes(avail)} is {source}. "
                      f"{instead}")


def needs_cuda(what: str, instead: str) -> None:
    """Refuse (:class:`Refused`) ``what`` where torch sees no CUDA GPU; ``instead`` says what runs here."""
    import torch

    if not torch.cuda.is_available():
        raise Refused(f"{what} needs a CUDA GPU, and torch sees none here. {instead}")


@contextlib.contextmanager
def progress(enabled: bool) -> Iterator[None]:
    """Within: the bars of :func:`bar` are shown (``enabled``) or not (``--quiet``)."""
    token = _quiet.set(not enabled)
    try:
        yield
    finally:
        _quiet.reset(token)


def bar(iterable: Iterable | None = None, *, total: int | None = None, desc: str = "", unit: str = "it",
        leave: bool = False) -> tqdm:
    """A progress bar on stderr (tqdm), shown once a step has taken :data:`BAR_DELAY_S`; redrawn in place on
    a terminal (cleared when done unless ``leave``), every :data:`LOG_EVERY_S` and when done on a log; off
    under ``--quiet``."""
    tty = bool(getattr(sys.stderr, "isatty", lambda: False)())
    return tqdm(iterable, total=total, desc=desc, unit=unit, leave=leave or not tty, file=sys.stderr,
                disable=_quiet.get(),
                delay=BAR_DELAY_S, mininterval=0.2 if tty else LOG_EVERY_S, dynamic_ncols=tty)


def say(line: str) -> None:
    """A result line on stdout, written around the bars on stderr."""
    tqdm.write(line, file=sys.stdout)
    sys.stdout.flush()


def write_json(out_dir: Path, name: str, doc: Any) -> Path:
    path = out_dir / name
    path.write_text(json.dumps(doc, indent=1))
    return path


@contextlib.contextmanager
def kept_on_failure(out_dir: Path, name: str, doc: dict) -> Iterator[None]:
    """A run that fails inside keeps what it measured: ``doc`` (with the error) written to ``out_dir/name``,
    where it is said on stderr, and the failure raised as before."""
    try:
        yield
    except BaseException as e:
        doc["error"] = f"{type(e).__name__}: {e}"
        path = write_json(out_dir, name, doc)
        print(f"the run failed ({doc['error'][:200]}); what it measured is in {path}", file=sys.stderr)
        raise


def wrote(out_dir: Path, paths: Iterable[Path], note: str = "") -> None:
    """The last line: where the results are."""
    names = ", ".join(p.name for p in paths)
    say(f"results in {out_dir}/ ({names}){note}")
