"""The plugin's settings: ``--additional-config '{"uvaple": {...}}'`` and ``UVAPLE_*`` environment variables.

The plugin is enabled when either source names a setting (``{"uvaple": {}}`` enables it with the
defaults). Keys of the additional config win over the environment. Every key is checked: an unknown key,
a wrong type or a bad value is a :class:`PluginConfigError` that names the key, its source and the
allowed values, raised before anything is allocated.

======================  =============================  ============================================================
key                     environment                    meaning
======================  =============================  ============================================================
``placement``           ``UVAPLE_PLACEMENT``           ``uva`` (default): rows read from host memory in the model's
                                                       stream; ``copy``: the copy-based path (a host wait per
                                                       call: eager engines only, see below); ``device``: the
                                                       table copied into HBM (the reference); ``disk``: a table
                                                       file on local disk behind a host row cache, for tables
                                                       larger than host memory (eager engines only; needs
                                                       ``disk_dir``). ``split`` is refused: it gathers from ids
                                                       on the host, and vLLM hands the PLE layer its ids on the
                                                       GPU.
``fallback``            ``UVAPLE_FALLBACK``            ``none`` (default): UVA unusable is an error at startup;
                                                       ``copy``: use the copy placement then (eager engines).
``quantize``            ``UVAPLE_QUANTIZE``            ``none`` (default): rows stored as the checkpoint has
                                                       them; ``fp8_row``: Qwen4Exp's bf16/fp16 n-gram tables
                                                       quantised on load into fp8 e4m3 codes and a scale per row
                                                       (about half the host bytes), dequantised in the gather.
``shared``              ``UVAPLE_SHARED``              ``true`` (default): one host copy per node, attached by
                                                       every rank and replica (a named segment per vocabulary
                                                       shard); ``false``: a private table per process.
``segment``             ``UVAPLE_SEGMENT``             Base name of the shared segments (default: derived from
                                                       the model, its revision and dtype).
``timeout_s``           ``UVAPLE_TIMEOUT_S``           Bound, in seconds, on waiting for another process's fill
                                                       of a shared table (default 600).
``segment_dir``         ``UVAPLE_SEGMENT_DIR``         tmpfs directory of the shared segments (default
                                                       ``/dev/shm``). A ``huge=always`` tmpfs mount gives the table
                                                       2 MiB pages: ready several times sooner where ``/dev/shm``
                                                       has 4 KiB pages (``uvaple doctor`` says which).
``metrics_interval_s``  ``UVAPLE_METRICS_INTERVAL_S``  Seconds between pushes of the lookups' progress into vLLM's
                                                       ``/metrics`` (default 5, at least 0.5; 0: no export).
                                                       Needs ``prometheus_client`` (vLLM brings it) and, for
                                                       engine processes, ``PROMETHEUS_MULTIPROC_DIR``; see
                                                       :func:`uvaple.integration.models.vllm.tables.export_metrics`.
``dedup``               ``UVAPLE_DEDUP``               ``false`` (default); ``true``: a prefill-sized call reads
                                                       each distinct id once (sorted, de-duplicated: the same
                                                       bits; ``tuning.dedup_min_ids``). For token-id tables
                                                       (Gemma 3n); hashed n-gram ids hardly repeat.
``hot_cache_gb``        ``UVAPLE_HOT_CACHE_GB``        0 (default): no hot set; else 10^9 bytes of HBM per rank
                                                       for the rank's most frequent rows, ranked on
                                                       ``hot_profile`` (needed with it). The ``uva`` placement.
``hot_profile``         ``UVAPLE_HOT_PROFILE``         A ``.npy`` file or a text file of token ids (a tokenised
                                                       text like the served one): each rank counts the ids of
                                                       its vocabulary shard and holds the most frequent rows.
``disk_dir``            ``UVAPLE_DISK_DIR``            The ``disk`` placement's folder on a local disk (made if
                                                       missing): a table file per shard, named by the model, its
                                                       revision and dtype, reused by later engines of the same
                                                       checkpoint (:mod:`.disk_shard`). Needs about twice the
                                                       table's size free while the engine starts.
``disk_cache_gb``       ``UVAPLE_DISK_CACHE_GB``       The ``disk`` placement's row cache: 10^9 bytes of pinned
                                                       host memory per shard (default 4; at least a batch's
                                                       distinct rows: checked at start-up).
======================  =============================  ============================================================

What the engine runs is checked too, when the model is built (:func:`check_engine`): a setting that cannot
serve it stops the engine at start-up with a :class:`PluginConfigError` that names the setting to use
instead. The ``copy`` placement waits on the host for each call's ids, which a CUDA graph cannot hold: with
vLLM's CUDA graphs on (its default) it is refused, and ``enforce_eager`` (``--enforce-eager``) or the ``uva``
placement serve instead; a ``copy`` fallback under CUDA graphs is refused where it would be taken.
"""

