"""Prometheus text exposition (format 0.0.4) of the daemon's counters and histograms.

Invariants owned here:
- Counters only go up; histograms are cumulative with a final `+Inf` bucket equal to `_count`.
- Rendering reads live gauges (queue depth, locked bytes, free KV blocks) through callables
  passed in, so /metrics never disagrees with /health at the same instant.
- A value that is an integer prints as one, every digit (538060032, never 5.3806e+08);
  other values print with full float precision (`format_value`).
- Per-model families (requests, tokens, histograms) carry a `model` label; a histogram has
  samples only for the models it has observed. `edge_agent_build_info{version}` is always 1.
"""

from __future__ import annotations

import bisect
import math
from collections import defaultdict
from collections.abc import Callable, Sequence
from typing import Any

from edge_agent import __version__

__all__ = ["Histogram", "Metrics", "format_value"]

LATENCY_BUCKETS = (0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0)
BATCH_BUCKETS = (1, 2, 4, 8, 16, 32)
STEP_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5)


def format_value(value: float) -> str:
    """A sample value in Prometheus text: integers exactly, floats at full precision."""
    if isinstance(value, bool):
        return str(int(value))
    if isinstance(value, int):
        return str(value)
    v = float(value)
    if math.isnan(v):
        return "NaN"
    if math.isinf(v):
        return "+Inf" if v > 0 else "-Inf"
    if v.is_integer() and abs(v) < 2**53:
        return str(int(v))
    return repr(v)


class Histogram:
    def __init__(self, buckets: Sequence[float]) -> None:
        self.buckets = tuple(buckets)
        self.counts = [0] * (len(self.buckets) + 1)
        self.sum = 0.0
        self.count = 0

    def observe(self, value: float) -> None:
        self.counts[bisect.bisect_left(self.buckets, value)] += 1
        self.sum += value
        self.count += 1

    def render(self, name: str, labels: str = "") -> list[str]:
        sep = "," if labels else ""
        out, acc = [], 0
        for bound, n in zip((*self.buckets, float("inf")), self.counts, strict=True):
            acc += n
            le = "+Inf" if bound == float("inf") else repr(bound)
            out.append(f'{name}_bucket{{{labels}{sep}le="{le}"}} {acc}')
        lab = f"{{{labels}}}" if labels else ""
        out += [f"{name}_sum{lab} {self.sum:.6f}", f"{name}_count{lab} {self.count}"]
        return out


