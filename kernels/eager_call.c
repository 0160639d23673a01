/* A lookup's whole-row eager call, checked and launched below Python (see eager_call.py).
 *
 * An EagerCall serves the calls `lookup(ids)` and `lookup(ids, out)` of one lookup's direct gather. It checks
 * what the Python path checks of such a call, picks the variant of the call key (the ids' dtype, whether the
 * ids' and out's addresses are 16-byte aligned) and launches its compiled kernel with cuLaunchKernel on
 * torch's current stream of the lookup's device, the parameters written on its own stack. Where it is unsure
 * it declines: it returns None, launches nothing, and the Python path runs the call with its named errors.
 *
 * It needs Python.h only: the driver's entry points are found with dlsym in the libcuda the process has
 * loaded, and everything torch is reached through the Python objects handed to the constructor. The variant
 * is looked up before the calls into Python (a call that will decline does no Python work) and again after the
 * last of them, so a close() or a teach() that runs meanwhile (another thread) is seen.
 * An Exception raised by such a call declines (the Python path raises its own, named); any other
 * BaseException (KeyboardInterrupt) is the caller's and propagates.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <dlfcn.h>
#include <stddef.h>
#include <pthread.h>
#include <stdint.h>
#include <string.h>

typedef int CUresult;
typedef void *CUfunction;
typedef void *CUstream;
typedef void *CUcontext;
typedef CUresult (*launch_fn)(CUfunction, unsigned, unsigned, unsigned, unsigned, unsigned, unsigned, unsigned,
                              CUstream, void **, void **);
typedef CUresult (*ctx_fn)(CUcontext *);
typedef CUresult (*capturing_fn)(CUstream, int *);
typedef CUresult (*param_info_fn)(CUfunction, size_t, size_t *, size_t *);

static launch_fn cu_launch;
static ctx_fn cu_ctx_current;
static capturing_fn cu_capturing;
static param_info_fn cu_param_info;
static const char *driver_error; /* why the driver's entry points are missing, or NULL */
static int driver_loaded;
static volatile long fork_generation; /* fork()s this process descends through: a child's parent's contexts,
                                          streams and tables are not its own */

#define MAX_PARAMS 64
#define N_VARIANTS 8         /* ids int64 (1) | ids 16-byte aligned (2) | out 16-byte aligned (4) */
#define MAX_EXTRA 2          /* hidden trailing pointers of a compiled kernel (Triton's scratch buffers) */
#define GRID_X_MAX 2147483647LL
#define GRID_Y_MAX 65535LL

/* what a parameter slot holds: a fixed value of 8 or 4 bytes, the ids' or out's address, the id count in
 * 4 or 8 bytes, a null pointer (a scratch buffer of size 0) */
enum { K_FIXED8 = 'P', K_FIXED4 = 'I', K_IDS = 'i', K_OUT = 'o', K_N4 = 'n', K_N8 = 'N', K_NULL = 'z' };

typedef struct {
    PyObject *keep; /* NULL: not taught; else what the launch reads (compiled kernel, tensors), held */
    CUfunction function;
    CUcontext context;
    unsigned block_x, shared;
    long long tiles;
    int row_tiles, n_params;
    char kinds[MAX_PARAMS];
    uint64_t values[MAX_PARAMS];
} Variant;

typedef struct {
    PyObject_HEAD
    vectorcallfunc vectorcall;
    PyObject *tensor_type, *out_dtype, *int32, *int64, *empty, *empty_kw, *stream_of, *device_obj, *bump, *hooks;
    PyObject *device_obj_index; /* the device's index as an int: the stream getter's argument */
    long device, generation; /* generation: fork_generation when made (a forked child's calls decline) */
    Py_ssize_t ncols, max_n;
    int closed;
    unsigned long long calls, declined;
    Variant variants[N_VARIANTS];
} EagerCall;

static PyObject *s_dtype, *s_is_cuda, *s_get_device, *s_is_contiguous, *s_shape, *s_data_ptr, *s_enter, *s_exit,
    *s_calls;

static void after_fork_in_child(void) { fork_generation++; }

