"""A native CPU kernel for fp32 and bf16 paged decode attention: K/V read in place from the pool.

The torch-only path (`cpu_attention`) gathers each sequence's blocks into a workspace and then
runs SDPA over the copy: K/V are read twice and written once per layer. This kernel
(`csrc/paged_decode.c`, AVX-512 or AVX2 + FMA, OpenMP) reads them once, straight from the pool. On
SmolLM2's shape (9 query / 3 KV heads, head_dim 64, 48 sequences of ~230 tokens, 30 layers) it
took 65 ms per step's attention against 140 ms for the gather + SDPA path, both threads of this
project's VM (docs/kernels.md).

It is built on first use with the host's C compiler (`cc -O3 -march=native -fopenmp`), into a
per-user cache keyed by the sources, the flags and the CPU, and loaded with ctypes (the GIL is
released during the call). Its vector width is torch's own (`vector_width()`: 16 floats where
torch runs AVX-512 code, 8 where it runs AVX2), so the bf16 kernel takes its exponentials where
torch's flash attention takes them. Where it cannot be had — no compiler, neither AVX-512 nor
AVX2 + FMA, another dtype or head size — `unavailable_reason()` says why, `supports()` says no,
and attention takes the torch path; nothing else changes.
fp32 differs from SDPA by ~1e-6 relative (another summation order), as the bucketed SDPA path
already does. bf16 computes what torch's CPU flash attention computes, step for step (its fast
exponential, the weights rounded to bf16 before P.V, keys in blocks of 512), so that greedy
tokens stay transformers': only the dot products' fp32 summation order differs, and an output
is rarely one bf16 step off (docs/kernels.md). fp16 takes the torch path.
"""

from __future__ import annotations

import ctypes
import hashlib
import logging
import os
import platform
import shutil
import subprocess
import tempfile
import threading
from collections.abc import Sequence
from pathlib import Path

import torch

from pagedserve.kernels.native_plan import NativePlan

log = logging.getLogger(__name__)

SOURCES = tuple(
    Path(__file__).with_name("csrc") / name
    for name in (
        "paged_decode.c", "linear_i8g.c", "linear_i4g.c", "linear_f32.c", "rms_norm.c",
        "decode_stack.c", "gemm_f32.c", "token_mask.c", "quant_act.c",
        "linear_w8a8.c", "layer_ops.c",
    )
)  # fmt: skip
HEADERS = (Path(__file__).with_name("csrc") / "simd.h",)
FLAGS = ("-O3", "-march=native", "-fopenmp", "-shared", "-fPIC")
LIBS = ("-lmvec", "-lm")
MAX_HEADS = 64  # the kernel's per-sequence scratch of row sums
# the cache dtypes the kernel reads in place (fp16 keeps torch's path)
NATIVE_DTYPES = (torch.float32, torch.bfloat16)

_lock = threading.Lock()
_lib: ctypes.CDLL | None = None
_why_not: str | None = None  # why the kernel is unavailable, once known
_tried = False
enabled = True  # tests and benchmarks switch it off to compare against the torch path


def _cpu_flags() -> str:
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return ""
    for line in text.splitlines():
        if line.startswith("flags"):
            return line.split(":", 1)[1]
    return ""


def has_bf16_arithmetic() -> bool:
    """Whether this CPU computes bf16 in hardware (AVX512-BF16 or AMX-BF16). Elsewhere torch
    emulates bf16 GEMMs in fp32 and rounds: on an AVX2 AMD EPYC a SmolLM2 decode step at 48
    sequences took 3.3x as long in bf16 as in fp32 (docs/kernels.md)."""
    return bool({"avx512_bf16", "amx_bf16"} & set(_cpu_flags().split()))


def _cache_dir() -> Path:
    root = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(root) / "pagedserve" / "kernels"


def _compiler() -> str | None:
    return os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")


