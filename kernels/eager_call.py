"""A lookup's whole-row eager call below Python: its checks and its launch in one C function.

An eager call (transformers' ``generate()``, vLLM's prefill outside its graphs) is bound by the host: the gather
itself is a few microseconds of the GPU, and the Python path (:meth:`Lookup._prepare`'s checks, the plan, the
kept kernel's launch through Triton's launcher) costs about twice ``torch.index_select``. The C function of
``eager_call.c`` (:class:`EagerCall`, one per lookup) serves the call ``lookup(ids)`` / ``lookup(ids, out)`` of
whole rows that the plan's direct gather serves (not the sorted one):

* it checks what the Python path checks of such a call: ``ids`` exactly a ``torch.Tensor``, int32 or int64,
  contiguous, on the lookup's device, at most the plan's direct count (``max_rows`` and the sort's bound);
  ``out`` (when given) of the output dtype and shape ``[*ids.shape, ncols]``, contiguous, on that device; else
  it allocates ``out`` with ``torch.empty``;
* it picks the variant of the call key (the ids' dtype, whether the ids' and out's addresses are 16-byte
  aligned) and calls ``cuLaunchKernel`` with the variant's compiled kernel on torch's current stream of the
  lookup's device, its parameters written on the C function's stack.

Where it is unsure it *declines*: it launches nothing and returns None, and the unchanged Python path runs the
call, with its named errors. It declines a tensor of another dtype, device, shape or layout or a tensor
subclass; a count past the direct gather's; a launch hook set (a profiler sees Triton's launches); another
CUDA context current (the Python path enters the lookup's device); a capturing stream (the Python path keeps a
host table for the graph); a closed lookup or a forked child; a variant not taught yet; a failed launch.

Teaching a variant. A key's first call goes through Triton (the Python path), which compiles or finds the
kernel; the launcher's ``on_compile`` (:meth:`~uvaple.kernels.launch.KernelLaunch`) then hands the compiled
kernel to :func:`teach`: the parameter block is written from the compiled kernel's own signature (its runtime
parameters in order, the ones Triton specialised into constants left out: :func:`program`), and the C side
checks it against the driver's own parameter list of the function (``cuFuncGetParamInfo``: count and sizes;
Triton's hidden scratch pointers, size 0 here, passed null) and refuses a variant that differs. The variant holds
the compiled kernel (Triton unloads a module whose kernel is collected) and the tensors its fixed pointers name.

Building. The C source needs ``Python.h`` only (the driver is found with ``dlsym`` in the ``libcuda`` the process
loaded; torch is reached through the Python objects handed to the constructor). It is compiled at first use with
the C compiler Triton's own launchers need (``CC``, else ``gcc``, ``clang`` or ``cc``) and cached in
``~/.cache/uvaple/native/<key of the source, the interpreter's ABI and the compiler>/``
(``UVAPLE_CACHE_DIR`` moves it). ``UVAPLE_EAGER_CALL=0`` turns it off. Where it cannot be built every call takes
the Python path, and :func:`unavailable` says why.
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import importlib.machinery
import importlib.util
import os
import secrets
import shutil
import subprocess
import sys
import sysconfig
from pathlib import Path

import torch

__all__ = ["unavailable", "for_lookup", "program", "teach", "SOURCE"]

SOURCE = Path(__file__).with_name("eager_call.c")
_NAME = "uvaple_eager_call"
#: what a parameter slot holds (eager_call.c's K_*): a fixed 8- or 4-byte value, the ids' or out's address,
#: the id count in 4 or 8 bytes
FIXED8, FIXED4, IDS, OUT, N4, N8 = b"P", b"I", b"i", b"o", b"n", b"N"
_SIZES = {"i32": 4, "u32": 4, "i64": 8, "u64": 8}
_I32_MAX = (1 << 31) - 1


def _cache_dir() -> Path:
    return Path(os.environ.get("UVAPLE_CACHE_DIR") or Path.home() / ".cache" / "uvaple") / "native"


def _compiler() -> str | None:
    return os.environ.get("CC") or shutil.which("gcc") or shutil.which("clang") or shutil.which("cc")


@functools.lru_cache(maxsize=1)
def _module():
    """(the compiled module, None) or (None, why not)."""
    if os.environ.get("UVAPLE_EAGER_CALL", "1") == "0":
        return None, "turned off (UVAPLE_EAGER_CALL=0)"
    try:
        return _build_and_load()
    except (OSError, RuntimeError, ImportError, ValueError, subprocess.SubprocessError) as e:
        return None, f"the eager call could not be built or loaded: {type(e).__name__}: {e}"


def _build_and_load():
    cc = _compiler()
    if cc is None:
        return None, "no C compiler found (set CC, or install gcc)"
    include = sysconfig.get_paths().get("include")
    if not include or not os.path.exists(os.path.join(include, "Python.h")):
        return None, f"Python.h is not in {include} (install the Python development headers)"
    suffix = sysconfig.get_config_var("EXT_SUFFIX") or ".so"
    src = SOURCE.read_bytes()
    key = hashlib.sha256(src + f"|{sys.version}|{suffix}|{cc}".encode()).hexdigest()[:16]
    folder = _cache_dir() / key
    so = folder / f"{_NAME}{suffix}"
    if not so.exists():
        folder.mkdir(parents=True, exist_ok=True)
        # a name of this build alone, made by the linker (its mode follows the umask, as any build's does)
        tmp = folder / f".{_NAME}.{os.getpid()}.{secrets.token_hex(8)}{suffix}"
        try:
            done = subprocess.run([cc, "-O2", "-shared", "-fPIC", "-o", str(tmp), str(SOURCE), f"-I{include}", "-ldl",
                                   "-lpthread"], capture_output=True, text=True, errors="replace", timeout=120)
            if done.returncode != 0:
                return None, f"{cc} could not build {SOURCE.name}: {done.stderr.strip()[-400:]}"
            os.replace(tmp, so)  # whole or not at all: another process may be loading the same key
        finally:
            with contextlib.suppress(FileNotFoundError):
                tmp.unlink()
    loader = importlib.machinery.ExtensionFileLoader(_NAME, str(so))
    spec = importlib.util.spec_from_file_location(_NAME, so, loader=loader)
    module = importlib.util.module_from_spec(spec)
    loader.exec_module(module)
    return module, None


def unavailable() -> str | None:
    """Why eager calls take the Python path on this machine (None: the C call serves them where it can)."""
    module, why = _module()
    return why


def _hooks():
    """Triton's launch-hook knobs (``triton.knobs.runtime``), or None where this Triton has none."""
    try:
        from triton import knobs
    except ImportError:
        return None
    return knobs.runtime


