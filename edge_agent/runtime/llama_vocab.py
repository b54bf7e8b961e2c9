"""A model's own vocabulary, through llama.cpp: tokenization for the llama.cpp engine.

The control plane tokenizes (and journals) a request before it is accepted, with a vocab-only
load of the same GGUF the runner serves: SPM, BPE, WPM and UGM vocabularies, every
pre-tokenizer llama.cpp knows, its special-token handling. The object offers what the daemon
needs of a tokenizer (`encode`, `decode`, `token_bytes` for `IncrementalDecoder`, the
end-of-generation ids, `apply_chat_template`), the same surface as `runtime/tokenizer.py`'s
`Tokenizer`, which stays the numpy engine's.

Invariants owned here:
- `token_bytes(t)` is the exact byte string llama.cpp's detokenizer gives that token inside a
  text (`llama_token_to_piece`, no leading-space strip, control tokens rendered as nothing),
  so the concatenation of a generation's pieces is what llama-server streams.
- `encode(text)` tokenizes as llama-server tokenizes a prompt: the vocabulary's own BOS rule
  (`add_bos=None`), special-token text NOT parsed (a user's text cannot forge control tokens);
  a rendered chat template is tokenized with special tokens parsed (its markers are the
  template's, not the user's).
- The library is initialised once per process (`llama_lib()`); llama.cpp's log is filtered to
  warnings and errors.
"""

from __future__ import annotations

import collections
import contextlib
import ctypes
import hashlib
import importlib
import importlib.util
import logging
import os
import signal
import sys
import threading
import types
from collections.abc import Iterable, Iterator, Mapping, Sequence
from functools import cached_property, lru_cache
from pathlib import Path
from typing import Any

from edge_agent.errors import EdgeAgentError, ModelFileError

__all__ = ["LlamaVocab", "VOCAB_TYPES", "check_gguf", "gguf_stamp", "llama_available",
           "llama_lib", "model_meta", "recent_errors", "sigint_after_call"]

VOCAB_TYPES = {0: "none", 1: "spm", 2: "bpe", 3: "wpm", 4: "ugm", 5: "rwkv", 6: "plamo2"}
_ATTR_CONTROL = 1 << 3  # LLAMA_TOKEN_ATTR_CONTROL


class LlamaUnavailable(EdgeAgentError):
    """llama-cpp-python is not installed or its library cannot be loaded."""


_BINDINGS_LOCK = threading.Lock()


def _bindings() -> Any:
    """llama-cpp-python's ctypes module (`llama_cpp.llama_cpp`) without running the package's
    `__init__`, which also imports its high-level API (`llama.py`: jinja2, diskcache, numpy,
    its chat formats). The engine and the vocabulary use only the C API; measured here, the
    package's import takes 0.17 s against 0.07 s for the bindings and numpy, and a served
    SmolLM2 runner holds 4 MiB less without it (PSS 341 against 345 MiB). The package stands
    in `sys.modules` with a module `__getattr__` (PEP 562): the first name asked of it that the
    bindings did not set (`llama_cpp.Llama`, `__version__`) runs the real `__init__` in its
    namespace, so code that uses the high-level API afterwards works unchanged."""
    with _BINDINGS_LOCK:
        if "llama_cpp" not in sys.modules:
            spec = importlib.util.find_spec("llama_cpp")
            if spec is None or spec.origin is None or spec.submodule_search_locations is None:
                raise ImportError("No module named 'llama_cpp'")
            pkg = types.ModuleType("llama_cpp")
            pkg.__spec__, pkg.__file__, pkg.__loader__ = spec, spec.origin, spec.loader
            pkg.__path__ = list(spec.submodule_search_locations)
            pkg.__package__ = "llama_cpp"
            origin = spec.origin

            def complete(name: str) -> Any:
                ns = pkg.__dict__
                if ns.pop("__getattr__", None) is not None:  # once: run the real __init__
                    with open(origin, "rb") as fh:
                        exec(compile(fh.read(), origin, "exec"), ns)  # noqa: S102
                    if _log_state["callback"] is not None:  # its _logger took llama.cpp's log
                        ns["llama_cpp"].llama_log_set(_log_state["callback"], ctypes.c_void_p(0))
                if name in ns:
                    return ns[name]
                raise AttributeError(f"module 'llama_cpp' has no attribute {name!r}")

            pkg.__dict__["__getattr__"] = complete
            sys.modules["llama_cpp"] = pkg
        return importlib.import_module("llama_cpp.llama_cpp")


