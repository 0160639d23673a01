"""The disk placement's decode steps against the whole table pinned and against a file-backed mmap table: the
second part of ``uvaple bench --workload disk``.

**Ids from real text.** The text files given (``--text``; by default this package's own documentation and
sources: English and code) are split into words, each word a token id (its CRC-32 modulo a 151,936-token
vocabulary), laid out as ``batch`` sequences (lanes) starting at even offsets. A step moves every lane one token
on; its ids are the n-gram hash of each lane's last tokens (:func:`uvaple.integration.models.qwen4_exp.ngram_ids`,
Qwen4Exp's definition: n-grams of 2 and 3 tokens, 8 heads each, 16 heads whose prime-sized ranges split the
table's rows), so a step reads ``batch x 16`` rows spread over the whole table, repeats where the text repeats.

**Providers**, each fed the same steps as host ids and each step ending with its rows on the device,
synchronised (a decode step waits for its rows):

* ``pinned``: every row in a registered host table (``uva``), the ids copied to the device: the ceiling;
* ``disk``, at each budget of ``--budgets`` (a fraction of the table): :class:`~uvaple.integration.DiskLookup`
  over the file, started cold (``O_DIRECT`` reads, an empty row cache);
* ``disk ... threads``, at the smallest budget, where the disk placement reads through io_uring: the same with
  its reads kept in flight by threads instead (``read_engine="threads"``), in the same run;
* ``disk ... hot``, at the smallest budget, for each fraction of ``--hot``: the same with that fraction of the
  table's rows held in device memory (``hot_rows``): the most frequent rows of a profile, the same number of
  steps of each lane's next tokens, right after the run's (text of the same kind that the run never reads);
* ``disk ... xN layer by layer`` and ``... xN round`` (``--layers N``), at the smallest budget: N lookups, one a
  PLE layer (each with its own cache and its own hash of the lanes), a step's rows read as a model reads them,
  each layer's ids copied and read in its own call, or all layers' ids copied once and read ahead in one round
  (:class:`Layers`): the same pages and hit rate, and the round's time against layer by layer's, with its parts
  timed apart (the ids' copy, the round, its longest read-ahead and the sum of them, the layers' calls);
* ``mmap``: the file mapped (``np.memmap``, ``MADV_RANDOM``), each step's pages advised ``MADV_WILLNEED`` at
  once (their reads in flight together, as SGLang's prefetcher issues them), then gathered by numpy and copied
  to the device: vLLM's disk-offload and SGLang's file backend, built to win. Its memory cap is the page
  cache's: ``--mmap-cap-gib`` makes it real by holding the rest of the host's available memory in a
  pre-faulted balloon while it runs (the file's cached pages are dropped first, ``POSIX_FADV_DONTNEED``).

**Figures**, per batch and provider: the median step of the first ``--cold-steps`` steps (the cold start),
then the steady state: ``--blocks`` blocks of steps, each block's median step, reported as the median of the
blocks with their min-max. For ``disk``: the row cache's hit rate, the pages read a step, and the I/O floor of a
step (those pages at the disk's best random-read rate, measured by the first part); the time a step adds over
``pinned`` against that floor (goal: at most 1.1x at batch 64). Every provider's rows are compared bit for bit
with the file's rows, at every step.
"""

from __future__ import annotations

import mmap
import os
import statistics
import time
import zlib
from pathlib import Path

import numpy as np
import torch

from uvaple.integration import DiskLookup, make_lookup
from uvaple.integration.models.qwen4_exp import layer_multipliers, ngram_ids
from uvaple.integration.placements.read_round import ReadRound
from uvaple.uva import HostTable, TableFile, system, uring
from uvaple.uva.table_file import PAGE, page_buffer

from . import command

VOCAB = 151_936
NGRAM, HEADS_PER_NGRAM = 3, 8
HEADS = (NGRAM - 1) * HEADS_PER_NGRAM
EOS = 151_643