#: what the C call bumps ``out``'s autograd version with, handed a 1-tuple ``(out,)`` (both take a sequence)
_bump = getattr(torch._C, "_increment_version", None) or torch.autograd.graph.increment_version


def for_lookup(plan, device: torch.device, out_dtype: torch.dtype, columns: tuple[int, int],
               max_rows: int | None):
    """The :class:`EagerCall` serving the whole-row direct calls of ``plan`` (a
    :class:`~uvaple.kernels.plan.GatherPlan`) on CUDA ``device``, rows ``columns`` (the lookup's whole range), at
    most ``max_rows`` ids a call; taught by the plan's direct gather as its variants compile. None where the C call
    cannot serve (a CPU lookup, no compiled module: :func:`unavailable`)."""
    if device.type != "cuda":
        return None
    module, _ = _module()
    if module is None:
        return None
    c0, c1 = columns
    max_n = min(plan.sort_from - 1, _I32_MAX if max_rows is None else max_rows, _I32_MAX)
    if max_n < 1 or c1 <= c0:
        return None
    call = module.EagerCall(torch.Tensor, out_dtype, torch.int32, torch.int64, device.index, device, c1 - c0, max_n,
                            torch.empty, torch._C._cuda_getCurrentRawStream, _bump, _hooks())
    plan.direct.serve_eager(call, c0, c1 - c0)
    return call


