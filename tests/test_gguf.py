"""GGUF reader (edge_agent.runtime.gguf) against the `gguf` package as oracle, and every bad input.

Synthetic files come from `write_tiny_gguf` (conftest), which uses gguf.GGUFWriter.
"""

from __future__ import annotations

import struct
from pathlib import Path

import gguf
import numpy as np
import pytest
from conftest import write_tiny_gguf

from edge_agent.errors import ModelFileError
from edge_agent.paths import default_model_path
from edge_agent.runtime import quant
from edge_agent.runtime.gguf import GGUFFile, SkippedStrings

Q = gguf.GGMLQuantizationType


@pytest.fixture(scope="module")
def real() -> tuple[GGUFFile, gguf.GGUFReader]:
    path = default_model_path()
    ours = GGUFFile(path)
    yield ours, gguf.GGUFReader(path)
    ours.close()


def _oracle_metadata(reader: gguf.GGUFReader) -> dict[str, object]:
    return {k: f.contents() for k, f in reader.fields.items() if not k.startswith("GGUF.")}


# -- the real default model against the oracle ---------------------------------------------------


def test_real_header_matches_oracle(real: tuple[GGUFFile, gguf.GGUFReader]) -> None:
    ours, oracle = real
    assert ours.version == oracle.fields["GGUF.version"].contents() == 3
    assert len(ours.tensors) == oracle.fields["GGUF.tensor_count"].contents() == 272
    assert ours.alignment == oracle.alignment == 32
    assert ours.data_offset == oracle.data_offset == 1_785_664
    assert ours.size == default_model_path().stat().st_size


def test_real_metadata_matches_oracle(real: tuple[GGUFFile, gguf.GGUFReader]) -> None:
    ours, oracle = real
    expected = _oracle_metadata(oracle)
    assert list(ours.metadata) == list(expected)
    for key, value in expected.items():
        got = ours.metadata[key]
        if isinstance(value, float):
            assert got == pytest.approx(value, rel=0, abs=0), key
        else:
            assert got == value, key
    assert len(ours.metadata["tokenizer.ggml.tokens"]) == 49152
    assert len(ours.metadata["tokenizer.ggml.merges"]) == 48900


def test_real_tensor_table_matches_oracle(real: tuple[GGUFFile, gguf.GGUFReader]) -> None:
    ours, oracle = real
    assert list(ours.tensors) == [t.name for t in oracle.tensors]
    for t in oracle.tensors:
        info = ours.tensors[t.name]
        assert info.shape == tuple(int(d) for d in reversed(t.shape)), t.name
        assert info.type_id == int(t.tensor_type), t.name
        assert info.offset == t.data_offset, t.name
        assert info.nbytes == t.n_bytes, t.name
        assert info.n_elements == t.n_elements, t.name
    types = {info.type_name for info in ours.tensors.values()}
    assert types == {"Q4_1", "Q8_0", "F32"}


@pytest.mark.parametrize(
    "name", ["token_embd.weight", "blk.0.attn_q.weight", "blk.29.ffn_down.weight",
             "output_norm.weight"]
)
def test_real_dequantize_matches_oracle(real: tuple[GGUFFile, gguf.GGUFReader], name: str) -> None:
    ours, oracle = real
    t = next(t for t in oracle.tensors if t.name == name)
    expected = gguf.quants.dequantize(t.data, t.tensor_type).reshape(ours.tensors[name].shape)
    got = ours.dequantize(name)
    assert got.dtype == np.float32 and got.shape == ours.tensors[name].shape
    np.testing.assert_array_equal(got, expected)


def test_raw_is_a_zero_copy_read_only_view(real: tuple[GGUFFile, gguf.GGUFReader]) -> None:
    ours, oracle = real
    raw = ours.raw("blk.0.attn_norm.weight")
    assert not raw.flags.writeable
    t = next(t for t in oracle.tensors if t.name == "blk.0.attn_norm.weight")
    np.testing.assert_array_equal(raw.view(np.float32), t.data)


