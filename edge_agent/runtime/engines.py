"""The engine seam: what the runner drives, and which implementation serves a model.

Two engines implement `EngineLike`:
- `llamacpp` (`runtime/llamacpp.py`): llama.cpp's kernels through llama-cpp-python's C API, any
  GGUF llama.cpp loads (K-quants, Q4_0-Q8_0, F16/BF16; llama, qwen2/3, gemma3, phi3, ...); the
  default wherever llama-cpp-python imports.
- `numpy` (`runtime/engine.py`): weights prepared as f32/f16 and computed with numpy; the
  reference (checked against transformers) and the fallback where llama-cpp-python cannot be
  built. llama-family GGUFs with F32/F16/BF16/Q4_0/Q4_1/Q5_0/Q5_1/Q8_0 tensors only.

Invariants owned here:
- `resolve_engine` is the one place "auto" becomes a name: llamacpp when llama-cpp-python
  imports, numpy otherwise. The control plane and the runner both call it, so they agree.
- The control plane needs no weights to admit a request: `open_tokenizer` and `model_facts`
  read the GGUF's metadata only (a vocab-only load for llamacpp), and the memory budget is
  computed from those facts before a runner starts.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

from edge_agent.errors import ConfigError, ModelFileError
from edge_agent.runtime.prefill_groups import NewSeq
from edge_agent.runtime.sampling_params import SamplingParams, TokenLogprobs

__all__ = ["EMBED_BATCH_TOKENS", "EMBED_LM_HEAD_BYTES", "ENGINES", "LLAMACPP_RUNNER_BASE_BYTES",
           "POOLINGS", "EngineLike", "ModelFacts", "TokenizerLike", "embed_batch_tokens",
           "embedding_pooling", "llamacpp_budget_bytes", "llamacpp_embed_bytes", "load_engine",
           "model_facts", "open_tokenizer", "resolve_engine"]

ENGINES = ("auto", "llamacpp", "numpy")

# The llama.cpp runner process besides weights, KV cache and compute buffers (interpreter,
# numpy, the llama libraries): measured as runner RSS minus those on SmolLM2 and Gemma 3 at
# max_batch 4/8/16 and context 512/2048: 25-40 MiB; 48 MiB leaves room for long prefills.
LLAMACPP_RUNNER_BASE_BYTES = 48 << 20

# Sentence embeddings (`EngineLike.embed`): the pooling a model's config may ask for
# (`models.NAME.pooling`; "model": the GGUF's own `<arch>.pooling_type`) and llama.cpp's
# llama_pooling_type values. 0 (none) and 4 (rank, a reranker's head) pool no sentence vector.
POOLINGS = ("model", "mean", "cls", "last")
FACTS_CACHE = "gguf-facts.json"  # cached_model_facts's file, in the state directory
FACTS_KEPT = 16  # GGUF files it remembers, the most recently parsed
_POOLING_TYPES = {1: "mean", 2: "cls", 3: "last"}
# Tokens per llama_decode of the embedding context (`embed_batch_tokens`). In embeddings mode
# llama.cpp computes every token's output, LM head included, so its compute and output buffers
# grow by ~2 x vocab x 4 bytes per token of a decode (Gemma 3: 2 MiB a token). Larger decodes
# are faster (SmolLM2, 256 tokens: 8.2 CPU-s at 32 a decode, 3.9 at 128), so a decode takes as
# many tokens as EMBED_LM_HEAD_BYTES of those buffers allow, within these bounds.
EMBED_BATCH_TOKENS = (32, 128)
EMBED_LM_HEAD_BYTES = 64 << 20


class TokenizerLike(Protocol):
    """What the daemon asks of a model's tokenizer (both engines' tokenizers offer it)."""

    bos_id: int
    eos_id: int
    add_bos: bool
    eog_ids: frozenset[int]
    special_ids: frozenset[int]

    @property
    def fingerprint(self) -> str: ...
    @property
    def chat_template(self) -> Any: ...
    @property
    def chat_note(self) -> str: ...
    def encode(self, text: str) -> list[int]: ...
    def tokenize(self, text: str, *, add_bos: bool, parse_special: bool) -> list[int]: ...
    def decode(self, ids: Sequence[int], *, skip_special: bool = False) -> str: ...
    def token_bytes(self, token_id: int) -> bytes: ...
    def apply_chat_template(self, messages: Sequence[Any], *,
                            add_generation_prompt: bool = True) -> list[int]: ...
    def turn_end_ids(self) -> list[int]: ...


class EngineLike(Protocol):
    """One loaded model serving up to `max_batch` sequences of up to `context` tokens."""

    name: str
    context: int
    max_batch: int
    stop_ids: frozenset[int]
    tokenizer: Any
    constraints: Any  # runtime/constrain.py Constraints: grammars of constrained sequences
    # the last add_many / step's log-probabilities, by sequence (only those whose params ask)
    last_logprobs: dict[str, TokenLogprobs]

    @property
    def free_blocks(self) -> int: ...
    def add(self, seq_id: str, prompt_ids: Sequence[int], params: SamplingParams, *,
            generated: Sequence[int] = ()) -> int: ...
    def add_many(self, new: Sequence[NewSeq]) -> tuple[dict[str, int], dict[str, Any]]: ...
    def step(self, seq_ids: Sequence[str]) -> dict[str, int]: ...
    def release(self, seq_id: str) -> None: ...
    def cached_tokens(self, seq_id: str) -> int: ...
    # a finished session's KV as a blob for the journal and back (None / False / 0: the
    # engine keeps none); identity() is what a blob must match to be loaded
    def snapshot(self, tokens: Sequence[int]) -> bytes | None: ...
    def restore(self, tokens: Sequence[int], blob: bytes) -> bool: ...
    def identity(self) -> str: ...
    def snapshot_tokens(self, blob: bytes) -> int: ...
    def close(self) -> None: ...
    def describe(self) -> dict[str, Any]: ...
    def lock_report(self) -> dict[str, Any] | None: ...
    def warmup_ids(self) -> list[int]: ...
    def batch_invariance(self, prompt_ids: Sequence[int], *, cache: Path | None = None
                         ) -> bool: ...
    def embed(self, token_lists: Sequence[Sequence[int]]) -> Any: ...
    def generate(self, prompt_ids: Sequence[int], params: SamplingParams) -> Iterator[int]: ...
    def stream_text(self, prompt_ids: Sequence[int], params: SamplingParams, *,
                    on_token: Callable[[int], None] | None = None) -> Iterator[str]: ...


def resolve_engine(name: str) -> str:
    """"auto" -> "llamacpp" when llama-cpp-python imports, else "numpy"; names pass through."""
    if name not in ENGINES:
        raise ConfigError(f"runtime.engine: {name!r} is not an engine (choose one of "
                          f"{', '.join(ENGINES)}). Hint: \"auto\" picks llamacpp when "
                          "llama-cpp-python is installed.")
    if name != "auto":
        return name
    from edge_agent.runtime.llama_vocab import llama_available

    return "llamacpp" if llama_available() else "numpy"


def load_engine(engine: str, model_path: Path, *, state_dir: Path, dtype: str = "f32",
                mlock: str = "best-effort", max_batch: int = 8, context: int = 2048,
                threads: int | None = None,
                progress: Callable[[int, int], None] | None = None,
                pooling: str = "model", decode: str = "batched",
                checked: str = "") -> EngineLike:
    """Load `model_path` on `engine` (a resolved name), pinned by the `mlock` policy;
    `pooling` (POOLINGS) is how the llamacpp engine's `embed` pools (numpy embeds nothing);
    `decode` how its sequences share llama_decode calls (the numpy engine's batched step is
    already batch-invariant: it ignores it); `checked`: the gguf_stamp of a header parse
    that accepted the file (llamacpp: not parsed again)."""
    name = resolve_engine(engine)
    if name == "llamacpp":
        from edge_agent.runtime.llamacpp import LlamaCppEngine

        return LlamaCppEngine.load(model_path, mlock=mlock, max_batch=max_batch,
                                   context=context, threads=threads, pooling=pooling,
                                   decode=decode, checked=checked)
    from edge_agent.runtime.engine import DEFAULT_THREADS, Engine

    return Engine.load(model_path, state_dir=state_dir, dtype=dtype, mlock=mlock,
                       max_batch=max_batch, context=context,
                       threads=threads or DEFAULT_THREADS, progress=progress)


def open_tokenizer(engine: str, model_path: Path, metadata: dict[str, Any] | None = None,
                   *, checked: str = "") -> Any:
    """The tokenizer the control plane uses for `model_path` on `engine` (no weights read);
    `checked`: the gguf_stamp of a header parse that accepted the file (llamacpp)."""
    if resolve_engine(engine) == "llamacpp":
        from edge_agent.runtime.llama_vocab import LlamaVocab

        return LlamaVocab.load(model_path, checked=checked)
    from edge_agent.runtime.gguf import GGUFFile
    from edge_agent.runtime.tokenizer import Tokenizer

    meta = metadata if metadata is not None else GGUFFile(model_path).metadata
    return Tokenizer.from_metadata(meta, source=str(model_path))


@dataclass(frozen=True)
class ModelFacts:
    """What a GGUF's metadata says about the memory a model needs, engine-independent."""

    architecture: str
    n_layers: int
    n_kv_heads: int
    key_dim: int  # per head
    value_dim: int  # per head
    context_length: int  # trained context (0: not stated)
    tensor_bytes: int  # the tensors as stored in the file
    sliding_window: int  # 0: every layer attends to the whole context
    swa_layers: int  # layers that attend only to the last `sliding_window` tokens
    vocab_size: int
    embedding_length: int = 0  # the model's hidden size: the length of its sentence vectors
    pooling_type: int = -1  # `<arch>.pooling_type` (llama_pooling_type); -1: not stated
    stamp: str = ""  # the parsed file's llama_vocab.gguf_stamp ("": not known)

    def kv_bytes(self, tokens: int, *, sequences: int = 1, elem_bytes: int = 2) -> int:
        """K and V cache bytes for `sequences` of `tokens` each (f16 cells by default); a
        sliding-window layer keeps at most its window (+ one batch of 512) per sequence."""
        per = self.n_kv_heads * (self.key_dim + self.value_dim) * elem_bytes
        full = self.n_layers - self.swa_layers
        swa_tokens = min(tokens, self.sliding_window + 512) if self.sliding_window else tokens
        return sequences * per * (full * tokens + self.swa_layers * swa_tokens)


