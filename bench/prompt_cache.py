"""Benchmark the prompt cache: time to first token of a session's first and second turn.

One daemon (`python -m edge_agent serve`, engine llamacpp, the default SmolLM2, context 2048,
max_batch 4, the model preloaded) on a Unix socket in a temporary directory; READY=1 on a
notify socket this script owns. Each run is a new session on a new subject (so its first turn
finds nothing of it in the cache): turn 1 is a chat whose user message makes a prompt of about
HISTORY tokens (the session's history afterwards); turn 2 is one short new message in the same
session, so its prompt is that history + reply + the new turn. Both are streamed
(/v1/chat/completions, temperature 0, 16 tokens); TTFT is the time from sending the request
to the first content chunk. After each turn, GET /v1/requests/{id} gives its prompt tokens and
how many of them the runner's prompt cache held.

Per run: TTFT of both turns and their ratio (turn 2 / turn 1; target <= 0.3); printed as the
median ratio with its min-max over the runs, and the tokens cached on turn 2.

    .venv/bin/python bench/prompt_cache.py [--runs 5] [--history 1200] [--threads N] [--json]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "tests"))  # daemon_proc, the launcher the tests use

from daemon_proc import Daemon, launch, serve_argv  # noqa: E402

from edge_agent.client import UnixHTTPConnection  # noqa: E402

SUBJECTS = ["a lighthouse keeper", "a lost robot", "a desert town", "an old violin",
            "a mountain train", "a clockmaker", "a red kite", "a sunken ship", "a night market",
            "a snow leopard"]
CONTEXT = 2048
MAX_BATCH = 4
TOKENS = 16


def config(root: Path, threads: int | None) -> Path:
    cfg = root / "config.toml"
    thr = f"threads = {threads}\n" if threads else ""
    cfg.write_text(
        f'[server]\nsocket = "{root / "ea.sock"}"\nstate_dir = "{root / "state"}"\n'
        f'[runtime]\nengine = "llamacpp"\n{thr}'
        f"[models.smollm2]\ncontext = {CONTEXT}\nmax_batch = {MAX_BATCH}\npreload = true\n")
    return cfg


def history_text(d: Daemon, subject: str, tokens: int) -> str:
    """Notes about `subject` whose chat prompt is about `tokens` tokens long."""
    lines: list[str] = []
    while True:
        lines.append(f"Note {len(lines)} about {subject}: it changes with the season, the "
                     "weather and the hour of the day.")
        status, body = d.json("POST", "/tokenize", {"content": "\n".join(lines)})
        assert status == 200, body
        if len(body["tokens"]) + 40 >= tokens:  # + the chat template's system prompt
            return "\n".join(lines)


def turn(d: Daemon, session: str, content: str) -> dict[str, Any]:
    """One streamed chat turn: TTFT, and its record's prompt and cached tokens."""
    body = json.dumps({"model": "smollm2", "stream": True, "temperature": 0,
                       "max_tokens": TOKENS, "session": session,
                       "messages": [{"role": "user", "content": content}]}).encode()
    conn = UnixHTTPConnection(str(d.sock))
    try:
        t0 = time.perf_counter()
        conn.request("POST", "/v1/chat/completions", body=body,
                     headers={"Content-Type": "application/json"})
        resp = conn.getresponse()
        assert resp.status == 200, resp.read()
        ttft, rid = None, None
        for raw in resp:
            line = raw.decode().strip()
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            rid = chunk.get("id", rid)
            delta = chunk.get("choices", [{}])[0].get("delta", {})
            if ttft is None and delta.get("content"):
                ttft = time.perf_counter() - t0
    finally:
        conn.close()
    assert ttft is not None and rid is not None, "no content streamed"
    status, rec = d.json("GET", f"/v1/requests/{rid}")
    assert status == 200, rec
    return {"ttft_s": ttft, "prompt_tokens": rec["prompt_tokens"],
            "cached_tokens": rec["cached_tokens"]}


def spread(xs: list[float]) -> dict[str, Any]:
    return {"median": statistics.median(xs), "min": min(xs), "max": max(xs), "runs": xs}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--runs", type=int, default=5)
    ap.add_argument("--history", type=int, default=1200, help="tokens of turn 1's prompt")
    ap.add_argument("--threads", type=int, default=None, help="runtime.threads (default: auto)")
    ap.add_argument("--json", action="store_true", help="print the results as JSON")
    args = ap.parse_args()
    if not 1 <= args.runs <= len(SUBJECTS):
        ap.error(f"--runs {args.runs}: expected 1..{len(SUBJECTS)} (one subject per run)")
    root = Path(tempfile.mkdtemp(prefix="ea-bpc-", dir="/tmp"))
    runs = []
    with launch(Daemon, root, serve_argv(config(root, args.threads)), ready_timeout=600) as d:
        health = d.health()["models"]["smollm2"]
        for k in range(args.runs):
            text = history_text(d, SUBJECTS[k], args.history)
            one = turn(d, f"bench-{k}", f"{text}\nWhat are these notes about?")
            two = turn(d, f"bench-{k}", "Say it in one word.")
            runs.append({"turn1": one, "turn2": two, "ratio": two["ttft_s"] / one["ttft_s"]})
        pc = d.health()["models"]["smollm2"]["prompt_cache"]
    out = {"model": "smollm2", "engine": health["engine"],
           "batch_invariant": health["batch_invariant"], "context": CONTEXT,
           "max_batch": MAX_BATCH, "threads": (health.get("engine_info") or {}).get("threads"),
           "ttft1_s": spread([r["turn1"]["ttft_s"] for r in runs]),
           "ttft2_s": spread([r["turn2"]["ttft_s"] for r in runs]),
           "ratio": spread([r["ratio"] for r in runs]),
           "prompt_tokens": [r["turn1"]["prompt_tokens"] for r in runs],
           "turn2_prompt_tokens": [r["turn2"]["prompt_tokens"] for r in runs],
           "turn2_cached_tokens": [r["turn2"]["cached_tokens"] for r in runs],
           "prompt_cache": pc, "runs": runs}
    if args.json:
        print(json.dumps(out, indent=2))
        return 0
    r = out["ratio"]
    print(f"smollm2 (llamacpp, {out['threads']} threads), {args.runs} runs, turn 1 prompt "
          f"{statistics.median(out['prompt_tokens']):.0f} tokens")
    print(f"  TTFT turn 1: {out['ttft1_s']['median'] * 1000:.0f} ms "
          f"({out['ttft1_s']['min'] * 1000:.0f}-{out['ttft1_s']['max'] * 1000:.0f})")
    print(f"  TTFT turn 2: {out['ttft2_s']['median'] * 1000:.0f} ms "
          f"({out['ttft2_s']['min'] * 1000:.0f}-{out['ttft2_s']['max'] * 1000:.0f}), "
          f"cached {statistics.median(out['turn2_cached_tokens']):.0f} of "
          f"{statistics.median(out['turn2_prompt_tokens']):.0f} prompt tokens")
    print(f"  ratio turn 2 / turn 1: {r['median']:.3f} ({r['min']:.3f}-{r['max']:.3f}); "
          "target <= 0.3")
    return 0


if __name__ == "__main__":
    sys.exit(main())