static void load_driver(void) {
    if (driver_loaded) return;
    driver_loaded = 1;
    void *lib = dlopen("libcuda.so.1", RTLD_NOW | RTLD_NOLOAD);
    if (!lib) lib = dlopen("libcuda.so.1", RTLD_NOW);
    if (!lib) { driver_error = "libcuda.so.1 is not loadable"; return; }
    cu_launch = (launch_fn)dlsym(lib, "cuLaunchKernel");
    cu_ctx_current = (ctx_fn)dlsym(lib, "cuCtxGetCurrent");
    cu_capturing = (capturing_fn)dlsym(lib, "cuStreamIsCapturing");
    cu_param_info = (param_info_fn)dlsym(lib, "cuFuncGetParamInfo");
    if (!cu_launch || !cu_ctx_current || !cu_capturing)
        driver_error = "the CUDA driver lacks cuLaunchKernel, cuCtxGetCurrent or cuStreamIsCapturing";
    else if (!cu_param_info)
        driver_error = "the CUDA driver lacks cuFuncGetParamInfo (a driver of CUDA 12.4 or later has it)";
}

/* 1: `r` (a new reference, or NULL with an error set) is exactly True; 0: anything else, the error left set
 * for the caller's decline to sort (an Exception declines, any other BaseException propagates). */
static int is_true(PyObject *r) {
    if (!r) return 0;
    int yes = r == Py_True;
    Py_DECREF(r);
    return yes;
}

/* The tensor checks of the Python path: exactly a torch.Tensor, on the lookup's CUDA device, contiguous.
 * Sets *dtype and *shape (new references; *shape a tuple) and *ptr. 1 on success, else 0 (an error may be
 * set: the caller declines). */
static int read_tensor(EagerCall *self, PyObject *t, PyObject **dtype, PyObject **shape, uint64_t *ptr) {
    if (Py_TYPE(t) != (PyTypeObject *)self->tensor_type) return 0;
    if (!is_true(PyObject_GetAttr(t, s_is_cuda))) return 0;
    PyObject *dev = PyObject_CallMethodNoArgs(t, s_get_device);
    if (!dev) return 0;
    long index = PyLong_Check(dev) ? PyLong_AsLong(dev) : -2;
    Py_DECREF(dev);
    if (index != self->device || !is_true(PyObject_CallMethodNoArgs(t, s_is_contiguous))) return 0;
    PyObject *p = PyObject_CallMethodNoArgs(t, s_data_ptr);
    if (!p) return 0;
    *ptr = PyLong_Check(p) ? (uint64_t)PyLong_AsUnsignedLongLong(p) : 0;
    Py_DECREF(p);
    if (*ptr == 0 || PyErr_Occurred()) return 0;
    *shape = PyObject_GetAttr(t, s_shape);
    if (!*shape || !PyTuple_Check(*shape)) return 0;
    *dtype = PyObject_GetAttr(t, s_dtype);
    return *dtype != NULL;
}

/* The count of ids a shape holds, each item an exact int >= 0; -1 when an item is not, or the count passes
 * `bound`. */
static Py_ssize_t count_of(PyObject *shape, Py_ssize_t bound) {
    Py_ssize_t n = 1, k = PyTuple_GET_SIZE(shape);
    for (Py_ssize_t i = 0; i < k; i++) {
        PyObject *item = PyTuple_GET_ITEM(shape, i);
        if (!PyLong_CheckExact(item)) return -1;
        Py_ssize_t d = PyLong_AsSsize_t(item);
        if (d < 0) { PyErr_Clear(); return -1; }
        if (d == 0) n = 0;
        else if (n > bound / d) return -1; /* past the bound (and no overflow) */
        else n *= d;
    }
    return n;
}

/* 0: no Triton launch hook is set; else 1 (a hook, or a chain holding one: Triton's own launch must be seen
 * by it; or an error, left set). */
