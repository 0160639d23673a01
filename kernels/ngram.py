"""The n-gram hash of an n-gram PLE layer (Qwen4Exp): every table row a step needs, in one launch.

Kernel, launcher, operator and fake, in that order, as in :mod:`uvaple.kernels.gather`, and the functional
:func:`ngram_rows`.

What it computes. ``history [B, L]`` int64 holds each sequence's cached context tokens, then this call's;
the rows of the n-grams ending at the last ``last`` positions are, for order ``k`` (2..N) and head ``h``,
``(t0*m0 ^ t1*m1 ^ ... ^ t_{k-1}*m_{k-1}) mod size + offset``, where ``t_s`` is the token ``s`` places back,
or ``eos`` where an end-of-sequence token lies strictly between (or the history starts before it); ``m`` are
the layer's N multipliers and ``size`` / ``offset`` its ``(N - 1) * heads_per_ngram`` head ranges. The
products wrap as int64 arithmetic does and the remainder is the floor one (never negative), so the result is
:func:`uvaple.integration.models.qwen4_exp.ngram_ids`'s (the definition, in torch), bit for bit, for any
token values. The rows go to a lookup whose policy keeps any id inside the table, so no token, however
malformed, makes the gather read outside it.

Why a kernel. In torch the hash is ~6 small operations per n-gram order plus the shifts and the concatenation:
tens of launches per PLE layer, most of an eager PLE layer's time at batch 1. Here program ``i`` takes
``BLOCK`` positions, loads each one's N tokens once and writes its ``(N - 1) * heads_per_ngram`` rows: one
launch, no host synchronisation, on the current stream (so CUDA graphs capture it and ``torch.compile`` sees
one opaque operator).

Operator schema::

    uvaple::ngram_rows(Tensor history, Tensor multipliers, Tensor sizes, Tensor offsets, Tensor(a!) out,
                       int eos) -> ()

``out`` is ``[B, last, (N - 1) * heads_per_ngram]`` int64; N is ``multipliers.numel()`` and
``heads_per_ngram`` follows from ``sizes.numel()``. ``sizes`` are positive in a layer's buffers; a head whose size
is not gives the row -1, which every lookup's row policy treats as outside the table (no remainder by zero,
whatever the buffers hold when the kernel reads them).
"""

from __future__ import annotations

import sys

import torch
import triton.language as tl

from . import jit
from .launch import KernelLaunch

__all__ = ["ngram_rows"]

kernel = jit.kernel_decorator(__name__)

_BLOCK = 128  # positions a program hashes
_I32_MIN, _I32_MAX = -(1 << 31), (1 << 31) - 1


# length, last and n_pos change with the batch and the step; eos with the model: none is specialised, so a
# new shape never compiles a new variant (perhaps inside a graph capture).
@kernel(do_not_specialize=["length", "last", "n_pos", "eos"])
def ngram_rows_kernel(
    hist_ptr,  # *Pointer* to history [B, length] int64, contiguous
    mult_ptr,  # *Pointer* to the N multipliers, int64
    sizes_ptr,  # *Pointer* to the (N - 1) * HPN head sizes, int64, positive
    offsets_ptr,  # *Pointer* to the (N - 1) * HPN head offsets, int64
    out_ptr,  # *Pointer* to out [B, last, (N - 1) * HPN] int64, contiguous
    length,  # L: tokens per sequence in the history
    last,  # positions hashed per sequence: the last `last` of the history
    n_pos,  # B * last
    eos,  # the end-of-sequence token
    N: tl.constexpr,  # the n-gram size (orders 2..N)
    HPN: tl.constexpr,  # heads per n-gram order
    BLOCK: tl.constexpr,
):
    idx = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    live = idx < n_pos
    row, pos = history_position(hist_ptr, idx, length, last)
    end = eos.to(tl.int64)
    mixed = tl.load(row + pos, mask=live, other=0) * tl.load(mult_ptr)
    clean = live  # no eos strictly between the position and the token s places back
    for s in tl.static_range(1, N):
        mixed, clean = mix_token(row, pos, s, mixed, clean, live, end, mult_ptr)
        for h in tl.static_range(HPN):
            j = (s - 1) * HPN + h
            tl.store(out_ptr + idx * ((N - 1) * HPN) + j, head_row(mixed, j, sizes_ptr, offsets_ptr), mask=live)


