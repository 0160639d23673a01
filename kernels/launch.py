"""One Triton kernel launched with only what varies per call: its compiled form kept by call key.

Triton's ``kernel[grid](*args, **constants)`` binds and specialises every argument on every call: tens of
microseconds of host time for a gather kernel of ~30 parameters, on every eager call. A
:class:`KernelLaunch` is made once, by a launcher's plan, with the constants that never change. Each call
names its *key*: every property of its per-call arguments that Triton specialises on (the ids' dtype,
whether each per-call pointer is 16-byte aligned, the per-call integers' values, whether a count fits in
32 bits). The first call of a key, on a device, goes through Triton, which compiles (or finds) the variant
and launches it; the compiled kernel is kept, and every later call of that key launches it directly
through its launcher: the grid, the current stream, the arguments, nothing else.

A compiled kernel reads pointers only: a call may pass a tensor of another dtype of the same width where
the variant was compiled for a view (a plain copy's bf16 ``out``, compiled for int16): ``views`` names the
arguments that Triton and the interpreter must see as such a view.

A launch runs on the device of its tensors, on that device's current stream, whichever device is current:
the caller names it (``device``, the ids' index) and a launch whose device is not the current one enters
that device first, as a torch operator's device guard does. (Triton launches on the current device: a
lookup of ``cuda:1`` called while ``cuda:0`` is current would otherwise run on ``cuda:0``'s stream, out of
the order of the caller's work on ``cuda:1``.)

Interpreted launches (CPU tensors) always go through Triton: the interpreter has no compiled form. So does
a launch while Triton's launch hooks are set (a profiler such as proton): they see every launch as Triton
makes it. The hooks are read at every launch, not planned: a profiler may install them at any moment of a
process, and a launch it does not see would be missing from its trace. The read is two attribute loads of
Triton's knobs (0.2 us).
"""

from __future__ import annotations

import torch

__all__ = ["KernelLaunch"]


class _Hooks:
    """Triton's launch-hook knobs (``triton.knobs.runtime``), looked up once; absent in older Triton."""

    runtime = None
    loaded = False

    @classmethod
    def set(cls) -> bool:
        """Whether a Triton launch hook is installed (a chain of hooks with a hook in it, or one hook)."""
        rt = cls.runtime
        if rt is None:
            if cls.loaded:
                return False
            try:
                from triton import knobs

                cls.runtime = knobs.runtime
            except ImportError:  # older Triton: no knobs, no hooks to honour here
                cls.runtime = None
            cls.loaded = True
            return cls.set()
        enter, leave = rt.launch_enter_hook, rt.launch_exit_hook  # read each time: a profiler may set them any time
        return (enter is not None and bool(getattr(enter, "calls", True))) or \
            (leave is not None and bool(getattr(leave, "calls", True)))


class _Driver:
    """Triton's active driver's device and stream getters, looked up once (the first compiled launch); until
    then ``device`` answers -1, a device no compiled kernel is kept for."""

    stream = None

    @staticmethod
    def device() -> int:
        return -1

    @classmethod
    def load(cls) -> None:
        from triton.runtime import driver

        cls.device = driver.active.get_current_device
        cls.stream = driver.active.get_current_stream
        if cls.device is torch.cuda.current_device and hasattr(torch._C, "_cuda_getDevice"):
            # what torch.cuda.current_device returns once CUDA is initialised (it is: a kernel was compiled),
            # without its lazy-initialisation check
            cls.device = torch._C._cuda_getDevice


