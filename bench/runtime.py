"""Runtime benchmark (run on demand: `make bench` or `.venv/bin/python bench/runtime.py`).

Prints, from one run: the BLAS kernel threadpoolctl sees, weight load time (mmap populate +
mlock) as a ratio to a plain read of the same bytes, prefill tok/s on a 128-token prompt,
single-stream decode tok/s, aggregate decode tok/s at batch 1, 4, 8, 16, 32 (per BLAS thread
count asked for), RSS, and llama-cpp-python's single-stream decode on the same GGUF as a ratio
when it is installed. Targets: batch-16 aggregate >= 6x single stream; batch 8 >= 5x single
stream (issue #4: a batch-8 step costs <= 1.6x a batch-1 step); populate + lock <= 1.2x the raw
read. Ratios are measured in the same run; absolute figures vary with machine load. Decode is
timed twice: wall clock, and the CPU time of the decoding thread (BLAS runs in it with one
thread), which other processes on a shared machine disturb much less.
`--profile` splits one decode step at batch 1 and 8 into its matrix products (by weight) and
everything else, in thread CPU time. OPENBLAS_CORETYPE is reported, never changed.

`--anchor` runs only the comparison with llama.cpp itself: single-stream decode of edge-agent's
llama.cpp engine (`LlamaCppEngine`, in this process, shaped as the daemon loads it: max_batch 16,
context 512 per sequence) against llama-bench's tg64 (`-p 0 -n 64 -t THREADS`, built by
bench/anchor.py from the same llama.cpp source as the pinned llama-cpp-python) on the same GGUF
with the same thread count, for the default SmolLM2 and Gemma 3 270M Q4_K_M. Both decode 64
tokens one at a time from an empty context (the engine: a one-token prompt, then 63 steps, with
its sampling; llama-bench: 64 decodes, no sampling). Rounds alternate which goes first; each
round is 3 repetitions of each (llama-bench's mean of 3), and the ratio engine / llama-bench is
reported as its median and min-max over the rounds. Target: >= 0.95.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np

from edge_agent.paths import default_model_path, state_dir
from edge_agent.runtime.engine import Engine, blas_info
from edge_agent.runtime.prepare import prepare_model
from edge_agent.runtime.sampling import SamplingParams
from edge_agent.runtime.weights import PinnedWeights

__all__ = ["main"]

BATCHES = (1, 4, 8, 16, 32)
DECODE_STEPS = 16
PROSE = (
    "The harbour town woke slowly. Fishing boats knocked against the pier while gulls argued "
    "over scraps, and the baker opened his shutters to the smell of bread. Down the lane, an "
    "old clockmaker wound every clock in his shop, one after the other, listening for the tick "
    "that told him each was true. Children ran to school along the sea wall, counting waves, "
    "and the ferry horn sounded twice across the bay as it left for the islands. By noon the "
    "market square was full: cheese, apples, rope, lanterns, and a man selling maps of places "
    "nobody had visited in years."
)


def _rss() -> dict[str, int]:
    out = {}
    for line in Path("/proc/self/status").read_text().splitlines():
        key, _, value = line.partition(":")
        if key in ("VmRSS", "VmHWM", "VmLck"):
            out[key] = int(value.split()[0]) * 1024
    return out


def _mib(n: float) -> str:
    return f"{n / 2**20:.1f} MiB"


def _drop_cache(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)


def _plain_read(path: Path, buf: np.ndarray) -> float:
    t = time.perf_counter()
    with open(path, "rb", buffering=0) as f:
        view = memoryview(buf)
        done = 0
        while done < len(view):
            n = f.readinto(view[done:])
            if not n:
                break
            done += n
    return time.perf_counter() - t


def bench_load(prepared: Path, repeats: int) -> None:
    size = prepared.stat().st_size
    buf = np.empty(size, dtype=np.uint8)
    buf.fill(0)  # fault the buffer in first: the read measures copying, not page faults
    print(f"\nweight load ({_mib(size)} prepared file, median of {repeats})")
    for cache in ("warm", "cold"):
        reads, pins, locked = [], [], True
        for _ in range(repeats):
            if cache == "cold":
                _drop_cache(prepared)
            reads.append(_plain_read(prepared, buf))
            if cache == "cold":
                _drop_cache(prepared)
            w = PinnedWeights.open(prepared, mlock="best-effort")
            pins.append(w.lock.populate_s + w.lock.lock_s)
            locked = locked and w.lock.locked
            w.close()
        r, p = statistics.median(reads), statistics.median(pins)
        verdict = "PASS" if p <= 1.2 * r else "FAIL"
        print(f"  {cache:4} cache: plain read {r * 1e3:7.1f} ms ({size / r / 2**30:.2f} GiB/s); "
              f"populate+mlock {p * 1e3:7.1f} ms -> ratio {p / r:.2f} (target <= 1.2: "
              f"{verdict}){'' if locked else '  [mlock failed: unlocked]'}")


def _prompt_ids(engine: Engine, n: int) -> list[int]:
    assert engine.tokenizer is not None
    ids = engine.tokenizer.encode(PROSE * 4)
    return ids[:n]


def _prefill(engine: Engine, prompt: list[int]) -> float:
    t = time.perf_counter()
    engine.add("p", prompt, SamplingParams(max_tokens=10_000, ignore_eos=True))
    dt = time.perf_counter() - t
    engine.release("p")
    return len(prompt) / dt


def _start(engine: Engine, prompt: list[int], b: int) -> list[str]:
    greedy = SamplingParams(max_tokens=10_000, ignore_eos=True)
    names = [f"s{i}" for i in range(b)]
    for i, name in enumerate(names):  # prompts of 8..23 tokens
        engine.add(name, prompt[i % 16 : i % 16 + 8 + i % 16], greedy)
    engine.step(names)  # warm-up step
    return names


def _decode(engine: Engine, prompt: list[int], b: int) -> tuple[float, float]:
    """Aggregate tok/s of DECODE_STEPS batched steps over b sequences of ragged lengths,
    by wall clock and by this thread's CPU time."""
    names = _start(engine, prompt, b)
    t, c = time.perf_counter(), time.thread_time()
    for _ in range(DECODE_STEPS):
        engine.step(names)
    dt, dc = time.perf_counter() - t, time.thread_time() - c
    for name in names:
        engine.release(name)
    return b * DECODE_STEPS / dt, b * DECODE_STEPS / dc