@lru_cache(maxsize=1)
def llama_lib() -> Any:
    """The llama_cpp ctypes module, initialised once (backend, log level)."""
    try:
        lib = _bindings()
    except (ImportError, OSError) as exc:
        raise LlamaUnavailable(
            f"the llama.cpp engine needs llama-cpp-python, which could not be imported ({exc}). "
            "Hint: `make run` builds and installs it; or set runtime.engine = \"numpy\"."
        ) from exc
    lib.llama_log_set(_LOG_CALLBACK(lib), ctypes.c_void_p(0))
    lib.llama_backend_init()
    return lib


_LOG = logging.getLogger("edge_agent.llama")
# ggml_log_level (ggml.h): NONE 0, DEBUG 1, INFO 2, WARN 3, ERROR 4, CONT 5 (continues the line)
_GGML_LEVELS = {0: logging.CRITICAL, 1: logging.DEBUG, 2: logging.INFO, 3: logging.WARNING,
                4: logging.ERROR}
_log_state: dict[str, Any] = {"level": logging.INFO, "callback": None}
_recent_errors: collections.deque[str] = collections.deque(maxlen=4)


def recent_errors() -> str:
    """llama.cpp's last error lines ("" when none), for an error message; then forgets them."""
    text = "; ".join(_recent_errors)
    _recent_errors.clear()
    return text


def gguf_stamp(path: str | Path) -> str:
    """Which file `path` is now (device, inode, size, mtime): equal stamps, same bytes."""
    st = os.stat(path)
    return f"{st.st_dev}:{st.st_ino}:{st.st_size}:{st.st_mtime_ns}"


def check_gguf(path: str | Path, checked: str = "") -> None:
    """Our own header check before llama.cpp sees the file: not a file, not a GGUF, a
    truncated or corrupt header get an error naming the path and what is wrong. `checked`:
    the `gguf_stamp` of the file a header parse already accepted (the control plane's, before
    it starts the runner); the same file is not parsed again (~0.04 s for a 49k vocabulary)."""
    from edge_agent.runtime.gguf import GGUFFile

    if checked:
        with contextlib.suppress(OSError):  # gone: the parse below says so
            if gguf_stamp(path) == checked:
                return

    with GGUFFile(path, string_arrays=False):  # checked, not built: llama.cpp reads them
        pass


@contextlib.contextmanager
def sigint_after_call() -> Iterator[None]:
    """Ctrl-C during a llama.cpp call that logs (a model load, a context's creation) raised
    KeyboardInterrupt inside our log callback, where ctypes prints it and drops it: the load
    went on and the command ran to its end. In the main thread with Python's own SIGINT
    handler, this keeps the signal for after the call and raises KeyboardInterrupt then;
    elsewhere (a thread, a process with its own handler) it changes nothing."""
    if (threading.current_thread() is not threading.main_thread()
            or signal.getsignal(signal.SIGINT) is not signal.default_int_handler):
        yield
        return
    hit: list[int] = []
    previous = signal.signal(signal.SIGINT, lambda signum, _frame: hit.append(signum))
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, previous)
    if hit:
        raise KeyboardInterrupt


def _LOG_CALLBACK(lib: Any) -> Any:
    """llama.cpp's (and ggml's) log as records of the `edge_agent.llama` logger; its INFO
    chatter (model loading, graph sizes) shows only when that logger is set to INFO."""

    def forward(level: int, text: bytes, _user: Any) -> None:
        lvl = _log_state["level"] if level == 5 else _GGML_LEVELS.get(level, logging.INFO)
        _log_state["level"] = lvl
        if _LOG.isEnabledFor(lvl):
            msg = text.decode("utf-8", "replace").rstrip("\n")
            if msg:
                _LOG.log(lvl, "llama.cpp: %s", msg)
        if lvl >= logging.ERROR:
            _recent_errors.append(text.decode("utf-8", "replace").strip())

    if _LOG.level == logging.NOTSET:
        _LOG.setLevel(logging.WARNING)
    cb = lib.llama_log_callback(forward)
    _log_state["callback"] = cb  # kept alive for as long as the library may call it
    return cb


def llama_available() -> bool:
    try:
        llama_lib()
    except LlamaUnavailable:
        return False
    return True


def model_meta(model: Any) -> dict[str, str]:
    """Every metadata key of a loaded llama model, as strings (llama.cpp's rendering)."""
    lib = llama_lib()
    out: dict[str, str] = {}
    key = ctypes.create_string_buffer(512)
    for i in range(int(lib.llama_model_meta_count(model))):
        if lib.llama_model_meta_key_by_index(model, i, key, len(key)) < 0:
            continue
        n = lib.llama_model_meta_val_str_by_index(model, i, None, 0)
        if n < 0:
            continue
        val = ctypes.create_string_buffer(n + 1)
        lib.llama_model_meta_val_str_by_index(model, i, val, n + 1)
        out[key.value.decode("utf-8", "replace")] = val.value.decode("utf-8", "replace")
    return out