static int hooks_set(EagerCall *self) {
    if (self->hooks == Py_None) return 0;
    PyObject *names[2] = {s_enter, s_exit};
    for (int i = 0; i < 2; i++) {
        PyObject *hook = PyObject_GetAttr(self->hooks, names[i]);
        if (!hook) return 1;
        int set = 0;
        if (hook != Py_None) {
            PyObject *calls = PyObject_GetAttr(hook, s_calls);
            if (calls) {
                set = PyObject_IsTrue(calls);
                Py_DECREF(calls);
                if (set < 0) set = 1;
            } else if (PyErr_ExceptionMatches(PyExc_AttributeError)) {
                PyErr_Clear(); /* a plain hook */
                set = 1;
            } else {
                set = 1;
            }
        }
        Py_DECREF(hook);
        if (set) return 1;
    }
    return 0;
}

static PyObject *EagerCall_call(EagerCall *self, PyObject *const *args, Py_ssize_t nargs) {
    if (nargs < 1 || nargs > 2) {
        PyErr_SetString(PyExc_TypeError, "EagerCall(ids, out=None)");
        return NULL;
    }
    PyObject *ids = args[0], *out = nargs == 2 ? args[1] : Py_None;
    PyObject *ids_dtype = NULL, *ids_shape = NULL, *out_dtype = NULL, *out_shape = NULL, *allocated = NULL;
    PyObject *result = NULL, *s = NULL;
    uint64_t ids_ptr = 0, out_ptr = 0;
    Py_ssize_t n = -1, k = 0;
    CUstream stream = NULL;
    CUcontext ctx = NULL;
    Variant *v = NULL;
    int status = 0, wide = 0;
    long long gx = 0, gy = 0;
    uint64_t values[MAX_PARAMS];
    void *params[MAX_PARAMS];

    if (self->closed || self->generation != fork_generation || !cu_launch || driver_error)
        goto declined; /* closed, a forked child, or nothing taught yet */
    if (!read_tensor(self, ids, &ids_dtype, &ids_shape, &ids_ptr)) goto declined;
    wide = ids_dtype == self->int64;
    if (!wide && ids_dtype != self->int32) goto declined;
    n = count_of(ids_shape, self->max_n);
    if (n <= 0) goto declined; /* none (the Python path's), or more than a direct call of this plan takes */
    k = PyTuple_GET_SIZE(ids_shape);
    if (out != Py_None) {
        if (!read_tensor(self, out, &out_dtype, &out_shape, &out_ptr) || out_dtype != self->out_dtype) goto declined;
        if (PyTuple_GET_SIZE(out_shape) != k + 1) goto declined;
        for (Py_ssize_t i = 0; i <= k; i++) {
            PyObject *b = PyTuple_GET_ITEM(out_shape, i);
            Py_ssize_t want = i < k ? PyLong_AsSsize_t(PyTuple_GET_ITEM(ids_shape, i)) : self->ncols;
            if (!PyLong_CheckExact(b) || PyLong_AsSsize_t(b) != want) goto declined;
        }
    }
    /* what needs no Python first: the variant (an allocated out is aligned: the caching allocator's blocks are),
     * the current context */
    v = &self->variants[wide | ((ids_ptr % 16 == 0) << 1) | ((out == Py_None || out_ptr % 16 == 0) << 2)];
    if (!v->keep || cu_ctx_current(&ctx) != 0 || ctx != v->context) goto declined;
    if (hooks_set(self)) goto declined;
    s = PyObject_CallOneArg(self->stream_of, self->device_obj_index);
    if (!s) goto declined;
    stream = (CUstream)(uintptr_t)PyLong_AsUnsignedLongLong(s);
    if (PyErr_Occurred()) goto declined;
    /* a capture: the Python path keeps the host table for the graph (and allocates out in its pool once) */
    if (cu_capturing(stream, &status) != 0 || status != 0) goto declined;
    if (out == Py_None) { /* torch.empty((*ids.shape, ncols), dtype=, device=) */
        PyObject *shape = PyTuple_New(k + 1);
        if (!shape) goto declined;
        for (Py_ssize_t i = 0; i < k; i++) {
            PyObject *item = PyTuple_GET_ITEM(ids_shape, i);
            Py_INCREF(item);
            PyTuple_SET_ITEM(shape, i, item);
        }
        PyObject *last = PyLong_FromSsize_t(self->ncols);
        if (!last) { Py_DECREF(shape); goto declined; }
        PyTuple_SET_ITEM(shape, k, last);
        PyObject *call_args = PyTuple_Pack(1, shape);
        Py_DECREF(shape);
        if (!call_args) goto declined;
        allocated = PyObject_Call(self->empty, call_args, self->empty_kw);
        Py_DECREF(call_args);
        if (!allocated) goto declined;
        /* checked as a given out is: what the kernel writes is what torch.empty made */
        if (!read_tensor(self, allocated, &out_dtype, &out_shape, &out_ptr) || out_dtype != self->out_dtype ||
            PyTuple_GET_SIZE(out_shape) != k + 1)
            goto declined;
        out = allocated;
    } else {
        PyObject *one = PyTuple_Pack(1, out); /* `out` is written: autograd's version counter, bumped once */
        if (!one) goto declined;
        PyObject *r = PyObject_CallOneArg(self->bump, one);
        Py_DECREF(one);
        if (!r) goto declined;
        Py_DECREF(r);
    }

    /* no call into Python from here on: the state read now is the state the launch uses */
    if (self->closed || self->generation != fork_generation) goto declined;
    v = &self->variants[wide | ((ids_ptr % 16 == 0) << 1) | ((out_ptr % 16 == 0) << 2)];
    if (!v->keep) goto declined; /* not taught: the Python path launches through Triton, which teaches it */
    if (cu_ctx_current(&ctx) != 0 || ctx != v->context) goto declined; /* another device or context current */
    gx = v->row_tiles ? (long long)n * v->tiles : (long long)n;
    gy = v->row_tiles ? 1 : v->tiles;
    if (gx > GRID_X_MAX || gy > GRID_Y_MAX) goto declined;
    for (int i = 0; i < v->n_params; i++) {
        switch (v->kinds[i]) {
        case K_IDS: values[i] = ids_ptr; break;
        case K_OUT: values[i] = out_ptr; break;
        case K_N4: { int32_t n4 = (int32_t)n; values[i] = 0; memcpy(&values[i], &n4, 4); break; }
        case K_N8: values[i] = (uint64_t)n; break;
        default: values[i] = v->values[i];
        }
        params[i] = &values[i];
    }
    if (cu_launch(v->function, (unsigned)gx, (unsigned)gy, 1, v->block_x, 1, 1, v->shared, stream, params, NULL) != 0)
        goto declined; /* the Python path launches again and raises Triton's error */
    self->calls++;
    Py_INCREF(out);
    result = out;
    goto done;

declined:
    if (PyErr_Occurred()) {
        if (!PyErr_ExceptionMatches(PyExc_Exception)) goto done; /* a KeyboardInterrupt is the caller's */
        PyErr_Clear();
    }
    self->declined++;
    Py_INCREF(Py_None);
    result = Py_None;
done:
    Py_XDECREF(s);
    Py_XDECREF(ids_dtype);
    Py_XDECREF(ids_shape);
    Py_XDECREF(out_dtype);
    Py_XDECREF(out_shape);
    Py_XDECREF(allocated);
    return result;
}

