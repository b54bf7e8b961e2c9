"""Prepared weights files (edge_agent.runtime.prepare): layout, contents, reuse, atomicity, and
every way a prepared file can be unusable."""

from __future__ import annotations

import hashlib
import json
import os
import struct
import subprocess
import sys
import zlib
from collections.abc import Callable
from pathlib import Path
from typing import Any

import gguf
import numpy as np
import pytest
from conftest import write_tiny_gguf

from edge_agent.errors import ConfigError, ModelFileError
from edge_agent.runtime.gguf import GGUFFile
from edge_agent.runtime.prepare import (
    ALIGNMENT,
    MAGIC,
    PreparedInfo,
    find_prepared,
    prepare_model,
    prepared_path,
    prepared_size,
    source_sha256,
)

Tiny = tuple[Path, dict[str, np.ndarray]]


def _sha(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def _read_tensor(info: PreparedInfo, name: str) -> np.ndarray:
    t = info.tensors[name]
    dtype = np.float32 if t.dtype == "f32" else np.float16
    with open(info.path, "rb") as f:
        f.seek(t.offset)
        return np.frombuffer(f.read(t.nbytes), dtype=dtype).reshape(t.shape)


# -- the real default model --------------------------------------------------------------------


def test_real_prepared_layout(prepared_f32_path: Path, model_path: Path,
                              gguf_model: GGUFFile) -> None:
    sha = _sha(model_path)
    assert prepared_f32_path.name == f"{sha[:16]}-f32.weights"
    assert prepared_f32_path.parent.name == "models"
    info = PreparedInfo.read(prepared_f32_path)
    assert (info.source_sha256, info.source_size, info.source_name) == (
        sha, model_path.stat().st_size, model_path.name)
    assert info.dtype == "f32" and info.version == 1
    assert info.file_size == prepared_f32_path.stat().st_size
    assert info.file_size % ALIGNMENT == 0 and info.data_offset % ALIGNMENT == 0
    assert info.weight_bytes == 538_060_032
    assert list(info.tensors) == list(gguf_model.tensors)
    for name, t in info.tensors.items():
        assert t.offset % ALIGNMENT == 0, name
        assert t.shape == gguf_model.tensors[name].shape, name
        assert t.dtype == "f32" and t.source_type == gguf_model.tensors[name].type_name
    assert info.metadata == dict(gguf_model.metadata)  # tokenizer arrays included
    assert prepared_size(gguf_model, "f32") == info.file_size


@pytest.mark.parametrize("name", ["token_embd.weight", "blk.7.ffn_gate.weight",
                                  "blk.29.attn_output.weight", "output_norm.weight"])
def test_real_prepared_values(prepared_f32_path: Path, gguf_model: GGUFFile, name: str) -> None:
    info = PreparedInfo.read(prepared_f32_path)
    np.testing.assert_array_equal(_read_tensor(info, name), gguf_model.dequantize(name))


def test_real_prepare_reuses_a_valid_file(prepared_state_dir: Path, prepared_f32_path: Path,
                                          model_path: Path) -> None:
    before = prepared_f32_path.stat()
    calls: list[tuple[int, int]] = []
    again = prepare_model(model_path, prepared_state_dir,
                          progress=lambda d, t: calls.append((d, t)))
    assert again == prepared_f32_path
    after = prepared_f32_path.stat()
    assert (after.st_ino, after.st_mtime_ns) == (before.st_ino, before.st_mtime_ns)
    assert calls == []
    assert find_prepared(model_path, prepared_state_dir, "f32") == prepared_f32_path
    assert find_prepared(model_path, prepared_state_dir, "f16") is None


# -- synthetic models: contents, dtypes, progress, atomicity ---------------------------------------


def test_prepare_f32_contents_and_progress(tiny_gguf: Tiny, tmp_path: Path) -> None:
    src, expected = tiny_gguf
    calls: list[tuple[int, int]] = []
    path = prepare_model(src, tmp_path / "state", progress=lambda d, t: calls.append((d, t)))
    assert path == prepared_path(tmp_path / "state", _sha(src), "f32")
    info = PreparedInfo.read(path)
    for name, values in expected.items():
        got = _read_tensor(info, name)
        assert got.dtype == np.float32
        np.testing.assert_array_equal(got, values)
    total = info.weight_bytes
    assert calls[0] == (0, total) and calls[-1] == (total, total)
    assert all(a[0] <= b[0] and a[1] == total for a, b in zip(calls, calls[1:], strict=False))
    assert sorted(p.name for p in path.parent.iterdir()) == [path.name]  # no temp file left
    assert info.metadata["tokenizer.ggml.tokens"][-1] == "é"
    assert info.metadata["test.flag"] is True


def test_prepare_f16_halves_matrices_keeps_vectors_f32(tiny_gguf: Tiny, tmp_path: Path) -> None:
    src, expected = tiny_gguf
    path = prepare_model(src, tmp_path, dtype="f16")
    assert path.name.endswith("-f16.weights")
    info = PreparedInfo.read(path)
    assert info.dtype == "f16"
    for name, values in expected.items():
        got = _read_tensor(info, name)
        if values.ndim >= 2:
            assert info.tensors[name].dtype == "f16" and got.dtype == np.float16
            np.testing.assert_array_equal(got, values.astype(np.float16))
        else:
            assert info.tensors[name].dtype == "f32"
            np.testing.assert_array_equal(got, values)
    with GGUFFile(src) as g:
        assert prepared_size(g, "f16") == info.file_size
        assert prepared_size(g, "f16") < prepared_size(g, "f32")


def test_f16_overflow_is_refused(tmp_path: Path) -> None:
    src = tmp_path / "big.gguf"
    writer = gguf.GGUFWriter(str(src), "llama")
    values = np.ones((4, 8), np.float32)
    values[2, 3] = 1e6
    writer.add_tensor("blk.0.big.weight", values)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    with pytest.raises(ModelFileError) as err:
        prepare_model(src, tmp_path / "state", dtype="f16")
    assert str(err.value) == (
        f"{src}: tensor 'blk.0.big.weight' holds values up to 1e+06, beyond float16's range "
        "(65504). Hint: prepare this model with --dtype f32.")
    assert list((tmp_path / "state" / "models").iterdir()) == []
    assert prepare_model(src, tmp_path / "state", dtype="f32").exists()


class _Crash(Exception):
    pass


def _crash_after(n: int) -> Callable[[int, int], None]:
    seen = []

    def progress(done: int, total: int) -> None:
        seen.append(done)
        if len(seen) > n:
            raise _Crash

    return progress


def test_crash_leaves_no_file_under_the_final_name(tiny_gguf: Tiny, tmp_path: Path) -> None:
    src, _ = tiny_gguf
    with pytest.raises(_Crash):
        prepare_model(src, tmp_path, progress=_crash_after(2))
    assert list((tmp_path / "models").iterdir()) == []
    assert find_prepared(src, tmp_path, "f32") is None


def test_crash_during_force_keeps_the_old_file(tiny_gguf: Tiny, tmp_path: Path) -> None:
    src, _ = tiny_gguf
    path = prepare_model(src, tmp_path)
    old = path.read_bytes()
    with pytest.raises(_Crash):
        prepare_model(src, tmp_path, force=True, progress=_crash_after(2))
    assert path.read_bytes() == old
    assert [p.name for p in path.parent.iterdir()] == [path.name]


def test_stale_temp_of_a_dead_process_is_removed(tiny_gguf: Tiny, tmp_path: Path) -> None:
    src, _ = tiny_gguf
    final = prepared_path(tmp_path, _sha(src), "f32")
    final.parent.mkdir(parents=True)
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"],
                          capture_output=True, text=True, check=True).stdout.strip()
    stale = final.with_name(f".{final.name}.{dead}.0badf00d.tmp")
    live = final.with_name(f".{final.name}.{os.getpid()}.0badf00d.tmp")
    stale.write_bytes(b"half")
    live.write_bytes(b"busy")
    prepare_model(src, tmp_path)
    assert sorted(p.name for p in final.parent.iterdir()) == sorted([final.name, live.name])