def write_cache_json(path: Path, obj: Any) -> None:
    """Replace the small cache file `path` with `obj` as JSON, atomically (a temporary file,
    then rename): a reader sees the old file or the new one. OSError when it cannot be written
    (no temporary file is left); the caller decides what the lost write costs."""
    import json
    import os

    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        tmp.write_text(json.dumps(obj))
        os.replace(tmp, path)
    except OSError:
        with contextlib.suppress(OSError):
            tmp.unlink()
        raise


def cached_model_facts(model_path: Path, cache: Path) -> ModelFacts:
    """model_facts, kept in the JSON file `cache` by path and `gguf_stamp`: the same file
    (device, inode, size, mtime) is not parsed again (a 49k-token vocabulary's header takes
    ~0.04 s at every start, before the runner can be told what to load). A missing, stale or
    unreadable entry is parsed and rewritten; a cache that cannot be written costs only that."""
    import dataclasses
    import json

    from edge_agent.runtime.llama_vocab import gguf_stamp

    try:
        entries = json.loads(cache.read_text())
        entry = entries.get(str(model_path)) if isinstance(entries, dict) else None
        if isinstance(entry, dict) and entry.get("stamp") == gguf_stamp(model_path):
            return ModelFacts(**entry)
    except (OSError, ValueError, TypeError):
        entries = None
    facts = model_facts(model_path)
    if facts.stamp:
        kept = {k: v for k, v in (entries or {}).items()
                if isinstance(v, dict) and k != str(model_path)}
        kept = dict(list(kept.items())[-(FACTS_KEPT - 1):])
        kept[str(model_path)] = dataclasses.asdict(facts)
        with contextlib.suppress(OSError):  # unwritten: the next start parses again
            write_cache_json(cache, kept)
    return facts


