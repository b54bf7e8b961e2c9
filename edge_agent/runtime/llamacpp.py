"""The llama.cpp engine: any GGUF llama.cpp loads, driven through llama-cpp-python's C API.

The runner drives it exactly as it drives the numpy engine (`runtime/engine.py`): `add_many`
(prefill new sequences, one token each back), `step` (one batched decode over any subset of the
active sequences), `release`, `close`, `describe`. Compute is llama.cpp's own (its quantized
kernels, its KV cache); sampling stays ours (`runtime/sampling.py`, Philox keyed by (seed,
generation index)), so a request resumed on either engine draws the same numbers.

Invariants owned here:
- One llama context per engine, created for `max_batch` sequences of `context` tokens each
  (`n_seq_max = max_batch`, `n_ctx = context * max_batch`, a per-sequence KV cache): a sequence
  holds one llama.cpp `seq_id` (a slot) from `add` to `release`.
- The prompt cache: a released slot keeps its KV cells and remembers the tokens they hold
  (prompt + fed tokens; checked against the cache's last position). `add` takes the free slot
  whose remembered tokens share the longest common prefix with the new prompt (llama-server's
  slot selection by LCP), removes the cells after that prefix and prefills the rest only; at
  least one token is decoded (its logits give the first token), except on a whole-prompt hit:
  a slot keeps the logits of its prompt's last row, and the same prompt again (a retry, a
  regenerated reply) takes its cells and those logits, and decodes nothing. On a batch-invariant
  model (`exact_reuse`, measured by `batch_invariance`) only cells a prefill wrote are reused,
  in whole BATCH_TOKENS pieces, so a hit gives the same tokens as a cold prefill; on others
  every held cell is (their tokens may already differ with the batch). A slot is reused by
  prefix only when the prefix keeps at least half of what it holds (a shared system prompt
  does not cut a long conversation's cache); otherwise the free slot next to the most busy
  ones, then an empty one, then the least recently released one, is cleared. The memory is
  the slots that exist and a logits row each.
- Sliding-window models (`llama_model_n_swa` > 0, `swa_full` off) keep only the window in
  their SWA layers: cells after the prefix are removed only when the window before it is
  still held (llama-server's `pos_min` check); else the slot is cleared. Appending to what a
  slot holds is always safe.
- `step` is all-or-nothing: every argument is checked before `llama_decode`; a failed decode
  advances no sequence. A sequence never grows past `context` tokens.
- Every token of one `llama_decode` call belongs to exactly one sequence; logits are requested
  only where a token is sampled (the last prompt token of an added sequence, every stepped
  token), and read back in batch order.
- `decode = "alone"`: a `llama_decode` call holds the rows of one sequence only (a step is one
  call per sequence, a prefill chunk one call per sequence in it), so llama.cpp picks its
  kernels from that sequence alone and a request's tokens never depend on its company. A call
  that fails removes the cells the step's earlier calls wrote, so the step stays
  all-or-nothing.
- Weights stay where llama.cpp puts them (the GGUF mapped, repacked copies in anonymous memory);
  pinning (`mlock` policy) locks exactly those: the file's mapping and the anonymous regions
  the model load created (seen in /proc/self/maps before and after), before the context (KV
  cache, compute buffers) exists; the report reads VmLck back (>= the weights' bytes). A runner
  loads one model in a fresh process, where those copies get regions of their own; in a process
  that loaded and freed other engines the allocator may reuse memory it holds, and such copies
  are not found (the file's mapping still is).
- The llama.cpp library is initialised once per process; its log goes to Python `logging`
  (logger `edge_agent.llama`), warnings and errors only.
- `embed` never touches the generation context: sentence vectors come from a second llama
  context (embeddings on, one sequence of `context` tokens, `embed_batch_tokens` per decode),
  created at the first `embed` and emptied after each input. It takes every token's final
  normed hidden state (llama.cpp's pooling "none") and pools them here as llama.cpp's
  mean/cls/last pooling does, because llama.cpp pools only within one decode: its own pooling
  would need the whole input in one decode, whose LM-head outputs cost vocab x 8 bytes a token.
  Vectors are L2-normalized (llama-server's /v1/embeddings default).
"""

from __future__ import annotations

import contextlib
import ctypes
import hashlib
import itertools
import json
import logging
import os
import time
from collections.abc import Callable, Generator, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from edge_agent.errors import EdgeAgentError, ModelFileError
from edge_agent.runtime import memlock
from edge_agent.runtime.constrain import Constraints
from edge_agent.runtime.engines import embed_batch_tokens, embedding_pooling, write_cache_json
from edge_agent.runtime.llama_vocab import (
    LlamaVocab,
    check_gguf,
    llama_lib,
    model_meta,
    recent_errors,
    sigint_after_call,
)
from edge_agent.runtime.prefill_groups import NewSeq
from edge_agent.runtime.sampling import SamplingParams, TokenLogprobs, sample_rows_with_logprobs

__all__ = ["LlamaCppEngine", "LlamaCppError", "common_prefix", "default_threads",
           "snapshot_tokens"]

log = logging.getLogger(__name__)

BATCH_TOKENS = 512  # tokens per llama_decode call while prefilling (llama.cpp's n_batch)
# llama.cpp's CPU flash attention takes its tiled kernel when one sequence has this many query
# rows in a compute (GGML_FA_TILE_Q in ggml-cpu), and other bits come out than row by row
FA_TILE_ROWS = 64
# the batch-invariance probe's prompt when none is given (the runner's): real text, as a
# lone BOS hides the difference (measured: Gemma 3's logits after BOS alone are the same with
# 1, 2, 4 and 8 rows in the step, after this prompt they are not)
PROBE_TEXT = "Once upon a time, in a village by the sea, there lived"
# How sequences share llama_decode calls. batched: a step decodes every stepped sequence in one
# call (llama-server's way); alone: one call per sequence, so no sequence's arithmetic depends
# on what else runs (exact on every model, at the cost of batching's throughput).
DECODE_MODES = ("batched", "alone")


class LlamaCppError(EdgeAgentError):
    """llama.cpp refused a model, a context or a batch; the message says which and why."""


def default_threads() -> int:
    """The cores this process may use: its CPU affinity, capped by the cgroup's cpu.max."""
    try:
        cores = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        cores = os.cpu_count() or 1
    quota = _cgroup_cpu_quota(Path("/proc/self/cgroup"), Path("/sys/fs/cgroup"))
    if quota is not None:
        cores = min(cores, max(1, int(quota + 0.5)))
    return max(1, cores)