/* teach(index, function, tiles, row_tiles, num_warps, shared, kinds, values, keep) -> None, or why not (str).
 * Called right after the Python path launched the variant through Triton, on the lookup's device (current):
 * that device's current context is the variant's. kinds: bytes, one K_* a parameter of the compiled kernel's
 * own signature; values: the fixed ones (0 elsewhere). The driver's own parameter list of the function must
 * match it: the same count (after at most MAX_EXTRA hidden 8-byte pointers, passed null) and sizes. */
static PyObject *EagerCall_teach(EagerCall *self, PyObject *args) {
    int index, row_tiles, num_warps;
    unsigned long long function;
    long long tiles;
    unsigned int shared;
    Py_buffer kinds;
    PyObject *values, *keep;
    if (!PyArg_ParseTuple(args, "iKLpiIy*OO", &index, &function, &tiles, &row_tiles, &num_warps, &shared, &kinds,
                          &values, &keep))
        return NULL;
    const char *why = NULL;
    Variant fresh;
    memset(&fresh, 0, sizeof fresh);
    load_driver();
    if (driver_error) why = driver_error;
    else if (self->closed) why = "the lookup is closed";
    else if (index < 0 || index >= N_VARIANTS) why = "no such variant";
    else if (!PyList_Check(values) || PyList_GET_SIZE(values) != kinds.len) why = "kinds and values differ in length";
    else if (kinds.len + MAX_EXTRA > MAX_PARAMS) why = "too many parameters";
    else if (tiles < 1 || num_warps < 1 || num_warps > 32) why = "a bad launch shape";
    if (!why) {
        fresh.function = (CUfunction)(uintptr_t)function;
        fresh.block_x = 32u * (unsigned)num_warps;
        fresh.shared = shared;
        fresh.tiles = tiles;
        fresh.row_tiles = row_tiles;
        for (Py_ssize_t i = 0; i < kinds.len && !why; i++) {
            char k = ((const char *)kinds.buf)[i];
            fresh.kinds[i] = k;
            if (k != K_FIXED8 && k != K_FIXED4 && k != K_IDS && k != K_OUT && k != K_N4 && k != K_N8)
                why = "an unknown parameter kind";
            else if (k == K_FIXED8 || k == K_FIXED4) {
                PyObject *item = PyList_GET_ITEM(values, i);
                if (!PyLong_Check(item)) why = "a fixed value is not an int";
                else if (k == K_FIXED4) {
                    long long x = PyLong_AsLongLong(item);
                    if (PyErr_Occurred() || x < INT32_MIN || x > (long long)UINT32_MAX) {
                        PyErr_Clear();
                        why = "a 4-byte parameter out of range";
                    }
                    uint32_t x4 = (uint32_t)x;
                    memcpy(&fresh.values[i], &x4, 4);
                } else {
                    fresh.values[i] = PyLong_AsUnsignedLongLongMask(item);
                    if (PyErr_Occurred()) { PyErr_Clear(); why = "an 8-byte parameter out of range"; }
                }
            }
        }
        fresh.n_params = (int)kinds.len;
    }
    PyBuffer_Release(&kinds);
    if (!why && cu_ctx_current(&fresh.context) != 0) why = "no CUDA context is current";
    if (!why) { /* the driver's parameter list of the function against this one */
        size_t offset, size;
        int declared = fresh.n_params;
        for (int i = 0; i <= declared + MAX_EXTRA && !why; i++) {
            if (cu_param_info(fresh.function, (size_t)i, &offset, &size) != 0) {
                if (i < declared) why = "the compiled kernel has fewer parameters than its signature";
                break;
            }
            if (i == declared + MAX_EXTRA) why = "the compiled kernel has more parameters than its signature";
            else if (i >= declared) {
                if (size != 8) why = "a hidden parameter of the compiled kernel is not a pointer";
                fresh.kinds[i] = K_NULL;
                fresh.values[i] = 0;
                fresh.n_params = i + 1;
            } else {
                char k = fresh.kinds[i];
                if (size != ((k == K_FIXED4 || k == K_N4) ? 4u : 8u))
                    why = "a parameter's size differs from the compiled kernel's";
            }
        }
    }
    if (why) return PyUnicode_FromString(why);
    Variant *v = &self->variants[index];
    PyObject *old = v->keep;
    Py_INCREF(keep);
    fresh.keep = keep;
    *v = fresh;
    Py_XDECREF(old);
    Py_RETURN_NONE;
}

