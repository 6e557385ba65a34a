"""Serving metrics in the Prometheus text exposition format (version 0.0.4), without a client library.

Latencies follow the usual serving definitions: TTFT = first token time - arrival; ITL = the gap
between consecutive tokens of one sample; E2E = finish time - arrival. The model time of every engine
step (broadcast, forward on all ranks, logits back) is kept per parallel mode, with the tokens it ran,
so that the two Shift Parallelism modes can be compared on live traffic. Gauges (running, waiting, KV
usage) and scheduler counters (mode switches, preemptions) are read at scrape time.
"""

from __future__ import annotations

import bisect
import threading

LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
STEP_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0)


class Histogram:
    """Cumulative-bucket histogram, as Prometheus expects (`le` buckets, `_sum`, `_count`)."""

    def __init__(self, buckets: tuple[float, ...] = LATENCY_BUCKETS):
        self.buckets = buckets
        self.counts = [0] * (len(buckets) + 1)  # the last one is +Inf
        self.sum = 0.0
        self.count = 0

    def observe(self, value: float) -> None:
        self.counts[bisect.bisect_left(self.buckets, value)] += 1
        self.sum += value
        self.count += 1

    def render(self, name: str, help_text: str | None, labels: str = "") -> list[str]:
        """Exposition lines; `help_text=None` omits HELP/TYPE (further label sets of one metric);
        `labels` like `mode="tp"` goes in front of `le`."""
        lines = [] if help_text is None else [f"# HELP {name} {help_text}", f"# TYPE {name} histogram"]
        cumulative = 0
        for bound, count in zip((*self.buckets, float("inf")), self.counts):
            cumulative += count
            label = "+Inf" if bound == float("inf") else repr(bound)
            lines.append(f'{name}_bucket{{{labels}{"," if labels else ""}le="{label}"}} {cumulative}')
        braces = f"{{{labels}}}" if labels else ""
        lines += [f"{name}_sum{braces} {self.sum}", f"{name}_count{braces} {self.count}"]
        return lines


def _scalar(name: str, kind: str, help_text: str, value: float) -> list[str]:
    return [f"# HELP {name} {help_text}", f"# TYPE {name} {kind}", f"{name} {value}"]