def model_facts(model_path: Path, metadata: dict[str, Any] | None = None) -> ModelFacts:
    """ModelFacts from the GGUF header at `model_path` (reads metadata and tensor infos)."""
    from edge_agent.runtime.gguf import GGUFFile
    from edge_agent.runtime.llama_vocab import gguf_stamp

    try:
        stamp = gguf_stamp(model_path)  # before the parse: a file replaced meanwhile differs
    except OSError:
        stamp = ""  # the parse names the problem
    with GGUFFile(model_path, string_arrays=False) as g:  # the vocabulary: its length only
        meta = dict(metadata if metadata is not None else g.metadata)
        tensor_bytes = g.size - g.data_offset
    arch = str(meta.get("general.architecture", ""))
    where = f"{model_path}: "

    def get(key: str, default: int | None = None) -> int:
        value = meta.get(f"{arch}.{key}", default)
        if value is None:
            raise ModelFileError(f"{where}metadata key {arch}.{key!r} is missing. Hint: convert "
                                 "the model again with llama.cpp's convert_hf_to_gguf.py.")
        if isinstance(value, (list, tuple)):  # per-layer values (e.g. OpenELM): the largest
            value = max(int(v) for v in value) if value else 0
        return int(value)

    n_heads = get("attention.head_count")
    dim = get("embedding_length")
    head_dim = dim // max(n_heads, 1)
    n_layers = get("block_count")
    window = get("attention.sliding_window", 0)
    swa_layers = 0
    if window and arch.startswith("gemma3"):  # five local layers for each global one
        swa_layers = n_layers - n_layers // 6
    elif window and arch.startswith("gemma2"):
        swa_layers = n_layers // 2
    elif window:
        swa_layers = n_layers
    return ModelFacts(
        architecture=arch, n_layers=n_layers,
        n_kv_heads=get("attention.head_count_kv", n_heads),
        key_dim=get("attention.key_length", head_dim),
        value_dim=get("attention.value_length", head_dim),
        context_length=get("context_length", 0),
        tensor_bytes=tensor_bytes,
        sliding_window=window, swa_layers=swa_layers,
        vocab_size=len(meta.get("tokenizer.ggml.tokens", ())),
        embedding_length=dim, pooling_type=get("pooling_type", -1), stamp=stamp)