# -- synthetic files: every supported type against the oracle -------------------------------------


@pytest.mark.parametrize("qtype", [Q.F32, Q.F16, Q.BF16, Q.Q4_0, Q.Q4_1, Q.Q5_0, Q.Q5_1, Q.Q8_0])
def test_every_supported_type_dequantizes_like_the_oracle(qtype: Q) -> None:
    rng = np.random.default_rng(int(qtype))
    values = (rng.standard_normal((8, 64)) * 3).astype(np.float32)
    if qtype == Q.F32:
        raw = values.view(np.uint8)
    elif qtype == Q.F16:
        raw = values.astype(np.float16).view(np.uint8)
    else:
        raw = gguf.quants.quantize(values, qtype)
    expected = gguf.quants.dequantize(raw, qtype).reshape(-1)
    gtype = quant.type_by_id(int(qtype))
    assert gtype is not None and gtype.name == qtype.name
    got = quant.dequantize(np.ascontiguousarray(raw).reshape(-1), gtype, values.size)
    np.testing.assert_array_equal(got, expected)
    assert quant.tensor_nbytes(gtype, values.size) == raw.size


def test_synthetic_file_round_trip(tiny_gguf: tuple[Path, dict[str, np.ndarray]]) -> None:
    path, expected = tiny_gguf
    with GGUFFile(path) as g:
        assert g.version == 3
        assert g.metadata["general.architecture"] == "llama"
        assert g.metadata["llama.context_length"] == 256
        assert g.metadata["test.flag"] is True
        assert g.metadata["test.ints"] == [1, -2, 3]
        assert g.metadata["tokenizer.ggml.tokens"][-1] == "é"
        assert g.metadata["llama.rope.freq_base"] == 10000.0
        assert {n: g.tensors[n].type_name for n in expected} == {
            "token_embd.weight": "Q8_0", "blk.0.attn_q.weight": "Q4_1",
            "blk.0.ffn_up.weight": "Q4_0", "blk.0.attn_k.weight": "F16",
            "blk.0.attn_norm.weight": "F32",
        }
        for name, values in expected.items():
            np.testing.assert_array_equal(g.dequantize(name), values)
            assert g.tensors[name].offset % g.alignment == 0


def test_version_2_is_read(tmp_path: Path) -> None:
    path = tmp_path / "v2.gguf"
    expected = write_tiny_gguf(path, version=2)
    with GGUFFile(path) as g:
        assert g.version == 2
        np.testing.assert_array_equal(g.dequantize("token_embd.weight"),
                                      expected["token_embd.weight"])


# -- bad input: each a ModelFileError naming the file and the fault -------------------------------


def _patch(path: Path, offset: int, data: bytes) -> None:
    with open(path, "r+b") as f:
        f.seek(offset)
        f.write(data)


def _type_field_offset(path: Path, name: str) -> tuple[int, int]:
    """(offset of the u32 ggml type of tensor `name` in its tensor info, n_dims)."""
    blob = path.read_bytes()
    key = struct.pack("<Q", len(name)) + name.encode()
    pos = blob.index(key) + len(key)
    n_dims = struct.unpack_from("<I", blob, pos)[0]
    return pos + 4 + 8 * n_dims, n_dims


def test_wrong_magic(tiny_gguf: tuple[Path, dict[str, np.ndarray]]) -> None:
    path, _ = tiny_gguf
    _patch(path, 0, b"\x7fELF")
    with pytest.raises(ModelFileError) as err:
        GGUFFile(path)
    msg = str(err.value)
    assert msg.startswith(f"{path}: not a GGUF file (magic b'\\x7fELF', expected b'GGUF')")
    assert "Hint:" in msg


def test_wrong_magic_in_a_tiny_file(tmp_path: Path) -> None:
    path = tmp_path / "notes.txt"
    path.write_bytes(b"hello")
    with pytest.raises(ModelFileError, match=r"notes\.txt: not a GGUF file \(magic b'hell'"):
        GGUFFile(path)