def vector_width() -> int | None:
    """Floats per vector of the kernel built here: 16 (AVX-512) where torch itself runs its
    AVX-512 code, 8 (AVX2 + FMA + F16C) where torch runs AVX2 (AMD Zen 1-3, Intel before
    Skylake-X, or `ATEN_CPU_CAPABILITY=avx2`); None where the CPU has neither."""
    flags = set(_cpu_flags().split())
    capability = torch.backends.cpu.get_cpu_capability()
    if capability.startswith("AVX512") and "avx512f" in flags:
        return 16
    if capability.startswith(("AVX2", "AVX512")) and {"avx2", "fma", "f16c"} <= flags:
        return 8
    return None


def build_blocker() -> str | None:
    """Why this host cannot build the kernel at all (CPU, compiler), or None if it can try."""
    if platform.machine() not in ("x86_64", "AMD64"):
        return f"not an x86-64 CPU ({platform.machine()})"
    if vector_width() is None:
        return "the CPU has neither AVX-512 nor AVX2 + FMA (or torch runs neither)"
    if _compiler() is None:
        return "no C compiler (cc) on PATH"
    return None


def _build() -> ctypes.CDLL:
    """Compile (once per source, flags and CPU) and load the kernel; raises RuntimeError."""
    blocker = build_blocker()
    if blocker is not None:
        raise RuntimeError(blocker)
    compiler, cpu = _compiler(), _cpu_flags()
    assert compiler is not None
    flags = (*FLAGS, f"-DPS_VEC={vector_width()}")
    sources = [path.read_bytes() for path in SOURCES + HEADERS]
    key = hashlib.sha256(
        b"\0".join([*sources, " ".join(flags + LIBS).encode(), compiler.encode(), cpu.encode()])
    ).hexdigest()[:16]
    target = _cache_dir() / f"paged_decode-{key}.so"
    if not target.is_file():
        target.parent.mkdir(parents=True, exist_ok=True)
        # NOTE: several workers may build at once: each writes its own file, the rename is atomic
        fd, tmp = tempfile.mkstemp(suffix=".so", dir=target.parent)
        os.close(fd)
        try:
            done = subprocess.run(
                [compiler, *flags, *map(str, SOURCES), "-o", tmp, *LIBS],
                capture_output=True,
                text=True,
                timeout=120,
            )
            if done.returncode != 0:
                raise RuntimeError(f"{compiler} failed: {done.stderr.strip()[-500:]}")
            os.replace(tmp, target)
        finally:
            if os.path.exists(tmp):
                os.unlink(tmp)
    lib = ctypes.CDLL(str(target))
    for name, (args, result) in _signatures().items():
        fn = getattr(lib, name)
        fn.argtypes, fn.restype = args, result
    return lib


def _signatures() -> dict[str, tuple[list[type], type | None]]:
    """Each C entry point's argument and result types."""
    ptr, i64, i32, f32 = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int, ctypes.c_float
    # query, K/V views and strides, tables, rows, firsts, ends, out, n, heads, kv heads, d, bs
    attention = [ptr, i64, ptr, ptr, i64, i64, ptr, i64, ptr, ptr, ptr, ptr, ptr, i64,
                 i32, i32, i32, i32, i32]  # fmt: skip
    q8 = [ptr, i64, ptr, ptr, i64, i64, ptr, ptr, i64, *attention[6:]]
    return {
        "paged_decode_f32": ([*attention, f32, f32, i32], i32),  # scale, softcap, threads
        "paged_decode_bf16": ([*attention, f32, i32], i32),  # scale, threads
        "kv_append_i8": ([ptr, i64, i64, ptr, i64, ptr, ptr, ptr, i32, i32, i32, i32], None),
        "paged_decode_q8": ([*q8, f32, f32, i32, i32, ptr], i32),  # ..., fp8, lut
        "linear_i8g_f32": ([ptr, i64, ptr, ptr, ptr, i64, i64, i64, i64, i64, i32], None),
        "linear_i4g_f32": ([ptr, i64, ptr, ptr, ptr, i64, i64, i64, i64, i64, i32], i32),
        "dequant_i4g_f32": ([ptr, ptr, ptr, i64, i64, i64, i32], None),
        "linear_f32": ([ptr, i64, ptr, ptr, ptr, i64, i64, i64, i64, i32], None),
        "gemm_f32": ([ptr, i64, ptr, ptr, ptr, i64, i64, i64, i64, i32], i32),
        "set_sgemm_compute": ([ptr], None),
        "linear_packed_f32": ([ptr, i64, ptr, ptr, ptr, i64, i64, i64, i64], i32),
        "rms_norm_f32": ([ptr, i64, ptr, i64, ptr, ptr, ptr, i64, i64, f32, i32], None),
        "rope_f32": ([ptr, i64, i64, i64, ptr, ptr, i64, i32], None),
        "silu_mul_f32": ([ptr, i64, ptr, i64, ptr, i64, i64, i32], None),
        "mask_logits_f32": ([ptr, i64, ptr, i64, ptr, i64, i64], None),
        "quantize_rows_i8": ([ptr, i64, ptr, ptr, i64, i64, i32], None),
        "dequant_rows_i32": ([ptr, ptr, ptr, ptr, ptr, i64, i64, i64, i32], None),
        "linear_w8a8_f32": ([ptr, i64, ptr, ptr, ptr, ptr, ptr, i64, i64, i64, i64, i32], i32),
        "w8a8_vnni": ([], i32),
        "sum_lanes_check": ([ptr, ptr, ptr], i32),  # tests: the scores' two reductions
    }