def bench_engine(engine: Engine, threads: list[int], repeats: int) -> dict[int, dict[int, float]]:
    """Rounds interleave every (threads, batch) cell so load drift hits all cells alike;
    medians over rounds, and ratios to single stream taken within each round."""
    prompt = _prompt_ids(engine, 128)
    pre: dict[int, list[float]] = {n: [] for n in threads}
    dec: dict[int, dict[int, list[tuple[float, float]]]] = {
        n: {b: [] for b in BATCHES} for n in threads}
    for _ in range(repeats):
        for n in threads:
            engine.threads = n
            pre[n].append(_prefill(engine, prompt))
            for b in BATCHES:
                dec[n][b].append(_decode(engine, prompt, b))
    med = statistics.median
    out: dict[int, dict[int, float]] = {}
    for n in threads:
        print(f"\nBLAS threads = {n} (median of {repeats} interleaved rounds; wall clock, and "
              "by the decoding thread's CPU time)")
        print(f"  prefill, 128-token prompt   : {med(pre[n]):7.1f} tok/s")
        out[n] = {b: med(w for w, _ in dec[n][b]) for b in BATCHES}
        ratios: dict[int, tuple[float, float]] = {}
        for b in BATCHES:
            ratios[b] = tuple(  # type: ignore[assignment]  # tuple() of two medians
                med(x[k] / y[k] for x, y in zip(dec[n][b], dec[n][1], strict=True))
                for k in (0, 1))
            cpu = med(c for _, c in dec[n][b])
            label = "single-stream decode" if b == 1 else f"aggregate decode, batch {b:2}"
            extra = "" if b == 1 else (f"  ({ratios[b][0]:.2f}x single stream; CPU time "
                                       f"{ratios[b][1]:.2f}x)")
            print(f"  {label:28}: {out[n][b]:7.1f} tok/s (CPU time {cpu:6.1f}){extra}")
        for b, target in ((8, 5.0), (16, 6.0)):
            if b in ratios:
                w, c = ratios[b]
                print(f"  target batch {b} >= {target:.0f}x single stream: {w:.2f}x "
                      f"{'PASS' if w >= target else 'FAIL'} (CPU time {c:.2f}x "
                      f"{'PASS' if c >= target else 'FAIL'}); step({b}) / step(1) = "
                      f"{b / w:.2f} (CPU time {b / c:.2f})")
    return out