from __future__ import annotations

import logging
import math
import os
import re
from collections.abc import Mapping
from dataclasses import dataclass

from uvaple.integration.errors import BackendError
from uvaple.integration.factory import PLACEMENTS as _ALL_PLACEMENTS
from uvaple.integration.factory import model_placements, placement

__all__ = ["PluginConfig", "PluginConfigError", "ENV_VARS", "DEFAULT_DISK_CACHE_GB", "from_sources", "check_engine"]

#: the placements the plugin serves: the library's, less those model layers cannot serve
PLACEMENTS = model_placements(engine=True)
#: what serves a table where the GPU cannot map host memory: a placement whose rows stay in host memory, read
#: without the GPU mapping them
FALLBACKS = ("none", *(name for name in PLACEMENTS if placement(name).host_rows and not placement(name).mapped))
QUANTIZE = ("none", "fp8_row")
#: placements of the library that the plugin cannot serve, and why (named in the error)
REFUSED_PLACEMENTS = {name: p.model_refusal or p.engine_refusal for name, p in _ALL_PLACEMENTS.items()
                      if name not in PLACEMENTS}
_SEGMENT_RE = re.compile(r"^[A-Za-z0-9_.-]{1,120}$")
# the test suite's knobs (tests/test_equivalence.py, tests/test_fuzz.py): read there, never by the plugin
_OTHER_VARS = ("UVAPLE_EQUIV_SCHEDULES", "UVAPLE_EQUIV_FIRST_SEED", "UVAPLE_EQUIV_DEADLINE_S", "UVAPLE_EQUIV_SUMMARY",
               "UVAPLE_FUZZ_EXAMPLES")
log = logging.getLogger("uvaple.vllm")

#: setting -> its environment variable
ENV_VARS = {"placement": "UVAPLE_PLACEMENT", "fallback": "UVAPLE_FALLBACK", "shared": "UVAPLE_SHARED",
            "segment": "UVAPLE_SEGMENT", "timeout_s": "UVAPLE_TIMEOUT_S", "segment_dir": "UVAPLE_SEGMENT_DIR",
            "metrics_interval_s": "UVAPLE_METRICS_INTERVAL_S", "dedup": "UVAPLE_DEDUP",
            "hot_cache_gb": "UVAPLE_HOT_CACHE_GB", "hot_profile": "UVAPLE_HOT_PROFILE",
            "quantize": "UVAPLE_QUANTIZE", "disk_dir": "UVAPLE_DISK_DIR", "disk_cache_gb": "UVAPLE_DISK_CACHE_GB"}
#: the disk placement's row cache per shard when ``disk_cache_gb`` is not given (10^9 bytes)
DEFAULT_DISK_CACHE_GB = 4.0


class PluginConfigError(BackendError, ValueError):
    """A uvaple setting of the vLLM plugin is unknown or has a bad value (the message names it)."""


@dataclass(frozen=True)
class PluginConfig:
    """The plugin's checked settings (see the module docstring)."""

    placement: str = "uva"
    fallback: str = "none"
    shared: bool = True
    segment: str | None = None
    timeout_s: float = 600.0
    segment_dir: str | None = None
    metrics_interval_s: float = 5.0
    dedup: bool = False
    hot_cache_gb: float = 0.0
    hot_profile: str | None = None
    quantize: str = "none"
    disk_dir: str | None = None
    disk_cache_gb: float | None = None  # None: DEFAULT_DISK_CACHE_GB


