"""`edge-agent generate PROMPT`: stream one completion to stdout.

stdout carries the completion text and nothing else, written as it is decoded (whole UTF-8
characters only). Weight preparation progress, the memory-lock report and (with -v) timing go
to stderr. Sampling parameters are checked before the model is loaded.

Seam for the daemon: `run` is where a request will go to a running daemon's client instead of
`generate_local` unless `--local` is given; until the daemon exists every request runs locally.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path
from typing import TextIO

from edge_agent.errors import EXIT_OK, UsageError
from edge_agent.paths import state_dir
from edge_agent.runtime.memlock import MLOCK_POLICIES
from edge_agent.runtime.prepare import DTYPES
from edge_agent.runtime.sampling import SamplingParams

__all__ = ["register", "run", "generate_local", "sampling_params"]


def register(sub: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    p = sub.add_parser(
        "generate",
        help="stream a completion of PROMPT to stdout",
        description="Generate a completion of PROMPT with the local model and stream it to "
        "stdout (diagnostics on stderr). Greedy unless --temperature > 0.",
    )
    p.add_argument("prompt", metavar="PROMPT", help="prompt text ('-' reads it from stdin)")
    p.add_argument("--model", metavar="PATH", help="GGUF file (default: the installed "
                   "SmolLM2-135M-Instruct)")
    p.add_argument("--max-tokens", type=int, default=256, metavar="N",
                   help="stop after N tokens (default: 256)")
    p.add_argument("--temperature", type=float, default=0.0, metavar="T",
                   help="0 = greedy (default); e.g. 0.8 for varied text")
    p.add_argument("--top-k", type=int, default=0, metavar="K",
                   help="sample among the K most likely tokens (default: 0 = off)")
    p.add_argument("--top-p", type=float, default=1.0, metavar="P",
                   help="sample within the nucleus of probability P (default: 1.0 = off)")
    p.add_argument("--seed", type=int, default=0, metavar="S",
                   help="random seed; token i draws from (S, i) (default: 0)")
    p.add_argument("--stop", action="append", default=[], metavar="TEXT",
                   help="stop before TEXT (repeatable)")
    p.add_argument("--chat", action="store_true",
                   help="treat PROMPT as a user message under the model's chat template")
    p.add_argument("--mlock", choices=MLOCK_POLICIES, default="best-effort",
                   help="lock weights in RAM: required | best-effort | off (default: best-effort)")
    p.add_argument("--dtype", choices=tuple(DTYPES), default="f32",
                   help="prepared weights dtype (default: f32; f16 halves memory, slower)")
    p.add_argument("--threads", type=int, default=1, metavar="N",
                   help="BLAS threads for the forward (default: 1)")
    p.add_argument("--local", action="store_true",
                   help="run the model in this process even when a daemon is running")
    p.add_argument("-v", "--verbose", action="store_true", help="timing figures on stderr")
    p.set_defaults(func=run)


def sampling_params(args: argparse.Namespace) -> SamplingParams:
    return SamplingParams(
        temperature=args.temperature, top_k=args.top_k, top_p=args.top_p, seed=args.seed,
        max_tokens=args.max_tokens, stop=tuple(args.stop),
    )


def _prompt_text(arg: str, stdin: TextIO) -> str:
    text = stdin.read() if arg == "-" else arg
    if not text:
        raise UsageError("generate: the prompt is empty. Hint: pass the prompt text as the "
                         "argument, or '-' and the text on stdin.")
    return text


def run(args: argparse.Namespace) -> int:
    params = sampling_params(args)  # bad values are usage errors, before any loading
    if args.threads < 1:
        raise UsageError(f"generate: --threads {args.threads} must be >= 1. Hint: use 1 on a "
                         "busy 2-core board.")
    prompt = _prompt_text(args.prompt, sys.stdin)
    # The daemon client plugs in here: unless --local, hand the request to a running daemon.
    generate_local(
        prompt, params, model=Path(args.model) if args.model else None,
        state=state_dir(args.state_dir), chat=args.chat, dtype=args.dtype, mlock=args.mlock,
        threads=args.threads, verbose=args.verbose,
    )
    return EXIT_OK


def generate_local(
    prompt: str,
    params: SamplingParams,
    *,
    model: Path | None,
    state: Path,
    chat: bool = False,
    dtype: str = "f32",
    mlock: str = "best-effort",
    threads: int = 1,
    verbose: bool = False,
    out: TextIO | None = None,
    err: TextIO | None = None,
) -> int:
    """Load the model in this process and stream the completion to `out`; return its tokens."""
    from edge_agent.commands.model import StderrProgress
    from edge_agent.runtime.engine import Engine

    out = out if out is not None else sys.stdout
    err = err if err is not None else sys.stderr
    t0 = time.monotonic()
    name = model.name if model is not None else "default model"
    engine = Engine.load(
        model, state_dir=state, dtype=dtype, mlock=mlock, max_batch=1, context=1 << 20,
        threads=threads, progress=StderrProgress(f"preparing {name} ({dtype})", err),
    )
    try:
        assert engine.weights is not None and engine.tokenizer is not None
        print(f"edge-agent: {engine.weights.lock.summary()}", file=err)
        tok = engine.tokenizer
        ids = tok.apply_chat_template([{"role": "user", "content": prompt}]) if chat \
            else tok.encode(prompt)
        t_load = time.monotonic()
        generated: list[int] = []
        last = ""
        for piece in engine.stream_text(ids, params, on_token=generated.append):
            out.write(piece)
            out.flush()
            last = piece
        t_end = time.monotonic()
        if getattr(out, "isatty", lambda: False)() and last and not last.endswith("\n"):
            out.write("\n")
            out.flush()
        if verbose:
            secs = max(t_end - t_load, 1e-9)
            print(f"edge-agent: load {t_load - t0:.2f} s; prompt {len(ids)} tokens; "
                  f"{len(generated)} tokens in {secs:.2f} s ({len(generated) / secs:.1f} tok/s)",
                  file=err)
        return len(generated)
    finally:
        engine.close()