class Metrics:
    def __init__(self) -> None:
        self.requests: dict[tuple[str, str], int] = defaultdict(int)  # (model, outcome)
        self.tokens: dict[str, int] = defaultdict(int)
        self.messages: dict[str, int] = defaultdict(int)  # runner step messages
        self.prompt_tokens: dict[str, int] = defaultdict(int)
        self.prompt_cache_hit_tokens: dict[str, int] = defaultdict(int)  # of prompt_tokens
        self.prompt_cache_hits: dict[str, int] = defaultdict(int)  # requests with any
        self.model_events: dict[tuple[str, str], int] = defaultdict(int)
        # per model (the `model` label)
        self.batch: dict[str, Histogram] = defaultdict(lambda: Histogram(BATCH_BUCKETS))
        self.ttft: dict[str, Histogram] = defaultdict(lambda: Histogram(LATENCY_BUCKETS))
        self.latency: dict[str, Histogram] = defaultdict(lambda: Histogram(LATENCY_BUCKETS))
        self.step_seconds: dict[str, Histogram] = defaultdict(lambda: Histogram(STEP_BUCKETS))

    def observe_step(self, model: str, batch: int, tokens: int, step_s: float,
                     steps: int = 1) -> None:
        """One runner message: `steps` decode steps (runtime.step_window_ms) of `batch`
        sequences in `step_s`; each step is observed with its share of the time."""
        self.messages[model] += 1
        if batch:
            for _ in range(max(1, steps)):
                self.batch[model].observe(batch)
                self.step_seconds[model].observe(step_s / max(1, steps))
        self.tokens[model] += tokens

    def request_done(self, rec: Any, outcome: str) -> None:
        import time

        self.requests[(rec.model, outcome)] += 1
        self.prompt_tokens[rec.model] += int(getattr(rec, "prompt_tokens", 0) or 0)
        cached = int(getattr(rec, "cached_tokens", 0) or 0)
        self.prompt_cache_hit_tokens[rec.model] += cached
        self.prompt_cache_hits[rec.model] += cached > 0
        now = time.monotonic()
        self.latency[rec.model].observe(now - rec.submitted_mono)
        if rec.first_token_at is not None:
            self.ttft[rec.model].observe(rec.first_token_at - rec.submitted_mono)

    def model_event(self, model: str, event: str) -> None:
        self.model_events[(model, event)] += 1

    def render(self, gauges: Callable[[], dict[str, list[tuple[str, float]]]]) -> str:
        lines: list[str] = []

        def family(name: str, kind: str, help_: str) -> None:
            lines.append(f"# HELP {name} {help_}")
            lines.append(f"# TYPE {name} {kind}")

        family("edge_agent_build_info", "gauge", "Always 1; the daemon's version in a label.")
        lines.append(f'edge_agent_build_info{{version="{__version__}"}} 1')
        family("edge_agent_requests_total", "counter", "Requests finished, by model and outcome.")
        for (model, outcome), n in sorted(self.requests.items()):
            lines.append(f'edge_agent_requests_total{{model="{model}",outcome="{outcome}"}} {n}')
        family("edge_agent_tokens_generated_total", "counter", "Tokens sampled by runners.")
        for model, n in sorted(self.tokens.items()):
            lines.append(f'edge_agent_tokens_generated_total{{model="{model}"}} {n}')
        family("edge_agent_runner_messages_total", "counter",
               "Step messages answered by runners (each runs up to runtime.step_window_ms "
               "of decode steps).")
        for model, n in sorted(self.messages.items()):
            lines.append(f'edge_agent_runner_messages_total{{model="{model}"}} {n}')
        family("edge_agent_prompt_tokens_total", "counter",
               "Prompt tokens of finished requests (every outcome), by model.")
        for model, n in sorted(self.prompt_tokens.items()):
            lines.append(f'edge_agent_prompt_tokens_total{{model="{model}"}} {n}')
        family("edge_agent_prompt_cache_hit_tokens_total", "counter",
               "Prompt tokens of finished requests the runner's prompt cache held (not "
               "prefilled again), by model.")
        for model in sorted(self.prompt_tokens):
            lines.append(f'edge_agent_prompt_cache_hit_tokens_total{{model="{model}"}} '
                         f'{self.prompt_cache_hit_tokens.get(model, 0)}')
        family("edge_agent_model_events_total", "counter", "Model loads, unloads, failures.")
        for (model, event), n in sorted(self.model_events.items()):
            lines.append(f'edge_agent_model_events_total{{model="{model}",event="{event}"}} {n}')
        for name, hists, help_ in (
                ("edge_agent_batch_size", self.batch, "Sequences per decode step."),
                ("edge_agent_step_seconds", self.step_seconds,
                 "Decode step wall time (a runner message's time, shared by its steps)."),
                ("edge_agent_ttft_seconds", self.ttft, "Submission to first token."),
                ("edge_agent_request_latency_seconds", self.latency,
                 "Submission to completion.")):
            family(name, "histogram", help_)
            for model, hist in sorted(hists.items()):
                lines += hist.render(name, f'model="{model}"')
        for name, samples in gauges().items():
            family(name, "gauge", name.replace("edge_agent_", "").replace("_", " "))
            for labels, value in samples:
                lab = f"{{{labels}}}" if labels else ""
                lines.append(f"{name}{lab} {format_value(value)}")
        return "\n".join(lines) + "\n"