def bench_profile(engine: Engine, repeats: int) -> None:
    """One decode step at batch 1 and 8 split by thread CPU time: each weight's products
    (all layers), the rest of the forward, and what the engine does around it."""
    import edge_agent.runtime.model as model_mod

    m = engine.model
    kinds = {id(m.output): "lm_head"}
    for la in m.layers:
        for field in ("wq", "wk", "wv", "wo", "w_gate", "w_up", "w_down"):
            kinds[id(getattr(la, field))] = field
    acc: dict[str, float] = {}
    real_mm, real_forward = model_mod._mm, m.forward

    def timed_mm(x: np.ndarray, w: np.ndarray, **kw: bool) -> np.ndarray:
        c = time.thread_time()
        try:
            return real_mm(x, w, **kw)
        finally:
            key = kinds.get(id(w), "other weight")
            acc[key] = acc.get(key, 0.0) + time.thread_time() - c

    def timed_forward(*args: object, **kw: object) -> np.ndarray:
        c = time.thread_time()
        try:
            return real_forward(*args, **kw)  # type: ignore[arg-type]  # forward's own arguments, passed on
        finally:
            acc["forward"] = acc.get("forward", 0.0) + time.thread_time() - c

    prompt = _prompt_ids(engine, 64)
    rows: dict[int, dict[str, float]] = {}
    model_mod._mm = timed_mm
    m.forward = timed_forward  # type: ignore[method-assign]  # timing wrapper, restored below
    try:
        engine.threads = 1
        for b in (1, 8):
            names = _start(engine, prompt, b)
            acc.clear()
            c = time.thread_time()
            steps = DECODE_STEPS * repeats
            for _ in range(steps):
                engine.step(names)
            total = time.thread_time() - c
            for name in names:
                engine.release(name)
            rows[b] = {k: v / steps for k, v in acc.items()} | {"step": total / steps}
    finally:
        model_mod._mm = real_mm
        del m.forward
    print(f"\ndecode step profile, 1 BLAS thread, thread CPU time per step "
          f"({DECODE_STEPS * repeats} steps each)")
    print(f"  {'':24} {'batch 1':>9} {'batch 8':>9} {'8 / 1':>6}")
    products = [k for k in rows[8] if k not in ("forward", "step")]
    for r in rows.values():
        r["all products"] = sum(r.get(k, 0.0) for k in products)
        r["rest of forward"] = r.get("forward", 0.0) - r["all products"]
        r["engine (sampling...)"] = r["step"] - r.get("forward", 0.0)
    for k in [*sorted(products, key=lambda k: -rows[8][k]), "all products", "rest of forward",
              "engine (sampling...)", "step"]:
        a, b8 = rows[1].get(k, 0.0), rows[8].get(k, 0.0)
        print(f"  {k:24} {a * 1e3:7.2f}ms {b8 * 1e3:7.2f}ms {b8 / a if a else 0:6.2f}")


def bench_llama_cpp(model: Path, threads: int, ours: float) -> None:
    try:
        import llama_cpp
    except ImportError:
        print("\nllama-cpp-python: not installed (optional: pip install '.[llamacpp]'); "
              "no comparison")
        return
    llm = llama_cpp.Llama(model_path=str(model), n_threads=threads, n_ctx=512, verbose=False)
    ids = llm.tokenize(PROSE.encode(), add_bos=False)[:16]
    llm.eval(ids)
    t = time.perf_counter()
    n = 0
    for token in llm.generate(ids, temp=0.0, reset=True):
        n += 1
        if n == 64:
            break
        _ = token
    tps = 64 / (time.perf_counter() - t)
    print(f"\nllama-cpp-python {llama_cpp.__version__}, {threads} thread(s): single-stream "
          f"decode {tps:.1f} tok/s; ours / llama.cpp = {ours / tps:.2f}")