def _load() -> ctypes.CDLL | None:
    global _lib, _why_not, _tried
    if not _tried:
        with _lock:
            if not _tried:
                try:
                    _lib = _build()
                except (RuntimeError, OSError, subprocess.SubprocessError) as err:
                    _why_not = str(err)
                    log.warning(
                        "native CPU kernels unavailable (attention, linears use torch's): %s",
                        err,
                    )
                _tried = True
    return _lib


def library() -> ctypes.CDLL | None:
    """The loaded kernels (built on first call), or None where they cannot be had."""
    return _load() if enabled else None


def unavailable_reason() -> str | None:
    """None when the kernel is built and loaded; else why not (building it on first call)."""
    _load()
    return _why_not


def supports(query: torch.Tensor, k_cache: torch.Tensor, softcap: float | None = None) -> bool:
    """Whether this call can take the kernel (else the caller uses the torch path).

    NOTE: no soft cap in bf16: the bf16 kernel follows SDPA's roundings, and transformers runs
    capped attention (Gemma 2) eagerly, rounding each step to bf16: the torch path does that."""
    num_heads, head_dim = query.shape[1], query.shape[2]
    num_kv_heads = k_cache.shape[2]
    return (
        enabled
        and query.device.type == "cpu"
        and query.dtype in NATIVE_DTYPES
        and (softcap is None or query.dtype == torch.float32)
        and k_cache.dtype == query.dtype
        and head_dim % 16 == 0
        and num_heads <= MAX_HEADS
        and num_heads % num_kv_heads == 0
        and query.stride(2) == 1
        and query.stride(1) == head_dim
        and k_cache.stride(3) == 1
        and k_cache.stride(2) == head_dim
        and _load() is not None
    )


def supports_quantized(query: torch.Tensor, codes: torch.Tensor, scales: torch.Tensor) -> bool:
    """Whether attention over an 8-bit cache's `codes` (a layer view) can take the kernel."""
    num_heads, head_dim = query.shape[1], query.shape[2]
    return (
        enabled
        and query.device.type == "cpu"
        and query.dtype in NATIVE_DTYPES
        and codes.dtype in (torch.int8, torch.float8_e4m3fn)
        and head_dim % 16 == 0
        and num_heads <= MAX_HEADS
        and num_heads % codes.shape[2] == 0
        and query.stride(2) == 1
        and query.stride(1) == head_dim
        and codes.stride(3) == 1
        and codes.stride(2) == head_dim
        and scales.stride(1) == 1
        and _load() is not None
    )


# float8 e4m3 code -> float32, for the kernel's table lookups
_E4M3 = torch.arange(256, dtype=torch.int32).to(torch.uint8).view(torch.float8_e4m3fn).float()


