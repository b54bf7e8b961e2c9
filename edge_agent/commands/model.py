"""`edge-agent model prepare|info|pin`: prepared weights, model facts, and a pinning check.

Data goes to stdout (the prepared path, the info table, or JSON with --json); progress and
diagnostics go to stderr. The progress bar redraws in place on a terminal and prints plain
periodic lines otherwise (logs, pipes, systemd journal).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections import Counter
from collections.abc import Callable
from pathlib import Path
from typing import Any, TextIO

from edge_agent.errors import EXIT_ERROR, EXIT_OK, ModelFileError
from edge_agent.paths import default_model_path
from edge_agent.runtime import memlock
from edge_agent.runtime.engines import ENGINES, resolve_engine
from edge_agent.runtime.gguf import GGUFFile
from edge_agent.runtime.memlock import MLOCK_POLICIES
from edge_agent.runtime.prepared_format import DTYPES, PreparedInfo

# numpy (the prepared weights, dequantization) is imported by the subcommands that use it:
# building this parser is part of every `edge-agent` command, `serve` included

__all__ = ["register", "StderrProgress", "describe_model"]

_MiB = 1024 * 1024


class StderrProgress:
    """A `progress(done, total)` callback drawing `label [####....] done/total MiB, rate`."""

    def __init__(self, label: str, stream: TextIO | None = None, *, interval: float | None = None,
                 clock: Callable[[], float] = time.monotonic, width: int = 30) -> None:
        self.label, self.stream, self.clock, self.width = label, stream or sys.stderr, clock, width
        self.tty = bool(getattr(self.stream, "isatty", lambda: False)())
        self.interval = interval if interval is not None else (0.1 if self.tty else 2.0)
        self._start: float | None = None
        self._last = float("-inf")
        self._finished = False

    def __call__(self, done: int, total: int) -> None:
        now = self.clock()
        if self._start is None:
            self._start = now
        final = done >= total
        if self._finished or (not final and now - self._last < self.interval):
            return
        self._last, self._finished = now, final
        elapsed = now - self._start
        rate = f"{done / _MiB / elapsed:.0f} MiB/s" if elapsed > 0 else "-- MiB/s"
        frac = done / total if total else 1.0
        figures = f"{done / _MiB:.1f}/{total / _MiB:.1f} MiB, {rate}"
        if self.tty:
            filled = int(frac * self.width)
            bar = "#" * filled + "." * (self.width - filled)
            self.stream.write(f"\r{self.label} [{bar}] {figures}" + ("\n" if final else ""))
        else:
            self.stream.write(f"{self.label}: {frac * 100:.0f}% {figures}\n")
        self.stream.flush()


def register(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    parser = sub.add_parser("model", help="prepare weights, show model facts, check pinning",
                            description="Prepare, inspect and pin model weights.")
    msub = parser.add_subparsers(dest="model_command", metavar="ACTION", required=True)

    def common(p: argparse.ArgumentParser, dtype: bool = True) -> None:
        p.add_argument("path", nargs="?", metavar="PATH",
                       help="GGUF model file (default: the installed SmolLM2-135M-Instruct)")
        if dtype:
            p.add_argument("--dtype", choices=tuple(DTYPES), default="f32",
                           help="prepared weights dtype for matrices (default: f32)")
        p.add_argument("--json", action="store_true", help="print one JSON object on stdout")

    p = msub.add_parser("prepare", help="dequantize a GGUF once into a prepared weights file",
                        description="Dequantize a GGUF into <state>/models/<sha256[:16]>-"
                        "<dtype>.weights (4096-aligned tensors); reuses a valid existing file.")
    common(p)
    p.add_argument("--force", action="store_true", help="rebuild even if a prepared file exists")
    p.set_defaults(func=run_prepare)

    p = msub.add_parser("info", help="architecture, sizes, quantization, tokenizer, state",
                        description="Describe a GGUF model, the engine that would run it and "
                        "the state of its prepared files.")
    common(p, dtype=False)
    p.add_argument("--engine", choices=ENGINES,
                   help="the engine to report on: llamacpp, numpy, or auto (llamacpp when "
                   "llama-cpp-python is installed); default: runtime.engine from the "
                   "configuration, itself auto")
    p.set_defaults(func=run_info)

    p = msub.add_parser("pin", help="map and lock the prepared weights once, report VmLck",
                        description="Map the prepared weights with MAP_POPULATE, lock them per "
                        "the policy and report what the kernel says (exit 1 if they could "
                        "not be locked, unless --mlock off).")
    common(p)
    p.add_argument("--mlock", choices=MLOCK_POLICIES, default="best-effort",
                   help="required | best-effort | off (default: best-effort)")
    p.set_defaults(func=run_pin)


def _source(args: argparse.Namespace) -> Path:
    return Path(args.path) if args.path else default_model_path()


def _state(args: argparse.Namespace) -> Path:
    """The daemon's state directory (where it looks for prepared weights): --state-dir, else
    server.state_dir from the configuration and EDGE_AGENT_*, else the paths rule."""
    from edge_agent.commands.client import configured

    return Path(configured(args).server.state_dir)


def run_prepare(args: argparse.Namespace) -> int:
    from edge_agent.runtime.prepare import prepare_model

    src, state = _source(args), _state(args)
    progress = StderrProgress(f"preparing {src.name} ({args.dtype})")
    calls = []

    def track(done: int, total: int) -> None:
        calls.append(done)
        progress(done, total)

    t0 = time.monotonic()
    path = prepare_model(src, state, dtype=args.dtype, progress=track, force=args.force)
    seconds = time.monotonic() - t0
    info = PreparedInfo.read(path)
    reused = not calls
    if args.json:
        print(json.dumps({
            "path": str(path), "dtype": info.dtype, "reused": reused,
            "file_bytes": info.file_size, "weight_bytes": info.weight_bytes,
            "tensors": len(info.tensors), "seconds": round(seconds, 3),
            "source": {"path": str(src), "sha256": info.source_sha256,
                       "size": info.source_size},
        }))
    else:
        verb = "reusing" if reused else f"prepared in {seconds:.1f} s:"
        print(f"{verb} {path} ({memlock.format_bytes(info.file_size)})", file=sys.stderr)
        print(path)
    return EXIT_OK


def run_pin(args: argparse.Namespace) -> int:
    from edge_agent.runtime.prepare import find_prepared
    from edge_agent.runtime.weights import PinnedWeights

    src, state = _source(args), _state(args)
    path = find_prepared(src, state, args.dtype)
    if path is None:
        raise ModelFileError(
            f"{src}: no prepared {args.dtype} weights in {state / 'models'}. Hint: run "
            f"`edge-agent model prepare --dtype {args.dtype} {src}` first."
        )
    weights = PinnedWeights.open(path, mlock=args.mlock)
    try:
        report = weights.lock
        if args.json:
            print(json.dumps({"path": str(path), **report.as_dict()}))
        else:
            print(f"{path}: {report.summary()}")  # a failure was logged on stderr already
    finally:
        weights.close()
    return EXIT_OK if report.locked or args.mlock == "off" else EXIT_ERROR


# -- info ----------------------------------------------------------------------------------


def _hyper(meta: dict[str, Any], arch: str) -> dict[str, Any]:
    def get(key: str) -> Any:
        return meta.get(f"{arch}.{key}")

    dim, heads = get("embedding_length"), get("attention.head_count")
    head_dim = get("attention.key_length") or (dim // heads if dim and heads else None)
    tokens = meta.get("tokenizer.ggml.tokens")
    return {
        "context_length": get("context_length"), "n_layers": get("block_count"), "dim": dim,
        "ffn_dim": get("feed_forward_length"), "n_heads": heads,
        "n_kv_heads": get("attention.head_count_kv") or heads, "head_dim": head_dim,
        "rope_base": get("rope.freq_base"), "rms_eps": get("attention.layer_norm_rms_epsilon"),
        "vocab_size": get("vocab_size") or (len(tokens) if isinstance(tokens, list) else None),
    }


def _tokenizer(meta: dict[str, Any]) -> dict[str, Any]:
    tokens = meta.get("tokenizer.ggml.tokens")
    tokens = tokens if isinstance(tokens, list) else []
    merges = meta.get("tokenizer.ggml.merges")

    def tok(key: str) -> dict[str, Any] | None:
        i = meta.get(f"tokenizer.ggml.{key}_token_id")
        if not isinstance(i, int):
            return None
        return {"id": i, "token": tokens[i] if 0 <= i < len(tokens) else None}

    return {
        "model": meta.get("tokenizer.ggml.model"), "pre": meta.get("tokenizer.ggml.pre"),
        "vocab_size": len(tokens), "merges": len(merges) if isinstance(merges, list) else 0,
        "bos": tok("bos"), "eos": tok("eos"),
        "add_bos": meta.get("tokenizer.ggml.add_bos_token"),
        "chat_template": "tokenizer.chat_template" in meta,
    }


# tokenizer.ggml.model -> llama.cpp's vocabulary type (llama-vocab.cpp's names)
VOCAB_TYPES = {"gpt2": "BPE", "llama": "SPM", "bert": "WPM", "t5": "UGM", "rwkv": "RWKV",
               "plamo2": "PLaMo2", "no_vocab": "none", "none": "none"}
_TEMPLATE_KEY = "tokenizer.chat_template"


def _vocab_type(meta: dict[str, Any]) -> str | None:
    model = meta.get("tokenizer.ggml.model")
    return VOCAB_TYPES.get(model) if isinstance(model, str) else None


def _chat_template(meta: dict[str, Any]) -> dict[str, Any]:
    """Whether the GGUF carries a chat template, under which key, and its first line."""
    named = sorted(k[len(_TEMPLATE_KEY) + 1:] for k in meta
                   if k.startswith(_TEMPLATE_KEY + ".") and isinstance(meta[k], str))
    text = meta.get(_TEMPLATE_KEY)
    if not isinstance(text, str) or not text.strip():
        return {"present": False, "key": None, "chars": 0, "first_line": None, "named": named}
    first = next(line.strip() for line in text.splitlines() if line.strip())
    return {"present": True, "key": _TEMPLATE_KEY, "chars": len(text), "first_line": first,
            "named": named}


def _prepared_state(src: Path, state: Path, dtype: str, sha: str) -> dict[str, Any]:
    from edge_agent.runtime.prepare import find_prepared, prepared_path

    path = prepared_path(state, sha, dtype)
    entry: dict[str, Any] = {"dtype": dtype, "path": str(path), "exists": path.exists(),
                             "matches_source": False, "error": None}
    if entry["exists"]:
        try:
            entry["matches_source"] = find_prepared(src, state, dtype) == path
        except ModelFileError as exc:
            entry["error"] = str(exc)
    return entry


def _engine(requested: str, meta: dict[str, Any], undequantized: list[str]) -> dict[str, Any]:
    """The engine `requested` resolves to here, and whether it can run this model (for the
    numpy engine: the checks its load makes, on the metadata alone)."""
    from edge_agent.runtime.model_config import ModelConfig, UnsupportedModel

    name = resolve_engine(requested)
    problem = None
    if name == "numpy":
        try:
            ModelConfig.from_metadata(meta)
        except UnsupportedModel as exc:
            problem = exc.reason
        except ModelFileError as exc:
            problem = str(exc)
        if problem is None and undequantized:
            problem = f"the numpy engine cannot dequantize {', '.join(undequantized)}"
    return {"requested": requested, "name": name, "can_run": problem is None,
            "problem": problem}


def describe_model(src: Path, state: Path, engine: str = "auto") -> dict[str, Any]:
    """Everything `model info` shows, as JSON-ready data."""
    from edge_agent.runtime import quant
    from edge_agent.runtime.prepare import prepared_size, source_sha256

    with GGUFFile(src) as g:
        meta = dict(g.metadata)
        arch = str(meta.get("general.architecture", "unknown"))
        hist: Counter[str] = Counter()
        params: Counter[str] = Counter()
        nbytes: Counter[str] = Counter()
        for t in g.tensors.values():
            hist[t.type_name] += 1
            params[t.type_name] += t.n_elements
            nbytes[t.type_name] += t.nbytes  # sized by ggml's block sizes, any type
        undequantized = sorted({t.type_name for t in g.tensors.values()
                                if quant.type_by_id(t.type_id) is None})
        sizes = {d: prepared_size(g, d) for d in DTYPES}
        out = {
            "path": str(src), "name": meta.get("general.name"), "architecture": arch,
            "engine": _engine(engine, meta, undequantized),
            "gguf_version": g.version, "file_bytes": g.size, "tensor_count": len(g.tensors),
            "parameters": sum(params.values()), "tensor_bytes": sum(nbytes.values()),
            "prepared_bytes": sizes,
            "quantization": {k: {"tensors": hist[k], "parameters": params[k],
                                 "bytes": nbytes[k]}
                             for k, _ in sorted(hist.items(), key=lambda kv: -nbytes[kv[0]])},
            "context_length": _hyper(meta, arch)["context_length"],
            "vocab_type": _vocab_type(meta),
            "chat_template": _chat_template(meta),
            "hyperparameters": _hyper(meta, arch),
            "tokenizer": _tokenizer(meta),
            # the numpy engine dequantizes these types only; the llama.cpp engine reads any
            "numpy_engine": {"can_prepare": not undequantized,
                             "undequantized_types": undequantized},
        }
    sha = source_sha256(src)
    out["sha256"] = sha
    out["prepared"] = [_prepared_state(src, state, d, sha) for d in DTYPES]
    env = memlock.memlock_env()
    out["mlock"] = {**env.as_dict(),
                    "can_lock": {d: env.can_lock(sizes[d]) for d in DTYPES}}
    return out


def run_info(args: argparse.Namespace) -> int:
    from edge_agent.commands.client import engine_for

    info = describe_model(_source(args), _state(args), engine=engine_for(args))
    if args.json:
        print(json.dumps(info))
        return EXIT_OK
    print(_format_info(info))
    return EXIT_OK


def _engine_line(e: dict[str, Any]) -> str:
    how = " (auto: llama-cpp-python " + ("is" if e["name"] == "llamacpp" else "is not") \
        + " installed)" if e["requested"] == "auto" else ""
    if e["can_run"]:
        return str(e["name"]) + how
    hint = ("install llama-cpp-python (the llamacpp engine reads any GGUF llama.cpp loads)"
            if e["requested"] == "auto" else "use --engine llamacpp")
    return f"{e['name']}{how}: CANNOT run this model: {e['problem']}. Hint: {hint}"


def _format_info(i: dict[str, Any]) -> str:
    mb = memlock.format_bytes
    h, t = i["hyperparameters"], i["tokenizer"]
    quant = ", ".join(f"{k} x{v['tensors']} ({v['parameters']:,} params, {mb(v['bytes'])})"
                      for k, v in i["quantization"].items())
    tmpl = i["chat_template"]
    template = (f"none (no {_TEMPLATE_KEY} key: chat requests need one)"
                if not tmpl["present"] else
                f"{tmpl['key']}, {tmpl['chars']:,} chars: " + _clip(tmpl["first_line"], 60))
    if tmpl["named"]:
        template += "; named: " + ", ".join(tmpl["named"])
    sizes = ", ".join(f"{d} {mb(n)}" for d, n in i["prepared_bytes"].items())
    hyper = ", ".join(f"{k} {v}" for k, v in h.items() if k != "context_length")

    def special(x: dict[str, Any] | None) -> str:
        return "none" if x is None else f"{x['id']} {x['token']!r}"

    lines = [
        ("model", i["path"]), ("name", str(i["name"])), ("architecture", i["architecture"]),
        ("engine", _engine_line(i["engine"])),
        ("parameters", f"{i['parameters']:,}"),
        ("file", f"{i['file_bytes']:,} bytes ({mb(i['file_bytes'])}), GGUF v{i['gguf_version']},"
                 f" {i['tensor_count']} tensors, sha256 {i['sha256'][:16]}..."),
        ("prepared size", sizes), ("quantization", quant),
        ("context", str(i["context_length"])), ("hyperparameters", hyper),
        ("vocabulary", f"{i['vocab_type'] or 'unknown'} (tokenizer.ggml.model "
                       f"{t['model']!r}), {t['vocab_size']:,} tokens"),
        ("template", template),
        ("tokenizer", f"{t['model']} (pre {t['pre']}), vocab {t['vocab_size']}, merges "
                      f"{t['merges']}, bos {special(t['bos'])}, eos {special(t['eos'])}"),
    ]
    undequantized = i["numpy_engine"]["undequantized_types"]
    for p in i["prepared"]:
        state = ("missing (run `edge-agent model prepare"
                 + ("" if p["dtype"] == "f32" else f" --dtype {p['dtype']}") + "`)")
        if undequantized:
            state = (f"not possible: the numpy engine cannot dequantize "
                     f"{', '.join(undequantized)} (the llama.cpp engine reads the GGUF as is)")
        if p["exists"]:
            state = "ready, matches source" if p["matches_source"] else "INVALID: " + p["error"]
        lines.append((f"prepared {p['dtype']}", f"{p['path']} {state}"))
    m = i["mlock"]
    env = memlock.MemlockEnv(m["rlimit_memlock_soft"], m["rlimit_memlock_hard"],
                             m["cap_ipc_lock"])
    can = ", ".join(f"{d} {'yes' if ok else 'NO'}" for d, ok in m["can_lock"].items())
    lines.append(("mlock", f"{env.describe()}; can lock: {can}"))
    return "\n".join(f"{k:<16} {v}" for k, v in lines)


def _clip(text: str, n: int) -> str:
    return text if len(text) <= n else text[: n - 3] + "..."