def test_force_rebuilds(tiny_gguf: Tiny, tmp_path: Path) -> None:
    src, _ = tiny_gguf
    path = prepare_model(src, tmp_path)
    inode = path.stat().st_ino
    assert prepare_model(src, tmp_path).stat().st_ino == inode
    assert prepare_model(src, tmp_path, force=True).stat().st_ino != inode
    PreparedInfo.read(path)


def test_changed_source_gets_its_own_file(tiny_gguf: Tiny, tmp_path: Path) -> None:
    src, _ = tiny_gguf
    first = prepare_model(src, tmp_path)
    write_tiny_gguf(src, seed=7)
    assert find_prepared(src, tmp_path, "f32") is None
    second = prepare_model(src, tmp_path)
    assert second != first and second.name.startswith(source_sha256(src)[:16])


# -- bad input ----------------------------------------------------------------------------------


def test_bad_dtype(tiny_gguf: Tiny, tmp_path: Path) -> None:
    src, _ = tiny_gguf
    with pytest.raises(ConfigError, match=r"prepared weights dtype 'bf16' is not supported\. "
                       r"Hint: use one of f32, f16"):
        prepare_model(src, tmp_path, dtype="bf16")


def test_unsupported_quantization_is_refused_before_writing(tiny_gguf: Tiny,
                                                            tmp_path: Path) -> None:
    src, _ = tiny_gguf
    blob = src.read_bytes()
    key = struct.pack("<Q", len("blk.0.ffn_up.weight")) + b"blk.0.ffn_up.weight"
    pos = blob.index(key) + len(key)
    n_dims = struct.unpack_from("<I", blob, pos)[0]
    src.write_bytes(blob[: pos + 4 + 8 * n_dims] + struct.pack("<I", 14)
                    + blob[pos + 8 + 8 * n_dims:])
    with pytest.raises(ModelFileError, match=r"tiny\.gguf: tensor 'blk\.0\.ffn_up\.weight' has "
                       r"quantization Q6_K, which edge-agent cannot dequantize"):
        prepare_model(src, tmp_path)
    assert not (tmp_path / "models").exists()