static PyObject *EagerCall_close(EagerCall *self, PyObject *unused) {
    self->closed = 1;
    for (int i = 0; i < N_VARIANTS; i++) Py_CLEAR(self->variants[i].keep);
    Py_RETURN_NONE;
}

static PyObject *EagerCall_taught(EagerCall *self, PyObject *unused) {
    int n = 0;
    for (int i = 0; i < N_VARIANTS; i++) n += self->variants[i].keep != NULL;
    return PyLong_FromLong(n);
}

static PyObject *EagerCall_stats(EagerCall *self, PyObject *unused) {
    return Py_BuildValue("{sKsKsi}", "calls", self->calls, "declined", self->declined, "closed", self->closed);
}

static int EagerCall_init(EagerCall *self, PyObject *args, PyObject *kw) {
    /* EagerCall(tensor_type, out_dtype, int32, int64, device, device_obj, ncols, max_n, empty, stream_of, bump,
     *           hooks): all or nothing */
    PyObject *tensor_type, *out_dtype, *int32, *int64, *device_obj, *empty, *stream_of, *bump, *hooks;
    long device;
    Py_ssize_t ncols, max_n;
    if (kw && PyDict_GET_SIZE(kw)) {
        PyErr_SetString(PyExc_TypeError, "EagerCall(...) takes no keywords");
        return -1;
    }
    if (self->tensor_type) {
        PyErr_SetString(PyExc_TypeError, "EagerCall is initialised once");
        return -1;
    }
    if (!PyArg_ParseTuple(args, "OOOOlOnnOOOO", &tensor_type, &out_dtype, &int32, &int64, &device, &device_obj,
                          &ncols, &max_n, &empty, &stream_of, &bump, &hooks))
        return -1;
    if (!PyType_Check(tensor_type) || device < 0 || ncols < 1 || max_n < 0) {
        PyErr_SetString(PyExc_ValueError, "EagerCall: a bad tensor type, device, column count or bound");
        return -1;
    }
    PyObject *kw_dict = Py_BuildValue("{sOsO}", "dtype", out_dtype, "device", device_obj);
    if (!kw_dict) return -1;
    PyObject *index = PyLong_FromLong(device);
    if (!index) { Py_DECREF(kw_dict); return -1; }
    PyObject **slots[] = {&self->tensor_type, &self->out_dtype, &self->int32, &self->int64, &self->device_obj,
                          &self->empty, &self->stream_of, &self->bump, &self->hooks};
    PyObject *given[] = {tensor_type, out_dtype, int32, int64, device_obj, empty, stream_of, bump, hooks};
    for (int i = 0; i < 9; i++) {
        Py_INCREF(given[i]);
        Py_XSETREF(*slots[i], given[i]);
    }
    Py_XSETREF(self->empty_kw, kw_dict);
    Py_XSETREF(self->device_obj_index, index);
    self->device = device;
    self->generation = fork_generation;
    self->ncols = ncols;
    self->max_n = max_n;
    return 0;
}

