"""`edge-agent generate PROMPT`: stream one completion to stdout.

stdout carries the completion text and nothing else, written as it is decoded (whole UTF-8
characters only). Weight preparation progress, the memory-lock report and (with -v) timing go
to stderr. Sampling parameters are checked before the model is loaded.

Invariants owned here:
- Without --local or --model, the request goes through the daemon on its socket (--socket, else
  server.socket from the configuration, whose default follows the state directory: see
  edge_agent.paths) by `DaemonClient.stream_completion` (SSE); the output is the same text the
  in-process path prints at temperature 0. No daemon on that socket, or a socket that does not
  answer, is an error (exit 1) with a Hint naming --local: the model is never loaded in this
  process (a second mlocked copy next to a daemon's) unless asked.
- `--local` or `--model PATH` (a file, which the daemon's named models cannot take) runs in this
  process, and says so on stderr at default verbosity.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any, TextIO

from edge_agent.errors import EXIT_OK, UsageError
from edge_agent.runtime.engines import ENGINES
from edge_agent.runtime.memlock import MLOCK_POLICIES
from edge_agent.runtime.prepared_format import DTYPES
from edge_agent.runtime.sampling_params import SamplingParams

if TYPE_CHECKING:
    from edge_agent.client import DaemonClient

__all__ = ["register", "run", "generate_local", "generate_daemon", "sampling_params"]

PROBE_TIMEOUT_S = 5.0


def register(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = sub.add_parser(
        "generate",
        help="stream a completion of PROMPT to stdout",
        description="Generate a completion of PROMPT and stream it to stdout (diagnostics on "
        "stderr). Greedy unless --temperature > 0.",
        epilog="Where it runs: through the running daemon (found like `edge-agent status` "
        "finds it: --socket, else the configuration, else STATE_DIR/edge-agent.sock; inside a "
        "checkout that is the .state/edge-agent.sock `make run` serves on). When no daemon "
        "answers, generate stops with an error instead of loading the model itself; --local "
        "(or --model PATH) loads the model in this process, and says so on stderr.",
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
                   help="stop before TEXT (repeatable); escapes as in llama.cpp's tools: "
                   "\\n, \\r, \\t, \\\\, \\', \\\", \\xHH (so --stop '\\n\\n' stops at a blank "
                   "line)")
    p.add_argument("--chat", action="store_true",
                   help="treat PROMPT as a user message under the model's chat template")
    p.add_argument("--mlock", choices=MLOCK_POLICIES, default="best-effort",
                   help="lock weights in RAM: required | best-effort | off (default: best-effort)")
    p.add_argument("--dtype", choices=tuple(DTYPES), default="f32",
                   help="prepared weights dtype (default: f32; f16 halves memory, slower)")
    p.add_argument("--threads", type=int, default=0, metavar="N",
                   help="compute threads (default: llamacpp the cores this process may use, "
                   "numpy 1)")
    p.add_argument("--engine", choices=ENGINES,
                   help="compute engine with --local: llamacpp, numpy, or auto (llamacpp when "
                   "llama-cpp-python is installed); default: runtime.engine from the "
                   "configuration, itself auto")
    p.add_argument("--local", action="store_true",
                   help="load the model in this process instead of asking the daemon (another "
                   "copy in RAM if a daemon runs)")
    p.add_argument("--socket", metavar="PATH",
                   help="daemon socket (default: server.socket from the configuration, else "
                   "STATE_DIR/edge-agent.sock)")
    p.add_argument("--config", metavar="FILE",
                   help="configuration file for the default socket "
                   "(default: /etc/edge-agent/config.toml)")
    p.add_argument("--daemon-model", metavar="NAME",
                   help="model name in the daemon (default: the daemon's default model)")
    p.add_argument("-v", "--verbose", action="store_true", help="timing figures on stderr")
    p.set_defaults(func=run)


def sampling_params(args: argparse.Namespace) -> SamplingParams:
    return SamplingParams(
        temperature=args.temperature, top_k=args.top_k, top_p=args.top_p, seed=args.seed,
        max_tokens=args.max_tokens, stop=tuple(process_escapes(s) for s in args.stop),
    )


_ESCAPES = {"n": "\n", "r": "\r", "t": "\t", "\\": "\\", "'": "'", '"': '"'}


def process_escapes(text: str) -> str:
    """`--stop` text with llama.cpp's escapes (common.cpp string_process_escapes) turned into
    the characters: a shell passes "\\n\\n" as a backslash and an n, twice. An unknown escape
    stays as typed, backslash included."""
    out: list[str] = []
    i = 0
    while i < len(text):
        c = text[i]
        if c == "\\" and i + 1 < len(text):
            nxt = text[i + 1]
            if nxt in _ESCAPES:
                out.append(_ESCAPES[nxt])
                i += 2
                continue
            hexa = text[i + 2:i + 4]
            if nxt == "x" and len(hexa) == 2 and all(h in "0123456789abcdefABCDEF" for h in hexa):
                out.append(chr(int(hexa, 16)))
                i += 4
                continue
        out.append(c)
        i += 1
    return "".join(out)


def _prompt_text(arg: str, stdin: TextIO) -> str:
    text = stdin.read() if arg == "-" else arg
    if not text:
        raise UsageError("generate: the prompt is empty. Hint: pass the prompt text as the "
                         "argument, or '-' and the text on stdin.")
    return text


def run(args: argparse.Namespace) -> int:
    params = sampling_params(args)  # bad values are usage errors, before any loading
    if args.threads < 0:
        raise UsageError(f"generate: --threads {args.threads} must be >= 0 (0: choose). Hint: "
                         "use 1 on a busy 2-core board.")
    prompt = _prompt_text(args.prompt, sys.stdin)
    if not args.local and not args.model:
        client = _daemon_client(args)
        _require_daemon(client)
        generate_daemon(client, prompt, params, chat=args.chat, model=args.daemon_model,
                        verbose=args.verbose)
        return EXIT_OK
    if args.daemon_model:
        raise UsageError("generate: --daemon-model names a model of the daemon; it cannot be "
                         "used with --local or --model. Hint: drop one of them.")
    why = "--local" if args.local else f"--model {args.model}"
    print(f"edge-agent: loading the model in this process ({why}), not using a daemon",
          file=sys.stderr)
    from edge_agent.commands.client import configured, engine_for

    config = configured(args)
    generate_local(
        prompt, params, model=Path(args.model) if args.model else None,
        state=Path(config.server.state_dir), chat=args.chat, dtype=args.dtype,
        mlock=args.mlock,
        threads=args.threads, verbose=args.verbose,
        engine=engine_for(args, config),
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
    threads: int = 0,
    verbose: bool = False,
    out: TextIO | None = None,
    err: TextIO | None = None,
    engine: str = "auto",
) -> int:
    """Load the model in this process and stream the completion to `out`; return its tokens."""
    from edge_agent.commands.model import StderrProgress
    from edge_agent.paths import default_model_path
    from edge_agent.runtime.engines import load_engine, resolve_engine
    from edge_agent.runtime.memlock import lock_summary

    out = out if out is not None else sys.stdout
    err = err if err is not None else sys.stderr
    t0 = time.monotonic()
    path = model if model is not None else default_model_path()
    kind = resolve_engine(engine)
    loaded = load_engine(
        kind, path, state_dir=state, dtype=dtype, mlock=mlock, max_batch=1, context=1 << 20,
        threads=threads or None,
        progress=StderrProgress(f"preparing {path.name} ({dtype})", err),
    )
    try:
        print(f"edge-agent: engine {kind}; {lock_summary(loaded.lock_report() or {})}",
              file=err)
        tok = loaded.tokenizer
        ids = tok.apply_chat_template([{"role": "user", "content": prompt}]) if chat \
            else tok.encode(prompt)
        t_load = time.monotonic()
        generated: list[int] = []
        last = ""
        for piece in loaded.stream_text(ids, params, on_token=generated.append):
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
        loaded.close()


def _daemon_client(args: argparse.Namespace) -> DaemonClient:
    from edge_agent.client import DaemonClient
    from edge_agent.commands.client import daemon_socket

    # The first token may wait for a model load in the daemon: a long read timeout.
    return DaemonClient(daemon_socket(args), timeout=600.0)


def _require_daemon(client: DaemonClient) -> None:
    """A short probe (a stuck daemon must not hang `generate` for the long stream timeout);
    no daemon, or one that does not answer, is an error naming --local."""
    from edge_agent.client import DaemonClient, DaemonError
    from edge_agent.errors import EdgeAgentError

    path = Path(client.socket_path)
    if not path.exists():
        raise EdgeAgentError(
            f"generate: no daemon: {path} does not exist. Hint: start one (`make run` in the "
            "checkout, `sudo systemctl start edge-agent`, or `edge-agent serve`), point "
            "--socket/--state-dir at it, or pass --local to load the model in this process.")
    try:
        DaemonClient(path, timeout=PROBE_TIMEOUT_S).health_status()
    except DaemonError as exc:
        raise EdgeAgentError(
            f"generate: the daemon socket {path} exists but does not answer "
            f"({exc.message.split(' Hint:')[0]}). "
            "Hint: check it with `edge-agent status`; a stale socket of a daemon that died "
            "can be removed; --local loads the model in this process instead (a second copy "
            "if a daemon is running).") from exc


def generate_daemon(
    client: DaemonClient,
    prompt: str,
    params: SamplingParams,
    *,
    chat: bool = False,
    model: str | None = None,
    verbose: bool = False,
    out: TextIO | None = None,
    err: TextIO | None = None,
) -> int:
    """Stream the completion from the daemon to `out`; return the number of text pieces."""
    out = out if out is not None else sys.stdout
    err = err if err is not None else sys.stderr
    print(f"edge-agent: generating through the daemon on {client.socket_path} "
          "(--local runs in this process)", file=err)
    body: dict[str, Any] = {  # JSON fields, stream_completion's **params
        "max_tokens": params.max_tokens, "temperature": params.temperature,
        "top_p": params.top_p, "top_k": params.top_k, "seed": params.seed,
    }
    if params.stop:
        body["stop"] = list(params.stop)
    if model:
        body["model"] = model
    t0 = time.monotonic()
    if chat:
        pieces = client.stream_completion(messages=[{"role": "user", "content": prompt}],
                                          **body)
    else:
        pieces = client.stream_completion(prompt, **body)
    count = 0
    last = ""
    first_at: float | None = None
    try:
        for piece in pieces:
            if first_at is None:
                first_at = time.monotonic()
            out.write(piece)
            out.flush()
            last = piece
            count += 1
    finally:
        pieces.close()  # an interrupted stream disconnects: the daemon cancels the request
    if getattr(out, "isatty", lambda: False)() and last and not last.endswith("\n"):
        out.write("\n")
        out.flush()
    if verbose:
        t_end = time.monotonic()
        ttft = (first_at - t0) if first_at is not None else float("nan")
        print(f"edge-agent: daemon: first text after {ttft:.2f} s; {count} pieces in "
              f"{t_end - t0:.2f} s", file=err)
    return count
