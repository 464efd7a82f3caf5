"""The engine side of ``weightsync bench --suite vllm-prefetch``: a vLLM engine's pause per update.

One process per path, started by :mod:`weightsync.bench.vllm_prefetch` next to a writer
process that writes versions 1, 2, ... as fast as this reader applies them (staleness 0):

* ``engine``: the in-process :class:`~weightsync.engines.vllm.VLLMEngine` (``in_place=False``)
  with a :class:`~weightsync.reader.WeightReader`, and a :class:`~weightsync.reader.Prefetch`;
* ``backend``: the ``"weightsync"`` worker backend of an in-process ``LLM`` (the code a
  ``vllm serve`` worker runs), driven through vLLM's weight-transfer calls.

Measured side by side in one process: greedy generation throughput with no sync under way
(idle); updates without prefetch (the engine cannot generate during the whole sync: the pause
is the sync); updates with prefetch, generating while the next version arrives (throughput
during a sync), then the pause (``apply``: vLLM's reload, the cache reset and the version
report), against the engine's own apply time. The last line is ``WSPREFETCH <json>``.

    python -m weightsync.integrations.vllm_prefetch --checkpoint DIR --job J --path engine --updates 3
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from collections.abc import Callable
from typing import Any

PREFIX = "WSPREFETCH "


def _generator(llm: Any, batch: int, tokens: int) -> Callable[[], int]:
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    params = SamplingParams(temperature=0.0, max_tokens=tokens, ignore_eos=True, detokenize=False)
    prompts = [TokensPrompt(prompt_token_ids=[(7 * i + 3 * b) % 500 + 4 for i in range(32)]) for b in range(batch)]

    def generate() -> int:
        outs = llm.generate(prompts, params, use_tqdm=False)
        return sum(len(o.outputs[0].token_ids) for o in outs)

    return generate


def _throughput(generate: Callable[[], int], until: Callable[[], bool], *, min_seconds: float = 0.0,
                max_seconds: float = 600.0) -> tuple[float, float]:
    """Tokens per second of ``generate`` calls repeated until ``until()`` (and ``min_seconds``)."""
    t0, n = time.perf_counter(), 0
    while True:
        n += generate()
        elapsed = time.perf_counter() - t0
        if (until() and elapsed >= min_seconds) or elapsed > max_seconds:
            return n / elapsed, elapsed


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m weightsync.integrations.vllm_prefetch")
    parser.add_argument("--checkpoint", required=True)
    parser.add_argument("--job", required=True)
    parser.add_argument("--path", choices=["engine", "backend"], required=True)
    parser.add_argument("--updates", type=int, default=3, help="updates timed in each mode")
    parser.add_argument("--transport", default="auto")
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--tokens", type=int, default=16)
    parser.add_argument("--timeout", type=float, default=300.0)
    args = parser.parse_args(argv)
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    from vllm import LLM

    extra: dict[str, Any] = {"weight_transfer_config": {"backend": "weightsync"}} if args.path == "backend" else {}
    llm = LLM(model=args.checkpoint, dtype="float32", enforce_eager=True, max_model_len=256,
              max_num_seqs=args.batch, seed=0, kv_cache_memory_bytes=64 << 20, skip_tokenizer_init=True, **extra)
    generate = _generator(llm, args.batch, args.tokens)
    generate()  # warm-up
    idle, _ = _throughput(generate, lambda: True, min_seconds=3.0)
    run = _engine_path if args.path == "engine" else _backend_path
    record = run(llm, args, generate) | {"idle_tokens_per_s": idle}
    record["during_over_idle"] = record["during_tokens_per_s"] / idle
    print(PREFIX + json.dumps(record), flush=True)
    llm.llm_engine.engine_core.shutdown()
    return 0


def _engine_path(llm: Any, args: argparse.Namespace, generate: Callable[[], int]) -> dict[str, Any]:
    from weightsync.engines.vllm import VLLMEngine
    from weightsync.reader import Prefetch, WeightReader
    from weightsync.session import SyncConfig

    engine = VLLMEngine(llm, in_place=False)
    sync = SyncConfig(num_writers=1, num_readers=1, job=args.job, timeout=args.timeout, transport=args.transport)
    blocking: list[dict[str, float]] = []
    prefetched: list[dict[str, float]] = []
    with WeightReader(engine, rank=0, config=sync) as reader:
        reader.update(1)  # forms the transport and lays staging out
        version = 1
        for _ in range(args.updates):  # no prefetch: the engine waits for the whole sync
            version += 1
            t0 = time.perf_counter()
            result = reader.update(version)
            blocking.append({"pause": time.perf_counter() - t0, "apply": result.phases["apply"],
                             "sync": time.perf_counter() - t0})
        prefetch = Prefetch(reader)
        tokens = seconds = 0.0
        for _ in range(args.updates):
            version += 1
            t0 = time.perf_counter()
            prefetch.start(version)
            rate, elapsed = _throughput(generate, lambda: prefetch.received is not None)
            tokens, seconds = tokens + rate * elapsed, seconds + elapsed
            t1 = time.perf_counter()
            result = prefetch.apply(version)
            prefetched.append({"pause": time.perf_counter() - t1, "apply": result.phases["apply"],
                               "sync": time.perf_counter() - t0})
    return _summary(blocking, prefetched, tokens / seconds)


def _backend_path(llm: Any, args: argparse.Namespace, generate: Callable[[], int]) -> dict[str, Any]:
    from weightsync.engines.vllm import update_llm

    # One worker reader with prefetch on for both modes (the same staging): without overlap,
    # update_llm's start_weight_update is followed at once by update_weights.
    llm.init_weight_transfer_engine({"init_info": {"job": args.job, "rank": 0, "num_writers": 1, "num_readers": 1,
                                                   "timeout": args.timeout, "transport": args.transport,
                                                   "prefetch": True}})
    blocking: list[dict[str, float]] = []
    prefetched: list[dict[str, float]] = []
    tokens = seconds = 0.0

    def last_apply() -> float:
        return float(llm.collective_rpc(lambda w: w.weight_transfer_engine.last_result.phases["apply"])[0])

    def received() -> bool:
        return llm.collective_rpc(lambda w: w.weight_transfer_engine.prefetch.received)[0] is not None

    try:
        update_llm(llm, 1)
        version = 1
        for _ in range(args.updates):
            version += 1
            t0 = time.perf_counter()
            update_llm(llm, version)
            took = time.perf_counter() - t0
            blocking.append({"pause": took, "apply": last_apply(), "sync": took})
        for _ in range(args.updates):
            version += 1
            t0 = time.perf_counter()
            llm.start_weight_update()  # the worker starts receiving and returns
            rate, elapsed = _throughput(generate, received)
            tokens, seconds = tokens + rate * elapsed, seconds + elapsed
            t1 = time.perf_counter()
            llm.update_weights({"update_info": {"version": version}})
            llm.finish_weight_update(weight_version=str(version))
            if not llm.reset_prefix_cache():
                raise RuntimeError("vLLM could not reset its prefix cache")
            prefetched.append({"pause": time.perf_counter() - t1, "apply": last_apply(),
                               "sync": time.perf_counter() - t0})
    finally:
        llm.shutdown_weight_transfer_engine()
    return _summary(blocking, prefetched, tokens / seconds)


def _summary(blocking: list[dict[str, float]], prefetched: list[dict[str, float]], during: float) -> dict[str, Any]:
    def median(rows: list[dict[str, float]], key: str) -> float:
        values = sorted(r[key] for r in rows)
        return values[len(values) // 2]

    out: dict[str, Any] = {"updates": len(prefetched), "during_tokens_per_s": during}
    for name, rows in (("blocking", blocking), ("prefetch", prefetched)):
        out |= {f"{name}_{k}_s": median(rows, k) for k in ("pause", "apply", "sync")}
    out["pause_over_apply"] = out["prefetch_pause_s"] / out["prefetch_apply_s"]
    out["pause_over_blocking_pause"] = out["prefetch_pause_s"] / out["blocking_pause_s"]
    return out


if __name__ == "__main__":
    sys.exit(main())