static int EagerCall_traverse(EagerCall *self, visitproc visit, void *arg) {
    Py_VISIT(self->tensor_type); Py_VISIT(self->out_dtype); Py_VISIT(self->int32); Py_VISIT(self->int64);
    Py_VISIT(self->empty); Py_VISIT(self->empty_kw); Py_VISIT(self->stream_of); Py_VISIT(self->device_obj);
    Py_VISIT(self->bump); Py_VISIT(self->hooks); Py_VISIT(self->device_obj_index);
    for (int i = 0; i < N_VARIANTS; i++) Py_VISIT(self->variants[i].keep);
    return 0;
}

static int EagerCall_clear(EagerCall *self) {
    Py_CLEAR(self->tensor_type); Py_CLEAR(self->out_dtype); Py_CLEAR(self->int32); Py_CLEAR(self->int64);
    Py_CLEAR(self->empty); Py_CLEAR(self->empty_kw); Py_CLEAR(self->stream_of); Py_CLEAR(self->device_obj);
    Py_CLEAR(self->bump); Py_CLEAR(self->hooks); Py_CLEAR(self->device_obj_index);
    for (int i = 0; i < N_VARIANTS; i++) Py_CLEAR(self->variants[i].keep);
    return 0;
}

static void EagerCall_dealloc(EagerCall *self) {
    PyObject_GC_UnTrack(self);
    EagerCall_clear(self);
    Py_TYPE(self)->tp_free((PyObject *)self);
}