def _bool(value, where: str) -> bool:
    if isinstance(value, bool):
        return value
    if isinstance(value, str) and value.strip().lower() in ("1", "true", "yes", "on"):
        return True
    if isinstance(value, str) and value.strip().lower() in ("0", "false", "no", "off"):
        return False
    raise PluginConfigError(f"{where}: expected true or false, got {value!r}")


def _number(value) -> float:
    """``value`` as a float (a number or its string), NaN for anything else (a bool too)."""
    try:
        return float(value) if not isinstance(value, bool) else math.nan
    except (TypeError, ValueError):
        return math.nan


def _check(key: str, value, where: str):
    if key in ("placement", "fallback", "quantize"):
        allowed = {"placement": PLACEMENTS, "fallback": FALLBACKS, "quantize": QUANTIZE}[key]
        if key == "placement" and isinstance(value, str) and value.strip().lower() in REFUSED_PLACEMENTS:
            raise PluginConfigError(f"{where}: {value.strip().lower()!r} cannot serve vLLM: "
                                    f"{REFUSED_PLACEMENTS[value.strip().lower()]}")
        if not isinstance(value, str) or value.strip().lower() not in allowed:
            raise PluginConfigError(f"{where}: expected one of {list(allowed)}, got {value!r}")
        return value.strip().lower()
    if key in ("shared", "dedup"):
        return _bool(value, where)
    if key == "hot_cache_gb":
        gb = _number(value)
        if not (gb >= 0 and math.isfinite(gb)):
            raise PluginConfigError(f"{where}: expected 0 (no hot set) or a positive number of gigabytes (10^9 "
                                    f"bytes of HBM per rank), got {value!r}")
        return gb
    if key == "hot_profile":
        if value is None:
            return None
        if not isinstance(value, str) or not os.path.isfile(value) or not os.access(value, os.R_OK):
            raise PluginConfigError(f"{where}: expected a readable .npy or text file of token ids, got {value!r}")
        return value
    if key == "segment":
        if value is None:
            return None
        if not isinstance(value, str) or not _SEGMENT_RE.match(value):
            raise PluginConfigError(f"{where}: a segment name is 1-120 letters, digits, '_', '-' or '.', "
                                    f"got {value!r}")
        return value
    if key == "segment_dir":
        if value is None:
            return None
        if not isinstance(value, str) or not value:
            raise PluginConfigError(f"{where}: expected a directory path, got {value!r}")
        from uvaple.uva import SharedSegmentError, segments

        try:
            return segments.segment_dir(value)
        except SharedSegmentError as e:
            raise PluginConfigError(f"{where}: {e}") from None
    if key == "disk_dir":
        if not isinstance(value, str) or not value.strip():
            raise PluginConfigError(f"{where}: expected a folder on a local disk for the table files, got {value!r}")
        return os.path.abspath(os.path.expanduser(value.strip()))
    if key == "disk_cache_gb":
        gb = _number(value)
        if not (gb > 0 and math.isfinite(gb)):
            raise PluginConfigError(f"{where}: expected a positive number of gigabytes (10^9 bytes of pinned host "
                                    f"memory per shard), got {value!r}")
        return gb
    if key == "timeout_s":
        t = _number(value)
        if not (t > 0 and math.isfinite(t)):
            raise PluginConfigError(f"{where}: expected a positive number of seconds, got {value!r}")
        return t
    if key == "metrics_interval_s":
        t = _number(value)
        if not (t == 0 or 0.5 <= t < 1e6):
            raise PluginConfigError(f"{where}: expected 0 (no metrics export) or at least 0.5 seconds, got "
                                    f"{value!r}")
        return t
    raise AssertionError(key)