def _rows(plan: NativePlan, query: torch.Tensor) -> tuple[ctypes.CDLL, int]:
    """The loaded kernel and the plan's number of sequences, once the plan fits `query`."""
    assert _lib is not None
    if plan.num_rows != query.shape[0]:
        raise ValueError(f"query: plan is for {plan.num_rows} rows, got {query.shape[0]}")
    return _lib, plan.query_rows.numel()


def decode(
    plan: NativePlan,
    query: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    scale: float,
    out: torch.Tensor,
    softcap: float | None = None,
) -> torch.Tensor:
    """Attention of the plan's rows of `query` [rows, num_heads, head_dim] into the same rows of
    `out` (same shape, contiguous); other rows of `out` are left as they are. `softcap` (> 0)
    caps the scaled logits, tanh(s / softcap) * softcap, as the reference does.

    The caller has checked `supports(query, k_cache, softcap)` (once per layer, in dispatch)."""
    lib, n = _rows(plan, query)
    if n == 0:
        return out
    assert out.is_contiguous() and out.shape == query.shape and v_cache.stride() == k_cache.stride()
    num_heads, head_dim = query.shape[1], query.shape[2]
    if query.dtype == torch.bfloat16:
        if softcap is not None:
            raise ValueError("softcap: the bf16 kernel has none (see `supports`)")
        # NOTE: bf16 widens to fp32 exactly; the kernel rounds where torch's SDPA rounds
        entry, query = lib.paged_decode_bf16, query.to(torch.float32)
        # scale, threads (it splits a sequence's positions between threads)
        last: tuple[float | int, ...] = (scale, torch.get_num_threads())
    else:  # scale, softcap (0: none), threads
        entry, last = lib.paged_decode_f32, (scale, softcap or 0.0, torch.get_num_threads())
    failed = entry(
        query.data_ptr(), query.stride(0),
        k_cache.data_ptr(), v_cache.data_ptr(), k_cache.stride(0), k_cache.stride(1),
        plan.tables.data_ptr(), plan.tables.stride(0),
        plan.query_rows.data_ptr(), plan.table_rows.data_ptr(),
        plan.firsts.data_ptr(), plan.ends.data_ptr(),
        out.data_ptr(), out.stride(0),
        n, num_heads, k_cache.shape[2], head_dim, k_cache.shape[1], *last,
    )  # fmt: skip
    if failed:
        raise MemoryError("native paged attention: scratch allocation failed")
    return out


def decode_quantized(
    plan: NativePlan,
    query: torch.Tensor,
    k_codes: torch.Tensor,
    v_codes: torch.Tensor,
    scales: tuple[torch.Tensor, torch.Tensor],
    scale: float,
    out: torch.Tensor,
    softcap: float | None = None,
) -> torch.Tensor:
    """`decode` over an 8-bit cache: codes read in place and scaled per (block, head), no
    dequantized copy. The caller has checked `supports_quantized`. A bf16 query is widened to
    fp32 and its rows' outputs rounded back to bf16 (the values are the codes' anyway: there is
    no SDPA rounding to follow, so fp32 throughout)."""
    lib, n = _rows(plan, query)
    if n == 0:
        return out
    k_scales, v_scales = scales
    assert out.is_contiguous() and out.shape == query.shape and v_codes.stride() == k_codes.stride()
    assert k_scales.stride() == v_scales.stride()
    if query.dtype != torch.float32:
        wide = decode_quantized(plan, query.float(), k_codes, v_codes, scales, scale,
                                torch.empty(query.shape, dtype=torch.float32), softcap)  # fmt: skip
        rows = plan.query_rows
        return out.index_copy_(0, rows, wide.index_select(0, rows).to(out.dtype))
    num_heads, head_dim = query.shape[1], query.shape[2]
    failed = lib.paged_decode_q8(
        query.data_ptr(), query.stride(0),
        k_codes.data_ptr(), v_codes.data_ptr(), k_codes.stride(0), k_codes.stride(1),
        k_scales.data_ptr(), v_scales.data_ptr(), k_scales.stride(0),
        plan.tables.data_ptr(), plan.tables.stride(0),
        plan.query_rows.data_ptr(), plan.table_rows.data_ptr(),
        plan.firsts.data_ptr(), plan.ends.data_ptr(),
        out.data_ptr(), out.stride(0),
        n, num_heads, k_codes.shape[2], head_dim, k_codes.shape[1], scale, softcap or 0.0,
        torch.get_num_threads(), int(k_codes.dtype == torch.float8_e4m3fn), _E4M3.data_ptr(),
    )  # fmt: skip
    if failed:
        raise MemoryError("native paged attention: scratch allocation failed")
    return out