class LlamaVocab:
    """The vocabulary of one GGUF as llama.cpp reads it."""

    def __init__(self, model: Any, *, source: str, owned: bool) -> None:
        lib = llama_lib()
        self._lib = lib
        self._model = model
        self._owned = owned
        self.source = source
        self._vocab = lib.llama_model_get_vocab(model)
        v = self._vocab
        self.vocab_size = int(lib.llama_vocab_n_tokens(v))
        self.vocab_type = VOCAB_TYPES.get(int(lib.llama_vocab_type(v)), "unknown")
        self.bos_id = int(lib.llama_vocab_bos(v))
        self.eos_id = int(lib.llama_vocab_eos(v))
        self.add_bos = bool(lib.llama_vocab_get_add_bos(v))
        self.eog_ids = frozenset(t for t in range(self.vocab_size) if lib.llama_vocab_is_eog(v, t))
        self._bytes: list[bytes | None] = [None] * self.vocab_size
        self.meta = model_meta(model)
        self._template: Any = None
        self._template_error: EdgeAgentError | None = None
        self._template_source = source  # what template errors name: the GGUF, or the file
        self._turn_end: list[int] | None = None

    @classmethod
    def load(cls, path: str | Path, *, checked: str = "") -> LlamaVocab:
        """A vocab-only load of the GGUF at `path` (no weights are read); `checked`: as for
        check_gguf."""
        check_gguf(path, checked)
        lib = llama_lib()
        params = lib.llama_model_default_params()
        params.vocab_only = True
        with sigint_after_call():
            model = lib.llama_model_load_from_file(str(path).encode(), params)
        if not model:
            raise ModelFileError(
                f"{path}: llama.cpp could not read this GGUF's vocabulary "
                f"({recent_errors() or 'no reason given'}). Hint: check that the file is a "
                "complete GGUF of an architecture llama.cpp supports.")
        vocab = cls(model, source=str(path), owned=True)
        vocab.special_ids  # noqa: B018 - now, in the loading thread, not at the first request
        return vocab

    @classmethod
    def from_model(cls, model: Any, *, source: str) -> LlamaVocab:
        """The vocabulary of a model the caller owns (an engine's loaded model)."""
        return cls(model, source=source, owned=False)

    @cached_property
    def special_ids(self) -> frozenset[int]:
        """The control tokens (detokenizing skips them; grammars never emit them). Read at
        first use on an engine's vocabulary: a runner's start does not wait for 49k calls."""
        v = self._vocab
        return frozenset(t for t in range(self.vocab_size)
                         if int(self._lib.llama_vocab_get_attr(v, t)) & _ATTR_CONTROL)

    def close(self) -> None:
        if self._owned and self._model:
            self._lib.llama_model_free(self._model)
        self._model = None

    def __del__(self) -> None:
        try:
            self.close()
        except Exception:  # noqa: BLE001 - interpreter shutdown
            pass

    # -- ids <-> text -----------------------------------------------------------------------------
    def _check_id(self, token_id: int) -> int:
        if not 0 <= token_id < self.vocab_size:
            raise EdgeAgentError(f"token id {token_id} is outside the vocabulary "
                                 f"0..{self.vocab_size - 1} of {self.source}. Hint: pass ids "
                                 "this model's tokenizer produced.")
        return token_id

    def tokenize(self, text: str, *, add_bos: bool, parse_special: bool) -> list[int]:
        data = text.encode("utf-8", "surrogatepass")
        n_max = len(data) + 8
        while True:
            buf = (ctypes.c_int32 * n_max)()
            n = self._lib.llama_tokenize(self._vocab, data, len(data), buf, n_max, add_bos,
                                         parse_special)
            if n >= 0:
                return list(buf[:n])
            n_max = -n

    def encode(self, text: str, *, add_bos: bool | None = None) -> list[int]:
        """Token ids of `text` (special-token text is plain text); BOS by the vocabulary's own
        rule unless `add_bos` says otherwise."""
        return self.tokenize(text, add_bos=self.add_bos if add_bos is None else add_bos,
                             parse_special=False)

    def token_bytes(self, token_id: int) -> bytes:
        cached = self._bytes[self._check_id(token_id)]
        if cached is not None:
            return cached
        raw = self._piece(token_id, special=False)
        self._bytes[token_id] = raw
        return raw

    def _piece(self, token_id: int, *, special: bool) -> bytes:
        """llama.cpp's bytes for one (checked) id; `special`: control tokens as their text."""
        buf = ctypes.create_string_buffer(64)
        n = self._lib.llama_token_to_piece(self._vocab, token_id, buf, len(buf), 0, special)
        if n < 0:
            buf = ctypes.create_string_buffer(-n)
            n = self._lib.llama_token_to_piece(self._vocab, token_id, buf, len(buf), 0, special)
        return buf.raw[:n]

    def token_text(self, token_id: int) -> str:
        text: bytes = self._lib.llama_vocab_get_text(self._vocab, self._check_id(token_id))
        return text.decode("utf-8", "replace")

    def decode(self, ids: Iterable[int], *, skip_special: bool = False) -> str:
        return b"".join(self.token_bytes(t) for t in ids
                        if not (skip_special and t in self.special_ids)).decode("utf-8",
                                                                                 "replace")

    def detokenize(self, ids: Iterable[int]) -> str:
        """Text of the ids with control tokens as their text (`<|im_start|>`), as
        llama-server's /detokenize gives it; `decode` renders them as nothing, as a
        completion's text does."""
        return b"".join(self._piece(self._check_id(t), special=True)
                        for t in ids).decode("utf-8", "replace")

    @property
    def fingerprint(self) -> str:
        h = hashlib.sha256()
        for key in sorted(self.meta):
            if key.startswith("tokenizer."):
                h.update(f"{key}={self.meta[key]}\n".encode())
        return h.hexdigest()[:16]

    # -- chat ---------------------------------------------------------------------------------
    @property
    def chat_template(self) -> Any:
        """The GGUF's chat template (`runtime/chat_template.py`), or None when it has none."""
        if self._template is None and self._template_error is None:
            from edge_agent.runtime.chat_template import GGUFChatTemplate

            try:
                self._template = GGUFChatTemplate.from_metadata(
                    self._template_meta(), source=self._template_source)
            except EdgeAgentError as exc:
                self._template_error = exc
        return self._template

    def use_template_file(self, path: Path) -> None:
        """Render chats with the Jinja template in `path` instead of the GGUF's own
        (`models.NAME.chat_template_file`); ModelFileError naming the file when it cannot be
        read or compiled, so the model does not load with a template it cannot render."""
        from edge_agent.runtime.chat_template import TEMPLATE_KEY

        try:
            text = path.read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError) as exc:
            raise ModelFileError(f"{path}: cannot read this chat template file ({exc}). Hint: "
                                 "point models.NAME.chat_template_file at a readable UTF-8 "
                                 "Jinja file.") from exc
        meta = {k: v for k, v in self.meta.items() if not k.startswith(TEMPLATE_KEY)}
        meta[TEMPLATE_KEY] = text
        self.meta = meta
        self._template, self._template_error, self._turn_end = None, None, None
        self._template_source = str(path)
        if self.chat_template is None:
            assert self._template_error is not None
            raise ModelFileError(str(self._template_error))

    def _template_meta(self) -> Mapping[str, Any]:
        meta: dict[str, Any] = dict(self.meta)
        meta["tokenizer.ggml.bos_token_id"] = self.bos_id
        meta["tokenizer.ggml.eos_token_id"] = self.eos_id
        meta["tokenizer.ggml.tokens"] = _TokenTexts(self)
        return meta

    @property
    def chat_note(self) -> str:
        return "" if self._template_error is None else str(self._template_error)

    def apply_chat_template(self, messages: Sequence[Mapping[str, Any]], *,
                            add_generation_prompt: bool = True, **extra: Any) -> list[int]:
        template = self.chat_template
        if template is None:
            assert self._template_error is not None
            raise self._template_error
        text = template.render(list(messages), add_generation_prompt=add_generation_prompt,
                               **extra)
        return self.tokenize(text, add_bos=False, parse_special=True)


    def turn_end_ids(self) -> list[int]:
        """What the template writes after an assistant's reply (`<|im_end|>` + newline for
        ChatML, `<end_of_turn>` + newline for Gemma): a session's history closes each turn with
        it, as the template would render the conversation. [] without a template."""
        if self._turn_end is None:
            template = self.chat_template
            if template is None:
                return []
            mark = "\ue000edge-agent-reply\ue000"
            text = template.render([{"role": "user", "content": "x"},
                                    {"role": "assistant", "content": mark}],
                                   add_generation_prompt=False)
            tail = text[text.index(mark) + len(mark):] if mark in text else ""
            self._turn_end = self.tokenize(tail, add_bos=False, parse_special=True)
        return list(self._turn_end)


class _TokenTexts(Sequence[str]):
    """`tokenizer.ggml.tokens` as a lazy sequence over llama.cpp's vocabulary (for bos/eos text)."""

    def __init__(self, vocab: LlamaVocab) -> None:
        self._v = vocab

    def __len__(self) -> int:
        return self._v.vocab_size

    def __getitem__(self, i: Any) -> Any:
        if isinstance(i, slice):
            return [self._v.token_text(j) for j in range(*i.indices(len(self)))]
        return self._v.token_text(int(i))