# ------------------------------------------------------------------ ids from text
def text_tokens(paths: list[str] | None) -> np.ndarray:
    """Word tokens (int64) of the text files ``paths`` (default: this package's docs and sources)."""
    if not paths:
        root = Path(__file__).resolve().parents[1]  # the package: its folders, never an environment inside it
        patterns = ("*.md", "docs/*.md", *(f"{d}/**/*.py" for d in ("kernels", "uva", "integration", "uvaple",
                                                                      "perf")))
        paths = sorted(str(p) for pattern in patterns for p in root.glob(pattern) if "results" not in p.parts)
    words: list[int] = []
    for p in paths:
        try:
            text = Path(p).read_text(errors="replace")
        except OSError as e:
            raise command.Refused(f"--text {p}: {e.strerror}") from None
        words.extend(zlib.crc32(w.encode()) % VOCAB for w in text.split())
    if len(words) < 1000:
        raise command.Refused(f"--text: {len(words)} words in {len(paths)} files; give at least 1,000 words")
    return np.asarray(words, dtype=np.int64)


class Steps:
    """The table rows of each decode step of ``batch`` lanes over ``tokens`` (see the module docstring)."""

    def __init__(self, tokens: np.ndarray, rows: int, batch: int, steps: int, seed: int = 11, skip: int = 0):
        g = torch.Generator().manual_seed(seed)
        size = rows // HEADS
        sizes = (torch.randint(size - size // 8, size, (HEADS,), generator=g) | 1).clamp(max=size)
        self.buffers = dict(multipliers=torch.tensor(layer_multipliers(VOCAB, NGRAM, 1, seed), dtype=torch.long),
                            sizes=sizes, offsets=torch.arange(HEADS) * size)
        starts = (np.arange(batch) * (len(tokens) // batch) + skip).astype(np.int64)  # ``skip``: tokens into a lane
        span = NGRAM - 1 + steps
        idx = (starts[:, None] + np.arange(span)) % len(tokens)
        self.history = torch.from_numpy(tokens[idx])  # [batch, NGRAM - 1 + steps]
        self.batch, self.count = batch, steps

    def ids(self, step: int) -> torch.Tensor:
        """Step ``step``'s rows, ``[batch, HEADS]`` int64 (host)."""
        h = self.history[:, step: step + NGRAM].contiguous()
        return ngram_ids(h, eos=EOS, heads_per_ngram=HEADS_PER_NGRAM, last=1, **self.buffers)[:, 0]


# ------------------------------------------------------------------ providers
class Pinned:
    name = "pinned"

    def __init__(self, f: TableFile, device: torch.device):
        lay = f.layout
        self.table = HostTable.empty(lay.rows, lay.cols, lay.dtype, register=device.type == "cuda")
        dst = torch.from_numpy(self.table.bytes_view())  # [rows, stride]: the file's row stride
        per = max(1, lay.pages_per_row)
        chunk = (16384 // per) * per  # 64 MiB of pages a read, whole rows
        buf = page_buffer(chunk)
        for p0 in command.bar(range(0, lay.data_pages, chunk), desc="loading the whole table (pinned)", unit="read"):
            n = min(chunk, lay.data_pages - p0)
            f.read_pages(range(p0, p0 + n), buf[:n])  # sequential, each page checked
            r0, r1 = lay.rows_of(p0, p0 + n)
            if lay.rows_per_page:
                rows = buf[:n, : lay.rows_per_page * lay.stride].reshape(-1, lay.stride)[: r1 - r0]
            else:
                rows = buf[:n].reshape(-1, per * PAGE)[:, : lay.stride]
            dst[r0:r1] = rows
        self.lookup = make_lookup("uva", self.table, device=device)
        self.device = device

    def __call__(self, ids: torch.Tensor) -> torch.Tensor:
        return self.lookup.lookup(ids.to(self.device))

    def close(self) -> None:
        self.lookup.close()
        self.table.close()


def disk_lookup(path: str, device: torch.device, budget: float, max_rows: int, **options) -> DiskLookup:
    """A disk lookup over the file at ``path`` whose row cache holds ``budget`` (a fraction) of the table."""
    with TableFile.open(path) as f:
        nbytes = int(f.layout.rows * f.layout.stride * budget)
    return make_lookup("disk", path, device=device, max_rows=max_rows, budget_bytes=max(nbytes, 1 << 16), **options)


class Disk:
    def __init__(self, path: str, device: torch.device, budget: float, max_rows: int, hot: tuple | None = None,
                 engine: str = "auto"):
        self.lookup = disk_lookup(path, device, budget, max_rows, read_engine=engine,
                                  **({} if hot is None else {"hot_rows": hot[1]}))
        self.name = f"disk {budget:g}" + ("" if hot is None else f" hot {hot[0]:g}") + \
            ("" if engine == "auto" else f" {engine}")

        self.phases: dict[str, list[float]] = {"read_in": [], "pages": [], "gather": []}
        self._time_phases()

    def _time_phases(self) -> None:
        """Each call's parts timed apart, on this instance only (the product untouched): the row cache's plan
        and the misses' reads into their slots (``read_in``), the reads alone (``pages``, the reader's rounds;
        ``read_in`` less ``pages`` is ``plan_copy``: the plan and the rows copied into their slots) and the
        gather's launch (``gather``); the call's ``rest`` is its own Python (ids, staging, completion word)."""
        lk = self.lookup

        def timed(fn, key):
            def call(*args, **kwargs):
                t0 = time.perf_counter()
                try:
                    return fn(*args, **kwargs)
                finally:
                    self._part[key] += (time.perf_counter() - t0) * 1e6
            return call

        self._part = dict.fromkeys(self.phases, 0.0)
        lk.cache.read_in = timed(lk.cache.read_in, "read_in")
        if lk._reader is not None:
            lk._reader._read = timed(lk._reader._read, "pages")
        lk._plan.run = timed(lk._plan.run, "gather")

    def __call__(self, ids: torch.Tensor) -> torch.Tensor:
        self._part = dict.fromkeys(self.phases, 0.0)
        out = self.lookup.lookup(ids)
        for k, v in self._part.items():
            self.phases[k].append(v)
        return out

    def counts(self) -> tuple[int, int, int, int]:
        st = self.lookup.stats()
        return st["cache"]["hits"], st["cache"]["misses"], st["pages_read"], st["hot_hits"]

    def close(self) -> None:
        lk = self.lookup  # the timers off first: each held its object's own method, a cycle that kept it alive
        for obj, name in ((lk.cache, "read_in"), (lk._reader, "_read"), (lk._plan, "run")):
            if obj is not None:
                vars(obj).pop(name, None)
        lk.close()


class LayerSteps:
    """The rows of ``layers`` PLE layers a step, ``[layers, batch, HEADS]``: the same lanes hashed by each layer's
    own multipliers and head sizes (:class:`Steps` of another seed each)."""

    def __init__(self, tokens: np.ndarray, rows: int, batch: int, steps: int, layers: int):
        self.per = [Steps(tokens, rows, batch, steps, seed=11 + i) for i in range(layers)]
        self.batch, self.count = batch, steps

    def ids(self, step: int) -> torch.Tensor:
        return torch.stack([p.ids(step) for p in self.per])


class Layers:
    """``layers`` disk lookups over the file (one a PLE layer, each its own row cache of ``budget``), a step's rows
    read as a model reads them: the hashed ids on the device, then either each layer's call copies its ids to the
    host, waits for them and reads its misses in turn (``layer by layer``), or every layer's ids are copied at once,
    waited for once and read ahead in one :class:`~uvaple.integration.placements.read_round.ReadRound` (``round``),
    each call then looking up from the host ids."""

    hot = False

    def __init__(self, path: str, device: torch.device, budget: float, max_rows: int, layers: int, together: bool):
        self.lookups: list[DiskLookup] = []
        self.round = None
        try:
            for _ in range(layers):
                self.lookups.append(disk_lookup(path, device, budget, max_rows))
            if together:
                self.round = ReadRound(self.lookups)
        except BaseException:
            self.close()
            raise
        self.host = torch.empty((layers, max_rows), dtype=torch.int64, pin_memory=device.type == "cuda")
        self.device = device
        self.name = f"disk {budget:g} x{layers} " + ("round" if together else "layer by layer")
        # a round's parts a step (us): the ids' copy and wait, the round, its longest read-ahead and their sum (each
        # timed on its own thread: the round less the longest is the pool's hand-over; the sum against the longest
        # says how much the read-aheads overlapped), then the layers' calls
        self.phases: dict[str, list[float]] = {k: [] for k in ("ids", "read_ahead", "read_ahead_longest",
                                                              "read_ahead_sum", "calls")} if together else {}
        self._each: list[float] = []
        if together:
            for lk in self.lookups:  # on the instance only (the product untouched); close() takes them off
                lk.prefetch = self._timed(lk.prefetch)

    def _timed(self, fn):
        def call(ids):
            t0 = time.perf_counter()
            try:
                return fn(ids)
            finally:
                self._each.append((time.perf_counter() - t0) * 1e6)  # (list.append is atomic across threads)
        return call

    def __call__(self, ids: torch.Tensor) -> torch.Tensor:
        dev = ids.to(self.device)  # [layers, batch, HEADS]: a model's hashed ids are the GPU's
        if self.round is None:  # each call copies its ids to the host and waits for them
            return torch.stack([lk.lookup(d) for lk, d in zip(self.lookups, dev, strict=True)])
        t0 = time.perf_counter()
        host = self.host[:, :dev[0].numel()].view(dev.shape)
        host.copy_(dev, non_blocking=True)
        _sync(self.device)  # the step's one wait for its ids
        t1 = time.perf_counter()
        self._each = []
        self.round.prefetch(list(host))
        t2 = time.perf_counter()
        rows = torch.stack([lk.lookup(h) for lk, h in zip(self.lookups, host, strict=True)])
        t3 = time.perf_counter()
        for key, value in (("ids", t1 - t0), ("read_ahead", t2 - t1), ("calls", t3 - t2)):
            self.phases[key].append(value * 1e6)
        self.phases["read_ahead_longest"].append(max(self._each))
        self.phases["read_ahead_sum"].append(sum(self._each))
        return rows

    def counts(self) -> tuple[int, int, int, int]:
        st = [lk.stats() for lk in self.lookups]
        return (sum(s["cache"]["hits"] for s in st), sum(s["cache"]["misses"] for s in st),
                sum(s["pages_read"] for s in st), 0)

    def close(self) -> None:
        if self.round is not None:
            self.round.close()
        for lk in self.lookups:
            vars(lk).pop("prefetch", None)  # the timer off first (it held the lookup's own method)
            lk.close()


def hot_rows(tokens: np.ndarray, rows: int, batch: int, steps: int, fraction: float) -> torch.Tensor:
    """The ``fraction`` of the table's rows most often read by ``steps`` steps of ``batch`` lanes, each starting
    where the run's lane of the same number stops reading (a profile of the same kind of text, never of the
    run's own ids; a profile shifted by half the text would be the run's own lanes at every even batch)."""
    span = NGRAM - 1 + steps
    if len(tokens) // batch < 2 * span:
        raise command.Refused(f"--hot at batch {batch}: a hot set's profile needs text the run does not read, {batch} "
                              f"lanes of twice {span} tokens ({2 * span * batch:,} words); the text has "
                              f"{len(tokens):,}: give more --text, fewer --steps, or --no-hot")
    profile = Steps(tokens, rows, batch, steps, skip=span)
    ids = torch.cat([profile.ids(s).reshape(-1) for s in range(steps)])
    counts = torch.bincount(ids, minlength=rows)
    return torch.argsort(counts, descending=True, stable=True)[:max(1, int(rows * fraction))]


class Mmap:
    name = "mmap"

    def __init__(self, path: str, device: torch.device, cap_gib: float | None):
        with TableFile.open(path) as f:
            self.lay = f.layout
        self.balloon = None
        if cap_gib:  # the page cache's cap made real: the rest of the available memory held, pre-faulted
            hold = (system.mem_available_bytes() or 0) - int(cap_gib * (1 << 30))
            if hold > PAGE:
                command.say(f"mmap: holding {hold / (1 << 30):.1f} GiB so that about {cap_gib:g} GiB is left to the "
                            "page cache")
                self.balloon = HostTable.empty(hold // PAGE, PAGE, torch.uint8, register=False)
        fd = os.open(path, os.O_RDONLY)
        try:
            if hasattr(os, "posix_fadvise"):
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)  # cold: the file's cached pages dropped
            self.map = mmap.mmap(fd, 0, prot=mmap.PROT_READ)
        finally:
            os.close(fd)
        self.map.madvise(mmap.MADV_RANDOM)
        self.bytes = np.frombuffer(self.map, dtype=np.uint8)
        self.device = device

    def __call__(self, ids: torch.Tensor) -> torch.Tensor:
        lay, r = self.lay, ids.reshape(-1).numpy()
        if lay.rows_per_page:
            page = r // lay.rows_per_page
            at = (1 + page) * PAGE + (r % lay.rows_per_page) * lay.stride
        else:
            page = r * lay.pages_per_row
            at = (1 + page) * PAGE
        for p in np.unique(page):  # every page of the step in flight at once
            self.map.madvise(mmap.MADV_WILLNEED, int(1 + p) * PAGE, PAGE * max(1, lay.pages_per_row))
        rows = torch.from_numpy(self.bytes[at[:, None] + np.arange(lay.row_bytes)]).view(lay.dtype)
        return rows.reshape(*ids.shape, lay.cols).to(self.device)

    def close(self) -> None:
        self.bytes = None
        self.map.close()
        if self.balloon is not None:
            self.balloon.close()


# ------------------------------------------------------------------ the run
def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def time_steps(provider, steps: Steps, src_of, device: torch.device, cold: int, blocks: int,
               check_every: int = 1) -> dict:
    """Every step of ``steps`` through ``provider``, each timed to its rows on the device; the rows of every
    ``check_every``-th step checked against ``src_of(ids)`` (the table's rows), outside the timed region."""
    times, calls, exact = [], [], True
    pages0 = provider.counts() if hasattr(provider, "counts") else None
    for s in command.bar(range(steps.count), desc=f"{provider.name}, batch {steps.batch}", unit="step"):
        ids = steps.ids(s)
        t0 = time.perf_counter()
        rows = provider(ids)
        t1 = time.perf_counter()
        _sync(device)
        times.append((time.perf_counter() - t0) * 1e6)
        calls.append((t1 - t0) * 1e6)
        if exact and s % check_every == 0 and not torch.equal(rows.cpu().view(torch.uint8),
                                                              src_of(ids).view(torch.uint8)):
            exact = False
    steady = times[cold:]
    per = max(1, len(steady) // blocks)
    medians = [statistics.median(steady[i * per:(i + 1) * per]) for i in range(blocks) if steady[i * per:(i + 1) * per]]
    r = {"cold_median_us": round(statistics.median(times[:cold]), 1),
         "steady_median_us": round(statistics.median(medians), 1),
         "steady_min_us": round(min(medians), 1), "steady_max_us": round(max(medians), 1),
         "steps": steps.count, "exact": exact}
    # where a steady step's time goes (medians of the steady steps): the call on the host, then the wait for
    # its rows on the device; for the disk placement the call's parts (see Disk._time_phases)
    parts = {"call": calls[cold:], "sync": [t - c for t, c in zip(steady, calls[cold:], strict=True)]}
    for k, v in getattr(provider, "phases", {}).items():
        parts[k] = v[cold:]
    if "read_in" in parts:
        # the row cache's plan and the rows copied from the read buffer into their slots
        parts["plan_copy"] = [a - b for a, b in zip(parts["read_in"], parts["pages"], strict=True)]
        parts["rest"] = [c - a - g for c, a, g in zip(parts["call"], parts["read_in"], parts["gather"], strict=True)]
    r["parts_median_us"] = {k: round(statistics.median(v), 1) for k, v in parts.items() if v}
    if pages0 is not None:
        hits, misses, pages, hot = (b - a for a, b in zip(pages0, provider.counts(), strict=True))
        r.update(hit_rate=round(hits / max(1, hits + misses), 3), pages_per_step=round(pages / steps.count, 1))
        if getattr(provider, "hot", None) is None and provider.lookup.stats()["hot_rows"]:  # of every id: from HBM
            r["hot_hit_rate"] = round(hot / max(1, steps.count * steps.batch * HEADS), 3)
    return r


def run(a, path: str, limit_reads_per_s: float, device: torch.device) -> dict:
    """The steps of every batch through every provider (see the module docstring)."""
    tokens = text_tokens(a.text)
    res = {"device": str(device), "tokens": int(len(tokens)), "batches": {}, "budgets": a.budgets,
           "limit_reads_per_s": limit_reads_per_s}
    with TableFile.open(path) as f:
        rows = f.layout.rows

        pinned = Pinned(f, device) if a.pinned else None

        def src_of(ids: torch.Tensor) -> torch.Tensor:  # the rows in memory where pinned holds them, else the file's
            if pinned is not None:
                return pinned.table.tensor[ids.reshape(-1)].reshape(*ids.shape, f.layout.cols)
            return f.read_rows(ids.reshape(-1)).reshape(*ids.shape, f.layout.cols)

        try:
            for b in a.batches:
                steps = Steps(tokens, rows, b, a.steps)
                out = res["batches"][str(b)] = {}
                providers = ([lambda: pinned] if pinned else []) + \
                    [lambda q=q, b=b: Disk(path, device, q, b * HEADS) for q in a.budgets] + \
                    ([lambda b=b: Disk(path, device, min(a.budgets), b * HEADS, engine="threads")]
                     if uring.unavailable() is None else []) + \
                    [lambda h=h, b=b: Disk(path, device, min(a.budgets), b * HEADS,
                                           (h, hot_rows(tokens, rows, b, a.steps, h))) for h in a.hot] + \
                    ([lambda: Mmap(path, device, a.mmap_cap_gib)] if a.mmap else [])
                layer_steps = LayerSteps(tokens, rows, b, a.steps, a.layers) if a.layers else None
                providers += [lambda t=t, b=b: Layers(path, device, min(a.budgets), b * HEADS, a.layers, t)
                              for t in ((False, True) if a.layers else ())]
                for make in providers:
                    p = make()
                    try:
                        r = time_steps(p, layer_steps if isinstance(p, Layers) else steps, src_of, device,
                                       a.cold_steps, a.blocks, 1 if pinned is not None else 10)
                    finally:
                        if p is not pinned:
                            p.close()
                    out[p.name] = r
                    line = (f"batch {b:>3} {p.name:>10}: steady {r['steady_median_us']:>9,.1f} us a step "
                            f"[{r['steady_min_us']:,.1f}-{r['steady_max_us']:,.1f}], cold {r['cold_median_us']:,.1f}")
                    if "hit_rate" in r:
                        floor = r["pages_per_step"] / limit_reads_per_s * 1e6
                        r["io_floor_us"] = round(floor, 1)
                        line += f"; hits {r['hit_rate']:.1%}, {r['pages_per_step']} pages a step (I/O floor " \
                                f"{floor:,.1f} us)"
                        if "hot_hit_rate" in r:
                            line += f", {r['hot_hit_rate']:.1%} of ids from the hot rows"
                        if pinned:
                            added = r["steady_median_us"] - out["pinned"]["steady_median_us"]
                            r["added_us"] = round(added, 1)
                            r["added_x_floor"] = round(added / floor, 2) if floor else None
                            line += f", adds {added:,.1f} us over pinned"
                    if isinstance(p, Layers) and p.round is not None:  # against layer by layer, same run
                        alone = out[p.name.replace("round", "layer by layer")]
                        r["x_layer_by_layer"] = round(r["steady_median_us"] / alone["steady_median_us"], 3)
                        line += f"; {r['x_layer_by_layer']}x the time of layer by layer"
                    command.say(line + ("" if r["exact"] else "  ROWS DIFFER"))
                    command.say("    parts (median us): " + ", ".join(f"{k} {v:,.1f}"
                                                                     for k, v in r["parts_median_us"].items()))
        finally:
            if pinned:
                pinned.close()
    return res
