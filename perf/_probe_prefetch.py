import time, numpy as np, torch, numba, sys
from numba import types
from numba.extending import intrinsic
from numba.core import cgutils
from llvmlite import ir
T = int(sys.argv[1]) if len(sys.argv) > 1 else 16
print("numba", numba.__version__, "llvmlite", __import__("llvmlite").__version__, flush=True)
torch.set_num_threads(T); numba.set_num_threads(T)

@intrinsic
def prefetch(typingctx, addr):
    sig = types.void(types.intp)
    def codegen(context, builder, signature, args):
        i8p = ir.IntType(8).as_pointer()
        ptr = builder.inttoptr(args[0], i8p)
        fnty = ir.FunctionType(ir.VoidType(), [i8p, ir.IntType(32), ir.IntType(32), ir.IntType(32)])
        fn = cgutils.get_or_insert_function(builder.module, fnty, "llvm.prefetch.p0")
        builder.call(fn, [ptr, ir.Constant(ir.IntType(32), 0), ir.Constant(ir.IntType(32), 3), ir.Constant(ir.IntType(32), 1)])
        return context.get_dummy_value()
    return sig, codegen

@numba.njit(nogil=True, parallel=True)
def pf_gather(tw, ids, ow, D):
    W = ow.shape[1]; n = ids.shape[0]
    nt = numba.get_num_threads()
    per = (n + nt - 1) // nt
    base = tw.ctypes.data
    rs = tw.strides[0]
    for t_ in numba.prange(nt):
        a = t_ * per; b = min(n, a + per)
        for i in range(a, b):
            if i + D < b:
                p = base + ids[i + D] * rs
                prefetch(p); prefetch(p + 64); prefetch(p + 128)
            r = ids[i]
            for j in range(W):
                ow[i, j] = tw[r, j]

from uvaple.uva import HostTable
R = 160
rows = (int(sys.argv[2]) << 30) // R if len(sys.argv) > 2 else (8 << 30) // R
ht = HostTable.empty(rows, R, torch.uint8, register="auto")
t = ht.tensor
t.view(torch.int64).fill_(0x0102030405060708)
tw = t.numpy().view(np.uint64)
for n in (65536, 262144, 1 << 20):
    out = torch.empty(n, R, dtype=torch.uint8); ow = out.numpy().view(np.uint64)
    from uvaple.integration.copy.cpu_gather import cpu_gather
    zero = np.zeros(1, np.uint8); tn = t.numpy(); on = out.numpy()
    for name in ("torch", "numba-par", "pf0", "pf4", "pf8", "pf16", "pf32"):
        ts = []
        for k in range(9):
            ids = torch.randint(0, rows, (n,), dtype=torch.int64); idn = ids.numpy()
            t0 = time.perf_counter()
            if name == "torch": torch.index_select(t, 0, ids, out=out)
            elif name == "numba-par": cpu_gather(tn, idn, on, 0, True, zero, path="parallel")
            else: pf_gather(tw, idn, ow, int(name[2:]) or 0)
            ts.append(time.perf_counter() - t0)
            if k == 0: assert torch.equal(out, t[ids]), name
        med = sorted(ts[1:])[4]
        print(f"threads {T} n {n:8d} {name:6s} {med*1e6:9.0f} us {n/med/1e6:6.1f} M rows/s", flush=True)