def _cgroup_cpu_quota(proc_cgroup: Path, root: Path) -> float | None:
    """CPUs allowed by cpu.max along this process's cgroup v2 path (None: no limit known)."""
    try:
        line = next(ln for ln in proc_cgroup.read_text().splitlines() if ln.startswith("0::"))
    except (OSError, StopIteration):
        return None
    rel = Path(line[3:].strip().lstrip("/"))
    best: float | None = None
    for d in [root / rel, *[root / p for p in rel.parents]]:
        try:
            quota, period = (d / "cpu.max").read_text().split()[:2]
        except (OSError, ValueError):
            continue
        if quota != "max":
            cpus = int(quota) / int(period)
            best = cpus if best is None else min(best, cpus)
    return best


def _regions(maps: Path = Path("/proc/self/maps")) -> list[tuple[int, int, str]]:
    """(start, end, path) of this process's mappings ("" for anonymous memory)."""
    out = []
    for line in maps.read_text().splitlines():
        parts = line.split(None, 5)
        rng = parts[0].split("-")
        out.append((int(rng[0], 16), int(rng[1], 16), parts[5] if len(parts) > 5 else ""))
    return out


@dataclass
class _Seq:
    slot: int
    params: SamplingParams
    last: int  # last sampled token, fed by the next step
    generated: int  # tokens sampled so far (the next one is generation index `generated`)
    kv: list[int] = field(default_factory=list)  # the tokens the KV cells hold, in order
    cached: int = 0  # tokens of the prompt (+ resumed tokens) the prompt cache gave at add
    prefilled: int = 0  # leading cells a prefill wrote (the rest: one decode step each)
    end: np.ndarray | None = None  # the prompt's last logits (added without generated tokens)

    @property
    def length(self) -> int:
        """Tokens in the KV cache (prompt + fed tokens)."""
        return len(self.kv)

    def history(self) -> list[int]:
        """The penalty window's source, prompt + sampled tokens (empty: no penalty asked)."""
        return [*self.kv, self.last] if self.params.penalized else []


VERDICTS_KEPT = 32  # batch-invariance verdicts a cache file keeps (the newest)


def _cpu_features() -> str:
    """The CPU's model and feature flags as /proc/cpuinfo gives them (its first processor)."""
    keep = ("model name", "flags", "features", "cpu implementer", "cpu part")
    lines: list[str] = []
    with contextlib.suppress(OSError):
        for line in Path("/proc/cpuinfo").read_text(errors="replace").splitlines():
            if not line.strip() and lines:
                break  # the first processor's block
            name = line.split(":", 1)[0].strip().lower()
            if name in keep:
                lines.append(line.strip())
    return "\n".join(lines)


def _read_verdicts(path: Path) -> dict[str, Any]:
    """The verdicts of a cache file; {} when it is missing or not one (then it is rewritten)."""
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError):
        return {}
    verdicts = data.get("verdicts") if isinstance(data, dict) else None
    return verdicts if isinstance(verdicts, dict) else {}


def _write_verdict(path: Path, key: str, verdict: bool) -> None:
    """Add `key`'s verdict to the cache file (atomically; a failure costs the next probe)."""
    verdicts = {k: v for k, v in _read_verdicts(path).items() if k != key}
    verdicts[key] = verdict
    kept = dict(list(verdicts.items())[-VERDICTS_KEPT:])
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        write_cache_json(path, {"verdicts": kept})
    except OSError as exc:
        log.warning("batch-invariance cache %s not written (%s); the next load probes again",
                    path, exc)


