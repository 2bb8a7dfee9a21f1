"""The engine's own attention kernel for a prefill chunk against its cache, built from attention_kernel.c at first use.

Why its own: torch's CPU flash kernel reads a KV head's keys and values once per query head, and a grouped
model has 4 to 16 query heads per KV head; at depth that traffic, not arithmetic, sets its speed. This kernel
packs each block of keys and values once for all the query rows of a KV head, runs bf16 on AMX tiles and
float32 on AVX-512 or, on x86 without it (AMD Zen 3, an Intel Mac), on AVX2 (`body` says which), and shares the
work out to the torch thread count's POSIX threads.

Which rows see which keys is given as one range [lo, hi) per query position (causal, sliding window); any
other mask stays with torch. Whether it is faster on this machine is measured, not assumed (attach/attention.py).
"""

from __future__ import annotations

import ctypes

import torch

from .host import cpu_flags
from .native import NativeKernel, cpu_lacks, has_avx2, x86_avx512_missing

# Query positions per unit of work: its rows (positions x query heads per KV head) share each packed block of
# keys and values, so a unit is as long as keeps its rows' output in L2 and still gives every thread units.
MAX_POSITIONS, UNITS_PER_THREAD = 128, 2
DTYPES = (torch.float32, torch.bfloat16)


def unsupported_cpu() -> str | None:
    """Why this CPU cannot run the kernel whatever the compiler does, or None when it can: x86-64 with AVX2 and FMA
    (torch's AVX2 level), which its float32 body needs at the least."""
    return cpu_lacks("the attention kernel", "x86-64", "AVX2 and FMA", has_avx2, "avx2")


def body(dtype: torch.dtype) -> str:
    """Which of the kernel's bodies runs attention in `dtype` here, once `unavailable(dtype)` is None: "amx" (bf16),
    "avx512" or "avx2" (float32; the widest this CPU and `$NPUMOE_MAX_CPU_ISA` allow)."""
    if dtype == torch.bfloat16:
        return "amx"
    return "avx512" if x86_avx512_missing("the attention kernel") is None else "avx2"


_amx: str | bool | None = False  # False: not asked yet


def unavailable(dtype: torch.dtype) -> str | None:
    """Why the kernel cannot run attention in `dtype` here, or None when it can."""
    global _amx
    if dtype not in DTYPES:
        return f"the attention kernel reads float32 or bfloat16, not {str(dtype).removeprefix('torch.')}"
    if dtype == torch.bfloat16 and (why := x86_avx512_missing("the bf16 attention kernel")) is not None:
        return why  # before the build: AMX tiles come with AVX-512
    if (why := KERNEL.unavailable()) is not None:
        return why
    if dtype == torch.bfloat16:
        if _amx is False:
            if not {"amx_tile", "amx_bf16"} <= cpu_flags():
                _amx = "this CPU lacks AMX-BF16 tiles"
            else:  # Linux hands out the tiles' state only on request
                _amx = None if KERNEL.library().npumoe_attention_amx_init() == 0 else "Linux refused AMX tile state"
        return _amx
    return None


def supports(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor) -> bool:
    """Whether the kernel takes these (B, H, n, d) tensors: one dtype, a head size it tiles, grouped heads."""
    dim = query.shape[-1]
    return (query.dtype == key.dtype == value.dtype and key.shape[-1] == value.shape[-1] == dim
            and dim % 64 == 0 and dim <= 256 and query.shape[1] % key.shape[1] == 0
            and all(t.stride(-1) == 1 for t in (query, key, value)))


def attend(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, lo: torch.Tensor, hi: torch.Tensor, *,
           scale: float, sinks: torch.Tensor | None = None, threads: int | None = None) -> torch.Tensor:
    """Attention of (B, Hq, n, d) queries over (B, Hkv, kv, d) keys and values, query position i seeing keys
    lo[i]..hi[i]-1 -> (B, n, Hq, d). `sinks`: one logit per query head that takes probability, adds no value."""
    batch, heads, rows, dim = query.shape
    if (why := unavailable(query.dtype)) is not None:  # also asks Linux for the AMX state before the first bf16 call
        raise OSError(why)
    if not supports(query, key, value):
        raise ValueError(f"the attention kernel cannot take queries {query.dtype} {tuple(query.shape)} with keys "
                         f"{key.dtype} {tuple(key.shape)} and values {value.dtype} {tuple(value.shape)}")
    lo, hi = lo.to(torch.int64).contiguous(), hi.to(torch.int64).contiguous()
    if lo.shape != (rows,) or hi.shape != (rows,) or bool((lo < 0).any()) or bool((hi > key.shape[2]).any()):
        raise ValueError(f"need one key range per query position within {key.shape[2]} keys")
    if sinks is not None:
        sinks = sinks.detach().float().contiguous()
    out = query.new_empty(batch, rows, heads, dim)
    threads = threads or torch.get_num_threads()
    positions = max(1, min(MAX_POSITIONS, -(-rows * key.shape[1] // (threads * UNITS_PER_THREAD))))
    function = getattr(KERNEL.library(), _ENTRIES[body(query.dtype)])
    for b in range(batch):
        q, k, v, o = query[b], key[b], value[b], out[b]
        status = function(q.data_ptr(), q.stride(0), q.stride(1), k.data_ptr(), k.stride(0), k.stride(1),
                          v.data_ptr(), v.stride(0), v.stride(1), o.data_ptr(), o.stride(1), o.stride(0),
                          lo.data_ptr(), hi.data_ptr(), None if sinks is None else sinks.data_ptr(),
                          heads, key.shape[1], rows, dim, scale, positions, threads)
        if status != 0:
            raise MemoryError("the attention kernel could not allocate its buffers")
    return out


def mask_ranges(visible: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor] | None:
    """A (rows, keys) boolean mask as one run of keys per row [lo, hi) (0, 0 where a row shows none), or None
    where some row shows keys apart from each other. One scan of the mask, for the kernel's own use."""
    if visible.dtype != torch.bool or visible.dim() != 2:
        raise ValueError(f"need a (rows, keys) boolean mask, got {visible.dtype} {tuple(visible.shape)}")
    if visible.stride(-1) != 1:
        visible = visible.contiguous()
    rows, keys = visible.shape
    lo, hi = torch.empty(rows, dtype=torch.int64), torch.empty(rows, dtype=torch.int64)
    status = KERNEL.library().npumoe_mask_ranges(visible.data_ptr(), rows, keys, visible.stride(0), lo.data_ptr(),
                                                 hi.data_ptr())
    return (lo, hi) if status == 0 else None


_ENTRIES = {"amx": "npumoe_attention_bf16_amx", "avx512": "npumoe_attention_f32", "avx2": "npumoe_attention_f32_avx2"}
_POINTER, _SIZE = ctypes.c_void_p, ctypes.c_int64
_ARGUMENTS = (_POINTER, _SIZE, _SIZE) * 4 + (_POINTER, _POINTER, _POINTER) + (_SIZE,) * 4 + (ctypes.c_float,
                                                                                              _SIZE, _SIZE)
KERNEL = NativeKernel("attention_kernel", "the attention kernel",
                      {"npumoe_attention_amx_init": (), "npumoe_attention_bf16_amx": _ARGUMENTS,
                       "npumoe_attention_f32": _ARGUMENTS, "npumoe_attention_f32_avx2": _ARGUMENTS,
                       "npumoe_mask_ranges": (_POINTER, _SIZE, _SIZE, _SIZE, _POINTER, _POINTER)},
                      unsupported_cpu, restype=ctypes.c_int)
SOURCE = KERNEL.source
