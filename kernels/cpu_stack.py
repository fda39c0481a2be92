"""A decode step's whole decoder stack in one native call (csrc/decode_stack.c).

The structures mirror the C ones field for field. `model/native_stack.py` fills a `Layer` per
decoder layer once (the weights and the KV views never move) and calls `run` per step; this
module knows nothing of the model's classes.
"""

from __future__ import annotations

import ctypes

import torch

from pagedserve.kernels import cpu_native

F32, I8G, I4G, W8A8 = 0, 1, 2, 3  # a Linear's kind (W8A8: `zeros` holds the codes' row sums)
MAX_PARTS = 3  # linears side by side in the q/k/v and gate/up slots

_ptr, _i64 = ctypes.c_void_p, ctypes.c_int64


class Linear(ctypes.Structure):
    _fields_ = [
        ("kind", _i64), ("w", _ptr), ("scales", _ptr), ("zeros", _ptr), ("bias", _ptr),
        ("n", _i64), ("k", _i64), ("group", _i64),
        ("packed", _ptr),  # F32: the weight packed for MKL (kernels/mkl_packed.py), or None
    ]  # fmt: skip


class Layer(ctypes.Structure):
    _fields_ = [
        ("input_norm", _ptr), ("post_norm", _ptr),
        ("qkv", Linear * MAX_PARTS), ("o", Linear), ("gate_up", Linear * MAX_PARTS),
        ("down", Linear), ("qkv_parts", _i64), ("gate_up_parts", _i64),
        ("k_cache", _ptr), ("v_cache", _ptr), ("windowed", _i64),
    ]  # fmt: skip


class Step(ctypes.Structure):
    _fields_ = [
        ("rows", _i64), ("hidden", _i64), ("heads", _i64), ("kv_heads", _i64),
        ("head_dim", _i64), ("inter", _i64),
        ("block_size", _i64), ("blk_stride", _i64), ("pos_stride", _i64),
        ("cos", _ptr), ("sin", _ptr), ("slots", _ptr), ("tables", _ptr), ("table_stride", _i64),
        ("row_ids", _ptr), ("firsts", _ptr), ("firsts_window", _ptr), ("ends", _ptr),
        ("eps", ctypes.c_float), ("scale", ctypes.c_float), ("threads", ctypes.c_int),
    ]  # fmt: skip


_bound: ctypes.CDLL | None = None


def library() -> ctypes.CDLL | None:
    """The native kernels with `decode_stack_f32` typed, or None where they cannot be had."""
    global _bound
    lib = cpu_native.library()
    if lib is not None and _bound is not lib:
        lib.decode_stack_f32.argtypes = [_ptr, _i64, ctypes.POINTER(Step), _ptr, _ptr, _ptr]
        lib.decode_stack_f32.restype = ctypes.c_int
        lib.decode_stack_scratch.argtypes = [_i64] * 6
        lib.decode_stack_scratch.restype = _i64
        _bound = lib
    return lib


def scratch_floats(rows: int, hidden: int, heads: int, kv_heads: int, head_dim: int,
                   inter: int) -> int:  # fmt: skip
    """Floats of scratch `run` needs for `rows` rows."""
    lib = library()
    assert lib is not None
    return int(lib.decode_stack_scratch(rows, hidden, heads, kv_heads, head_dim, inter))


def run(layers: ctypes.Array[Layer], step: Step, final_norm: torch.Tensor, x: torch.Tensor,
        scratch: torch.Tensor) -> None:  # fmt: skip
    """Every layer over x [rows, hidden] float32 (contiguous, the embeddings), leaving the final
    norm's output in x; writes each layer's K/V at `step.slots`. `scratch` holds at least
    `scratch_floats` floats. The caller keeps every tensor the structures point to alive."""
    lib = library()
    assert lib is not None
    failed = lib.decode_stack_f32(
        ctypes.addressof(layers), len(layers), ctypes.byref(step), final_norm.data_ptr(),
        x.data_ptr(), scratch.data_ptr(),
    )  # fmt: skip
    if failed:
        raise MemoryError("native decode stack: a scratch allocation failed")