def test_not_a_gguf_source(tmp_path: Path) -> None:
    src = tmp_path / "model.bin"
    src.write_bytes(b"PK\x03\x04" + bytes(100))
    with pytest.raises(ModelFileError, match=r"model\.bin: not a GGUF file \(magic b'PK"):
        prepare_model(src, tmp_path)


def test_missing_source(tmp_path: Path) -> None:
    with pytest.raises(ModelFileError, match=r"nope\.gguf: cannot read model file: No such file"):
        find_prepared(tmp_path / "nope.gguf", tmp_path, "f32")


@pytest.fixture
def prepared_tiny(tiny_gguf: Tiny, tmp_path: Path) -> Path:
    return prepare_model(tiny_gguf[0], tmp_path / "state")


def _rewrite_header(path: Path, mutate: Callable[[dict[str, Any]], None]) -> None:
    """Change the JSON header in place, keeping its length (space padding) and a valid CRC."""
    blob = bytearray(path.read_bytes())
    n = struct.unpack_from("<Q", blob, 16)[0]
    header = json.loads(blob[24 : 24 + n])
    mutate(header)
    raw = json.dumps(header, ensure_ascii=False, separators=(",", ":")).encode()
    assert len(raw) <= n
    raw += b" " * (n - len(raw))
    blob[24 : 24 + n] = raw
    struct.pack_into("<I", blob, 12, zlib.crc32(raw))
    path.write_bytes(bytes(blob))


def _expect_bad(path: Path, what: str) -> None:
    with pytest.raises(ModelFileError) as err:
        PreparedInfo.read(path)
    msg = str(err.value)
    assert msg.startswith(f"{path}: not a usable prepared weights file: {what}"), msg
    assert msg.endswith("Hint: run `edge-agent model prepare --force` to rebuild it from its "
                        "source.")


def test_truncated_prepared_file(prepared_tiny: Path) -> None:
    size = prepared_tiny.stat().st_size
    os.truncate(prepared_tiny, size - 4096)
    _expect_bad(prepared_tiny, f"size is {size - 4096} bytes but its header describes {size} "
                "bytes (truncated or overwritten)")