def test_empty_file(tmp_path: Path) -> None:
    path = tmp_path / "empty.gguf"
    path.write_bytes(b"")
    with pytest.raises(ModelFileError, match=r"empty\.gguf: not a GGUF file \(magic b''"):
        GGUFFile(path)


def test_missing_file(tmp_path: Path) -> None:
    path = tmp_path / "absent.gguf"
    with pytest.raises(ModelFileError, match=r"absent\.gguf: cannot open model file: No such"):
        GGUFFile(path)


@pytest.mark.parametrize("version", [1, 4, 0xFFFF])
def test_unsupported_version(tmp_path: Path, version: int) -> None:
    path = tmp_path / "v.gguf"
    write_tiny_gguf(path, version=version)
    with pytest.raises(ModelFileError) as err:
        GGUFFile(path)
    assert str(err.value).startswith(
        f"{path}: GGUF version {version} is not supported (supported: 2, 3)")
    assert "Hint:" in str(err.value)


def test_truncated_fixed_header(tiny_gguf: tuple[Path, dict[str, np.ndarray]]) -> None:
    path, _ = tiny_gguf
    path.write_bytes(path.read_bytes()[:10])
    with pytest.raises(ModelFileError,
                       match=r"tiny\.gguf: truncated GGUF file \(10 bytes, the header alone is 24"):
        GGUFFile(path)


def test_skipped_string_arrays_keep_their_length_and_the_rest_of_the_header(
        real: tuple[GGUFFile, gguf.GGUFReader]) -> None:
    ours, _ = real
    with GGUFFile(default_model_path(), string_arrays=False) as lean:
        assert lean.metadata["tokenizer.ggml.tokens"] == SkippedStrings(49152)
        assert len(lean.metadata["tokenizer.ggml.merges"]) == 48900
        strings = {k for k, v in ours.metadata.items()
                   if isinstance(v, list) and v and isinstance(v[0], str)}
        assert strings == {k for k, v in lean.metadata.items() if isinstance(v, SkippedStrings)}
        assert {k: v for k, v in lean.metadata.items() if k not in strings} == {
            k: v for k, v in ours.metadata.items() if k not in strings}
        assert lean.tensors == ours.tensors and lean.data_offset == ours.data_offset


def test_a_string_array_cut_short_is_refused_alike_when_skipped(tmp_path: Path) -> None:
    """Truncation inside the vocabulary: the same error whether its strings are built or
    skipped, at every cut (length field or string body)."""
    src = default_model_path().read_bytes()[:2_000_000]
    start = src.index(b"tokenizer.ggml.tokens") + len(b"tokenizer.ggml.tokens") + 4 + 4 + 8
    path = tmp_path / "cut.gguf"
    for cut in (start + 3, start + 8, start + 9, start + 400_123):
        path.write_bytes(src[:cut])
        errors = []
        for string_arrays in (True, False):
            with pytest.raises(ModelFileError) as err:
                GGUFFile(path, string_arrays=string_arrays)
            errors.append(str(err.value))
        assert errors[0] == errors[1], cut
        assert "truncated GGUF file" in errors[0] and "tokenizer.ggml.tokens" in errors[0]


@pytest.mark.parametrize("cut", [30, 200])
def test_truncated_in_metadata(tiny_gguf: tuple[Path, dict[str, np.ndarray]], cut: int) -> None:
    path, _ = tiny_gguf
    path.write_bytes(path.read_bytes()[:cut])
    with pytest.raises(ModelFileError) as err:
        GGUFFile(path)
    msg = str(err.value)
    assert msg.startswith(f"{path}: truncated GGUF file: reading ")
    assert f"but the file is {cut} bytes" in msg and "Hint:" in msg


def test_truncated_in_tensor_infos(tiny_gguf: tuple[Path, dict[str, np.ndarray]]) -> None:
    path, _ = tiny_gguf
    offset, _ = _type_field_offset(path, "blk.0.ffn_up.weight")
    path.write_bytes(path.read_bytes()[:offset + 2])
    with pytest.raises(ModelFileError,
                       match=r"truncated GGUF file: reading type of 'blk\.0\.ffn_up\.weight'"):
        GGUFFile(path)


