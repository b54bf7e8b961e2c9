"""The llama.cpp engine on small random-weight GGUFs of each architecture it promises: llama,
qwen2, phi3, gemma3 (tests/tiny_archs.py writes them with the `gguf` package: llama.cpp's tensor
names, shapes and metadata keys, the default model's tokenizer, F32/F16/Q8_0/Q4_0/Q4_K tensors).

Oracles: llama.cpp's own greedy decoding (llama-cpp-python's high-level `Llama`: its tokenizer,
its sampler, a batch of one) for the same file and prompt; the same prompt alone and in a batch
with others; ggml's own type table for the sizes edge-agent reads K-quant tensors with.
"""

from __future__ import annotations

import ctypes
import struct
from collections.abc import Iterator
from pathlib import Path

import pytest

from edge_agent.errors import ModelFileError
from edge_agent.runtime import quant
from edge_agent.runtime.gguf import GGUFFile
from edge_agent.runtime.prefill_groups import NewSeq
from edge_agent.runtime.sampling import SamplingParams

llama_cpp = pytest.importorskip("llama_cpp", reason="the llama.cpp engine needs llama-cpp-python")

from tiny_archs import ARCHS, write_tiny_arch  # noqa: E402

from edge_agent.runtime.llamacpp import LlamaCppEngine  # noqa: E402

PROMPTS = ["The capital of France is", "Once upon a time", "def fib(n):", "1, 2, 3, 4,"]
GREEDY = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True)


