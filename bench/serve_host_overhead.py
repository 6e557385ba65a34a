"""Host-side costs of a serving step that no model time hides: decoding a decode step's plan (the
fast path against the general one, `plan_codec.decode_plan(fast_decode=...)`), and suffix decoding's
tries (bytes a node, microseconds to index a token, a full garbage collection with them alive).

    python bench/serve_host_overhead.py [--json]     # ~20 s; writes bench/results/serve_host_overhead.json

Plans: B one-token decode chunks at positions 100..100+B, block size 16, no new blocks (a steady
decode step). Tries: depth 24 (vLLM's default) over 8 prompts of Python standard library source
tokenized by code point (the trie's cost depends on how often substrings repeat, which source shows).
"""

from __future__ import annotations

import argparse
import gc
import json
import statistics
import sysconfig
import time
import tracemalloc
from pathlib import Path

from shiftlm.serve.engine.suffix_tree import SuffixTrie
from shiftlm.serve.plan import Mode, ScheduledChunk, StepPlan
from shiftlm.serve.worker.plan_codec import BlockTables, decode_plan, encode_plan

ROOT = Path(__file__).resolve().parent.parent


def plan_decode_ms(batch: int, fast: bool, reps: int = 300) -> float:
    chunks = tuple(
        ScheduledChunk(i, (7,), 100 + i, (), True, row=i, first_block=(100 + i) // 16) for i in range(batch)
    )
    message = encode_plan(StepPlan(0, Mode.TP, chunks))
    tables = BlockTables(64, rows=batch)
    times = []
    for _ in range(reps):
        started = time.perf_counter()
        decode_plan(message, tables, 16, fast_decode=fast)
        times.append(time.perf_counter() - started)
    return 1000 * statistics.median(times)


def stdlib_texts(count: int = 8, chars: int = 3000) -> list[list[int]]:
    files = sorted(Path(sysconfig.get_paths()["stdlib"]).glob("*.py"))[: count * 5 : 5]
    return [[ord(c) for c in f.read_text(errors="replace")[:chars]] for f in files]


def tries(depth: int = 24) -> dict:
    texts = stdlib_texts()
    gc.collect()
    started = time.perf_counter()
    gc.collect()
    baseline = time.perf_counter() - started  # this process's own objects (torch's among them)
    tracemalloc.start()
    before = tracemalloc.get_traced_memory()[0]
    started = time.perf_counter()
    kept = []
    for text in texts:
        trie = SuffixTrie(depth)
        trie.add(text)
        kept.append(trie)
    seconds = time.perf_counter() - started
    size = tracemalloc.get_traced_memory()[0] - before
    tracemalloc.stop()
    nodes = sum(t.num_nodes for t in kept)
    tokens = sum(map(len, texts))
    started = time.perf_counter()
    gc.collect()
    collect = time.perf_counter() - started
    return {
        "tokens": tokens,
        "nodes": nodes,
        "bytes_per_node": size / nodes,
        "megabytes": size / 1e6,
        "index_us_per_token": 1e6 * seconds / tokens,
        "full_gc_ms_with_tries_alive": 1000 * collect,
        "full_gc_ms_without": 1000 * baseline,
    }


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--out", default=str(ROOT / "bench" / "results" / "serve_host_overhead.json"))
    parser.add_argument("--json", action="store_true", help="print the result as one JSON object")
    args = parser.parse_args()
    plans = {
        batch: {"fast_ms": plan_decode_ms(batch, True), "general_ms": plan_decode_ms(batch, False)}
        for batch in (1, 8, 64)
    }
    result = {"decode_plan": plans, "suffix_tries": tries()}
    Path(args.out).write_text(json.dumps(result, indent=1) + "\n")
    if args.json:
        print(json.dumps(result))
        return 0
    for batch, row in plans.items():
        print(
            f"decode_plan, {batch:2d} decode rows: {row['fast_ms']:.3f} ms fast path, "
            f"{row['general_ms']:.3f} ms general ({row['general_ms'] / row['fast_ms']:.1f}x)"
        )
    t = result["suffix_tries"]
    print(
        f"suffix tries, depth 24: {t['tokens']} tokens -> {t['nodes']} nodes, {t['bytes_per_node']:.0f} "
        f"bytes a node ({t['megabytes']:.1f} MB), {t['index_us_per_token']:.1f} us a token to index, "
        f"a full gc.collect() {t['full_gc_ms_with_tries_alive']:.1f} ms with them alive "
        f"({t['full_gc_ms_without']:.1f} ms without)"
    )
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