class KernelLaunch:
    """``fn`` (a Triton kernel or its interpreted twin) with fixed ``constants`` (its constexpr parameters,
    and launch options such as ``num_warps``), launched by :meth:`__call__`.

    The kernel's constexpr parameters must come after all its runtime parameters (the compiled launcher
    takes every parameter positionally and skips the constexprs).
    """

    __slots__ = ("fn", "constants", "interpret", "_values", "_views", "_compiled", "on_compile")

    def __init__(self, fn, constants: dict, *, interpret: bool, views: tuple[tuple[int, torch.dtype], ...] = ()):
        self.fn = fn
        self.constants = dict(constants)
        self.interpret = interpret
        names = [p.name for p in getattr(fn, "params", ()) if p.is_constexpr]
        self._values = tuple(self.constants[n] for n in names)
        self._views = views
        self._compiled: dict = {}
        #: called ``on_compile(key, kernel, args)`` after Triton launched a key's first compiled call on a device
        #: and its kernel was kept (the eager C call learns the variant: :mod:`uvaple.kernels.eager_call`)
        self.on_compile = None

    def _viewed(self, args: tuple) -> tuple:
        if not self._views:
            return args
        args = list(args)
        for i, dtype in self._views:
            args[i] = args[i].view(dtype)
        return tuple(args)

    def __call__(self, grid: tuple, args: tuple, key, device: int) -> None:
        """Launch on ``grid`` (one or two dimensions) with the runtime ``args`` in parameter order; ``key``
        says what of them Triton specialises on; ``device``: the index of the CUDA device the tensors are on
        (see the module docstring; ignored when interpreted)."""
        # the eager hot path, one frame: the kept compiled kernel of this key, on the current device, no hook set
        compiled = self._compiled.get((device, key))
        if compiled is not None and _Driver.device() == device and not _Hooks.set():
            run, function, metadata, _ = compiled
            run(grid[0], grid[1] if len(grid) > 1 else 1, 1, _Driver.stream(device), function, metadata, None, None,
                None, *args, *self._values)
            return
        if self.interpret:
            self.fn[grid](*self._viewed(args), **self.constants)
            return
        if _Driver.stream is None:
            _Driver.load()
        if device != _Driver.device():
            with torch.cuda.device(device):  # then this call again, its device current: the kept kernel, if any
                self(grid, args, key, device)
            return
        self._launch(grid, args, key, device)

    def _launch(self, grid: tuple, args: tuple, key, device: int) -> None:
        """Triton's own launch of a call on its device (current now), whose compiled kernel is then kept (a launch
        hook set: Triton's launch every time, which the hooks see)."""
        kernel = self.fn[grid](*self._viewed(args), **self.constants)
        kernel = kernel.result() if hasattr(kernel, "result") and not hasattr(kernel, "function") else kernel
        if getattr(kernel, "function", None) is not None and hasattr(kernel, "packed_metadata"):
            first = (device, key) not in self._compiled
            self.keep(device, key, kernel.run, kernel.function, kernel.packed_metadata, kernel)
            if first and self.on_compile is not None:
                self.on_compile(key, kernel, args)

    def keep(self, device: int, key, run, function, metadata, kernel) -> None:
        """Key ``key``'s calls on ``device`` launch by ``run(..., function, metadata, ...)`` from now on. The compiled
        ``kernel`` is kept with them: Triton 3.8 unloads a kernel's module when its CompiledKernel is collected, and
        the function handle would then launch unloaded code."""
        self._compiled[(device, key)] = (run, function, metadata, kernel)

    def bare(self, grid: tuple, args: tuple, key, device: int):
        """A zero-argument launch with everything of this call bound (the compiled kernel of ``key``, which a call
        made first; the stream current now): the floor of a Triton launch, what a call's own host work is measured
        against (``uvaple bench --workload host``). Interpreted: the plain call."""
        if self.interpret:
            return lambda: self(grid, args, key, device)
        run, function, metadata, kernel = self._compiled[(device, key)]
        stream, g0, g1 = _Driver.stream(device), grid[0], grid[1] if len(grid) > 1 else 1
        full = (*args, *self._values)
        # (the kernel bound too: a launch that outlives this one must not outlive its module)
        return lambda kernel=kernel: run(g0, g1, 1, stream, function, metadata, None, None, None, *full)

    def compiled(self) -> int:
        """How many call keys have a kept compiled kernel (for tests)."""
        return len(self._compiled)