def program(signature, args: tuple, *, ids_at: int = 1, out_at: int = 2, n_at: int = 9):
    """The parameter block of a compiled gather kernel: ``(kinds, values)``, one entry a runtime parameter that
    the compiled kernel takes, in order, or None where a parameter is of a type the C call does not write.

    ``signature``: the compiled kernel's types in parameter order (``kernel.src.signature``'s values: ``"*i64"``
    a pointer, ``"i32"``, ``"i64"``, ..., ``"constexpr"`` for a parameter Triton specialised into a constant or a
    constexpr one); ``args``: the call's runtime arguments in parameter order (``DirectGather``'s), of which
    ``args[ids_at]``/``args[out_at]`` are the ids and out (read per call) and ``args[n_at]`` the id count."""
    kinds, values = [], []
    types = list(signature)
    if len(types) < len(args) or any(t != "constexpr" for t in types[len(args):]):
        return None
    for i, (arg, ty) in enumerate(zip(args, types[:len(args)], strict=True)):
        if ty == "constexpr":
            continue
        if i in (ids_at, out_at):
            if not ty.startswith("*"):
                return None
            kinds.append(IDS if i == ids_at else OUT)
            values.append(0)
        elif i == n_at:
            if ty not in ("i32", "i64"):
                return None
            kinds.append(N4 if ty == "i32" else N8)
            values.append(0)
        elif ty.startswith("*"):
            if not isinstance(arg, torch.Tensor):
                return None
            kinds.append(FIXED8)
            values.append(arg.data_ptr())
        elif ty in _SIZES and isinstance(arg, int) and not isinstance(arg, bool):
            kinds.append(FIXED4 if _SIZES[ty] == 4 else FIXED8)
            values.append(arg)
        else:
            return None
    block = b"".join(kinds)
    if (block.count(IDS), block.count(OUT), block.count(N4) + block.count(N8)) != (1, 1, 1):
        return None  # the call's own slots, each once (a count Triton made a constant would reuse its value)
    return block, values


def teach(call, kernel, args: tuple, key, tiles: int, row_tiles: bool) -> str | None:
    """Hand ``call`` the compiled ``kernel`` of the call key ``key`` (``DirectGather``'s: ids dtype, ids aligned,
    out aligned, col_start, n within int32), launched by Triton just now with ``args``; ``tiles``/``row_tiles``:
    the grid's shape. None when kept, else why not."""
    dtype, ids_aligned, out_aligned, _, fits = key
    md = getattr(kernel, "metadata", None)
    src = getattr(kernel, "src", None)
    if md is None or src is None or not hasattr(src, "signature") or getattr(kernel, "function", None) is None:
        return "the compiled kernel does not show its signature and metadata"
    if not fits or dtype not in (torch.int32, torch.int64):
        return "a count past int32, or ids of another dtype"
    if getattr(md, "num_ctas", 1) != 1 or getattr(md, "launch_pdl", False) or \
            getattr(md, "launch_cooperative_grid", False) or getattr(md, "global_scratch_size", 0) or \
            getattr(md, "profile_scratch_size", 0) or getattr(md, "shared", 0) > 48 * 1024:
        return "the compiled kernel needs a launch the C call does not make (clusters, scratch, large shared memory)"
    fixed = tuple(a for i, a in enumerate(args) if i not in (1, 2) and isinstance(a, torch.Tensor))
    if not all(a.is_cuda for a in fixed):
        return "a fixed tensor is a host tensor (the table's host view): Triton maps its pointer for each launch"
    block = program(src.signature.values(), args)
    if block is None:
        return "the compiled kernel takes a parameter of a type the C call does not write"
    kinds, values = block
    index = (dtype is torch.int64) | (bool(ids_aligned) << 1) | (bool(out_aligned) << 2)
    keep = (kernel, fixed)  # the compiled kernel and the tensors its fixed pointers name (not the call's ids, out)
    return call.teach(index, kernel.function, tiles, row_tiles, md.num_warps, md.shared, kinds, values, keep)