def append_int8(
    codes: torch.Tensor,
    scales: torch.Tensor,
    values: torch.Tensor,
    blocks: torch.Tensor,
    offsets: torch.Tensor,
) -> bool:
    """A decode step's int8 KV write in C (kv_quant's rule, bit for bit): one token per block.
    False, writing nothing, when the kernel cannot take it (the caller uses torch)."""
    if not (
        enabled
        and codes.device.type == "cpu"
        and codes.dtype == torch.int8
        and codes.stride(3) == 1
        and codes.stride(2) == codes.shape[3]
        and scales.stride(1) == 1
        and _load() is not None
    ):
        return False
    lib = _lib
    assert lib is not None
    x = values.to(torch.float32).contiguous()
    blocks, offsets = blocks.to(torch.int64).contiguous(), offsets.to(torch.int64).contiguous()
    lib.kv_append_i8(
        codes.data_ptr(), codes.stride(0), codes.stride(1), scales.data_ptr(), scales.stride(0),
        x.data_ptr(), blocks.data_ptr(), offsets.data_ptr(),
        x.shape[0], codes.shape[2], codes.shape[3], codes.shape[1],
    )  # fmt: skip
    return True


def _linear_operands(x: torch.Tensor, n: int) -> tuple[ctypes.CDLL, torch.Tensor, torch.Tensor]:
    """The loaded library, x as contiguous float32 [M, K] and an empty float32 output [M, n]:
    what the quantized linear kernels take (after their callers' checks)."""
    assert _lib is not None
    x32 = x.to(torch.float32).contiguous()
    return _lib, x32, torch.empty(x32.shape[0], n, dtype=torch.float32)


def linear_int8_groups(
    x: torch.Tensor, codes: torch.Tensor, scales: torch.Tensor
) -> torch.Tensor | None:
    """x [M, K] @ W.T for int8 `codes` [N, K] scaled per group of input features by `scales`
    [N, K / group] (GGUF Q8_0's layout) -> float32 [M, N], the codes widened in registers (no
    dequantized copy). None when the kernel cannot take it (the caller dequantizes)."""
    n, k = codes.shape
    group = k // scales.shape[1]
    if not (
        enabled
        and x.device.type == "cpu"
        and codes.dtype == torch.int8
        and codes.is_contiguous()
        and scales.dtype == torch.float32
        and scales.is_contiguous()
        and group * scales.shape[1] == k
        and group % 16 == 0
        and _load() is not None
    ):
        return None
    lib, x32, y = _linear_operands(x, n)
    lib.linear_i8g_f32(
        x32.data_ptr(), x32.stride(0), codes.data_ptr(), scales.data_ptr(), y.data_ptr(),
        y.stride(0), x32.shape[0], n, k, group, torch.get_num_threads(),
    )  # fmt: skip
    return y


def linear_f32(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None
) -> torch.Tensor | None:
    """x [M, K] @ weight.T (+ bias) for float32 `weight` [N, K] in its own layout -> float32
    [M, N], each output the same sum whatever M (csrc/linear_f32.c). None when the kernel
    cannot take it (the caller uses torch)."""
    return _f32_product("linear_f32", x, weight, bias)


def gemm_f32(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None
) -> torch.Tensor | None:
    """`linear_f32`'s operation for batches of tens to hundreds of rows (csrc/gemm_f32.c: a
    register-blocked GEMM, x packed, the weight read as it lies): each output one FMA chain
    over k, whatever M. None when the kernel cannot take it (the caller uses torch)."""
    return _f32_product("gemm_f32", x, weight, bias)