class ServingMetrics:
    """Written by the engine thread, rendered by the HTTP thread; one lock, held by every method here
    and by nothing outside, keeps them consistent."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.ttft = Histogram()
        self.itl = Histogram()
        self.e2e = Histogram()
        self.prompt_tokens = 0
        self.generation_tokens = 0
        self.finished_requests: dict[str, int] = {}
        self.rejected_requests = 0
        self.step_seconds: dict[str, Histogram] = {}
        self.step_tokens: dict[str, int] = {}
        # mixture of experts: (token, choice) rows routed to each expert, summed over the MoE layers
        self.expert_rows: list[float] = []
        self.last_expert_rows: list[float] | None = None  # the last step's (the step log's)
        # speculative decoding: steps that verified drafts, draft tokens, drafts kept
        self.spec_drafts = self.spec_draft_tokens = self.spec_accepted_tokens = 0

    def record_prompt(self, num_tokens: int) -> None:
        with self._lock:
            self.prompt_tokens += num_tokens

    def record_token(self, ttft: float | None = None, itl: float | None = None) -> None:
        """One generated token; `ttft` on a request's first, `itl` since its sample's previous one."""
        with self._lock:
            self.generation_tokens += 1
            if ttft is not None:
                self.ttft.observe(ttft)
            if itl is not None:
                self.itl.observe(itl)

    def token_counts(self) -> tuple[int, int]:
        """(prompt tokens, generated tokens) so far."""
        with self._lock:
            return self.prompt_tokens, self.generation_tokens

    def record_step(self, mode: str, num_tokens: int, seconds: float) -> None:
        with self._lock:
            self.step_seconds.setdefault(mode, Histogram(STEP_BUCKETS)).observe(seconds)
            self.step_tokens[mode] = self.step_tokens.get(mode, 0) + num_tokens

    def record_expert_rows(self, rows: list[float]) -> None:
        """One step's rows per expert (a mixture-of-experts model's load balance)."""
        with self._lock:
            if not self.expert_rows:
                self.expert_rows = [0.0] * len(rows)
            self.expert_rows = [total + n for total, n in zip(self.expert_rows, rows)]
            self.last_expert_rows = rows

    def record_speculation(self, draft_tokens: int, accepted: int) -> None:
        """One sample's step verified `draft_tokens` drafts and kept `accepted` of them."""
        with self._lock:
            self.spec_drafts += 1
            self.spec_draft_tokens += draft_tokens
            self.spec_accepted_tokens += accepted

    def speculation_counts(self) -> tuple[int, int, int]:
        """(drafts, draft tokens, accepted tokens) so far."""
        with self._lock:
            return self.spec_drafts, self.spec_draft_tokens, self.spec_accepted_tokens

    def record_rejected(self) -> None:
        with self._lock:
            self.rejected_requests += 1

    def record_finished(self, reason: str, e2e: float | None = None) -> None:
        """A request ended (`reason`: stop, length, abort); `e2e`: its seconds since arrival."""
        with self._lock:
            self.finished_requests[reason] = self.finished_requests.get(reason, 0) + 1
            if e2e is not None:
                self.e2e.observe(e2e)

    def render(self, gauges: dict[str, tuple[str, float]], counters: dict[str, tuple[str, float]]) -> str:
        """Text exposition; `gauges`/`counters` map a metric name to (help, value) read at scrape time."""
        prefix = "shiftlm_"
        with self._lock:
            lines: list[str] = []
            for name, (help_text, value) in gauges.items():
                lines += _scalar(prefix + name, "gauge", help_text, value)
            for name, (help_text, value) in counters.items():
                lines += _scalar(prefix + name + "_total", "counter", help_text, value)
            lines += _scalar(
                prefix + "prompt_tokens_total", "counter", "Prompt tokens received.", self.prompt_tokens
            )
            lines += _scalar(
                prefix + "generation_tokens_total", "counter", "Tokens generated.", self.generation_tokens
            )
            lines += _scalar(
                prefix + "rejected_requests_total", "counter", "Requests refused.", self.rejected_requests
            )
            lines += [f"# HELP {prefix}request_success_total Finished requests by finish reason."]
            lines += [f"# TYPE {prefix}request_success_total counter"]
            lines += [
                f'{prefix}request_success_total{{finished_reason="{reason}"}} {count}'
                for reason, count in sorted(self.finished_requests.items())
            ]
            lines += self.ttft.render(prefix + "time_to_first_token_seconds", "Time to first token.")
            lines += self.itl.render(prefix + "inter_token_latency_seconds", "Time between tokens.")
            lines += self.e2e.render(prefix + "e2e_request_latency_seconds", "Request latency.")
            help_text = "Model time of one engine step (plan broadcast, forward, logits), by mode."
            for mode, histogram in sorted(self.step_seconds.items()):
                lines += histogram.render(prefix + "step_duration_seconds", help_text, f'mode="{mode}"')
                help_text = None
            if self.expert_rows:
                name = prefix + "moe_expert_rows_total"
                lines += [f"# HELP {name} Token rows routed to each expert (top-k choices, all MoE layers)."]
                lines += [f"# TYPE {name} counter"]
                lines += [f'{name}{{expert="{e}"}} {n:g}' for e, n in enumerate(self.expert_rows)]
            if self.spec_drafts:  # vLLM's spec_decode counters
                lines += _scalar(
                    prefix + "spec_decode_num_drafts_total",
                    "counter",
                    "Sample steps that verified drafted tokens.",
                    self.spec_drafts,
                )
                lines += _scalar(
                    prefix + "spec_decode_num_draft_tokens_total",
                    "counter",
                    "Drafted tokens verified.",
                    self.spec_draft_tokens,
                )
                lines += _scalar(
                    prefix + "spec_decode_num_accepted_tokens_total",
                    "counter",
                    "Drafted tokens kept (the draw agreed).",
                    self.spec_accepted_tokens,
                )
            lines += [f"# HELP {prefix}step_tokens_total Tokens run by engine steps, by mode."]
            lines += [f"# TYPE {prefix}step_tokens_total counter"]
            lines += [
                f'{prefix}step_tokens_total{{mode="{mode}"}} {count}'
                for mode, count in sorted(self.step_tokens.items())
            ]
        return "\n".join(lines) + "\n"


