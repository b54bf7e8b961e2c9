"""`edge-agent tokenize`: text -> token ids (or ids -> text with --decode), from GGUF metadata.

Tokenizes with the engine's tokenizer, as the daemon does: on llamacpp (the default where
llama-cpp-python is installed) a vocab-only llama.cpp load, any vocabulary type (BPE, SPM, WPM,
UGM); on numpy the GPT-2 style BPE built from the metadata. Reads only the GGUF header and
metadata (no tensor is touched), so it is fast on any model.
Input is TEXT, or stdin when TEXT is `-` or absent (read as bytes, decoded as strict UTF-8, taken
verbatim: a trailing newline is part of the text). Ids go to stdout, space separated, or as a JSON
list with --json; diagnostics go to stderr.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

from edge_agent.errors import UsageError
from edge_agent.runtime.engines import ENGINES

__all__ = ["register", "run"]


def register(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    parser = sub.add_parser(
        "tokenize",
        help="print the token ids of a text (or the text of ids with --decode)",
        description="Tokenize TEXT with the model's tokenizer, as the daemon does (llama.cpp's "
        "vocabulary, or the numpy engine's BPE). Control-token text such as <|im_start|> is "
        "tokenized as plain text.",
    )
    parser.add_argument("text", nargs="?", default="-", metavar="TEXT",
                        help="text to tokenize; '-' or absent reads stdin")
    parser.add_argument("--model", metavar="PATH",
                        help="GGUF file (default: the installed SmolLM2-135M-Instruct)")
    parser.add_argument("--engine", choices=ENGINES,
                        help="whose tokenizer: llamacpp, numpy, or auto (llamacpp when "
                        "llama-cpp-python is installed); default: runtime.engine from the "
                        "configuration, itself auto")
    parser.add_argument("--config", metavar="FILE",
                        help="configuration file read for runtime.engine "
                        "(default: /etc/edge-agent/config.toml)")
    parser.add_argument("--json", action="store_true",
                        help="print a JSON list of ids (with --decode: a JSON string)")
    mode = parser.add_mutually_exclusive_group()
    mode.add_argument("--decode", action="store_true",
                      help="TEXT is token ids (space/comma separated or a JSON list): print text")
    mode.add_argument("--chat", action="store_true",
                      help="tokenize TEXT as a user message under the model's chat template")
    parser.set_defaults(func=run)


def _read_input(arg: str) -> str:
    if arg == "-":
        raw = sys.stdin.buffer.read()
        where = "stdin"
    else:
        raw = os.fsencode(arg)  # undo surrogateescape so bad bytes are caught below
        where = "TEXT"
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise UsageError(
            f"tokenize: {where} is not valid UTF-8 (byte {raw[exc.start:exc.start + 1]!r} at "
            f"offset {exc.start}). Hint: convert it first, e.g. `iconv -t UTF-8`."
        ) from exc


def _parse_ids(text: str, vocab_size: int) -> list[int]:
    stripped = text.strip()
    ids: list[int]  # from JSON: each value is checked to be an int below
    try:
        if stripped.startswith("["):
            ids = json.loads(stripped)
            bad = [v for v in ids if type(v) is not int]
            if bad:
                raise ValueError(f"{bad[0]!r} is not an integer")
        else:
            ids = [int(v) for v in stripped.replace(",", " ").split()]
    except ValueError as exc:
        raise UsageError(
            f"tokenize --decode: cannot read token ids from {stripped[:60]!r} ({exc}). "
            "Hint: pass integers separated by spaces or commas, or a JSON list."
        ) from exc
    for i in ids:
        if not 0 <= i < vocab_size:
            raise UsageError(
                f"tokenize --decode: token id {i} is outside the vocabulary (0..{vocab_size - 1})."
                " Hint: decode ids produced by the same model."
            )
    return ids


def run(args: argparse.Namespace) -> int:
    from edge_agent.commands.client import engine_for
    from edge_agent.paths import default_model_path
    from edge_agent.runtime.engines import open_tokenizer

    path = Path(args.model) if args.model else default_model_path()
    text = _read_input(args.text)
    tokenizer = open_tokenizer(engine_for(args), path)
    if args.decode:
        out = tokenizer.detokenize(_parse_ids(text, tokenizer.vocab_size))
        sys.stdout.write(json.dumps(out, ensure_ascii=False) + "\n" if args.json else out)
        return 0
    if args.chat:
        if tokenizer.chat_note:
            print(f"edge-agent: note: {tokenizer.chat_note}", file=sys.stderr)
        ids = tokenizer.apply_chat_template([{"role": "user", "content": text}])
    else:
        ids = tokenizer.encode(text)
    print(json.dumps(ids) if args.json else " ".join(map(str, ids)))
    return 0
