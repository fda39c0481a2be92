"""A GGUF file's header (metadata and tensor directory) read in one pass, vocabulary skipped.

gguf's `GGUFReader` builds every field, the 49,152 tokens and 48,900 merges of a SmolLM2 file
among them, as numpy views: ~3 s a file on this project's 2-core machines. A worker loading
GGUF blocks read the file that way four times before (its architecture twice, its tensors
twice). Here the header is walked with `struct` over an mmap: arrays are stepped over (their
strings' lengths read, not the strings), scalars and strings kept; ~0.03 s for that file.

    | magic "GGUF" | version u32 | tensors u64 | fields u64 |
    | field: key (u64 length + UTF-8) | type u32 | value | ...
    | tensor: name | dims u32 | dim u64 x dims (fastest first) | GGML type u32 | offset u64 | ...
    | padding to general.alignment (32) | tensor data, each at the data start + its offset |

Little-endian files only (llama.cpp writes those; a big-endian one is refused by name).
Torch-free and numpy-free at import: `GgufHeader.tensor_bytes` imports numpy when called.
"""

from __future__ import annotations

import mmap
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any

MAGIC = b"GGUF"
DEFAULT_ALIGNMENT = 32

# value type -> struct format, GGUF's numbering (8: string, 9: array)
_SCALARS = {
    0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?", 10: "<Q", 11: "<q",
    12: "<d",
}  # fmt: skip
_STRING, _ARRAY = 8, 9


@dataclass(frozen=True, slots=True)
class GgufTensor:
    """One entry of the tensor directory."""

    name: str
    shape: tuple[int, ...]  # GGUF's order: the fastest-varying dimension first
    type_id: int  # GGML type number
    offset: int  # bytes from the start of the file

    @property
    def type_name(self) -> str:
        """The GGML type's name ("F32", "Q8_0", "Q4_1", ...)."""
        from gguf import GGMLQuantizationType

        return GGMLQuantizationType(self.type_id).name


@dataclass(frozen=True, slots=True)
class GgufHeader:
    path: Path
    fields: dict[str, Any]  # scalars and strings; arrays are left out
    tensors: tuple[GgufTensor, ...]

    @property
    def architecture(self) -> str | None:
        """`general.architecture` ("llama", "qwen2", ...); None where the file has none."""
        arch = self.fields.get("general.architecture")
        return arch if isinstance(arch, str) else None

    def tensor_bytes(self, tensor: GgufTensor):
        """A read-only memory map of the tensor's bytes as uint8 [rows..., bytes per row] (the
        shape `GGUFReader` gives a quantized tensor's data)."""
        import numpy as np
        from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

        block, block_bytes = GGML_QUANT_SIZES[GGMLQuantizationType(tensor.type_id)]
        *outer, inner = reversed(tensor.shape)
        if inner % block:
            raise ValueError(f"{self.path.name}: {tensor.name} is not whole blocks of {block}")
        shape = (*outer, inner // block * block_bytes)
        return np.memmap(self.path, dtype=np.uint8, mode="r", offset=tensor.offset, shape=shape)


class _Cursor:
    """Reads little-endian values from `buf` forward."""

    def __init__(self, buf: mmap.mmap, name: str) -> None:
        self.buf, self.pos, self.name = buf, 0, name

    def unpack(self, fmt: str) -> Any:
        try:
            (value,) = struct.unpack_from(fmt, self.buf, self.pos)
        except struct.error as exc:
            raise ValueError(f"{self.name}: the GGUF header ends early") from exc
        self.pos += struct.calcsize(fmt)
        return value

    def string(self) -> str:
        n = self.unpack("<Q")
        if self.pos + n > len(self.buf):
            raise ValueError(f"{self.name}: the GGUF header ends early")
        self.pos += n
        return bytes(self.buf[self.pos - n : self.pos]).decode("utf-8", errors="replace")

    def value(self, kind: int) -> Any:
        """A field's value; None (stepped over) for an array."""
        if kind in _SCALARS:
            return self.unpack(_SCALARS[kind])
        if kind == _STRING:
            return self.string()
        if kind != _ARRAY:
            raise ValueError(f"{self.name}: unknown GGUF value type {kind}")
        item, count = self.unpack("<I"), self.unpack("<Q")
        if item == _STRING:
            for _ in range(count):
                n = self.unpack("<Q")  # NOTE: read first: `pos += unpack()` adds to the old pos
                self.pos += n
        elif item == _ARRAY:
            for _ in range(count):
                self.value(_ARRAY)
        elif item in _SCALARS:
            self.pos += count * struct.calcsize(_SCALARS[item])
        else:
            raise ValueError(f"{self.name}: unknown GGUF value type {item}")
        return None


def read_gguf_header(path: str | Path) -> GgufHeader:
    """The header of the GGUF file at `path`; ValueError for a file that is not one."""
    path = Path(path)
    if path.stat().st_size < len(MAGIC):  # NOTE: mmap refuses an empty file, naming nothing
        raise ValueError(f"{path.name}: not a GGUF file (shorter than its magic)")
    with open(path, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as buf:
        cur = _Cursor(buf, path.name)
        if bytes(buf[:4]) != MAGIC:
            raise ValueError(f"{path.name}: not a GGUF file (no GGUF magic)")
        cur.pos = 4
        version = cur.unpack("<I")
        if version & 0xFFFF == 0:
            raise ValueError(f"{path.name}: a big-endian GGUF file; only little-endian is read")
        n_tensors, n_fields = cur.unpack("<Q"), cur.unpack("<Q")
        fields = {}
        for _ in range(n_fields):
            key = cur.string()
            value = cur.value(cur.unpack("<I"))
            if value is not None:
                fields[key] = value
        entries = []
        for _ in range(n_tensors):
            name = cur.string()
            dims = tuple(cur.unpack("<Q") for _ in range(cur.unpack("<I")))
            entries.append((name, dims, cur.unpack("<I"), cur.unpack("<Q")))
        align = int(fields.get("general.alignment", DEFAULT_ALIGNMENT))
        start = -(-cur.pos // align) * align
    tensors = tuple(GgufTensor(name, dims, kind, start + at) for name, dims, kind, at in entries)
    return GgufHeader(path, fields, tensors)
