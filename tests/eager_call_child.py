"""Run by tests/test_eager_call.py in a child process over a stand-in CUDA driver (a libcuda.so.1 built from
FAKE_DRIVER and loaded first, so the C call's dlopen finds it): every scenario of the C call up to and through
its launch, with stand-in tensors; prints one JSON object of what each scenario saw."""

import ctypes
import json
import os
import sys

FAKE_DRIVER = r"""
#include <stdint.h>
#include <stddef.h>
#include <string.h>
static void *ctx = (void *)0x1000;
static int capturing, launch_result, n_sizes;
static size_t sizes[64];
static uint64_t last[64];
static unsigned last_shape[8];
static void *last_stream;
static int launches;
int cuCtxGetCurrent(void **c) { *c = ctx; return 0; }
int cuStreamIsCapturing(void *s, int *st) { *st = capturing; return 0; }
int cuFuncGetParamInfo(void *f, size_t i, size_t *off, size_t *size) {
    if ((int)i >= n_sizes) return 1;
    *off = 8 * i; *size = sizes[i]; return 0;
}
int cuLaunchKernel(void *f, unsigned gx, unsigned gy, unsigned gz, unsigned bx, unsigned by, unsigned bz,
                   unsigned shared, void *stream, void **params, void **extra) {
    if (launch_result) return launch_result;
    unsigned shape[8] = {gx, gy, gz, bx, by, bz, shared, (unsigned)(uintptr_t)f};
    memcpy(last_shape, shape, sizeof shape);
    last_stream = stream;
    for (int i = 0; i < n_sizes; i++) { last[i] = 0; memcpy(&last[i], params[i], sizes[i]); }
    launches++;
    return 0;
}
void fake_set(void *c, int cap, int result) { ctx = c; capturing = cap; launch_result = result; }
void fake_sizes(int n, const size_t *s) { n_sizes = n; memcpy(sizes, s, n * sizeof *s); }
int fake_launches(void) { return launches; }
void fake_last(uint64_t *params, unsigned *shape, void **stream) {
    memcpy(params, last, sizeof last); memcpy(shape, last_shape, sizeof last_shape); *stream = last_stream;
}
"""


class FakeTensor:
    """What the C call reads of a tensor: a CUDA tensor of device 0 unless told otherwise."""

    def __init__(self, shape, dtype, ptr=4096, *, cuda=True, device=0, contiguous=True):
        self.shape, self.dtype, self.ptr = tuple(shape), dtype, ptr
        self.is_cuda, self.device, self.contiguous = cuda, device, contiguous

    def get_device(self):
        return self.device

    def is_contiguous(self):
        return self.contiguous

    def data_ptr(self):
        return self.ptr


class Recorder:
    """The torch callables handed to the C call, each recording its calls; ``fail`` raises from one."""

    def __init__(self):
        self.streams, self.empties, self.bumps, self.fail = [], [], [], {}

    def stream_of(self, index):
        self.streams.append(index)
        if "stream" in self.fail:
            raise self.fail["stream"]
        return 0xABC0

    def empty(self, shape, dtype, device):
        self.empties.append(list(shape))
        if "empty" in self.fail:
            raise self.fail["empty"]
        return FakeTensor(shape, dtype, ptr=8192)

    def bump(self, tensors):
        self.bumps.append([t.ptr for t in tensors])
        if "bump" in self.fail:
            raise self.fail["bump"]


OUT_DTYPE, I32, I64 = "out-dtype", "int32", "int64"
#: kinds and values of a taught block: table pointer, ids, out, an int32, the count, an int64; the driver's own
#: list adds two hidden pointers
KINDS, VALUES = b"PioInP", [0x5000, 0, 0, -3, 0, 1 << 40]
SIZES = [8, 8, 8, 4, 4, 8, 8, 8]