def _engine_tg(engine: Any, tokens: int) -> float:
    """tok/s of `tokens` single-stream tokens from an empty context: a one-token prompt (the
    first token), then tokens - 1 steps."""
    params = SamplingParams(max_tokens=tokens, ignore_eos=True)
    t = time.perf_counter()
    engine.add("tg", engine.warmup_ids(), params)
    for _ in range(tokens - 1):
        engine.step(["tg"])
    dt = time.perf_counter() - t
    engine.release("tg")
    return tokens / dt


def _llama_bench_tg(binary: Path, model: Path, threads: int, tokens: int, reps: int
                    ) -> dict[str, Any]:
    out = subprocess.run([str(binary), "-m", str(model), "-p", "0", "-n", str(tokens),
                          "-t", str(threads), "-r", str(reps), "-o", "json"],
                         check=True, capture_output=True, text=True)
    return json.loads(out.stdout)[0]


def bench_anchor(names: list[str], threads: int, rounds: int, tokens: int = 64,
                 reps: int = 3, quiet: tuple[float, float] = (0.5, 60.0)
                 ) -> list[dict[str, Any]]:
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from anchor import anchor_bins
    from serve import model_paths, wait_quiet

    from edge_agent.runtime.llamacpp import LlamaCppEngine

    bins = anchor_bins()
    cache = Path(os.environ.get("EDGE_AGENT_CACHE") or Path.home() / ".cache/edge-agent")
    results = []
    for name, path in model_paths(names, cache / "models").items():
        ours: list[float] = []
        theirs: list[float] = []
        busy: list[float] = []
        info: dict[str, Any] = {}
        with LlamaCppEngine.load(path, mlock="off", max_batch=16, context=512,
                                 threads=threads) as engine:
            _engine_tg(engine, 16)  # warm-up (llama-bench warms up too)
            for r in range(rounds):
                for who in (("engine", "llama-bench") if r % 2 == 0 else
                            ("llama-bench", "engine")):
                    busy.append(wait_quiet(*quiet))
                    if who == "engine":
                        ours.append(statistics.mean(_engine_tg(engine, tokens)
                                                    for _ in range(reps)))
                    else:
                        info = _llama_bench_tg(bins["bench"], path, threads, tokens, reps)
                        theirs.append(float(info["avg_ts"]))
                print(f"{name} round {r + 1}/{rounds}: engine {ours[-1]:.1f} tok/s, "
                      f"llama-bench tg{tokens} {theirs[-1]:.1f} tok/s", file=sys.stderr)
        ratios = [a / b for a, b in zip(ours, theirs, strict=True)]
        results.append({"model": name, "file": path.name, "threads": threads,
                        "engine_tok_s": statistics.median(ours),
                        "llama_bench_tok_s": statistics.median(theirs),
                        "ratio": statistics.median(ratios), "ratio_min": min(ratios),
                        "ratio_max": max(ratios), "ratios": ratios,
                        "others_busy_cores": busy,
                        "llama_bench_build": f"{info.get('build_commit')} "
                                             f"({info.get('build_number')})"})
    print(f"\nsingle-stream decode, {threads} thread(s), {tokens} tokens: edge-agent's llama.cpp "
          f"engine in process vs llama-bench tg{tokens} (median of {rounds} rounds)")
    print("| model | engine tok/s | llama-bench tok/s | ratio (min-max) | target >= 0.95 |")
    print("|---|---|---|---|---|")
    for res in results:
        print(f"| {res['model']} | {res['engine_tok_s']:.1f} | {res['llama_bench_tok_s']:.1f} | "
              f"**{res['ratio']:.2f}** ({res['ratio_min']:.2f}-{res['ratio_max']:.2f}) | "
              f"{'met' if res['ratio'] >= 0.95 else 'MISSED'} |")
    busy_all = [b for res in results for b in res["others_busy_cores"]]
    print(f"other processes (nice <= 0) kept {statistics.median(busy_all):.2f} CPUs busy before a "
          f"measurement (median; {min(busy_all):.2f}-{max(busy_all):.2f})")
    return results


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", type=Path, default=None, help="GGUF (default: the default model)")
    ap.add_argument("--state-dir", default=None, help="where the prepared file lives "
                    "(default: a temporary directory)")
    ap.add_argument("--threads", default="1,2", help="BLAS thread counts to run (default: 1,2)")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--dtype", choices=("f32", "f16"), default="f32",
                    help="prepared weights dtype (default: f32)")
    ap.add_argument("--profile", action="store_true",
                    help="also split a decode step at batch 1 and 8 by operation")
    ap.add_argument("--skip-load", action="store_true",
                    help="skip the weight load (populate + mlock) measurement")
    ap.add_argument("--anchor", action="store_true",
                    help="only the llama.cpp engine vs llama-bench tg64 (both models)")
    ap.add_argument("--anchor-models", default="smollm2,gemma3")
    ap.add_argument("--anchor-threads", type=int, default=None,
                    help="threads for both (default: the engine's default)")
    ap.add_argument("--rounds", type=int, default=5, help="--anchor rounds (default: 5)")
    ap.add_argument("--json", action="store_true", help="--anchor: print JSON too")
    ap.add_argument("--quiet-cpus", type=float, default=0.5,
                    help="--anchor: before each measurement, wait until other processes keep "
                         "at most this many CPUs busy (negative: do not wait)")
    ap.add_argument("--quiet-wait", type=float, default=60.0,
                    help="--anchor: longest wait for --quiet-cpus, seconds")
    args = ap.parse_args(argv)
    if args.anchor:
        from edge_agent.runtime.llamacpp import default_threads

        print(f"edge-agent vs llama-bench, {datetime.datetime.now().isoformat(timespec='seconds')}"
              f"; {os.cpu_count()} CPUs; load average "
              f"{', '.join(f'{x:.2f}' for x in os.getloadavg())}")
        res = bench_anchor(args.anchor_models.split(","),
                           args.anchor_threads or default_threads(), args.rounds,
                           quiet=(args.quiet_cpus, args.quiet_wait))
        if args.json:
            print(json.dumps(res, indent=2))
        return 0
    model = args.model or default_model_path()
    threads = [int(t) for t in args.threads.split(",")]

    print(f"edge-agent runtime benchmark, {datetime.datetime.now().isoformat(timespec='seconds')}")
    print(f"model {model.name} ({args.dtype} weights); numpy {np.__version__}; "
          f"{os.cpu_count()} CPUs; load average "
          f"{', '.join(f'{x:.2f}' for x in os.getloadavg())}")
    print(f"OPENBLAS_CORETYPE={os.environ.get('OPENBLAS_CORETYPE', '(unset)')}")
    if not blas_info():
        print("BLAS: threadpoolctl is not installed or sees no BLAS; kernel and threads unknown")
    for info in blas_info():
        print(f"BLAS: {info.get('internal_api')} {info.get('version')}, kernel "
              f"{info.get('architecture')}, {info.get('num_threads')} threads by default")

    with tempfile.TemporaryDirectory(prefix="edge-agent-bench-") as tmp:
        state = state_dir(args.state_dir) if args.state_dir else Path(tmp)
        t = time.perf_counter()
        prepared = prepare_model(model, state, dtype=args.dtype)
        print(f"prepared weights: {prepared} ({time.perf_counter() - t:.1f} s incl. sha256)")
        if not args.skip_load:
            bench_load(prepared, args.repeats)
        engine = Engine.load(model, state_dir=state, dtype=args.dtype, max_batch=max(BATCHES),
                             context=160)
        try:
            assert engine.weights is not None
            print(f"\nengine: {engine.weights.lock.summary()}; KV pool "
                  f"{_mib(engine.pool.nbytes)} ({engine.pool.n_blocks} blocks of 16 tokens)")
            results = bench_engine(engine, threads, args.repeats)
            if args.profile:
                bench_profile(engine, args.repeats)
            rss = _rss()
            print(f"\nRSS {_mib(rss['VmRSS'])} (weights {_mib(engine.weights.lock.weight_bytes)}, "
                  f"locked {_mib(rss.get('VmLck', 0))}, KV pool touched up to "
                  f"{_mib(engine.pool.nbytes)}; peak {_mib(rss['VmHWM'])} includes the "
                  "plain-read buffer)")
            best = max(threads, key=lambda n: results[n][1])
            bench_llama_cpp(model, best, results[best][1])
        finally:
            engine.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