def _f32_product(
    kernel: str, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None
) -> torch.Tensor | None:
    n, k = weight.shape
    if not (
        enabled
        and x.device.type == "cpu"
        and x.dtype == torch.float32
        and weight.dtype == torch.float32
        and weight.stride(1) == 1
        and weight.stride(0) == k
        and x.dim() == 2
        and x.stride(1) == 1
        and (bias is None or (bias.dtype == torch.float32 and bias.is_contiguous()))
        and _load() is not None
    ):
        return None
    y = torch.empty(x.shape[0], n, dtype=torch.float32)
    done = getattr(_lib, kernel)(
        x.data_ptr(), x.stride(0), weight.data_ptr(), None if bias is None else bias.data_ptr(),
        y.data_ptr(), n, x.shape[0], n, k, torch.get_num_threads(),
    )  # fmt: skip
    return None if done == 0 else y  # linear_f32 returns nothing; gemm_f32 0 when out of memory


def mask_logits(logits: torch.Tensor, bitmask: torch.Tensor, rows: Sequence[int]) -> bool:
    """-inf, in place, for every token of `logits` [B, V] (float32, CPU) whose bit is 0 in
    `bitmask` [B, ceil(V / 32)] (int32, xgrammar's layout), in `rows` only (csrc/token_mask.c).
    False when the kernel cannot take it (nothing changed)."""
    if not (
        logits.device.type == "cpu" and logits.dtype == torch.float32 and logits.stride(1) == 1
        and bitmask.dtype == torch.int32 and bitmask.is_contiguous()
        and bitmask.shape[1] * 32 >= logits.shape[1] and _load() is not None
    ):  # fmt: skip
        return False
    index = torch.tensor(list(rows), dtype=torch.int64)
    assert _lib is not None
    _lib.mask_logits_f32(
        logits.data_ptr(), logits.stride(0), bitmask.data_ptr(), bitmask.stride(0),
        index.data_ptr(), len(index), logits.shape[1],
    )  # fmt: skip
    return True


def rms_norm(
    x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None
) -> tuple[torch.Tensor, torch.Tensor] | None:
    """(RMSNorm of s, s) for s = x (+ residual), float32 rows [M, N] (csrc/rms_norm.c): the
    residual add and the norm in one call. None when the kernel cannot take it."""
    rows, n = x.shape if x.dim() == 2 else (0, 0)
    if not (
        enabled
        and rows > 0
        and x.device.type == "cpu"
        and x.dtype == torch.float32
        and x.stride(1) == 1
        and weight.dtype == torch.float32
        and weight.is_contiguous()
        and weight.shape == (n,)
        and (residual is None or (residual.shape == x.shape and residual.dtype == x.dtype
                                  and residual.stride(1) == 1))
        and _load() is not None
    ):  # fmt: skip
        return None
    lib = _lib
    assert lib is not None
    out = torch.empty(rows, n, dtype=torch.float32)
    total = x if residual is None else torch.empty(rows, n, dtype=torch.float32)
    lib.rms_norm_f32(
        x.data_ptr(), x.stride(0), None if residual is None else residual.data_ptr(),
        0 if residual is None else residual.stride(0), total.data_ptr(), weight.data_ptr(),
        out.data_ptr(), rows, n, eps, torch.get_num_threads(),
    )  # fmt: skip
    return out, total


