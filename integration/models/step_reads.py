"""``StepReads``: one read round a forward for the disk-served n-gram tables of a Qwen4Exp model.

With ``backend="disk"`` each PLE layer's n-gram table is a table file read through a host row cache, and each
layer's call plans on the host: alone, a layer copies its hashed ids to the host, waits for the GPU to reach
them (the GPU idles while the host then reads the misses), reads its misses, and launches its gather; the next
PLE layer does the same, so a forward waits on the GPU once and on the disk once per PLE layer.

All PLE layers of a forward hash the same tokens (``ple_input_ids``, one tensor handed to every decoder layer)
over each layer's own stored context, so the first PLE layer's forward can compute every layer's ids at once.
:meth:`StepReads.read_ahead`, called there, hashes each layer's ids with the kernel the layer's own call runs
(:func:`~uvaple.kernels.ngram.ngram_rows`, same bits) into one device buffer, copies it to pinned host memory and
waits once, then reads every layer's misses in one :class:`~uvaple.integration.placements.read_round.ReadRound`
(all tables' reads in flight together). Each layer's forward then takes its ids from the round
(:meth:`StepReads.take`) and looks them up from the host (``FileEmbedding.forward_host_ids``): no copy, no wait,
no read: the host runs ahead of the GPU again until the next forward.

A layer takes its ids only when they are this forward's: the same ``input_ids`` tensor, unchanged since (its
version), over the same stored context, unchanged since; anything else (a layer called on its own, a forward
that stopped after the round, a layer on another device under a ``device_map``, a round that failed) leaves the
layer to hash and read its rows itself, as without a round, with the same bits and its own named errors. A
round that fails anywhere (a read-ahead, the pinned buffer, the hash) is logged at debug level and dropped; the
lookups whose read-ahead failed hold none of its rows, and a call whose ids are not its read-ahead's lets those go
if it needs their slots. Like the model's forward (its layers' outputs are static buffers), a round serves one
thread's forwards at a time. A compiled forward has no round (the layers' forwards do not call it while
``torch.compile`` traces them: each disk call runs eagerly, a graph break, and reads alone), nor does a CUDA graph
capture (the disk placement refuses one by name).

Built by the Qwen4Exp entry points (``load_qwen4_exp_with_host_ple``, ``apply_uvaple_to_qwen4_exp(model)``) over
the model's disk-served n-gram modules; closed with them.
"""

from __future__ import annotations

import logging
import weakref

import torch

from uvaple.kernels.ngram import ngram_rows

from ..placements.read_round import ReadRound

__all__ = ["StepReads"]

log = logging.getLogger("uvaple.integration.models.step_reads")


def _version(t: torch.Tensor) -> int | None:
    """``t``'s version counter (its in-place writes), or None for a tensor made under ``torch.inference_mode``,
    which keeps none (nothing but the forward itself writes such a tensor within a forward)."""
    return None if t.is_inference() else t._version


def _stamp(t: torch.Tensor | None) -> tuple | None:
    """What identifies a stored context as unchanged: its memory, shape and version (None before the first)."""
    return None if t is None else (t.data_ptr(), tuple(t.shape), _version(t))


