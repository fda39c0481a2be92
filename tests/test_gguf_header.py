"""The GGUF header reader (pagedserve/gguf_header.py) against the gguf package's own GGUFReader:
every scalar and string field, every tensor's name, shape, type and offset, and the bytes of
the quantized ones; a file with every value type and a custom alignment, and the real model's
file with its vocabulary. Files that are not GGUF, cut short or big-endian are ValueErrors
naming the file."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from gguf import GGMLQuantizationType, GGUFReader, GGUFWriter, quants
from support.smollm2 import smollm2_gguf

from pagedserve.gguf_header import read_gguf_header

QUANTIZED = ("Q8_0", "Q4_0", "Q4_1")


def assert_header_is_readers(path: Path) -> int:
    """Our header equals GGUFReader's view of `path`; returns the quantized tensors compared."""
    ours, theirs = read_gguf_header(path), GGUFReader(str(path))
    for key, field in theirs.fields.items():
        if key.startswith("GGUF."):  # the reader's own entries (version, counts)
            continue
        if field.types[0].name == "ARRAY":
            assert key not in ours.fields, key
        else:
            assert ours.fields[key] == field.contents(), key
    assert len(ours.tensors) == len(theirs.tensors)
    compared = 0
    for got, want in zip(ours.tensors, theirs.tensors, strict=True):
        assert (got.name, got.shape, got.type_id, got.offset) == (
            want.name, tuple(int(d) for d in want.shape), int(want.tensor_type), want.data_offset,
        )  # fmt: skip
        assert got.type_name == want.tensor_type.name
        if got.type_name in QUANTIZED:
            data = ours.tensor_bytes(got)
            assert data.shape == want.data.shape and np.array_equal(data, want.data), got.name
            compared += 1
    return compared


def write_every_kind(path: Path, alignment: int = 64) -> Path:
    writer = GGUFWriter(str(path), "llama")
    writer.add_custom_alignment(alignment)
    writer.add_uint8("t.u8", 200)
    writer.add_int8("t.i8", -100)
    writer.add_uint16("t.u16", 60_000)
    writer.add_int16("t.i16", -30_000)
    writer.add_uint32("t.u32", 4_000_000_000)
    writer.add_int32("t.i32", -2_000_000_000)
    writer.add_float32("t.f32", 1e-6)
    writer.add_uint64("t.u64", 2**63 + 5)
    writer.add_int64("t.i64", -(2**62))
    writer.add_float64("t.f64", 0.1)
    writer.add_bool("t.bool", True)
    writer.add_string("t.text", "héllo ✓")
    writer.add_array("t.tokens", ["a", "", "longer token ✓"] * 50)
    writer.add_array("t.ints", list(range(300)))
    writer.add_array("t.nested", [[1, 2], [3]])
    writer.add_uint32("t.after_arrays", 7)
    g = np.random.default_rng(0)
    rows = g.standard_normal((6, 64)).astype(np.float32)
    writer.add_tensor("plain.f32", g.standard_normal((3, 5)).astype(np.float32))
    writer.add_tensor("plain.f16", g.standard_normal(7).astype(np.float16))
    for kind in QUANTIZED:
        t = GGMLQuantizationType[kind]
        writer.add_tensor(f"blocks.{kind}", quants.quantize(rows, t), raw_dtype=t)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def test_every_value_type_and_tensor_equals_what_gguf_reads(tmp_path):
    path = write_every_kind(tmp_path / "every.gguf")
    assert assert_header_is_readers(path) == len(QUANTIZED)
    header = read_gguf_header(path)
    assert header.fields["t.after_arrays"] == 7 and header.fields["general.alignment"] == 64
    assert all(t.offset % 64 == 0 for t in header.tensors)


def test_the_real_models_file_equals_what_gguf_reads():
    header = read_gguf_header(smollm2_gguf())
    assert header.architecture == header.fields["general.architecture"] == "llama"
    assert "tokenizer.ggml.tokens" not in header.fields  # the vocabulary is stepped over
    assert assert_header_is_readers(smollm2_gguf()) > 200  # 30 layers x 7 linears + embedding


def test_what_is_not_a_whole_little_endian_gguf_is_a_value_error_naming_the_file(tmp_path):
    text = tmp_path / "notes.gguf"
    text.write_bytes(b"hello, this is not a model")
    with pytest.raises(ValueError, match="notes.gguf: not a GGUF file"):
        read_gguf_header(text)
    empty = tmp_path / "empty.gguf"
    empty.write_bytes(b"")
    with pytest.raises(ValueError, match="empty.gguf: not a GGUF file"):
        read_gguf_header(empty)
    whole = write_every_kind(tmp_path / "whole.gguf").read_bytes()
    cut = tmp_path / "cut.gguf"
    cut.write_bytes(whole[:200])
    with pytest.raises(ValueError, match="cut.gguf: the GGUF header ends early"):
        read_gguf_header(cut)
    big = tmp_path / "big.gguf"
    big.write_bytes(b"GGUF" + (3).to_bytes(4, "big") + whole[8:])
    with pytest.raises(ValueError, match="big.gguf: a big-endian GGUF"):
        read_gguf_header(big)
