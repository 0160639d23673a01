"""The eager C call (kernels/eager_call.c, .py): built here, its parameter block, and every check it makes
before a launch, driven on the CPU with stand-in tensors (a class given as the tensor type); the launches
themselves, against the Python path, in tests/test_eager_call_gpu.py."""

import json
import os
import subprocess
import sys

import pytest
import torch

from uvaple.kernels import eager_call

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

MODULE, WHY = eager_call._module()
needs_module = pytest.mark.skipif(MODULE is None, reason=f"the eager C call is not built here: {WHY}")


OUT_DTYPE, I32, I64 = "out-dtype", "int32", "int64"


@pytest.fixture(scope="module")
def seen(tmp_path_factory):
    """What every scenario of tests/eager_call_child.py saw, run once over a stand-in driver."""
    import eager_call_child

    folder = tmp_path_factory.mktemp("fake_cuda")
    src, lib = folder / "fake_cuda.c", folder / "libcuda.so.1"
    src.write_text(eager_call_child.FAKE_DRIVER)
    subprocess.run([eager_call._compiler(), "-O1", "-shared", "-fPIC", "-Wl,-soname,libcuda.so.1", "-o", str(lib),
                    str(src)], check=True, capture_output=True, timeout=120)
    done = subprocess.run([sys.executable, eager_call_child.__file__, str(lib)], capture_output=True, text=True,
                          timeout=300, env={**os.environ, "UVAPLE_EAGER_CALL": "1"})
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


@needs_module
def test_a_call_it_is_sure_of_launches_its_variant_with_the_block_taught(seen):
    s = seen["served"]
    assert s["same"] and s["launches"] == 1 and s["taught"] == 1
    # the table pointer, the ids, out, an int32 -3, the count (6 ids), an int64, the two hidden pointers null
    assert s["params"] == [0x5000, 4096, 8192, (1 << 32) - 3, 6, 1 << 40, 0, 0]
    assert s["shape"] == [12, 1, 1, 128, 1, 1, 256]  # 6 ids x 2 tiles a row, 4 warps, the shared bytes
    assert s["stream"] == 0xABC0 and s["bumps"] == [[8192]]  # torch's current stream; out's version bumped once
    assert s["stats"] == {"calls": 1, "declined": 0, "closed": 0}


@needs_module
def test_an_allocated_out_is_what_is_launched_and_returned(seen):
    a = seen["allocated"]
    assert a == {"fake": "FakeTensor", "shape": [2, 3, 7], "out_param": 8192, "empties": [[2, 3, 7]], "launches": 2}


@needs_module
def test_a_grid_of_rows_by_tiles_and_the_other_variants_of_a_key(seen):
    assert seen["two_d"] == [4, 5, 1]
    assert seen["other_variants"] == [True, True, True, 0]  # ids unaligned, int32, out unaligned: not taught


@needs_module
@pytest.mark.parametrize("case", ["ids_dtype", "ids_cpu", "ids_device", "ids_strided", "no_ids", "past_max_n",
                                  "shape_item", "ids_null", "out_dtype", "out_short", "out_shape", "out_flat",
                                  "out_strided", "out_device", "out_cpu", "out_not_a_tensor", "ids_subclass"])
def test_what_the_python_path_would_refuse_or_change_is_declined_before_anything_runs(seen, case):
    declined, streams, bumps, empties, launches, count = seen["refused"][case]
    assert declined and (streams, bumps, empties, launches, count) == ([], [], [], 0, 1)


@needs_module
def test_a_launch_hook_set_declines_before_the_stream_and_an_empty_chain_does_not(seen):
    assert seen["hooks"] == {"results": [True, True, True], "streams": 1}


@needs_module
def test_a_capture_another_context_and_a_failed_launch_decline(seen):
    assert seen["capturing"] == [True, [], 0]  # declined before out is allocated (the capture's pool)
    assert seen["other_context"] == [True, 0]
    assert seen["launch_failed"] == [True, 0] and seen["after"] == [True, 1]