static PyMethodDef EagerCall_methods[] = {
    {"teach", (PyCFunction)EagerCall_teach, METH_VARARGS, "Keep a variant's compiled kernel; None, or why not."},
    {"close", (PyCFunction)EagerCall_close, METH_NOARGS, "Decline every later call; drop the variants."},
    {"taught", (PyCFunction)EagerCall_taught, METH_NOARGS, "How many variants are kept."},
    {"stats", (PyCFunction)EagerCall_stats, METH_NOARGS, "Calls launched here and declined."},
    {NULL, NULL, 0, NULL},
};

static PyObject *EagerCall_vectorcall(PyObject *self, PyObject *const *args, size_t nargsf, PyObject *kwnames) {
    if (kwnames && PyTuple_GET_SIZE(kwnames)) {
        PyErr_SetString(PyExc_TypeError, "EagerCall(ids, out=None) takes no keywords");
        return NULL;
    }
    return EagerCall_call((EagerCall *)self, args, PyVectorcall_NARGS(nargsf));
}

static PyObject *EagerCall_tp_call(PyObject *self, PyObject *args, PyObject *kw) {
    if (kw && PyDict_GET_SIZE(kw)) {
        PyErr_SetString(PyExc_TypeError, "EagerCall(ids, out=None) takes no keywords");
        return NULL;
    }
    return EagerCall_call((EagerCall *)self, &PyTuple_GET_ITEM(args, 0), PyTuple_GET_SIZE(args));
}

static PyObject *EagerCall_new(PyTypeObject *type, PyObject *args, PyObject *kw) {
    EagerCall *self = (EagerCall *)type->tp_alloc(type, 0);
    if (self) self->vectorcall = EagerCall_vectorcall;
    return (PyObject *)self;
}

static PyTypeObject EagerCallType = {
    PyVarObject_HEAD_INIT(NULL, 0).tp_name = "uvaple_eager_call.EagerCall",
    .tp_basicsize = sizeof(EagerCall),
    .tp_flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_HAVE_GC | Py_TPFLAGS_HAVE_VECTORCALL,
    .tp_doc = "A lookup's whole-row eager call below Python: call(ids, out=None) -> out, or None (declined).",
    .tp_new = EagerCall_new,
    .tp_init = (initproc)EagerCall_init,
    .tp_dealloc = (destructor)EagerCall_dealloc,
    .tp_traverse = (traverseproc)EagerCall_traverse,
    .tp_clear = (inquiry)EagerCall_clear,
    .tp_call = EagerCall_tp_call,
    .tp_vectorcall_offset = offsetof(EagerCall, vectorcall),
    .tp_methods = EagerCall_methods,
};

static PyObject *driver_state(PyObject *m, PyObject *unused) {
    load_driver();
    if (driver_error) return PyUnicode_FromString(driver_error);
    Py_RETURN_NONE;
}

static PyMethodDef module_methods[] = {
    {"driver_error", driver_state, METH_NOARGS, "Why the driver's entry points are missing, or None."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "uvaple_eager_call", NULL, -1, module_methods};

PyMODINIT_FUNC PyInit_uvaple_eager_call(void) {
    const char *names[] = {"dtype", "is_cuda", "get_device", "is_contiguous", "shape", "data_ptr",
                           "launch_enter_hook", "launch_exit_hook", "calls"};
    PyObject **slots[] = {&s_dtype, &s_is_cuda, &s_get_device, &s_is_contiguous, &s_shape, &s_data_ptr, &s_enter,
                          &s_exit, &s_calls};
    for (int i = 0; i < 9; i++)
        if (!(*slots[i] = PyUnicode_InternFromString(names[i]))) return NULL;
    if (PyType_Ready(&EagerCallType) < 0) return NULL;
    PyObject *m = PyModule_Create(&module);
    if (!m) return NULL;
    Py_INCREF(&EagerCallType);
    if (PyModule_AddObject(m, "EagerCall", (PyObject *)&EagerCallType) < 0) {
        Py_DECREF(&EagerCallType);
        Py_DECREF(m);
        return NULL;
    }
    pthread_atfork(NULL, NULL, after_fork_in_child);
    return m;
}
