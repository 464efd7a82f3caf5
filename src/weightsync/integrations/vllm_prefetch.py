"""The engine side of ``weightsync bench --suite vllm-prefetch``: a vLLM engine's pause per update.

One process per path, started by :mod:`weightsync.apps.bench.vllm_prefetch` next to a writer
process that writes versions 1, 2, ... as fast as this reader applies them (staleness 0):

* ``engine``: the in-process :class:`~weightsync.engines.vllm.VLLMEngine` (``in_place=False``)
  with a :class:`~weightsync.roles.reader.WeightReader`, and a :class:`~weightsync.roles.prefetch.Prefetch`;
* ``backend``: the ``"weightsync"`` worker backend of an in-process ``LLM`` (the code a
  ``vllm serve`` worker runs), driven through vLLM's weight-transfer calls.

Measured side by side in one process: updates without prefetch (the engine cannot generate
during the whole sync: the pause is the sync); updates with prefetch, stepping the engine
(``batch`` greedy requests) while the next version arrives (tokens/s during a sync), then
the pause (aborting the running requests, as an RL driver's pause does, then ``apply``:
vLLM's reload, the cache reset and the version report) against the engine's own apply time,
then as long a window of generation with no sync (idle tokens/s, interleaved so that the
machine's load drifts alike in both). The last line is ``WSPREFETCH <json>``.

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
#: Engine steps after an apply counted in neither window (the first ones after a reload are slow).
SETTLE_STEPS = 3


class _Stepper:
    """Keeps ``batch`` greedy requests running and steps the engine one decode step at a time, so
    throughput is counted over exactly the steps taken while a sync is under way."""

    def __init__(self, llm: Any, batch: int) -> None:
        from vllm import SamplingParams
        from vllm.sampling_params import RequestOutputKind

        self.engine, self.batch, self.count = llm.llm_engine, batch, 0
        self.params = SamplingParams(temperature=0.0, max_tokens=64, ignore_eos=True, detokenize=False,
                                     output_kind=RequestOutputKind.DELTA)
        self.running: list[str] = []

    def step(self) -> int:
        """One engine step (new requests when none runs); the tokens it generated."""
        from vllm.inputs import TokensPrompt

        if not self.engine.has_unfinished_requests():
            self.running = []
            for b in range(self.batch):
                request = f"bench-{self.count}"
                self.count += 1
                prompt = TokensPrompt(prompt_token_ids=[(7 * i + 3 * b) % 500 + 4 for i in range(32)])
                self.engine.add_request(request, prompt, self.params)
                self.running.append(request)
        return sum(len(o.outputs[0].token_ids) for o in self.engine.step() if getattr(o, "outputs", None))

    def stop(self) -> None:
        """Abort what runs (an RL driver pauses generation so; the cache reset needs it idle)."""
        if self.running:
            self.engine.abort_request(self.running)
        while self.engine.has_unfinished_requests():
            self.engine.step()
        self.running = []


def _throughput(stepper: _Stepper, until: Callable[[], bool], *, min_seconds: float = 0.0,
                max_seconds: float = 600.0) -> tuple[float, float]:
    """Tokens per second over engine steps taken until ``until()`` (at least one, and ``min_seconds``)."""
    t0, n = time.perf_counter(), 0
    while True:
        n += stepper.step()
        elapsed = time.perf_counter() - t0
        if (until() and elapsed >= min_seconds) or elapsed > max_seconds:
            stepper.stop()
            return n / elapsed, elapsed


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m weightsync.integrations.vllm_prefetch")
    parser.add_argument("--checkpoint", required=True)
    parser.add_argument("--job", required=True)
    parser.add_argument("--path", choices=["engine", "backend"], required=True)
    parser.add_argument("--updates", type=int, default=3, help="updates timed in each mode")
    parser.add_argument("--transport", default="auto")
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--timeout", type=float, default=300.0)
    args = parser.parse_args(argv)
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    from vllm import LLM

    extra: dict[str, Any] = {"weight_transfer_config": {"backend": "weightsync"}} if args.path == "backend" else {}
    llm = LLM(model=args.checkpoint, dtype="float32", enforce_eager=True, max_model_len=256,
              max_num_seqs=args.batch, seed=0, kv_cache_memory_bytes=64 << 20, skip_tokenizer_init=True, **extra)
    generate = _Stepper(llm, args.batch)
    _throughput(generate, lambda: True, min_seconds=1.0)  # warm-up
    run = _engine_path if args.path == "engine" else _backend_path
    record = run(llm, args, generate)
    record["during_over_idle"] = record["during_tokens_per_s"] / record["idle_tokens_per_s"]
    print(PREFIX + json.dumps(record), flush=True)
    llm.llm_engine.engine_core.shutdown()
    return 0


def _engine_path(llm: Any, args: argparse.Namespace, generate: _Stepper) -> dict[str, Any]:
    from weightsync.engines.vllm import VLLMEngine
    from weightsync.roles.prefetch import Prefetch
    from weightsync.roles.reader import WeightReader
    from weightsync.session.sync_session import SyncConfig

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
        during: list[tuple[float, float]] = []  # (tokens, seconds) while a version arrived
        idle: list[tuple[float, float]] = []  # the same, right after, with no sync under way
        for _ in range(args.updates):
            version += 1
            t0 = time.perf_counter()
            prefetch.start(version)
            rate, elapsed = _throughput(generate, lambda: prefetch.received is not None)
            during.append((rate * elapsed, elapsed))
            t1 = time.perf_counter()
            result = prefetch.apply(version)
            prefetched.append({"pause": time.perf_counter() - t1, "apply": result.phases["apply"],
                               "sync": time.perf_counter() - t0})
            idle.append(_idle_window(generate, elapsed))
    return _summary(blocking, prefetched, during, idle)


def _backend_path(llm: Any, args: argparse.Namespace, generate: _Stepper) -> dict[str, Any]:
    from weightsync.engines.vllm import update_llm

    # One worker reader with prefetch on for both modes (the same staging): without overlap,
    # update_llm's start_weight_update is followed at once by update_weights.
    llm.init_weight_transfer_engine({"init_info": {"job": args.job, "rank": 0, "num_writers": 1, "num_readers": 1,
                                                   "timeout": args.timeout, "transport": args.transport,
                                                   "prefetch": True}})
    blocking: list[dict[str, float]] = []
    prefetched: list[dict[str, float]] = []
    during: list[tuple[float, float]] = []  # (tokens, seconds) while a version arrived
    idle: list[tuple[float, float]] = []  # the same, right after, with no sync under way

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
            during.append((rate * elapsed, elapsed))
            t1 = time.perf_counter()
            llm.update_weights({"update_info": {"version": version}})
            llm.finish_weight_update(weight_version=str(version))
            if not llm.reset_prefix_cache():
                raise RuntimeError("vLLM could not reset its prefix cache")
            prefetched.append({"pause": time.perf_counter() - t1, "apply": last_apply(),
                               "sync": time.perf_counter() - t0})
            idle.append(_idle_window(generate, elapsed))
    finally:
        llm.shutdown_weight_transfer_engine()
    return _summary(blocking, prefetched, during, idle)


def _idle_window(stepper: _Stepper, seconds: float) -> tuple[float, float]:
    """Tokens and seconds of generation with no sync under way, over a window as long as ``seconds``
    (interleaved with the sync windows, so that the machine's load drifts alike in both)."""
    for _ in range(SETTLE_STEPS):  # the first steps after a reload rebuild oneDNN's kernels: not idle speed
        stepper.step()
    t0 = time.perf_counter()
    rate, elapsed = _throughput(stepper, lambda: time.perf_counter() - t0 >= seconds)
    return rate * elapsed, elapsed


def _summary(blocking: list[dict[str, float]], prefetched: list[dict[str, float]],
             during: list[tuple[float, float]], idle: list[tuple[float, float]]) -> dict[str, Any]:
    def median(rows: list[dict[str, float]], key: str) -> float:
        values = sorted(r[key] for r in rows)
        return values[len(values) // 2]

    out: dict[str, Any] = {"updates": len(prefetched),
                           "during_tokens_per_s": sum(n for n, _ in during) / sum(s for _, s in during),
                           "idle_tokens_per_s": sum(n for n, _ in idle) / sum(s for _, s in idle),
                           "during_windows_s": [round(s, 3) for _, s in during]}
    for name, rows in (("blocking", blocking), ("prefetch", prefetched)):
        out |= {f"{name}_{k}_s": median(rows, k) for k in ("pause", "apply", "sync")}
    out["pause_over_apply"] = out["prefetch_pause_s"] / out["prefetch_apply_s"]
    out["pause_over_blocking_pause"] = out["prefetch_pause_s"] / out["blocking_pause_s"]
    return out


if __name__ == "__main__":
    sys.exit(main())