@needs_module
def test_a_grid_past_the_drivers_bounds_declines(seen):
    assert seen["grid_x"] and seen["grid_y"]


@needs_module
@pytest.mark.parametrize("where", ["stream", "empty", "bump"])
def test_an_exception_in_a_call_into_python_declines_and_an_interrupt_propagates(seen, where):
    assert seen["errors"][where] == [True, True, True]


@needs_module
def test_a_block_unlike_the_drivers_own_list_is_not_taught(seen):
    why = seen["teach_refused"]["why"]
    assert "size differs" in why[0] and "fewer parameters" in why[1] and "more parameters" in why[2]
    assert "not a pointer" in why[3] and "unknown parameter kind" in why[4] and "differ in length" in why[5]
    assert "out of range" in why[6] and "no such variant" in why[7]
    assert seen["teach_refused"]["taught"] == 0


@needs_module
def test_a_forked_child_and_a_closed_call_decline(seen):
    assert seen["forked_child_declines"]
    assert seen["closed"] == [True, True, 0, 1]


def _call():
    return MODULE.EagerCall(object, OUT_DTYPE, I32, I64, 0, "cuda", 7, 10, print, print, print, None)


@needs_module
def test_bad_arguments_are_named_errors():
    call = _call()
    with pytest.raises(TypeError, match="EagerCall"):
        call()
    with pytest.raises(TypeError, match="no keywords"):
        call(1, out=None)
    with pytest.raises(ValueError, match="EagerCall"):
        MODULE.EagerCall(object, OUT_DTYPE, I32, I64, -1, "cuda", 7, 10, print, print, print, None)
    with pytest.raises(ValueError, match="EagerCall"):
        MODULE.EagerCall(object, OUT_DTYPE, I32, I64, 0, "cuda", 0, 10, print, print, print, None)
    with pytest.raises(TypeError, match="once"):
        call.__init__(object, OUT_DTYPE, I32, I64, 0, "cuda", 7, 10, print, print, print, None)


@needs_module
def test_teaching_without_a_driver_keeps_nothing_and_says_why():
    if MODULE.driver_error() is None:
        pytest.skip("this process has a CUDA driver: the stand-in driver's tests and the GPU tests teach kernels")
    call = _call()
    assert "libcuda" in call.teach(0, 1234, 1, True, 4, 0, b"Pio", [5, 0, 0], ()) and call.taught() == 0
    assert call(1, None) is None  # no driver: every call declines at once


# ------------------------------------------------------------------ the parameter block
TENSOR = torch.zeros(3)


def test_the_block_follows_the_compiled_signature_and_skips_what_triton_made_constant():
    args = (TENSOR, "ids", "out", None, None, None, None, 0, None, 5, 0, 0, 17, 24, 0, 24, 0, 1)
    types = ["*bf16", "*i64", "*bf16", "constexpr", "constexpr", "constexpr", "constexpr", "i32", "constexpr",
             "i32", "i32", "i32", "i32", "i32", "i32", "i32", "i32", "constexpr", "constexpr", "constexpr"]
    kinds, values = eager_call.program(types, args)
    assert kinds == b"PioInIIIIIII"
    assert values == [TENSOR.data_ptr(), 0, 0, 0, 0, 0, 0, 17, 24, 0, 24, 0]
    types[9], types[12] = "i64", "i64"  # a count past int32, and a wide row count
    kinds, _ = eager_call.program(types, args)
    assert kinds == b"PioINIIPIIII"


