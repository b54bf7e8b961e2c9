"""Runtime benchmark (run on demand: `make bench` or `.venv/bin/python bench/runtime.py`).

Prints, from one run: the BLAS kernel threadpoolctl sees, weight load time (mmap populate +
mlock) as a ratio to a plain read of the same bytes, prefill tok/s on a 128-token prompt,
single-stream decode tok/s, aggregate decode tok/s at batch 1, 4, 8, 16, 32 (per BLAS thread
count asked for), RSS, and llama-cpp-python's single-stream decode on the same GGUF as a ratio
when it is installed. Targets: batch-16 aggregate >= 6x single stream; populate + lock <= 1.2x
the raw read. Ratios are measured in the same run; absolute figures vary with machine load.
OPENBLAS_CORETYPE is reported, never changed.
"""

from __future__ import annotations

import argparse
import datetime
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

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


def _decode(engine: Engine, prompt: list[int], b: int) -> float:
    """Aggregate tok/s of DECODE_STEPS batched steps over b sequences of ragged lengths."""
    greedy = SamplingParams(max_tokens=10_000, ignore_eos=True)
    names = [f"s{i}" for i in range(b)]
    for i, name in enumerate(names):  # prompts of 8..23 tokens
        engine.add(name, prompt[i % 16 : i % 16 + 8 + i % 16], greedy)
    engine.step(names)  # warm-up step
    t = time.perf_counter()
    for _ in range(DECODE_STEPS):
        engine.step(names)
    dt = time.perf_counter() - t
    for name in names:
        engine.release(name)
    return b * DECODE_STEPS / dt


def bench_engine(engine: Engine, threads: list[int], repeats: int) -> dict[int, dict[int, float]]:
    """Rounds interleave every (threads, batch) cell so load drift hits all cells alike;
    medians over rounds, and ratios to single stream taken within each round."""
    prompt = _prompt_ids(engine, 128)
    pre: dict[int, list[float]] = {n: [] for n in threads}
    dec: dict[int, dict[int, list[float]]] = {n: {b: [] for b in BATCHES} for n in threads}
    for _ in range(repeats):
        for n in threads:
            engine.threads = n
            pre[n].append(_prefill(engine, prompt))
            for b in BATCHES:
                dec[n][b].append(_decode(engine, prompt, b))
    med = statistics.median
    out: dict[int, dict[int, float]] = {}
    for n in threads:
        print(f"\nBLAS threads = {n} (median of {repeats} interleaved rounds)")
        print(f"  prefill, 128-token prompt   : {med(pre[n]):7.1f} tok/s")
        out[n] = {b: med(dec[n][b]) for b in BATCHES}
        for b in BATCHES:
            ratio = med(x / y for x, y in zip(dec[n][b], dec[n][1], strict=True))
            label = "single-stream decode" if b == 1 else f"aggregate decode, batch {b:2}"
            extra = "" if b == 1 else f"  ({ratio:.1f}x single stream)"
            print(f"  {label:28}: {out[n][b]:7.1f} tok/s{extra}")
        r16 = med(x / y for x, y in zip(dec[n][16], dec[n][1], strict=True))
        print(f"  target batch 16 >= 6x single stream: {r16:.1f}x "
              f"{'PASS' if r16 >= 6 else 'FAIL'}")
    return out


def bench_llama_cpp(model: Path, threads: int, ours: float) -> None:
    try:
        import llama_cpp  # type: ignore[import-not-found]
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


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", type=Path, default=None, help="GGUF (default: the default model)")
    ap.add_argument("--state-dir", default=None, help="where the prepared file lives "
                    "(default: a temporary directory)")
    ap.add_argument("--threads", default="1,2", help="BLAS thread counts to run (default: 1,2)")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--dtype", choices=("f32", "f16"), default="f32",
                    help="prepared weights dtype (default: f32)")
    args = ap.parse_args(argv)
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
        bench_load(prepared, args.repeats)
        engine = Engine.load(model, state_dir=state, dtype=args.dtype, max_batch=max(BATCHES),
                             context=160)
        try:
            assert engine.weights is not None
            print(f"\nengine: {engine.weights.lock.summary()}; KV pool "
                  f"{_mib(engine.pool.nbytes)} ({engine.pool.n_blocks} blocks of 16 tokens)")
            results = bench_engine(engine, threads, args.repeats)
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