def pack_int4(codes: torch.Tensor) -> torch.Tensor:
    """int4 codes [N, K] in 0..15 (K a multiple of 32) -> uint8 [N, K / 2] in the layout
    `linear_int4_groups` reads (csrc/linear_i4g.c): 16 rows side by side, one little-endian
    32-bit word per row and 8 consecutive codes, code j of the word in bits 4j .. 4j + 3 (so
    byte b holds code 2b in its low nibble and 2b + 1 in its high one); a last tile of r < 16
    rows has r words side by side. The same layout on every CPU."""
    n, k = codes.shape
    pairs = codes.to(torch.uint8).view(n, k // 8, 4, 2)
    words = pairs[..., 0] | (pairs[..., 1] << 4)  # [n, k / 8, 4 bytes]
    full = n // 16 * 16
    tiles = [words[:full].view(n // 16, 16, k // 8, 4).transpose(1, 2).reshape(-1)]
    tiles.append(words[full:].transpose(0, 1).reshape(-1))  # the last r < 16 rows
    return torch.cat(tiles).view(n, k // 2)


def unpack_int4(packed: torch.Tensor) -> torch.Tensor:
    """`pack_int4`'s inverse: uint8 [N, K / 2] -> int32 codes [N, K]."""
    n, half = packed.shape
    k, full, flat = half * 2, n // 16 * 16, packed.reshape(-1)
    words = torch.cat([
        flat[: full * half].view(n // 16, k // 8, 16, 4).transpose(1, 2).reshape(full, k // 8, 4),
        flat[full * half :].view(k // 8, n - full, 4).transpose(0, 1),
    ])  # fmt: skip
    return torch.stack([words & 0xF, words >> 4], dim=-1).view(n, k).to(torch.int32)


def pack_int4_scales(scale: torch.Tensor, zero: torch.Tensor) -> torch.Tensor:
    """int4's scale and zero [N, groups] (W = (q - 8) scale + zero) -> float16 [ceil(N / 16),
    groups, 2, 16], what `linear_int4_groups` reads (csrc/linear_i4g.c): tile by tile of 16 rows
    as `pack_int4` lays the codes, per group the 16 rows' scales, then their minimums
    `low = zero - 8 scale` (W = q scale + low, GGUF Q4_1's d and m), the last tile padded with
    zeros. One group of a tile is one 64-byte line, and a panel of rows reads its groups as one
    stream, where ATen's [groups, N, 2] put each group 8 N bytes after the last (a page or
    more). float16 holds quant.quantize_int4's and GGUF's pairs exactly (others are rounded)."""
    n, groups = scale.shape
    tiles = -(-n // 16)
    pairs = torch.zeros(tiles * 16, groups, 2, dtype=torch.float16, device=scale.device)
    pairs[:n, :, 0], pairs[:n, :, 1] = scale, zero.float() - 8 * scale.float()
    return pairs.view(tiles, 16, groups, 2).permute(0, 2, 3, 1).contiguous()


def unpack_int4_scales(pairs: torch.Tensor, n: int) -> tuple[torch.Tensor, torch.Tensor]:
    """`pack_int4_scales`' inverse: float32 (scale, zero) [n, groups]."""
    tiles, groups = pairs.shape[:2]
    rows = pairs.float().permute(0, 3, 1, 2).reshape(tiles * 16, groups, 2)[:n]
    scale = rows[..., 0]
    return scale, rows[..., 1] + 8 * scale


def linear_int4_groups(
    x: torch.Tensor, codes: torch.Tensor, pairs: torch.Tensor
) -> torch.Tensor | None:
    """x [M, K] @ W.T for `pack_int4` codes [N, K / 2] and `pack_int4_scales` pairs (float16)
    with W = (q - 8) * scale + zero (groups of a multiple of 32) -> float32 [M, N], the codes
    widened in registers (no dequantized copy). None when the kernel cannot take it (the
    caller dequantizes)."""
    n, k = codes.shape[0], codes.shape[1] * 2
    groups = pairs.shape[1] if pairs.dim() == 4 else 0
    if not (
        enabled
        and x.device.type == "cpu"
        and x.dim() == 2
        and x.shape[1] == k
        and codes.dtype == torch.uint8
        and codes.is_contiguous()
        and pairs.dtype == torch.float16
        and pairs.shape == (-(-n // 16), groups, 2, 16)
        and pairs.is_contiguous()
        and groups > 0
        and k % (32 * groups) == 0
        and _load() is not None
    ):
        return None
    lib, x32, y = _linear_operands(x, n)
    failed = lib.linear_i4g_f32(
        x32.data_ptr(), x32.stride(0), codes.data_ptr(), pairs.data_ptr(), y.data_ptr(),
        y.stride(0), x32.shape[0], n, k, k // groups, torch.get_num_threads(),
    )  # fmt: skip
    return None if failed else y