class StepReads:
    """One read round a forward over ``modules`` (Qwen4Exp n-gram modules served by the disk placement; see the
    module docstring). ``context(cache, layer_idx)`` gives a layer's stored context (None before its first
    update)."""

    def __init__(self, modules, context) -> None:
        modules = sorted(modules, key=lambda m: m.layer_idx)
        if not modules:
            raise ValueError("a round of step reads needs at least one n-gram module")
        self._modules = [weakref.ref(m) for m in modules]  # (the modules hold this object: no cycle kept alive)
        self._first = self._modules[0]
        self._context = context
        self._round = None  # (device, ReadRound, device buffer, pinned buffer), made at the first round
        self._taken: dict = {}  # module id -> (input_ids, its version, the context's stamp, host ids)
        self._closed = False
        self.stats = {"rounds": 0, "failed": 0, "taken": 0}

    def read_ahead(self, module, input_ids: torch.Tensor, cache) -> None:
        """Called by each module's forward before it touches the cache: in the first module's, the round."""
        if self._closed or self._first() is not module:
            return
        self._taken.clear()  # a forward that stopped after the last round left its ids: never this forward's
        if input_ids.is_cuda and torch.cuda.is_current_stream_capturing():
            return
        self._run(input_ids, cache)

    @torch.compiler.disable
    def _run(self, input_ids: torch.Tensor, cache) -> None:
        self.stats["rounds"] += 1  # rounds begun; failed: those dropped; taken: the layers' calls served by one
        try:
            self._round_of(input_ids, cache)
        except Exception as e:  # each layer's call reads what it still needs, and names any error itself
            self._taken.clear()
            self.stats["failed"] += 1
            log.debug("uvaple: a read round of n-gram tables failed (%s: %s); each layer reads its own rows",
                      type(e).__name__, e)

    def _round_of(self, input_ids: torch.Tensor, cache) -> None:
        ids = input_ids.long()
        device = ids.device
        mods = [m for m in (r() for r in self._modules) if m is not None and m.layer_multipliers.device == device]
        if not mods:
            return
        shapes, counts = [], []
        for m in mods:
            shapes.append((ids.shape[0], ids.shape[1], m.ngram_heads_vocab_sizes.numel()))
            counts.append(shapes[-1][0] * shapes[-1][1] * shapes[-1][2])
        rnd = self._round_for(mods, device, sum(counts))
        if rnd is None:
            return
        lookups, dev_buf, host_buf = rnd
        stamps, at = [], 0
        for m, shape, n in zip(mods, shapes, counts, strict=True):
            stored = self._context(cache, m.layer_idx)
            before = ids.new_full((ids.shape[0], m.context_len), m.eos_token_id) if stored is None else stored
            history = torch.cat([before, ids], dim=1)
            ngram_rows(history, eos=m.eos_token_id, multipliers=m.layer_multipliers, sizes=m.ngram_heads_vocab_sizes,
                       offsets=m.ngram_heads_offsets, last=ids.shape[1], out=dev_buf[at:at + n].view(shape))
            stamps.append(_stamp(stored))
            at += n
        if host_buf is not None:  # one copy of every layer's ids, and the forward's one wait for the GPU
            host_buf[:at].copy_(dev_buf[:at], non_blocking=True)
            torch.cuda.current_stream(device).synchronize()
            host = host_buf
        else:
            host = dev_buf  # a CPU model: the ids are the host's already
        views, at = [], 0
        for shape, n in zip(shapes, counts, strict=True):
            views.append(host[at:at + n].view(shape))
            at += n
        lookups.prefetch(views)
        version = _version(input_ids)
        for m, stamp, v in zip(mods, stamps, views, strict=True):
            self._taken[id(m)] = (input_ids, version, stamp, v)

    def _round_for(self, mods, device: torch.device, count: int):
        """(the read round of ``mods``' lookups on ``device``, a device buffer and a pinned one of the ids they
        take at most), made once and again only when the modules or the device change; None for a forward of more
        ids than that."""
        lookups = [m.ngram_embedding.lookup_on(device) for m in mods]
        held = self._round
        if held is not None and held[0] == device and list(held[1].lookups) == lookups:
            return (held[1], held[2], held[3]) if count <= held[2].numel() else None
        if held is not None:
            held[1].close()
            self._round = None
        size = sum(m.ngram_embedding.max_tokens for m in mods)  # (a disk-served module always has max_tokens)
        if count > size:
            return None  # more ids than the layers take: each layer's call names it
        dev_buf = torch.empty(size, dtype=torch.int64, device=device)
        host_buf = torch.empty(size, dtype=torch.int64, pin_memory=True) if device.type == "cuda" else None
        self._round = (device, ReadRound(lookups), dev_buf, host_buf)
        return self._round[1], dev_buf, host_buf

    def take(self, module, input_ids: torch.Tensor, stored: torch.Tensor | None) -> torch.Tensor | None:
        """``module``'s host ids of this forward, read ahead (the round's), or None: its forward hashes and reads
        its rows itself. Taken once."""
        entry = self._taken.pop(id(module), None)
        if entry is None:
            return None
        ids, version, stamp, host = entry
        if ids is not input_ids or _version(input_ids) != version or _stamp(stored) != stamp:
            return None
        self.stats["taken"] += 1
        return host

    def __deepcopy__(self, memo):
        return None  # a copy of the model has modules of its own: its layers read alone (no round of theirs)

    def close(self) -> None:
        """Drop the round (its threads end) and whatever it read ahead. Idempotent."""
        self._closed = True
        self._taken.clear()
        held, self._round = self._round, None
        if held is not None:
            held[1].close()