def embedding_pooling(pooling_type: int, override: str = "model") -> str | None:
    """The pooling sentence embeddings use: `override` (POOLINGS) unless it is "model", else
    the model's own `pooling_type` (mean, cls or last); None when the model pools nothing."""
    if override != "model":
        if override not in POOLINGS:
            raise ConfigError(f"pooling {override!r} is not one of {', '.join(POOLINGS)}. "
                              "Hint: fix models.NAME.pooling.")
        return override
    return _POOLING_TYPES.get(pooling_type)


def llamacpp_budget_bytes(facts: ModelFacts, max_batch: int, context: int, *,
                          overhead_bytes: int = 0, embeddings: bool = False) -> int:
    """Bytes a llama.cpp runner holds resident: the weights as stored, the KV cache (f16
    cells, `max_batch` sequences of `context` tokens, sliding-window layers their window),
    the compute buffer a decode of up to BATCH_TOKENS touches, the logits of each slot's
    prompt end (float32, kept for the prompt cache's whole-prompt hits), `overhead_bytes` for the
    process itself, and with `embeddings` (the model can embed: it pools) the embedding
    context its first embedding request creates (`llamacpp_embed_bytes`)."""
    kv = facts.kv_bytes(context, sequences=max_batch)
    # measured on SmolLM2-135M (49,152 tokens) and Gemma 3 270M (262,144) at max_batch 2 and 8:
    # the compute buffer, logits and outputs grow with the vocabulary and the batch
    compute = (32 << 20) + (2 << 20) * max_batch + 256 * facts.vocab_size
    compute += 4 * facts.vocab_size * max_batch  # a prompt's last logits row per slot
    embed = llamacpp_embed_bytes(facts, context) if embeddings else 0
    return facts.tensor_bytes + kv + compute + embed + overhead_bytes


def embed_batch_tokens(vocab_size: int) -> int:
    """Tokens per decode of a llama.cpp embedding context (see EMBED_LM_HEAD_BYTES)."""
    lo, hi = EMBED_BATCH_TOKENS
    return max(lo, min(hi, EMBED_LM_HEAD_BYTES // max(1, 8 * vocab_size)))


def llamacpp_embed_bytes(facts: ModelFacts, context: int) -> int:
    """The embedding context of a llama.cpp runner: its own KV cache (one sequence of
    `context` tokens) and compute and output buffers for `embed_batch_tokens` tokens, every
    one with its LM-head row (measured on Gemma 3 270M: 78 MiB at context 512)."""
    return (facts.kv_bytes(context) + 8 * embed_batch_tokens(facts.vocab_size)
            * facts.vocab_size + (8 << 20))