@pytest.fixture(scope="module")
def tiny_files(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    d = tmp_path_factory.mktemp("archs")
    return {arch: write_tiny_arch(d / f"tiny-{arch}.gguf", arch) for arch in ARCHS}


@pytest.fixture(scope="module", params=ARCHS)
def arch(request: pytest.FixtureRequest) -> str:
    return str(request.param)


@pytest.fixture(scope="module")
def engine(tiny_files: dict[str, Path], arch: str) -> Iterator[LlamaCppEngine]:
    e = LlamaCppEngine.load(tiny_files[arch], max_batch=4, context=128, threads=1, mlock="off")
    try:
        yield e
    finally:
        e.close()


def _ggml_base() -> ctypes.CDLL:
    lib = ctypes.CDLL(str(Path(llama_cpp.__file__).parent / "lib" / "libggml-base.so"))
    lib.ggml_blck_size.restype = ctypes.c_int64
    lib.ggml_type_size.restype = ctypes.c_size_t
    lib.ggml_type_name.restype = ctypes.c_char_p
    return lib


def test_type_table_matches_ggml() -> None:
    """Every type id ggml knows has our name and block size; removed ids are not types."""
    lib = _ggml_base()
    for type_id in range(64):
        info = quant.type_info(type_id)
        elems = lib.ggml_blck_size(type_id) if type_id < 43 else 0
        if elems == 0:
            assert info is None, type_id
            continue
        assert info is not None, type_id
        name = lib.ggml_type_name(type_id).decode()
        assert (info.name.lower(), info.block_elems, info.block_bytes) == (
            name.lower(), elems, lib.ggml_type_size(type_id)), type_id


def test_files_are_small_and_hold_a_real_quantization_mix(tiny_files: dict[str, Path]) -> None:
    for arch, path in tiny_files.items():
        assert path.stat().st_size < 10 << 20, arch
        with GGUFFile(path) as g:
            assert g.metadata["general.architecture"] == arch
            kinds = {t.type_name for t in g.tensors.values()}
            assert {"F32", "F16", "Q8_0", "Q4_0", "Q4_K"} <= kinds or (
                arch == "phi3" and {"F32", "Q8_0", "Q4_0", "Q4_K"} <= kinds), (arch, kinds)
            # the K-quant tensors are sized by the type table: the data ends at the file's end
            end = max(t.offset + t.nbytes for t in g.tensors.values())
            assert end == g.size, (arch, end, g.size)
            down = g.tensors["blk.0.ffn_down.weight"]
            assert down.type_name == "Q4_K" and down.nbytes == down.n_elements // 256 * 144


def test_loads_and_describes_its_architecture(engine: LlamaCppEngine, arch: str,
                                              tiny_files: dict[str, Path]) -> None:
    d = engine.describe()
    assert d["architecture"] == arch
    assert d["description"].startswith(f"{arch} ") and "Q4_K" in d["description"]
    with GGUFFile(tiny_files[arch]) as g:
        n_params = sum(t.n_elements for t in g.tensors.values())
        assert d["vocab_size"] == len(g.metadata["tokenizer.ggml.tokens"])
    assert d["parameters"] == n_params
    assert d["vocab_type"] == "bpe" and d["context"] == 128


def _own_greedy(path: Path, prompt: str, n: int) -> list[int]:
    """llama.cpp's own greedy ids (high-level API: its tokenizer, its sampler, one sequence),
    with flash attention as the engine has it (llama.cpp's "auto" is on for the CPU; the
    high-level default is off, and on random weights the two paths' logits differ by up to
    0.24, enough to flip near-ties)."""
    llm = llama_cpp.Llama(model_path=str(path), n_ctx=128, n_threads=1, verbose=False,
                          flash_attn=True)
    try:
        ids = llm.tokenize(prompt.encode(), add_bos=True, special=False)
        out: list[int] = []
        for tok in llm.generate(ids, temp=0.0, top_k=1, top_p=1.0, min_p=0.0,
                                repeat_penalty=1.0):
            if len(out) >= n:
                break
            out.append(int(tok))
        return out
    finally:
        llm.close()


def test_greedy_generates_what_llama_cpp_generates(engine: LlamaCppEngine, arch: str,
                                                    tiny_files: dict[str, Path]) -> None:
    for prompt in PROMPTS[:2]:
        ids = engine.tokenizer.encode(prompt)
        ours = list(engine.generate(ids, GREEDY))
        assert len(ours) == GREEDY.max_tokens and all(0 <= t < engine.n_vocab for t in ours)
        assert len(set(ours)) > 1, (arch, ours)  # the random blocks are not dead weight
        assert ours == _own_greedy(tiny_files[arch], prompt, len(ours)), (arch, prompt)


def _batch(engine: LlamaCppEngine, prompts: list[list[int]], n: int) -> list[list[int]]:
    """Greedy tokens of `prompts` prefilled together and stepped together."""
    names = [f"b{i}" for i in range(len(prompts))]
    first, errors = engine.add_many([NewSeq(s, p, GREEDY) for s, p in zip(names, prompts,
                                                                           strict=True)])
    assert not errors, errors
    out = {s: [first[s]] for s in names}
    try:
        for _ in range(n - 1):
            for s, t in engine.step(names).items():
                out[s].append(t)
    finally:
        for s in names:
            engine.release(s)
    return [out[s] for s in names]


def test_same_tokens_alone_and_in_a_batch(engine: LlamaCppEngine, arch: str) -> None:
    prompts = [engine.tokenizer.encode(p) for p in PROMPTS]
    alone = [list(engine.generate(p, GREEDY)) for p in prompts]
    assert len({tuple(a) for a in alone}) == len(prompts)  # distinct prompts, distinct outputs
    batch = _batch(engine, prompts, GREEDY.max_tokens)
    same = [a == b for a, b in zip(alone, batch, strict=True)]
    assert all(same), f"{arch}: {sum(same)}/{len(same)} prompts equal alone and in a batch"
    twins = _batch(engine, [prompts[0], prompts[0]], GREEDY.max_tokens)
    assert twins == [alone[0], alone[0]], arch


def _cut(src: Path, dst: Path) -> Path:
    with GGUFFile(src) as g:
        down = g.tensors["blk.1.ffn_down.weight"]  # a Q4_K tensor: sized by the type table
        keep = down.offset + down.nbytes // 2
    dst.write_bytes(src.read_bytes()[:keep])
    return dst


def _rename(src: Path, dst: Path, old: bytes, new: bytes) -> Path:
    """A copy with `old` (a string in the header) replaced by `new` of the same length."""
    blob = src.read_bytes()
    key = struct.pack("<Q", len(old)) + old
    assert len(old) == len(new) and blob.count(key) == 1
    dst.write_bytes(blob.replace(key, struct.pack("<Q", len(new)) + new))
    return dst


def test_truncated_copy_is_refused_naming_the_path(tiny_files: dict[str, Path], arch: str,
                                                   tmp_path: Path) -> None:
    cut = _cut(tiny_files[arch], tmp_path / f"cut-{arch}.gguf")
    with pytest.raises(ModelFileError) as exc:
        LlamaCppEngine.load(cut, max_batch=1, context=64, threads=1, mlock="off")
    msg = str(exc.value)
    assert msg.startswith(f"{cut}: truncated GGUF file: tensor 'blk.1.ffn_down.weight' needs")
    assert "Hint: the download or copy was cut short" in msg


@pytest.mark.parametrize(("what", "old", "new", "says"), [
    ("a required tensor renamed", b"blk.1.ffn_down.weight", b"blk.1.ffn_dowX.weight",
     "tensor 'blk.1.ffn_down.weight' not found"),
    ("no architecture key", b"general.architecture", b"general.architectur_",
     "unknown model architecture: ''"),
])
def test_corrupt_copy_is_refused_naming_the_path(tiny_files: dict[str, Path], arch: str,
                                                 tmp_path: Path, what: str, old: bytes,
                                                 new: bytes, says: str) -> None:
    """Header intact (our own check passes), contents wrong: llama.cpp's refusal, our words."""
    bad = _rename(tiny_files[arch], tmp_path / f"bad-{arch}.gguf", old, new)
    with GGUFFile(bad):
        pass
    with pytest.raises(ModelFileError) as exc:
        LlamaCppEngine.load(bad, max_batch=1, context=64, threads=1, mlock="off")
    msg = str(exc.value)
    assert msg.startswith(f"{bad}: llama.cpp could not load this GGUF ("), what
    assert says in msg and "Hint:" in msg, (what, msg)


def test_llama_cpp_reasons_survive_the_high_level_package(tiny_files: dict[str, Path],
                                                          tmp_path: Path) -> None:
    """llama-cpp-python's own `__init__` (run at the first `llama_cpp.Llama`, after our log
    callback is installed) sets its logger as llama.cpp's; ours is put back, so a refusal
    still carries llama.cpp's reason. In a fresh interpreter: the import order is the point."""
    import subprocess
    import sys

    bad = _rename(tiny_files["llama"], tmp_path / "bad.gguf", b"general.architecture",
                  b"general.architectur_")
    code = f"""
from edge_agent.errors import ModelFileError
from edge_agent.runtime.llama_vocab import llama_lib
from edge_agent.runtime.llamacpp import LlamaCppEngine
llama_lib()
import llama_cpp
assert llama_cpp.Llama  # the real package __init__ runs now
try:
    LlamaCppEngine.load({str(bad)!r}, max_batch=1, context=64, threads=1, mlock="off")
except ModelFileError as exc:
    print(exc)
"""
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=120, check=True).stdout
    assert "unknown model architecture: ''" in out, out