@pytest.mark.parametrize("change", [
    lambda types, args: (types + ["i32"], args),  # a runtime parameter past the arguments
    lambda types, args: (types[:5], args),  # fewer types than arguments
    lambda types, args: (["fp32"] + types[1:], args),  # a type the block does not write
    lambda types, args: (types[:9] + ["fp32"] + types[10:], args),  # the count as a float
    lambda types, args: (types[:1] + ["i32"] + types[2:], args),  # the ids as an integer
    lambda types, args: (types, (0,) + args[1:]),  # a pointer parameter given a non-tensor
    lambda types, args: (types, args[:13] + (True,) + args[14:]),  # a bool where an int is expected
])
def test_a_signature_the_block_cannot_follow_is_none(change):
    args = (TENSOR, "ids", "out", None, None, None, None, 0, None, 5, 0, 0, 17, 24, 0, 24, 0, 1)
    types = ["*bf16", "*i64", "*bf16", "constexpr", "constexpr", "constexpr", "constexpr", "i32", "constexpr",
             "i32", "i32", "i32", "i32", "i32", "i32", "i32", "i32", "constexpr", "constexpr", "constexpr"]
    types, args = change(types, args)
    assert eager_call.program(types, args) is None


# ------------------------------------------------------------------ building
def test_it_builds_here_where_a_compiler_and_python_h_are():
    import shutil
    import sysconfig

    if os.environ.get("UVAPLE_EAGER_CALL") == "0":
        assert "UVAPLE_EAGER_CALL" in WHY
        return
    has_cc = bool(os.environ.get("CC") or shutil.which("gcc") or shutil.which("clang") or shutil.which("cc"))
    has_h = os.path.exists(os.path.join(sysconfig.get_paths()["include"], "Python.h"))
    assert (MODULE is not None) == (has_cc and has_h), WHY


def _unavailable_in_child(env: dict) -> str:
    """What unavailable() says in a fresh interpreter with ``env`` added."""
    code = "from uvaple.kernels import eager_call; print(eager_call.unavailable())"
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, cwd=REPO,
                          env={**os.environ, **env})
    assert done.returncode == 0, done.stderr
    return done.stdout.strip()


def test_turned_off_and_unbuildable_say_why_and_leave_the_python_path(tmp_path):
    import sysconfig

    assert "UVAPLE_EAGER_CALL=0" in _unavailable_in_child({"UVAPLE_EAGER_CALL": "0"})
    if not os.path.exists(os.path.join(sysconfig.get_paths()["include"], "Python.h")):
        assert "Python.h" in _unavailable_in_child({"UVAPLE_EAGER_CALL": "1"})
        return
    why = _unavailable_in_child({"CC": "false", "UVAPLE_CACHE_DIR": str(tmp_path), "UVAPLE_EAGER_CALL": "1"})
    assert why.startswith("false could not build eager_call.c")
    assert not [p for p in tmp_path.rglob("*") if p.is_file()]  # nothing half-built left


@needs_module
def test_a_build_is_cached_by_source_and_found_again(tmp_path):
    env = {"UVAPLE_CACHE_DIR": str(tmp_path), "UVAPLE_EAGER_CALL": "1"}
    assert _unavailable_in_child(env) == "None"
    built = list(tmp_path.rglob("uvaple_eager_call*"))
    assert len(built) == 1
    stamp = built[0].stat().st_mtime_ns
    inode = built[0].stat().st_ino
    assert _unavailable_in_child(env) == "None"
    assert (built[0].stat().st_mtime_ns, built[0].stat().st_ino) == (stamp, inode)  # found, not built again


def test_the_version_bump_the_c_call_makes_adds_one():
    """The C call hands ``_bump`` a 1-tuple ``(out,)``: torch's bump then adds exactly one, whatever out's shape."""
    for shape in ((), (7,), (5, 9), (2, 3, 4)):
        t = torch.zeros(shape)
        v = t._version
        eager_call._bump((t,))
        assert t._version == v + 1, shape


def test_teaching_holds_no_cycle_back_to_the_launcher_owner():
    """A direct gather taught to an eager call is freed by reference counting (its table's view with it)."""
    import gc
    import weakref

    from uvaple.kernels.gather import DirectGather

    table = torch.randn(50, 16).to(torch.bfloat16)
    gather = DirectGather(table, torch.device("cpu"), torch.bfloat16)
    gather.serve_eager(object(), 0, 16)
    gather._for_cols(16)
    ref = weakref.ref(gather)
    gc.disable()
    try:
        del gather
        assert ref() is None
    finally:
        gc.enable()