def from_sources(additional: Mapping | None, environ: Mapping[str, str] | None = None) -> PluginConfig | None:
    """The settings from vLLM's additional config (its ``"uvaple"`` entry) and the environment, or None
    when neither enables the plugin."""
    environ = os.environ if environ is None else environ
    values: dict = {}
    enabled = False
    for key, var in ENV_VARS.items():
        if var in environ:
            enabled = True
            values[key] = _check(key, environ[var], f"environment variable {var}")
    unknown_env = sorted(k for k in environ if k.startswith("UVAPLE_") and k not in ENV_VARS.values()
                         and k not in _OTHER_VARS)
    if unknown_env:  # a typo must not pass unseen; other tools' variables must not stop a server
        log.warning("ignoring unknown environment variable(s) %s; the vLLM plugin reads %s", unknown_env,
                    sorted(ENV_VARS.values()))
    if additional is not None and "uvaple" in additional:
        entry = additional["uvaple"]
        if not isinstance(entry, Mapping):
            raise PluginConfigError(f'--additional-config "uvaple" must be an object of settings, got {entry!r}')
        unknown = sorted(set(entry) - set(ENV_VARS))
        if unknown:
            raise PluginConfigError(f'unknown key(s) {unknown} in --additional-config "uvaple"; known keys: '
                                    f"{sorted(ENV_VARS)}")
        enabled = True
        for key, value in entry.items():
            values[key] = _check(key, value, f'--additional-config "uvaple".{key}')
    if not enabled:
        return None
    cfg = PluginConfig(**values)
    if cfg.placement == cfg.fallback:  # the placement needs no mapping: nothing to fall back from
        cfg = PluginConfig(**dict(values, fallback="none"))
    if (cfg.hot_cache_gb > 0) != (cfg.hot_profile is not None):
        raise PluginConfigError("hot_cache_gb and hot_profile go together: the hot set's size in HBM, and the "
                                "token ids that rank its rows (vLLM gives the plugin no point to re-rank it "
                                "from served ids)")
    if cfg.hot_cache_gb > 0 and not placement(cfg.placement).hot_set:
        served = [name for name in PLACEMENTS if placement(name).hot_set]
        raise PluginConfigError(f"hot_cache_gb: a hot set stands in front of rows in host memory that the GPU reads "
                                f"(placement {served}), not of placement {cfg.placement!r}")
    reads_file = placement(cfg.placement).reads_file
    if reads_file and cfg.disk_dir is None:
        raise PluginConfigError(f"placement {cfg.placement!r} needs disk_dir: a folder on a local disk for its table "
                                f"files (environment variable {ENV_VARS['disk_dir']})")
    given = [k for k in ("disk_dir", "disk_cache_gb") if getattr(cfg, k) is not None]
    if given and not reads_file:
        served = [name for name in PLACEMENTS if placement(name).reads_file]
        raise PluginConfigError(f"{' and '.join(given)}: settings of the placement that serves table files "
                                f"({served}), not of placement {cfg.placement!r}")
    if reads_file and cfg.fallback != "none":
        raise PluginConfigError(f"fallback {cfg.fallback!r}: the {cfg.placement} placement needs no fallback (its row "
                                "cache is registered like any pinned buffer); leave fallback unset")
    if cfg.quantize != "none":
        for which in ("placement", "fallback"):
            name = getattr(cfg, which)
            if name != "none" and not placement(name).reads(cfg.quantize):
                readers = [n for n in PLACEMENTS if placement(n).reads(cfg.quantize)]
                raise PluginConfigError(
                    f"quantize {cfg.quantize!r} with {which} {name!r}: the {name} placement serves rows as stored "
                    f"and vLLM's own methods cannot dequantise a scale per row; use a placement that dequantises "
                    f"in the gather ({readers}), or quantize 'none'")
    return cfg


def check_engine(cfg: PluginConfig, *, cuda_graphs: bool) -> None:
    """Refuse, at start-up, settings that cannot serve the engine as configured: a placement whose calls a CUDA
    graph cannot capture (its entry's ``graph_refusal``: the ``copy`` placement) under CUDA graphs
    (``cuda_graphs``: vLLM's ``cudagraph_mode`` is not NONE). A copy-placement call waits on the host for its ids
    and records events on the calling stream, which a graph being captured cannot do: vLLM's capture at
    start-up would end the engine (``cudaErrorCapturedEvent``)."""
    why = placement(cfg.placement).graph_refusal
    if cuda_graphs and why:
        raise PluginConfigError(f"placement {cfg.placement!r} cannot run inside vLLM's CUDA graphs ({why}): start the "
                                "engine with enforce_eager=True (--enforce-eager) to serve through it, or use "
                                "placement 'uva', which the graphs capture like any other op")