def main(lib_path: str) -> None:
    lib = ctypes.CDLL(lib_path, mode=ctypes.RTLD_GLOBAL)
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    from uvaple.kernels import eager_call

    module, why = eager_call._module()
    assert module is not None, why

    def sizes(s):
        arr = (ctypes.c_size_t * len(s))(*s)
        lib.fake_sizes(len(s), arr)

    def last():
        params, shape, stream = (ctypes.c_uint64 * 64)(), (ctypes.c_uint * 8)(), ctypes.c_void_p()
        lib.fake_last(params, shape, ctypes.byref(stream))
        return list(params), list(shape), stream.value

    def make(rec, *, max_n=100, hooks=None, ncols=7):
        return module.EagerCall(FakeTensor, OUT_DTYPE, I32, I64, 0, "cuda:0", ncols, max_n, rec.empty, rec.stream_of,
                                rec.bump, hooks)

    def taught(rec, *, tiles=2, row_tiles=True, index=3, **kw):
        call = make(rec, **kw)
        assert call.teach(index, 0x77, tiles, row_tiles, 4, 256, KINDS, VALUES, ("kept",)) is None
        return call

    seen = {}
    sizes(SIZES)
    lib.fake_set(ctypes.c_void_p(0x1000), 0, 0)
    assert module.driver_error() is None

    # a call served: ids int64 at an aligned address, out given and aligned (variant 1 | 2 | 4)
    rec = Recorder()
    call = taught(rec, index=7)
    ids, out = FakeTensor((2, 3), I64), FakeTensor((2, 3, 7), OUT_DTYPE, ptr=8192)
    result = call(ids, out)
    params, shape, stream = last()
    seen["served"] = dict(same=result is out, params=params[:8], shape=shape[:7], stream=stream, bumps=rec.bumps,
                          stats=call.stats(), taught=call.taught(), launches=lib.fake_launches())
    # out allocated: its pointer launched, the allocated tensor returned
    result = call(ids)
    params, _, _ = last()
    seen["allocated"] = dict(fake=type(result).__name__, shape=list(result.shape), out_param=params[2],
                             empties=rec.empties, launches=lib.fake_launches())
    # a row program (2-D grid)
    rec = Recorder()
    call = taught(rec, index=7, tiles=5, row_tiles=False)
    call(FakeTensor((4,), I64), FakeTensor((4, 7), OUT_DTYPE, ptr=8192))
    seen["two_d"] = last()[1][:3]
    # another variant of the key: declined, nothing launched
    before = lib.fake_launches()
    seen["other_variants"] = [call(FakeTensor((4,), I64, ptr=4100), FakeTensor((4, 7), OUT_DTYPE, ptr=8192)) is None,
                              call(FakeTensor((4,), I32), FakeTensor((4, 7), OUT_DTYPE, ptr=8192)) is None,
                              call(FakeTensor((4,), I64), FakeTensor((4, 7), OUT_DTYPE, ptr=8200)) is None,
                              lib.fake_launches() - before]

    # declined before the stream, a bump or an allocation: what the Python path refuses or changes
    bad = {
        "ids_dtype": (FakeTensor((2, 3), "int16"), None),
        "ids_cpu": (FakeTensor((2, 3), I64, cuda=False), None),
        "ids_device": (FakeTensor((2, 3), I64, device=1), None),
        "ids_strided": (FakeTensor((2, 3), I64, contiguous=False), None),
        "no_ids": (FakeTensor((0, 3), I64), None),
        "past_max_n": (FakeTensor((11, 10), I64), None),
        "shape_item": (FakeTensor((2, 3.0), I64), None),
        "ids_null": (FakeTensor((2, 3), I64, ptr=0), None),
        "out_dtype": (None, FakeTensor((2, 3, 7), "float")),
        "out_short": (None, FakeTensor((2, 3, 6), OUT_DTYPE, ptr=8192)),
        "out_shape": (None, FakeTensor((3, 2, 7), OUT_DTYPE, ptr=8192)),
        "out_flat": (None, FakeTensor((6, 7), OUT_DTYPE, ptr=8192)),
        "out_strided": (None, FakeTensor((2, 3, 7), OUT_DTYPE, ptr=8192, contiguous=False)),
        "out_device": (None, FakeTensor((2, 3, 7), OUT_DTYPE, ptr=8192, device=1)),
        "out_cpu": (None, FakeTensor((2, 3, 7), OUT_DTYPE, ptr=8192, cuda=False)),
        "out_not_a_tensor": (None, "out"),
        "ids_subclass": (type("Sub", (FakeTensor,), {})((2, 3), I64), None),
    }
    seen["refused"] = {}
    for name, (i, o) in bad.items():
        rec = Recorder()
        call = taught(rec, index=7)
        before = lib.fake_launches()
        got = call(i if i is not None else FakeTensor((2, 3), I64), o if o is not None else
                   FakeTensor((2, 3, 7), OUT_DTYPE, ptr=8192))
        seen["refused"][name] = [got is None, rec.streams, rec.bumps, rec.empties, lib.fake_launches() - before,
                                 call.stats()["declined"]]

    # the launch hooks: an empty chain is no hook, a chain with a hook or a plain hook declines before the stream
    class Chain:
        def __init__(self, calls):
            self.calls = calls

    class Knobs:
        launch_enter_hook = Chain([])
        launch_exit_hook = None

    rec, knobs = Recorder(), Knobs()
    call = taught(rec, index=7, hooks=knobs)
    args = (FakeTensor((4,), I64), FakeTensor((4, 7), OUT_DTYPE, ptr=8192))
    hooks = [call(*args) is args[1]]
    knobs.launch_exit_hook = Chain([print])
    hooks.append(call(*args) is None)
    knobs.launch_exit_hook, knobs.launch_enter_hook = None, print
    hooks.append(call(*args) is None)
    seen["hooks"] = dict(results=hooks, streams=len(rec.streams))

    # capturing, another context current, a failed launch
    rec = Recorder()
    call = taught(rec, index=7)
    lib.fake_set(ctypes.c_void_p(0x1000), 1, 0)
    before = lib.fake_launches()
    seen["capturing"] = [call(FakeTensor((4,), I64)) is None, rec.empties, lib.fake_launches() - before]
    lib.fake_set(ctypes.c_void_p(0x2000), 0, 0)
    seen["other_context"] = [call(*args) is None, lib.fake_launches() - before]
    lib.fake_set(ctypes.c_void_p(0x1000), 0, 700)
    seen["launch_failed"] = [call(*args) is None, call.stats()["calls"]]
    lib.fake_set(ctypes.c_void_p(0x1000), 0, 0)
    seen["after"] = [call(*args) is args[1], call.stats()["calls"]]

    # a grid past the driver's bounds
    rec = Recorder()
    call = taught(rec, index=7, tiles=1 << 30, max_n=1 << 20)
    seen["grid_x"] = call(FakeTensor((2,), I64), FakeTensor((2, 7), OUT_DTYPE, ptr=8192)) is None
    call = taught(rec, index=7, tiles=70000, row_tiles=False)
    seen["grid_y"] = call(FakeTensor((2,), I64), FakeTensor((2, 7), OUT_DTYPE, ptr=8192)) is None

    # an Exception from a call into Python declines; a KeyboardInterrupt propagates, and nothing stays pending
    seen["errors"] = {}
    for where in ("stream", "empty", "bump"):
        rec = Recorder()
        call = taught(rec, index=7)
        a = (FakeTensor((5,), I64), None if where == "empty" else FakeTensor((5, 7), OUT_DTYPE, ptr=8192))
        rec.fail[where] = ValueError("a torch error")
        declined = call(*a) is None
        rec.fail[where] = KeyboardInterrupt()
        try:
            call(*a)
            interrupted = False
        except KeyboardInterrupt:
            interrupted = True
        del rec.fail[where]
        seen["errors"][where] = [declined, interrupted, call(*a) is not None]

    # teaching refused: the driver's list against the block
    call = make(Recorder())
    refusals = []
    for s in ([8, 8, 8, 4, 8, 8, 8, 8], [8, 8, 8, 4, 4], [8, 8, 8, 4, 4, 8, 8, 8, 8], [8, 8, 8, 4, 4, 8, 4]):
        sizes(s)
        refusals.append(call.teach(7, 0x77, 2, True, 4, 0, KINDS, VALUES, ()))
    sizes(SIZES)
    refusals.append(call.teach(7, 0x77, 2, True, 4, 0, b"PioInX", VALUES, ()))
    refusals.append(call.teach(7, 0x77, 2, True, 4, 0, KINDS, VALUES[:-1], ()))
    refusals.append(call.teach(7, 0x77, 2, True, 4, 0, b"PioI" + b"In", [0, 0, 0, 1 << 33, 0, 0], ()))
    refusals.append(call.teach(9, 0x77, 2, True, 4, 0, KINDS, VALUES, ()))
    seen["teach_refused"] = dict(why=refusals, taught=call.taught())

    # closed, then a forked child
    rec = Recorder()
    call = taught(rec, index=7)
    child = os.fork()
    if child == 0:
        os._exit(0 if call(*args) is None and not rec.streams else 1)
    _, status = os.waitpid(child, 0)
    seen["forked_child_declines"] = os.waitstatus_to_exitcode(status) == 0
    served = call(*args) is args[1]
    call.close()
    seen["closed"] = [served, call(*args) is None, call.taught(), call.stats()["closed"]]
    print(json.dumps(seen))


if __name__ == "__main__":
    main(sys.argv[1])