def test_prepared_file_with_extra_bytes(prepared_tiny: Path) -> None:
    size = prepared_tiny.stat().st_size
    with open(prepared_tiny, "ab") as f:
        f.write(b"\0")
    _expect_bad(prepared_tiny, f"size is {size + 1} bytes but its header describes {size}")


def test_truncated_in_json_header(prepared_tiny: Path) -> None:
    os.truncate(prepared_tiny, 100)
    _expect_bad(prepared_tiny, "truncated: the JSON header needs")


def test_truncated_fixed_header(prepared_tiny: Path) -> None:
    os.truncate(prepared_tiny, 10)
    _expect_bad(prepared_tiny, "truncated: 10 bytes, the fixed header alone is 24")


def test_prepared_wrong_magic(tiny_gguf: Tiny) -> None:
    src, _ = tiny_gguf
    with pytest.raises(ModelFileError) as err:
        PreparedInfo.read(src)
    assert str(err.value).startswith(
        f"{src}: not a prepared weights file (magic b'GGUF\\x03\\x00\\x00\\x00', expected "
        f"{MAGIC!r}). Hint:")


def test_prepared_wrong_version(prepared_tiny: Path) -> None:
    with open(prepared_tiny, "r+b") as f:
        f.seek(8)
        f.write(struct.pack("<I", 2))
    _expect_bad(prepared_tiny, "format version 2, this edge-agent reads version 1")


def test_prepared_corrupt_header(prepared_tiny: Path) -> None:
    with open(prepared_tiny, "r+b") as f:
        f.seek(40)
        byte = f.read(1)
        f.seek(40)
        f.write(bytes([byte[0] ^ 0x20]))
    _expect_bad(prepared_tiny, "header checksum mismatch (the JSON header is corrupt)")


def test_prepared_header_missing_key(prepared_tiny: Path) -> None:
    _rewrite_header(prepared_tiny, lambda h: h.pop("tensors"))
    _expect_bad(prepared_tiny, "malformed JSON header (KeyError: 'tensors')")


def test_prepared_tensor_out_of_bounds(prepared_tiny: Path) -> None:
    def shrink(h: dict[str, Any]) -> None:
        h["data_bytes"] = 4096
        del h["tensors"]["token_embd.weight"]  # the first tensor; 8192 bytes at offset 0

    _rewrite_header(prepared_tiny, shrink)
    _expect_bad(prepared_tiny, "tensor 'blk.0.attn_q.weight' needs data bytes 8192..12288 but "
                "the data area is 4096 bytes")


def test_prepared_tensor_misaligned(prepared_tiny: Path) -> None:
    def shift(h: dict[str, Any]) -> None:
        h["tensors"]["blk.0.attn_q.weight"]["offset"] += 1

    _rewrite_header(prepared_tiny, shift)
    _expect_bad(prepared_tiny, "tensor 'blk.0.attn_q.weight' at data offset 8193 is not aligned "
                "to 4096 bytes")


def test_prepared_for_another_source(tiny_gguf: Tiny, tmp_path: Path) -> None:
    src, _ = tiny_gguf
    other = tmp_path / "other.gguf"
    write_tiny_gguf(other, seed=3)
    made = prepare_model(other, tmp_path / "state")
    wrong = prepared_path(tmp_path / "state", _sha(src), "f32")
    os.replace(made, wrong)  # a file under src's key that was prepared from `other`
    for call in (lambda: find_prepared(src, tmp_path / "state", "f32"),
                 lambda: prepare_model(src, tmp_path / "state")):
        with pytest.raises(ModelFileError) as err:
            call()
        msg = str(err.value)
        assert msg.startswith(f"{wrong}: not a usable prepared weights file: it was prepared "
                              f"from sha256 {_sha(other)[:16]}...")
        assert f"but its source {src} has sha256 {_sha(src)[:16]}..." in msg
        assert "--force" in msg
    fixed = prepare_model(src, tmp_path / "state", force=True)
    assert fixed == wrong and find_prepared(src, tmp_path / "state", "f32") == wrong