# The hash's steps, shared with the fused gather (gather_ngram.py): one definition of the rows on every path.
@kernel
def history_position(hist_ptr, idx, length, last):
    """(the start of its sequence's history, its position there) of hashed position ``idx`` (of ``B * last``)."""
    return hist_ptr + (idx // last) * length, (length - last) + idx % last


@kernel
def mix_token(row, pos, s, mixed, clean, live, end, mult_ptr):
    """The token ``s`` places back of ``pos`` xor'ed into ``mixed`` times its multiplier: ``end`` (the eos)
    instead where the history starts after it or (``clean`` false) an eos lies strictly between. Returns
    ``(mixed, clean)``, ``clean`` now also false where that token is an eos. ``live`` masks the load."""
    inside = pos >= s
    back = tl.where(inside, tl.load(row + pos - s, mask=live & inside, other=0), end)
    mixed = mixed ^ (tl.where(clean, back, end) * tl.load(mult_ptr + s))
    return mixed, clean & (back != end)


@kernel
def head_row(mixed, j, sizes_ptr, offsets_ptr):
    """Head ``j``'s table row of a mix: its floor remainder by the head's size (C's % truncates: negative for a
    negative mix), plus the head's offset; -1 (outside every table: the row policy's row) for a size <= 0, which
    no remainder is defined for (the buffers are the caller's to change, and are read at launch)."""
    size = tl.load(sizes_ptr + j)
    ok = size > 0
    size = tl.where(ok, size, 1)
    r = mixed % size
    r = tl.where(r < 0, r + size, r)
    return tl.where(ok, r + tl.load(offsets_ptr + j), -1)


# ------------------------------------------------------------------ launcher
_launches: dict[tuple[bool, int, int], KernelLaunch] = {}  # by (interpreted, N, heads per n-gram): made once


def launch(history: torch.Tensor, multipliers: torch.Tensor, sizes: torch.Tensor, offsets: torch.Tensor,
           out: torch.Tensor, eos: int, n: int, heads_per_ngram: int) -> None:
    """The kernel over checked arguments (:func:`check_layer`, :func:`check_call`), on the current stream: no
    allocation, no synchronisation. Its launch is made once per kind of device, N and heads per n-gram."""
    b, length = history.shape
    last = out.shape[1]
    n_pos = b * last
    if n_pos == 0:
        return
    interpret = history.device.type != "cuda"
    fixed = (interpret, n, heads_per_ngram)
    run = _launches.get(fixed)
    if run is None:
        fn = jit.variant(sys.modules[__name__], interpret).ngram_rows_kernel
        run = _launches.setdefault(fixed, KernelLaunch(fn, dict(N=n, HPN=heads_per_ngram, BLOCK=_BLOCK, num_warps=4),
                                                       interpret=interpret))
    key = (history.data_ptr() % 16 == 0, out.data_ptr() % 16 == 0, multipliers.data_ptr() % 16 == 0,
           sizes.data_ptr() % 16 == 0, offsets.data_ptr() % 16 == 0, length <= _I32_MAX, last <= _I32_MAX,
           n_pos <= _I32_MAX)
    run((-(-n_pos // _BLOCK),), (history, multipliers, sizes, offsets, out, length, last, n_pos, eos), key,
        history.get_device())


def check_layer(multipliers, sizes, offsets, eos) -> tuple[int, int]:
    """A layer's hash constants: ``(N, heads_per_ngram)``, or a named error."""
    for name, t in (("multipliers", multipliers), ("sizes", sizes), ("offsets", offsets)):
        if not isinstance(t, torch.Tensor) or t.dtype != torch.int64 or t.dim() != 1 or not t.is_contiguous():
            raise TypeError(f"the n-gram hash's {name} must be a contiguous 1-D int64 tensor, got "
                            f"{_describe(t)}")
        if t.device != multipliers.device:
            raise ValueError(f"the n-gram hash's {name} is on {t.device}, its multipliers on {multipliers.device}")
    n = multipliers.numel()
    if n < 2:
        raise ValueError(f"the n-gram hash needs at least 2 multipliers (n-grams of order 2 and up), got {n}")
    if sizes.numel() != offsets.numel() or sizes.numel() == 0 or sizes.numel() % (n - 1):
        raise ValueError(f"the n-gram hash's sizes and offsets must hold (N - 1) * heads_per_ngram values each "
                         f"(N = {n} multipliers), got {sizes.numel()} and {offsets.numel()}")
    check_eos(eos)
    return n, sizes.numel() // (n - 1)


def check_eos(eos) -> None:
    """The end-of-sequence token: an int32 token id (a bool is not one)."""
    if isinstance(eos, bool) or not isinstance(eos, int) or not _I32_MIN <= eos <= _I32_MAX:
        raise ValueError(f"the end-of-sequence token must be an int32 token id, got {eos!r}")


def check_history(history, last=None) -> None:
    """``history`` a contiguous ``[batch, tokens]`` int64 tensor, and ``last`` (when given) a count of its
    positions."""
    if not isinstance(history, torch.Tensor) or history.dtype != torch.int64 or history.dim() != 2 \
            or not history.is_contiguous():
        raise TypeError(f"history must be a contiguous [batch, tokens] int64 tensor, got {_describe(history)}")
    if last is not None:
        if isinstance(last, bool) or not isinstance(last, int) or last < 0:
            raise ValueError(f"last must be a count of positions (an int >= 0), got {last!r}")
        if last > history.shape[1]:
            raise ValueError(f"last is {last} but the history holds {history.shape[1]} tokens per sequence")


def check_call(history, out, multipliers: torch.Tensor) -> None:
    """What a call brings: ``history`` and ``out`` shaped, typed and placed for the layer's ``multipliers``."""
    check_history(history)
    if history.device != multipliers.device:
        raise ValueError(f"history is on {history.device}, the layer's hash buffers on {multipliers.device}")
    if not isinstance(out, torch.Tensor) or out.dtype != torch.int64 or out.dim() != 3 or not out.is_contiguous():
        raise TypeError(f"out must be a contiguous [batch, positions, heads] int64 tensor, got {_describe(out)}")
    if out.device != history.device:
        raise ValueError(f"out is on {out.device}, history on {history.device}")


def _describe(t) -> str:
    if not isinstance(t, torch.Tensor):
        return type(t).__name__
    return f"{t.dtype} {tuple(t.shape)}{'' if t.is_contiguous() else ' (not contiguous)'} on {t.device}"


# ------------------------------------------------------------------ operator
def _ngram_rows(history, multipliers, sizes, offsets, out, eos) -> None:
    torch.autograd.graph.increment_version(out)  # `out` was written: autograd must know a saved one changed
    n, heads_per_ngram = check_layer(multipliers, sizes, offsets, eos)
    check_call(history, out, multipliers)
    b, length = history.shape
    if out.shape[0] != b or out.shape[1] > length or out.shape[2] != sizes.numel():
        raise ValueError(f"out has shape {tuple(out.shape)}; for a history of {tuple(history.shape)} it must be "
                         f"[{b}, positions <= {length}, {sizes.numel()}]")
    launch(history, multipliers, sizes, offsets, out, eos, n, heads_per_ngram)


def _ngram_rows_fake(history, multipliers, sizes, offsets, out, eos) -> None:
    return None


if not jit.is_interpreted_copy(__name__):  # the interpreted copy of this module holds the kernel's twin only
    _lib = torch.library.Library("uvaple", "FRAGMENT")
    _lib.define("ngram_rows(Tensor history, Tensor multipliers, Tensor sizes, Tensor offsets, Tensor(a!) out, "
                "int eos) -> ()")
    _lib.impl("ngram_rows", _ngram_rows, "CompositeExplicitAutograd")
    torch.library.register_fake("uvaple::ngram_rows", _ngram_rows_fake, lib=_lib)


# ------------------------------------------------------------------ functional
def ngram_rows(history: torch.Tensor, *, eos: int, multipliers: torch.Tensor, sizes: torch.Tensor,
               offsets: torch.Tensor, last: int, out: torch.Tensor | None = None) -> torch.Tensor:
    """Table rows of the n-grams ending at the last ``last`` positions of ``history`` (see the module
    docstring): ``[B, last, sizes.numel()]`` int64 on ``history``'s device, in ``out`` when given.

    ``history [B, L]`` int64 (contiguous); ``multipliers [N]``, ``sizes`` and ``offsets [(N - 1) *
    heads_per_ngram]`` int64 on the same device. One launch on the current stream (interpreted for CPU
    tensors).
    """
    check_eos(eos)  # here too: the operator's schema would turn a bool into an int
    check_history(history, last)
    if out is None:
        heads = sizes.numel() if isinstance(sizes, torch.Tensor) else 0
        out = torch.empty((history.shape[0], last, heads), dtype=torch.int64, device=history.device)
    torch.ops.uvaple.ngram_rows(history, multipliers, sizes, offsets, out, eos)
    return out