def step_record(plan, started: float, seconds: float, expert_rows: list[float] | None) -> dict:
    """One step's line of the step log (`--step-log`): its mode, tokens, sequences, decode rows
    (one new token, drafts aside), draft tokens, start (time.perf_counter(): the host's monotonic
    clock, comparable across processes), model seconds, and a mixture of experts' rows per expert."""
    record = {"step": plan.step, "mode": plan.mode.value, "tokens": plan.num_tokens}
    decodes = sum(len(chunk.token_ids) - chunk.draft == 1 for chunk in plan.chunks)
    record.update(seqs=len(plan.chunks), decodes=decodes, start=round(started, 6), seconds=round(seconds, 6))
    drafts = sum(chunk.draft for chunk in plan.chunks)
    if drafts:
        record["drafts"] = drafts
    if expert_rows is not None:
        record.update(
            expert_rows=[int(n) for n in expert_rows],
            expert_imbalance=round(max(expert_rows) / max(sum(expert_rows) / len(expert_rows), 1e-9), 3),
        )
    return record


def render_engine_metrics(engine) -> str:
    """The /metrics page of an `AsyncEngine`: its metrics plus gauges and counters read now."""
    stats = engine.stats()
    gauges = {
        "num_requests_running": ("Sequences in the running batch.", stats.running),
        "num_requests_waiting": ("Sequences waiting to be scheduled.", stats.waiting),
        "kv_cache_usage_ratio": ("Fraction of KV-cache blocks in use.", stats.kv_cache_usage),
        "num_requests_pending": (
            "Requests admitted and not finished (what --max-pending bounds).",
            getattr(engine, "num_pending", 0),
        ),
    }
    counters = {
        "mode_switches": ("Steps whose parallel mode differs from the previous step's.", stats.mode_switches),
        "preemptions": ("Sequences preempted (to be recomputed) for lack of KV blocks.", stats.preemptions),
        "prefix_cache_hit_tokens": (
            "Prompt tokens whose K/V came from the prefix cache.",
            stats.prefix_cache_hit_tokens,
        ),
        "failed_steps": ("Engine steps that raised (their requests got a 500).", stats.failed_steps),
    }
    counters.update(
        {
            f"steps_{mode}": (f"Engine steps run in {mode} mode.", count)
            for mode, count in stats.steps_per_mode.items()
        }
    )
    return engine.metrics.render(gauges, counters)


class StatsLogger:
    """vLLM's periodic line: prompt and generation throughput, running / waiting, KV-cache usage.
    `tick()` logs one line when anything happened since the last one (idle servers stay quiet)."""

    def __init__(self, engine, log, clock=None):
        import time

        self.engine, self.log, self.clock = engine, log, clock or time.monotonic
        self._last = (self.clock(), 0, 0)
        self._last_spec = (0, 0, 0)

    def tick(self) -> str | None:
        stats = self.engine.stats()
        prompt, generation = stats.prompt_tokens, stats.generation_tokens
        now = self.clock()
        last_time, last_prompt, last_generation = self._last
        self._last = (now, prompt, generation)
        running, waiting = stats.running, stats.waiting
        if prompt == last_prompt and generation == last_generation and not running and not waiting:
            return None
        seconds = max(now - last_time, 1e-9)
        line = (
            f"throughput: prompt {(prompt - last_prompt) / seconds:.1f} tokens/s, "
            f"generation {(generation - last_generation) / seconds:.1f} tokens/s; "
            f"running {running}, waiting {waiting}; "
            f"KV cache usage {100 * stats.kv_cache_usage:.1f}%"
        )
        spec = self.engine.metrics.speculation_counts()
        drafts, tokens, accepted = (now_ - last_ for now_, last_ in zip(spec, self._last_spec))
        self._last_spec = spec
        if drafts:  # vLLM's SpecDecoding line: what the drafts bought
            line += (
                f"; draft acceptance rate {100 * accepted / max(tokens, 1):.1f}%, "
                f"mean acceptance length {1 + accepted / drafts:.2f}"
            )
        self.log.info(line)
        return line