def test_truncated_tensor_data(tiny_gguf: tuple[Path, dict[str, np.ndarray]]) -> None:
    path, _ = tiny_gguf
    data = path.read_bytes()
    with GGUFFile(path) as g:
        last = max(g.tensors.values(), key=lambda t: t.offset)
    path.write_bytes(data[: last.offset + last.nbytes - 10])
    with pytest.raises(ModelFileError) as err:
        GGUFFile(path)
    msg = str(err.value)
    assert msg.startswith(f"{path}: truncated GGUF file: tensor {last.name!r} needs bytes "
                          f"{last.offset}..{last.offset + last.nbytes}")
    assert "Hint: the download or copy was cut short" in msg


@pytest.mark.parametrize(("type_id", "type_name"), [(12, "Q4_K"), (99, "unknown type 99")])
def test_unknown_quantization_type(tiny_gguf: tuple[Path, dict[str, np.ndarray]], type_id: int,
                                   type_name: str) -> None:
    path, _ = tiny_gguf
    offset, _ = _type_field_offset(path, "blk.0.ffn_up.weight")
    _patch(path, offset, struct.pack("<I", type_id))
    with GGUFFile(path) as g:  # the table still opens; the tensor is refused when read
        assert g.tensors["blk.0.ffn_up.weight"].type_name == type_name
        g.dequantize("token_embd.weight")
        with pytest.raises(ModelFileError) as err:
            g.dequantize("blk.0.ffn_up.weight")
    msg = str(err.value)
    assert msg.startswith(f"{path}: tensor 'blk.0.ffn_up.weight' has quantization {type_name}, "
                          "which edge-agent cannot dequantize (supported: F32, F16, ")
    assert "Hint: re-quantize" in msg


def test_block_size_mismatch(tmp_path: Path) -> None:
    path = tmp_path / "odd.gguf"
    write_tiny_gguf(path)
    # Turn the 32-element F32 norm into a 33-element Q8_0 tensor (Q8_0 blocks hold 32).
    blob = path.read_bytes()
    key = struct.pack("<Q", len("blk.0.attn_norm.weight")) + b"blk.0.attn_norm.weight"
    pos = blob.index(key) + len(key) + 4  # first ne
    _patch(path, pos, struct.pack("<Q", 33))
    type_off, _ = _type_field_offset(path, "blk.0.attn_norm.weight")
    _patch(path, type_off, struct.pack("<I", int(Q.Q8_0)))
    with pytest.raises(ModelFileError, match=r"odd\.gguf: tensor 'blk\.0\.attn_norm\.weight' of "
                       r"type Q8_0 has 33 elements, not a multiple of its block size 32"):
        GGUFFile(path)


def test_bad_alignment(tmp_path: Path) -> None:
    path = tmp_path / "align.gguf"
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_uint32("general.alignment", 24)
    writer.add_tensor("x", np.zeros(4, np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    with pytest.raises(ModelFileError,
                       match=r"align\.gguf: general\.alignment = 24 is not a power of two"):
        GGUFFile(path)


def test_unknown_metadata_value_type(tiny_gguf: tuple[Path, dict[str, np.ndarray]]) -> None:
    path, _ = tiny_gguf
    blob = path.read_bytes()
    key = struct.pack("<Q", len("test.flag")) + b"test.flag"
    _patch(path, blob.index(key) + len(key), struct.pack("<I", 77))
    with pytest.raises(ModelFileError, match=r"tiny\.gguf: metadata key 'test\.flag' has unknown "
                       r"value type 77"):
        GGUFFile(path)


def test_unknown_tensor_name(real: tuple[GGUFFile, gguf.GGUFReader]) -> None:
    ours, _ = real
    with pytest.raises(ModelFileError, match=r"no tensor named 'output\.weight' \(272 tensors\)"):
        ours.dequantize("output.weight")