def _prefill_chunks(spans: list[tuple[int, list[int]]]) -> Iterator[list[tuple[int, int, int]]]:
    """(sequence index, position, token) rows of each llama_decode call prefilling `spans`
    (per sequence: first position to prefill, its tokens). A sequence's rows are cut at
    absolute positions that are multiples of BATCH_TOKENS, and a piece is never split over
    two calls: a prompt's cells are computed in the same pieces whether its head came from
    the prompt cache (cut at such a multiple) or not, so a hit gives the same bits.

    A piece of FA_TILE_ROWS rows or more is decoded alone. With one KV stream per sequence,
    llama.cpp computes a call in parts holding as many rows of each sequence (`split_equal`),
    so next to a shorter prompt the head of a long piece would be computed row by row and its
    rest by the tiled kernel, and its cells would differ from those of the piece alone."""
    chunk: list[tuple[int, int, int]] = []
    for k, (start, ids) in enumerate(spans):
        pos = start
        while pos < len(ids):
            end = min(len(ids), (pos // BATCH_TOKENS + 1) * BATCH_TOKENS)
            piece = [(k, p, ids[p]) for p in range(pos, end)]
            pos = end
            if len(piece) >= FA_TILE_ROWS:
                if any(row[0] == k for row in chunk):  # this sequence's earlier piece first
                    yield chunk
                    chunk = []
                yield piece
                continue
            if len(chunk) + len(piece) > BATCH_TOKENS:
                yield chunk
                chunk = []
            chunk += piece
    if chunk:
        yield chunk


SNAPSHOT_MAGIC = b"EAKV1\n"  # a snapshot blob: magic, 4-byte header length, JSON header, state


def _tokens_digest(ids: Sequence[int]) -> str:
    return hashlib.sha256(np.asarray(ids, "<i4").tobytes()).hexdigest()


def _snapshot_head(blob: bytes) -> tuple[dict[str, Any], bytes] | None:
    """(header, llama.cpp state) of a snapshot blob, or None when it is not one."""
    if not blob.startswith(SNAPSHOT_MAGIC):
        return None
    at = len(SNAPSHOT_MAGIC)
    size = int.from_bytes(blob[at:at + 4], "big")
    try:
        meta = json.loads(blob[at + 4:at + 4 + size])
    except ValueError:
        return None
    if not isinstance(meta, dict):
        return None
    return meta, blob[at + 4 + size:]


def snapshot_tokens(blob: bytes) -> int:
    """How many leading tokens a `LlamaCppEngine.snapshot` blob holds (0: not a snapshot)."""
    head = _snapshot_head(blob)
    return 0 if head is None else int(head[0].get("tokens", 0))


def common_prefix(a: Sequence[int], b: Sequence[int]) -> int:
    """The number of leading tokens `a` and `b` share."""
    n = min(len(a), len(b))
    if n == 0:
        return 0
    diff = np.flatnonzero(np.asarray(a[:n], np.int64) != np.asarray(b[:n], np.int64))
    return int(diff[0]) if diff.size else n


class LlamaCppEngine:
    """A GGUF loaded by llama.cpp, ready for up to `max_batch` sequences of `context` tokens."""

    name = "llamacpp"

    def __init__(self, path: Path, *, max_batch: int = 8, context: int = 2048,
                 threads: int | None = None, mlock: str = "best-effort",
                 pooling: str = "model", decode: str = "batched", checked: str = "") -> None:
        if decode not in DECODE_MODES:
            raise LlamaCppError(f"decode mode {decode!r} is not valid. Hint: use one of "
                                f"{', '.join(DECODE_MODES)}.")
        if max_batch < 1 or context < 2:
            raise LlamaCppError(f"llama.cpp engine: max_batch {max_batch} and context {context} "
                                "must be >= 1 and >= 2. Hint: fix the model's settings.")
        if mlock not in memlock.MLOCK_POLICIES:
            raise LlamaCppError(f"mlock policy {mlock!r} is not valid. Hint: use one of "
                                f"{', '.join(memlock.MLOCK_POLICIES)}.")
        check_gguf(path, checked)  # `checked`: the control plane's parse accepted this file
        lib = llama_lib()
        self._lib = lib
        self.path = Path(path)
        self.threads = threads or default_threads()
        self.decode = decode
        t0 = time.monotonic()
        mparams = lib.llama_model_default_params()
        mparams.load_mode = 1  # LLAMA_LOAD_MODE_MMAP: the page cache holds the file once
        before = set(_regions())
        with sigint_after_call():  # a Ctrl-C in llama.cpp's log callback would be lost
            model = lib.llama_model_load_from_file(str(self.path).encode(), mparams)
        self._model_load_s = time.monotonic() - t0  # llama.cpp maps with MAP_POPULATE here
        real = os.path.realpath(self.path)
        # the weights: the GGUF's mapping, and anonymous memory the load created (repacked or
        # copied tensors); mapped before the context exists, so KV cache and compute buffers
        # are not among them
        self._weight_regions = sorted(
            (a, b) for a, b, name in _regions()
            if name == real or (name == "" and (a, b, name) not in before))
        self._region_bytes = sum(b - a for a, b in self._weight_regions)
        self._anon_bytes = sum(b - a for a, b, name in _regions()
                               if name == "" and (a, b) in self._weight_regions)
        if not model:
            raise ModelFileError(
                f"{self.path}: llama.cpp could not load this GGUF "
                f"({recent_errors() or 'no reason given'}). Hint: check that the file is a "
                "complete GGUF of an architecture llama.cpp supports.")
        self._model = model
        self.tokenizer = LlamaVocab.from_model(model, source=str(self.path))
        train_ctx = int(lib.llama_model_n_ctx_train(model))
        self.context = min(context, train_ctx) if train_ctx > 0 else context
        self.max_batch = max_batch
        cparams = lib.llama_context_default_params()
        cparams.n_ctx = self.context * max_batch
        cparams.n_batch = BATCH_TOKENS
        cparams.n_ubatch = BATCH_TOKENS
        cparams.n_seq_max = max_batch
        cparams.n_threads = self.threads
        cparams.n_threads_batch = self.threads
        cparams.kv_unified = False
        cparams.swa_full = False  # sliding-window layers keep their window only (llama-server's)
        cparams.no_perf = True
        try:
            with sigint_after_call():
                ctx = lib.llama_init_from_model(model, cparams)
        except KeyboardInterrupt:
            lib.llama_model_free(model)
            raise
        if not ctx:
            lib.llama_model_free(model)
            raise LlamaCppError(
                f"{self.path}: llama.cpp could not create a context for {max_batch} sequences "
                f"of {self.context} tokens ({recent_errors() or 'out of memory?'}). Hint: "
                "lower max_batch or context.")
        self._ctx = ctx
        self._mem = lib.llama_get_memory(ctx)
        self.n_vocab = int(lib.llama_vocab_n_tokens(lib.llama_model_get_vocab(model)))
        self.load_s = time.monotonic() - t0
        self._batch = lib.llama_batch_init(max(BATCH_TOKENS, max_batch), 0, 1)
        self._seqs: dict[str, _Seq] = {}
        self._free_slots = list(range(max_batch))  # least recently released first
        # free slot -> (the tokens its KV cells hold, how many of them a prefill wrote)
        self._held: dict[int, tuple[list[int], int]] = {}
        # held slot -> the logits of the last of its prefilled cells, when those are a whole
        # prompt (added without generated tokens)
        self._ends: dict[int, np.ndarray] = {}
        self.exact_reuse = True  # batch_invariance() measures it; see _reusable
        self._n_swa = int(lib.llama_model_n_swa(model))  # 0: no sliding-window layers
        self._ids = itertools.count()
        self.constraints = Constraints(self.tokenizer, self.n_vocab)  # grammars by sequence
        # the log-probabilities of the last add_many / step, by sequence (those that asked)
        self.last_logprobs: dict[str, TokenLogprobs] = {}
        self.stop_ids: frozenset[int] = frozenset(self.tokenizer.eog_ids)
        self.mlock_policy = mlock
        self.lock: dict[str, Any] | None = None
        meta = model_meta(model)
        arch = meta.get("general.architecture", "")
        declared = meta.get(f"{arch}.pooling_type", "-1")
        self._declared_pooling = int(declared) if declared.lstrip("-").isdigit() else -1
        self.pooling = embedding_pooling(self._declared_pooling, pooling)  # None: no embed
        self._causal = meta.get(f"{arch}.attention.causal", "true") != "false"
        self.n_embd = int(lib.llama_model_n_embd(model))
        self._embed_ctx: Any = None
        self._embed_batch: Any = None
        self.embed_batch = embed_batch_tokens(self.n_vocab)  # tokens per embedding decode

    # -- construction ---------------------------------------------------------------------------
    @classmethod
    def load(cls, model_path: str | os.PathLike[str], *, mlock: str = "best-effort",
             max_batch: int = 8, context: int = 2048, threads: int | None = None,
             pooling: str = "model", decode: str = "batched", checked: str = "",
             **_ignored: Any) -> LlamaCppEngine:
        """Load `model_path` and pin the runner's memory by the `mlock` policy."""
        path = Path(model_path)
        engine = cls(path, max_batch=max_batch, context=context, threads=threads, mlock=mlock,
                     pooling=pooling, decode=decode, checked=checked)
        try:
            engine.pin()
        except BaseException:
            engine.close()
            raise
        return engine

    def pin(self) -> dict[str, Any]:
        """Lock the weights by the policy: the GGUF's mapping and the anonymous memory the
        model load created (weights llama.cpp repacked or copied); the report reads VmLck."""
        weight_bytes = int(self._lib.llama_model_size(self._model))
        env = memlock.memlock_env()
        report: dict[str, Any] = {"policy": self.mlock_policy, "locked": False,
                                  "weight_bytes": weight_bytes, "locked_bytes": 0,
                                  "vmlck_bytes": None, "error": None,
                                  # llama.cpp populates the mapping inside its model load
                                  # (MAP_POPULATE, then repacking): no time of its own
                                  "populate_s": None, "model_load_s": self._model_load_s,
                                  "lock_s": 0.0, "regions": len(self._weight_regions),
                                  "anonymous_bytes": self._anon_bytes,
                                  **env.as_dict()}
        if self.mlock_policy != "off":
            t0 = time.monotonic()
            err = 0
            done = 0
            for start, end in self._weight_regions:
                err = memlock.mlock(start, end - start)
                if err:
                    break
                done += end - start
            report["lock_s"] = time.monotonic() - t0
            report["vmlck_bytes"] = memlock.vmlck_bytes()
            report["locked_bytes"] = done
            if err:
                for start, end in self._weight_regions:
                    memlock.munlock(start, end - start)
                report["locked_bytes"] = 0
                report["vmlck_bytes"] = memlock.vmlck_bytes()
                report["error"] = memlock.lock_failure_message(
                    f"{self.path} (llama.cpp weights)", self._region_bytes, err, env)
                if self.mlock_policy == "required":
                    from edge_agent.errors import MemoryLockError

                    raise MemoryLockError(report["error"])
                log.warning("serving UNLOCKED weights (mlock policy best-effort): "
                            "%s", report["error"])
            else:
                report["locked"] = True
        self.lock = report
        return report

    def close(self) -> None:
        lib = self._lib
        if getattr(self, "_batch", None) is not None:
            lib.llama_batch_free(self._batch)
            self._batch = None
        if getattr(self, "_ctx", None):
            lib.llama_free(self._ctx)
            self._ctx = None
        if getattr(self, "_embed_batch", None) is not None:
            lib.llama_batch_free(self._embed_batch)
            self._embed_batch = None
        if getattr(self, "_embed_ctx", None):
            lib.llama_free(self._embed_ctx)
            self._embed_ctx = None
        if getattr(self, "_model", None):
            lib.llama_model_free(self._model)
            self._model = None
        self._seqs = {}

    def __enter__(self) -> LlamaCppEngine:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- description --------------------------------------------------------------------------
    @property
    def free_blocks(self) -> int:
        """Free sequence slots (each holds `context` tokens of KV cache)."""
        return len(self._free_slots)

    @property
    def active(self) -> list[str]:
        return list(self._seqs)

    def length(self, seq_id: str) -> int:
        return self._get(seq_id).length

    def lock_report(self) -> dict[str, Any] | None:
        """The `pin()` report (policy, locked, VmLck, error), None before pinning."""
        return None if self.lock is None else dict(self.lock)

    def warmup_ids(self) -> list[int]:
        """A one-token prompt for the warm-up forward."""
        bos = self.tokenizer.bos_id
        return [bos if 0 <= bos < self.n_vocab else 0]

    def describe(self) -> dict[str, Any]:
        lib, model = self._lib, self._model
        buf = ctypes.create_string_buffer(256)
        lib.llama_model_desc(model, buf, len(buf))
        meta = model_meta(model)
        arch = meta.get("general.architecture", "")
        return {"engine": self.name, "file": str(self.path), "description": buf.value.decode(),
                "architecture": arch, "parameters": int(lib.llama_model_n_params(model)),
                "weight_bytes": int(lib.llama_model_size(model)),
                "context": self.context, "max_batch": self.max_batch, "threads": self.threads,
                "decode": self.decode, "vocab_type": self.tokenizer.vocab_type,
                "vocab_size": self.n_vocab, "pooling": self.pooling,
                "embedding_length": self.n_embd,
                "prompt_cache": {"slots": self.max_batch, "sliding_window": self._n_swa,
                                 "exact": self.exact_reuse,
                                 "held_tokens": sum(len(t) for t, _ in self._held.values())}}

    # -- step API -------------------------------------------------------------------------------
    def _get(self, seq_id: str) -> _Seq:
        try:
            return self._seqs[seq_id]
        except KeyError:
            raise LlamaCppError(f"engine: no active sequence {seq_id!r} ({len(self._seqs)} "
                                "active). Hint: add() it first; it may have been released."
                                ) from None

    def add(self, seq_id: str, prompt_ids: Sequence[int], params: SamplingParams, *,
            generated: Sequence[int] = ()) -> int:
        tokens, errors = self.add_many([NewSeq(seq_id, prompt_ids, params, generated)])
        if errors:
            raise errors[seq_id]
        return tokens[seq_id]

    def _check_new(self, seq: NewSeq, pending: int) -> list[int]:
        if seq.seq_id in self._seqs:
            raise LlamaCppError(f"engine: sequence {seq.seq_id!r} is already active. Hint: "
                                "release() it first or use a new id.")
        if len(self._seqs) + pending >= self.max_batch:
            raise LlamaCppError(
                f"engine: {len(self._seqs) + pending} sequences active, max_batch is "
                f"{self.max_batch}; cannot add {seq.seq_id!r}. Hint: wait for one to finish or "
                "raise max_batch.")
        ids = [int(i) for i in seq.prompt_ids]
        if not ids:
            raise LlamaCppError(f"engine: sequence {seq.seq_id!r} has an empty prompt. Hint: "
                                "pass at least one token id.")
        done = len(seq.generated)
        ids += [int(i) for i in seq.generated]
        bad = [i for i in ids if not 0 <= i < self.n_vocab]
        if bad:
            raise LlamaCppError(
                f"engine: prompt of {seq.seq_id!r} holds token id {bad[0]} outside the "
                f"vocabulary 0..{self.n_vocab - 1}. Hint: encode text with this model's "
                "tokenizer.")
        bad = [i for i, _ in seq.params.logit_bias if i >= self.n_vocab]
        if bad:
            raise LlamaCppError(
                f"engine: logit_bias of {seq.seq_id!r} names token id {bad[0]} outside the "
                f"vocabulary 0..{self.n_vocab - 1}. Hint: use ids this model's tokenizer gives.")
        if len(ids) >= self.context:
            raise LlamaCppError(
                f"engine: prompt of {seq.seq_id!r} has {len(ids)} tokens"
                + (f" ({done} of them already generated)" if done else "")
                + f"; the context is {self.context} and at least one must remain to generate. "
                "Hint: shorten the prompt or load the model with a larger context.")
        return ids

    def add_many(self, new: Sequence[NewSeq]
                 ) -> tuple[dict[str, int], dict[str, EdgeAgentError]]:
        """Prefill new sequences together (their tokens share llama_decode calls of up to
        BATCH_TOKENS tokens); (first token by id, error by id)."""
        ids_seen = [s.seq_id for s in new]
        if len(set(ids_seen)) != len(ids_seen):
            raise LlamaCppError(f"engine: add_many() got a sequence id twice in {ids_seen!r}. "
                                "Hint: use a new id for each sequence.")
        tokens: dict[str, int] = {}
        errors: dict[str, EdgeAgentError] = {}
        self.last_logprobs = {}
        ready: list[tuple[NewSeq, list[int], int]] = []
        reused: list[int] = []  # per ready sequence: its leading tokens already in the cache
        hits: list[np.ndarray | None] = []  # per ready sequence: the logits of a whole hit
        for seq in new:
            try:
                ids = self._check_new(seq, len(ready))
            except LlamaCppError as exc:
                errors[seq.seq_id] = exc
                continue
            slot, keep, end = self._take_slot(ids, [r[2] for r in ready],
                                              whole=not seq.generated)
            ready.append((seq, ids, slot))
            reused.append(keep)
            hits.append(end)
        if not ready:
            return tokens, errors
        # slot order, so that llama.cpp computes consecutive slots' rows together (see step)
        by_slot = sorted(range(len(ready)), key=lambda k: ready[k][2])
        ready = [ready[k] for k in by_slot]
        reused = [reused[k] for k in by_slot]
        hits = [hits[k] for k in by_slot]
        # a whole-prompt hit: its cells are all there, its first token comes from its logits
        last_row = {k: end for k, end in enumerate(hits) if end is not None}
        # A resumed sequence's prompt is prefilled; its generated tokens are replayed one
        # position per llama_decode, as the steps of the uninterrupted run wrote them: with 64
        # or more rows of one sequence llama.cpp's flash attention takes its tiled kernel, so a
        # prefill of them would write other bits, and the continuation must be the tokens the
        # uninterrupted run gives (a greedy near-tie flips otherwise; docs/engines.md).
        # `prompt_end[k]`: where sequence k's prefill stops.
        prompt_end = [len(r[1]) - len(r[0].generated) for r in ready]
        try:
            spans = [(n, r[1][:end]) for n, r, end in zip(reused, ready, prompt_end, strict=True)]
            for chunk in _prefill_chunks(spans):
                self._decode_rows(chunk, ready, last_row)
            at = [max(n, end) for n, end in zip(reused, prompt_end, strict=True)]
            while True:
                chunk = [(k, at[k], ready[k][1][at[k]]) for k in range(len(ready))
                         if at[k] < len(ready[k][1])]
                if not chunk:
                    break
                self._decode_rows(chunk, ready, last_row)
                for k, _, _ in chunk:
                    at[k] += 1
        except LlamaCppError as exc:
            for seq, _, slot in ready:
                self._clear_slot(slot)
                errors[seq.seq_id] = exc
            return tokens, errors
        order = list(range(len(ready)))
        rows = np.stack([last_row[k] for k in order])  # (B, V)
        self.constraints.mask([ready[k][0].seq_id for k in order], rows)
        sampled, lps = sample_rows_with_logprobs(
            rows, [ready[k][0].params for k in order],
            [len(ready[k][0].generated) for k in order], [ready[k][1] for k in order])
        self.constraints.advance([ready[k][0].seq_id for k in order], sampled)
        for k, token, lp in zip(order, sampled, lps, strict=True):
            seq, ids, slot = ready[k]
            self._free_slots.remove(slot)
            self._seqs[seq.seq_id] = _Seq(slot=slot, params=seq.params, last=int(token),
                                          generated=len(seq.generated) + 1, kv=ids,
                                          cached=reused[k], prefilled=prompt_end[k],
                                          end=None if seq.generated else last_row[k])
            tokens[seq.seq_id] = int(token)
            if lp is not None:
                self.last_logprobs[seq.seq_id] = lp
        return tokens, errors

    def step(self, seq_ids: Sequence[str]) -> dict[str, int]:
        """One batched decode step: feed each sequence's last token, sample the next."""
        if not seq_ids:
            return {}
        if len(set(seq_ids)) != len(seq_ids):
            raise LlamaCppError(f"engine: step() got a sequence twice in {list(seq_ids)!r}. "
                                "Hint: pass each active sequence at most once.")
        seqs = [self._get(s) for s in seq_ids]
        full = [s for s, q in zip(seq_ids, seqs, strict=True) if q.length + 1 > self.context]
        if full:
            raise LlamaCppError(
                f"engine: sequence {full[0]!r} has reached the context of {self.context} "
                "tokens. Hint: release it (finish the request) or load a larger context.")
        self.last_logprobs = {}
        order, logits = self._step_logits(seqs)
        seq_ids = [seq_ids[i] for i in order]
        seqs = [seqs[i] for i in order]
        self.constraints.mask(seq_ids, logits)
        sampled, lps = sample_rows_with_logprobs(
            logits, [q.params for q in seqs], [q.generated for q in seqs],
            [q.history() for q in seqs])
        self.constraints.advance(seq_ids, sampled)
        out: dict[str, int] = {}
        for sid, q, token, lp in zip(seq_ids, seqs, sampled, lps, strict=True):
            q.kv.append(q.last)
            q.last = int(token)
            q.generated += 1
            out[sid] = int(token)
            if lp is not None:
                self.last_logprobs[sid] = lp
        return out

    def _step_logits(self, seqs: list[_Seq]) -> tuple[list[int], np.ndarray]:
        """One decode step of `seqs` (each fed its last token): the order of their rows and
        the logits, (B, V) in that order. Rows go in slot order: llama.cpp splits a step into
        one compute per run of consecutive slots (see _take_slot), and only rows listed in
        that order join their run."""
        order = sorted(range(len(seqs)), key=lambda i: seqs[i].slot)
        return order, self._run([(seqs[i].last, seqs[i].length, seqs[i].slot, True)
                                 for i in order])

    def release(self, seq_id: str) -> None:
        """Forget `seq_id`; its slot keeps the KV cells for the prompt cache (unknown ids are
        ignored)."""
        self.constraints.release(seq_id)
        q = self._seqs.pop(seq_id, None)
        if q is not None:
            self._free_slots.append(q.slot)  # the most recently released: evicted last
            if self._lib.llama_memory_seq_pos_max(self._mem, q.slot) == len(q.kv) - 1:
                self._held[q.slot] = (q.kv, q.prefilled)
                if q.end is not None:
                    self._ends[q.slot] = q.end
            else:  # the cells are not what we think they are: never reuse them
                self._clear_slot(q.slot)

    def cached_tokens(self, seq_id: str) -> int:
        """How many leading tokens of `seq_id`'s prompt (+ resumed tokens) came from the
        prompt cache when it was added (0: prefilled in full)."""
        return self._get(seq_id).cached

    def clear_cache(self) -> None:
        """Forget every free slot's cells (the next adds prefill in full)."""
        for slot in list(self._held):
            self._clear_slot(slot)

    # -- prompt-cache snapshots (a session's KV across a restart) ----------------------------
    def identity(self) -> str:
        """What a snapshot must match to be loaded here: the model (llama.cpp's description,
        parameter count, tensor bytes, the GGUF's size) and the tokens of KV per sequence."""
        buf = ctypes.create_string_buffer(256)
        self._lib.llama_model_desc(self._model, buf, len(buf))
        return (f"{buf.value.decode(errors='replace')}|"
                f"{int(self._lib.llama_model_n_params(self._model))}|"
                f"{int(self._lib.llama_model_size(self._model))}|"
                f"{self.path.stat().st_size}|ctx={self.context}")

    def snapshot(self, tokens: Sequence[int]) -> bytes | None:
        """The KV state of the free slot whose held tokens are a prefix of `tokens` (a
        finished session turn: prompt + fed tokens), as a blob `restore` loads into another
        engine of the same model and context; None when no slot holds such a prefix or none
        of its cells would be reused. With `exact_reuse` only the cells a later add may use
        are kept (the prefilled ones, in whole BATCH_TOKENS pieces; the slot's tail is
        dropped here too, it could never be reused); otherwise every held cell."""
        ids = [int(i) for i in tokens]
        for slot, (held, prefilled) in self._held.items():
            if not held or len(held) > len(ids) or common_prefix(held, ids) != len(held):
                continue
            n = len(held)
            if self.exact_reuse:
                n = min(n, prefilled) // BATCH_TOKENS * BATCH_TOKENS
                if n == 0:
                    return None
                if n < len(held) and self._lib.llama_memory_seq_rm(self._mem, slot, n, -1):
                    held = held[:n]
                    self._held[slot] = (held, min(prefilled, n))
                    if prefilled > n:  # the prompt's last row is cut off
                        self._ends.pop(slot, None)
                else:
                    n = len(held)
            size = int(self._lib.llama_state_seq_get_size(self._ctx, slot))
            buf = (ctypes.c_uint8 * size)()
            got = int(self._lib.llama_state_seq_get_data(self._ctx, buf, size, slot))
            if got == 0:
                return None
            head = json.dumps({"identity": self.identity(), "tokens": n,
                               "prefilled": min(self._held[slot][1], n),
                               "sha256": _tokens_digest(held[:n])}).encode()
            return SNAPSHOT_MAGIC + len(head).to_bytes(4, "big") + head + bytes(buf)[:got]
        return None

    def snapshot_tokens(self, blob: bytes) -> int:
        """How many leading tokens a `snapshot` blob holds (0: not a snapshot)."""
        return snapshot_tokens(blob)

    def restore(self, tokens: Sequence[int], blob: bytes) -> bool:
        """Load a `snapshot` blob into an empty free slot and offer it to the prompt cache as
        holding the first n of `tokens` (n and how many of them a prefill wrote come from the
        blob: `_reusable` keeps its exactness rule). False, with the reason logged, when the
        blob is from another model or context, does not match `tokens`, or no free slot is
        empty; the engine is unchanged then."""
        head = _snapshot_head(blob)
        if head is None:
            log.warning("prompt cache: a snapshot is not one this engine wrote; not restored")
            return False
        meta, state = head
        ids = [int(i) for i in tokens]
        n = int(meta.get("tokens", 0))
        if meta.get("identity") != self.identity():
            log.warning("prompt cache: a snapshot of model %r is not for this model (%r); "
                        "not restored", meta.get("identity"), self.identity())
            return False
        if not 0 < n <= len(ids) or meta.get("sha256") != _tokens_digest(ids[:n]):
            log.warning("prompt cache: a snapshot's %d tokens are not the session's; not "
                        "restored", n)
            return False
        empty = [s for s in self._free_slots if s not in self._held]
        if not empty:
            return False
        slot = empty[0]
        buf = (ctypes.c_uint8 * len(state)).from_buffer_copy(state)
        got = int(self._lib.llama_state_seq_set_data(self._ctx, buf, len(state), slot))
        if got == 0 or self._lib.llama_memory_seq_pos_max(self._mem, slot) != n - 1:
            self._clear_slot(slot)
            log.warning("prompt cache: llama.cpp could not load a snapshot of %d tokens "
                        "(%s); not restored", n, recent_errors() or "no reason given")
            return False
        self._held[slot] = (ids[:n], min(int(meta.get("prefilled", 0)), n))
        self._free_slots.remove(slot)
        self._free_slots.append(slot)  # the most recently restored: evicted last
        return True

    # -- the prompt cache ---------------------------------------------------------------------
    def _take_slot(self, ids: list[int], taken: list[int], *, whole: bool
                   ) -> tuple[int, int, np.ndarray | None]:
        """A free slot for prompt `ids` (not one in `taken`), how many leading tokens of
        `ids` its KV cells already hold (the cells after those are removed) and, on a
        whole-prompt hit, the logits of the prompt's last row.

        `whole`: `ids` is a prompt alone (no resumed tokens), so a slot that was added with
        exactly this prompt gives all of it: its cells and its last row's logits are those a
        prefill of `ids` wrote, bit for bit, whatever shared that prefill's calls on a
        batch-invariant model (a hit cuts off the reply the slot held: this prompt's own)."""
        free = [s for s in self._free_slots if s not in taken]
        if whole:
            for slot in free:
                end = self._ends.get(slot)
                held, n = self._held.get(slot, ((), 0))
                if (end is not None and n == len(ids) and held[:n] == ids
                        and self._swa_keeps(slot, n) == n):
                    if self._cut(slot, n) == n:
                        return slot, n, end
                    break  # its memory could not drop the reply (recurrent state): a miss
        best, keep = -1, 0
        for slot in free:  # least recently released first: ties go to the older slot
            held, prefilled = self._held.get(slot, ((), 0))
            n = common_prefix(held, ids)
            if 2 * n < len(held):  # keeps less than half: a shared system prompt, say
                continue
            n = self._reusable(slot, min(n, len(ids) - 1), prefilled)  # decode >= 1 token
            if n > keep:
                best, keep = slot, n
        if best < 0:
            # No prefix worth keeping. With one KV stream per slot, llama.cpp computes a step
            # once per run of consecutive busy slots (its `split_equal` takes increasing
            # sequence ids only): measured on SmolLM2 at 16 sequences, 65-73 ms a step in
            # one run, 124 ms in random order, 148 ms in 16 runs. So: the slot that joins
            # the most busy neighbours (a hole between two runs first), then an empty slot
            # before one whose cells the prompt cache holds, then the least recently used.
            busy = {q.slot for q in self._seqs.values()} | set(taken)
            rank = {slot: i for i, slot in enumerate(free)}
            best = min(free, key=lambda slot: (-((slot - 1) in busy) - ((slot + 1) in busy),
                                               slot in self._held, rank[slot]))
        return best, self._cut(best, keep), None

    def _cut(self, slot: int, keep: int) -> int:
        """Take `slot` out of the prompt cache keeping its first `keep` cells; how many it
        keeps (0 when its memory cannot drop a tail: recurrent state)."""
        if keep == 0:
            self._clear_slot(slot)
        elif keep < len(self._held[slot][0]):
            if not self._lib.llama_memory_seq_rm(self._mem, slot, keep, -1):
                self._clear_slot(slot)
                keep = 0
        self._held.pop(slot, None)
        self._ends.pop(slot, None)
        return keep

    def _reusable(self, slot: int, keep: int, prefilled: int) -> int:
        """How many of the first `keep` held tokens of `slot` a new sequence may use.

        Exact reuse (`exact_reuse`, the model's tokens do not depend on the batch): only
        cells a prefill wrote, in whole pieces of BATCH_TOKENS (`_prefill_chunks` computes
        every prompt in those pieces), so a hit is bit-identical to a cold prefill; a cell
        a decode step wrote differs in its last bits from one a prefill writes. Otherwise
        every held cell. Cutting a tail off a sliding-window cache needs the window before
        the cut, which the cache may have overwritten (llama-server's `pos_min` check);
        appending is always safe."""
        if self.exact_reuse:
            keep = min(keep, prefilled) // BATCH_TOKENS * BATCH_TOKENS
        return self._swa_keeps(slot, keep)

    def _swa_keeps(self, slot: int, keep: int) -> int:
        """`keep`, or 0 when cutting `slot` after `keep` cells would need sliding-window
        cells its cache no longer holds."""
        held = len(self._held.get(slot, ((), 0))[0])
        if keep <= 0 or self._n_swa == 0 or keep >= held:
            return max(keep, 0)
        pos_min = int(self._lib.llama_memory_seq_pos_min(self._mem, slot))
        return keep if 0 <= pos_min <= max(0, keep - self._n_swa) else 0

    def _clear_slot(self, slot: int) -> None:
        self._lib.llama_memory_seq_rm(self._mem, slot, -1, -1)
        self._held.pop(slot, None)
        self._ends.pop(slot, None)

    def batch_invariance(self, prompt_ids: Sequence[int], *, cache: Path | None = None
                         ) -> bool:
        """Measured, not assumed: does one decode step give a sequence bit-identical logits
        alone and next to 1, 3 and 7 others (as many as max_batch allows)? Some models' kernels
        change with the number of tokens in a step (on x86-64, Gemma 3's K-quant and repacked
        Q4_0 matrix products switch kernels at 2, 4 and 8 rows), so their tokens may depend
        on what shares the batch; llama-family Q4_0/Q4_1/Q8_0 files here do not. Needs free
        slots: call it before serving (the runner does, at warm-up). Sets `exact_reuse`
        (the prompt cache's mode) to the answer and leaves the prompt cache empty.
        `prompt_ids` is the probe's prompt; empty (the runner's call): PROBE_TEXT.

        `cache`: a JSON file of earlier verdicts (the runner's is in the state directory), by
        everything the kernels' choice depends on: the model file, its context and batch,
        the probe prompt, the thread count, llama.cpp's libraries and the CPU's features. A
        verdict found there is taken without the probe (0.2 s of every load, measured)."""
        ids = [int(i) for i in prompt_ids] or self.tokenizer.encode(PROBE_TEXT)
        key = self._probe_key(ids) if cache is not None else ""
        known = _read_verdicts(cache).get(key) if cache is not None else None
        if isinstance(known, bool):
            self.clear_cache()
            self.exact_reuse = known
            return known
        invariant = self._probe_invariance(ids)
        if cache is not None:
            _write_verdict(cache, key, invariant)
        return invariant

    def _probe_key(self, ids: list[int]) -> str:
        lib_dir = Path(getattr(self._lib, "__file__", ".")).parent / "lib"
        libs = []
        for lib in sorted(lib_dir.glob("lib*.so*")):
            with contextlib.suppress(OSError):
                st = lib.stat()
                libs.append([lib.name, st.st_size, st.st_mtime_ns])
        st = self.path.stat()
        parts = [self.identity(), str(self.path.resolve()), st.st_mtime_ns, self.threads,
                 self.max_batch, ids, libs, _cpu_features()]
        if self.decode != "batched":  # (keys written before the mode existed stay valid)
            parts.append(self.decode)
        return hashlib.sha256(json.dumps(parts).encode()).hexdigest()

    def _probe_invariance(self, ids: list[int]) -> bool:
        params = SamplingParams(max_tokens=2)
        rows: list[np.ndarray] = []
        for company in sorted({min(n, self.max_batch - 1) for n in (0, 1, 3, 7)}):
            seqs = [NewSeq("_probe", ids, params)] + [
                NewSeq(f"_probe{k}", [*ids[: 1 + k % len(ids)], 0], params)
                for k in range(company)]
            try:
                self.clear_cache()  # each round prefills afresh, next to its company
                _, errors = self.add_many(seqs)
                if errors:
                    raise next(iter(errors.values()))
                # the rows of one decode step, as step() decodes them (seqs[0] is the probe)
                order, logits = self._step_logits([self._seqs[s.seq_id] for s in seqs])
                rows.append(logits[order.index(0)].copy())
            finally:
                for s in seqs:
                    self.release(s.seq_id)
                self.clear_cache()
        invariant = all(np.array_equal(rows[0], r) for r in rows[1:])
        self.exact_reuse = invariant  # the prompt cache keeps such a model's tokens exact
        return invariant

    # -- sentence embeddings --------------------------------------------------------------------
    def embed(self, token_lists: Sequence[Sequence[int]]) -> np.ndarray:
        """One L2-normalized sentence vector per token list, (N, n_embd) float32, pooled by
        `self.pooling` (mean, cls or last) over the input's final normed hidden states, in
        the embedding context (the generation context's sequences are untouched)."""
        if self.pooling is None:
            raise LlamaCppError(
                f"{self.path}: the model declares no pooling type, so it has no sentence "
                "embedding. Hint: use an embedding model, or set the model's pooling "
                "(mean, cls or last) in its configuration.")
        lists = [[int(i) for i in ids] for ids in token_lists]
        for k, ids in enumerate(lists):
            if not ids:
                raise LlamaCppError(f"engine: embedding input {k} has no tokens. Hint: pass "
                                    "at least one token id.")
            if len(ids) > self.context:
                raise LlamaCppError(
                    f"engine: embedding input {k} has {len(ids)} tokens; the context is "
                    f"{self.context}. Hint: shorten the input or load a larger context.")
            bad = [i for i in ids if not 0 <= i < self.n_vocab]
            if bad:
                raise LlamaCppError(
                    f"engine: embedding input {k} holds token id {bad[0]} outside the "
                    f"vocabulary 0..{self.n_vocab - 1}. Hint: encode text with this model's "
                    "tokenizer.")
        ctx = self._embedding_context()
        mem = self._lib.llama_get_memory(ctx)
        out = np.zeros((len(lists), self.n_embd), np.float32)
        try:
            for k, ids in enumerate(lists):
                total = np.zeros(self.n_embd, np.float64)
                for start in range(0, len(ids), self.embed_batch):
                    chunk = ids[start:start + self.embed_batch]
                    rows = self._embed_decode(ctx, chunk, start)  # (T, n_embd)
                    if self.pooling == "mean":
                        total += rows.sum(axis=0, dtype=np.float64)
                    elif self.pooling == "cls" and start == 0:
                        total = rows[0].astype(np.float64)
                    elif self.pooling == "last" and start + len(chunk) == len(ids):
                        total = rows[-1].astype(np.float64)
                self._lib.llama_memory_clear(mem, True)
                vec = total / len(ids) if self.pooling == "mean" else total
                norm = float(np.sqrt(np.dot(vec, vec)))
                out[k] = vec / norm if norm > 0.0 else vec
        finally:
            self._lib.llama_memory_clear(mem, True)
        return out

    def _embedding_context(self) -> Any:
        """The embedding context, created at the first call (llamacpp_embed_bytes says what
        it holds)."""
        if self._embed_ctx:
            return self._embed_ctx
        if not self._causal:
            raise LlamaCppError(
                f"{self.path}: the model attends both ways (non-causal), so its inputs cannot "
                f"be embedded {self.embed_batch} tokens at a decode. Hint: use llama-server "
                "for encoder-only embedding models.")
        lib = self._lib
        cparams = lib.llama_context_default_params()
        cparams.n_ctx = self.context
        cparams.n_batch = self.embed_batch
        cparams.n_ubatch = self.embed_batch
        cparams.n_seq_max = 1
        cparams.n_threads = self.threads
        cparams.n_threads_batch = self.threads
        cparams.embeddings = True
        # LLAMA_POOLING_TYPE_NONE: every token's state, pooled here (-1, the model's own, when
        # that is none already: llama.cpp warns when a context overrides the model's pooling)
        cparams.pooling_type = 0 if self._declared_pooling > 0 else -1
        # f32 attention: flash attention rounds the queries to f16 (vectors moved by ~2e-3);
        # its memory saving is small at embed_batch queries
        cparams.flash_attn_type = 0
        cparams.swa_full = False
        cparams.no_perf = True
        ctx = lib.llama_init_from_model(self._model, cparams)
        if not ctx:
            raise LlamaCppError(
                f"{self.path}: llama.cpp could not create the embedding context of "
                f"{self.context} tokens ({recent_errors() or 'out of memory?'}). Hint: lower "
                "the model's context.")
        self._embed_ctx = ctx
        self._embed_batch = lib.llama_batch_init(self.embed_batch, 0, 1)
        return ctx

    def _embed_decode(self, ctx: Any, tokens: list[int], pos0: int) -> np.ndarray:
        """Decode `tokens` at positions pos0.. of the embedding context's one sequence; their
        final normed hidden states, (T, n_embd) float32 (a view: use before the next call)."""
        b = self._embed_batch
        for i, tok in enumerate(tokens):
            b.token[i] = tok
            b.pos[i] = pos0 + i
            b.n_seq_id[i] = 1
            b.seq_id[i][0] = 0
            b.logits[i] = 1  # embeddings mode outputs every token
        b.n_tokens = len(tokens)
        rc = self._lib.llama_decode(ctx, b)
        if rc != 0:
            raise LlamaCppError(f"llama_decode of {len(tokens)} token(s) for an embedding "
                                f"returned {rc} ({recent_errors() or 'see the log above'}). "
                                "Hint: retry the request.")
        ptr = self._lib.llama_get_embeddings(ctx)
        return np.ctypeslib.as_array(ptr, shape=(len(tokens), self.n_embd))

    # -- llama.cpp calls ------------------------------------------------------------------------
    def _decode_rows(self, chunk: list[tuple[int, int, int]],
                     ready: Sequence[tuple[NewSeq, list[int], int]],
                     last_row: dict[int, np.ndarray]) -> None:
        """One llama_decode of (sequence index, position, token) rows of sequences being
        added; the logits of a row at the last position of its sequence go to `last_row`."""
        outs = [k for k, pos, _ in chunk if pos == len(ready[k][1]) - 1]
        rows = self._run([(tok, pos, ready[k][2], pos == len(ready[k][1]) - 1)
                          for k, pos, tok in chunk])
        for j, k in enumerate(outs):
            last_row[k] = rows[j].copy()

    def _run(self, rows: list[tuple[int, int, int, bool]]) -> np.ndarray:
        """Decode (token, position, slot, wants logits) rows; the logits of the rows that want
        them, in row order, (n, V) float32. Batched: one llama_decode (a view of llama.cpp's
        buffer, valid until the next call: copy to keep). Alone: one call per slot (a copy);
        if a call fails, the cells the earlier calls wrote are removed and the error raised."""
        if self.decode == "batched" or len({slot for _, _, slot, _ in rows}) < 2:
            self._decode(rows)
            return self._logits(sum(1 for row in rows if row[3]))
        groups: dict[int, list[int]] = {}
        for i, (_, _, slot, _) in enumerate(rows):
            groups.setdefault(slot, []).append(i)
        out_index = {i: n for n, i in enumerate(i for i, row in enumerate(rows) if row[3])}
        result = np.empty((len(out_index), self.n_vocab), np.float32)
        done: list[tuple[int, int]] = []  # (slot, first position) of the calls made
        for slot, idx in groups.items():
            try:
                self._decode([rows[i] for i in idx])
            except LlamaCppError:
                for s, first in done:
                    self._lib.llama_memory_seq_rm(self._mem, s, first, -1)
                raise
            done.append((slot, min(rows[i][1] for i in idx)))
            outs = [i for i in idx if rows[i][3]]
            if outs:
                result[[out_index[i] for i in outs]] = self._logits(len(outs))
        return result

    def _decode(self, rows: list[tuple[int, int, int, bool]]) -> None:
        """One llama_decode of (token, position, slot, wants logits) rows."""
        b = self._batch
        for i, (tok, pos, slot, out) in enumerate(rows):
            b.token[i] = tok
            b.pos[i] = pos
            b.n_seq_id[i] = 1
            b.seq_id[i][0] = slot
            b.logits[i] = 1 if out else 0
        b.n_tokens = len(rows)
        rc = self._lib.llama_decode(self._ctx, b)
        if rc != 0:
            raise LlamaCppError(
                f"llama_decode of {len(rows)} token(s) returned {rc} "
                + ("(no KV cache slot for the batch)" if rc == 1 else "(see the log above)")
                + ". Hint: lower max_batch or context, or retry the request.")

    def _logits(self, n: int) -> np.ndarray:
        """The last decode's `n` output rows, (n, V) float32 (a view: copy to keep)."""
        if n == 0:
            return np.empty((0, self.n_vocab), np.float32)
        ptr = self._lib.llama_get_logits(self._ctx)
        return np.ctypeslib.as_array(ptr, shape=(n, self.n_vocab))

    # -- one-request conveniences (edge-agent generate --local, tests) ------------------------
    def generate(self, prompt_ids: Sequence[int],
                 params: SamplingParams) -> Generator[int, None, None]:
        from edge_agent.runtime.engine import generate

        return generate(self, f"_generate-{next(self._ids)}", prompt_ids, params)

    def stream_text(self, prompt_ids: Sequence[int], params: SamplingParams, *,
                    on_token: Callable[[int], None] | None = None) -> Iterator[str]:
        from edge_agent.runtime.engine import stream_text

        return stream_text(self.tokenizer, self.generate(prompt_ids, params), params.stop,
                           on_token=on_token)
