"""Resuming rollouts after their engine died: prefill saved and time to resume, KV restored against recomputed.

Two vLLM engines (each a process of its own, ``weightsync.integrations.vllm_rollout_host``) share
a KV store in ``/dev/shm``. ``--rollouts`` rollouts run ``--turns`` turns of a tool loop on engine
A (each turn ``--turn-tokens`` generated tokens, then ``--tool-tokens`` of tool result), saving
their KV as A computes it; then A is SIGKILLed. Each rollout's next turn then runs on engine B,
side by side in one run, in alternating order:

* ``restore``: B loads the blocks A saved for the rollout's version and computes the rest;
* ``recompute``: the same request without the store (B computes the whole context).

B's prefix cache is reset before each, so neither finds the context locally, and the store holds
exactly what A saved before each ``restore`` (B saves what it computes, too). Per rollout the
script reports the context length, the tokens restored (the connector's count) and computed
(vLLM's ``vllm:prompt_tokens_by_source``), and the time to resume: to the first token on B (a
1-token turn), as B's process CPU seconds (what the request cost B, whatever else the machine
runs) and wall seconds, the medians of ``--reps`` measurements; all must yield the same token.

    python benchmarks/rollout_resume.py [--model qwen3-30m] [--rollouts 4] [--prompt 512] [--turns 3] [--json]
"""

from __future__ import annotations

import argparse
import json
import os
import random
import secrets
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from weightsync.integrations.vllm_rollout_host import HostedTurnEngine
from weightsync.roles.rollouts import (
    KVStore,
    KVStoreConfig,
    Rollouts,
    RolloutStore,
    Sampling,
    ToolCall,
    Turn,
    TurnRequest,
)

LLM = {"dtype": "float32", "enforce_eager": True, "max_num_seqs": 4, "seed": 0}


def model_config(name: str, max_len: int) -> dict[str, Any]:
    from weightsync.apps.bench.vllm_memory import model_config as bench_config
    from weightsync.tools.tiny import tiny_config

    config = tiny_config() if name == "tiny" else bench_config(name)
    return {**config, "max_position_embeddings": max_len}


def tool_turn(turn: Turn, n: int) -> Turn:
    key = sum(turn.token_ids)
    return Turn(kind="tool", token_ids=tuple((key * (i + 3)) % 400 + 3 for i in range(n)),
                tool_call=ToolCall(name="lookup", arguments=json.dumps({"key": key})), tool_result=str(key))


def engine_cpu_seconds(engine: HostedTurnEngine) -> float:
    """CPU seconds the engine's process used so far (user + system): on a shared machine, the work
    a request cost, without the time the scheduler gave to other processes."""
    import psutil

    times = psutil.Process(engine.process.pid).cpu_times()
    return float(times.user + times.system)


def timed_first_token(engine: HostedTurnEngine, request: TurnRequest) -> tuple[float, float, Any, dict[str, int]]:
    """(wall s, engine CPU s, result, prefill counters) of one request, the prefix cache reset before."""
    engine.reset_prefix_cache()
    before = engine.info()["prefill"]
    cpu = engine_cpu_seconds(engine)
    start = time.perf_counter()
    result = engine.generate(request, timeout=600)
    seconds = time.perf_counter() - start
    cpu = engine_cpu_seconds(engine) - cpu
    after = engine.info()["prefill"]
    computed = {k: int(after.get(k, 0) - before.get(k, 0)) for k in ("local_compute", "external_kv_transfer")}
    return seconds, cpu, result, computed


def _snapshot(root: str, rollout: str, into: Path) -> Path:
    """A copy of the rollout's KV blocks (every layout) as the dead engine left them."""
    for path in Path(root).glob(f"*/{rollout}"):
        shutil.copytree(path, into / path.parent.name / rollout)
    return into


def _restore(root: str, rollout: str, snapshot: Path) -> None:
    for path in Path(root).glob(f"*/{rollout}"):
        shutil.rmtree(path)
    for path in snapshot.glob(f"*/{rollout}"):
        shutil.copytree(path, Path(root) / path.parent.name / rollout)


def run(args: argparse.Namespace) -> dict[str, Any]:
    tmp = Path(tempfile.mkdtemp(prefix="rollout-resume-"))
    directory = f"/dev/shm/weightsync-rl-bench-{secrets.token_hex(4)}"
    max_len = args.prompt + args.turns * (args.turn_tokens + args.tool_tokens) + 64
    from weightsync.tools.tiny import write_checkpoint

    write_checkpoint(tmp / "model", model_config(args.model, max_len), seed=1)
    llm = {**LLM, "max_model_len": max_len, "kv_cache_memory_bytes": args.kv_cache_mib << 20}
    engines = [HostedTurnEngine.spawn(str(tmp / "model"), name=name, version=1, kv_directory=directory,
                                      block_size=args.block_size, llm=llm, env={"HF_HUB_OFFLINE": "1"})
               for name in ("A", "B")]
    a, b = engines
    try:
        for engine in engines:
            engine.wait_ready(timeout=900)
        rollouts = Rollouts(RolloutStore(directory), KVStore(KVStoreConfig(directory=directory)))
        sampling = Sampling(temperature=0.0, max_tokens=args.turn_tokens, ignore_eos=True)
        ids = [f"r{i}" for i in range(args.rollouts)]
        rng = random.Random(0)
        for rid in ids:
            rollouts.start(rid, [rng.randrange(4, 400) for _ in range(args.prompt)], sampling=sampling)
            for _ in range(args.turns):
                turn = rollouts.generate(rid, [a], timeout=600, retain=False)
                rollouts.append_turn(rid, tool_turn(turn, args.tool_tokens))
        a.kill()
        assert rollouts.kv is not None
        saved = {rid: _snapshot(rollouts.kv.root, rid, tmp / "saved") for rid in ids}

        rows = []
        first = Sampling(temperature=0.0, max_tokens=1, ignore_eos=True)
        for i, rid in enumerate(ids):
            record = rollouts.record(rid)
            request = {mode: TurnRequest(rollout_id=rid, turn=len(record.turns), token_ids=record.token_ids(),
                                         sampling=first, seed=0, kv_version=1 if mode == "restore" else None)
                       for mode in ("restore", "recompute")}
            row: dict[str, Any] = {"rollout": rid, "context_tokens": len(record.token_ids())}
            wall: dict[str, list[float]] = {"restore": [], "recompute": []}
            cpu: dict[str, list[float]] = {"restore": [], "recompute": []}
            tokens = set()
            for rep in range(args.reps):
                for mode in ("restore", "recompute") if (i + rep) % 2 == 0 else ("recompute", "restore"):
                    if mode == "restore":  # only what A saved (B saves the blocks it computes, too)
                        _restore(rollouts.kv.root, rid, saved[rid])
                    seconds, cpu_s, result, computed = timed_first_token(b, request[mode])
                    wall[mode].append(seconds)
                    cpu[mode].append(cpu_s)
                    row[f"{mode}_computed_tokens"] = computed["local_compute"]
                    tokens.add(result.token_ids)
                    if mode == "restore":
                        row["restored_tokens"] = result.restored_tokens
                        row["restored_tokens_vllm"] = computed["external_kv_transfer"]
            for mode in ("restore", "recompute"):
                row[f"{mode}_s"] = round(statistics.median(wall[mode]), 4)
                row[f"{mode}_cpu_s"] = round(statistics.median(cpu[mode]), 4)
            row["same_token"] = len(tokens) == 1
            row["prefill_saved"] = round(row["restored_tokens"] / row["context_tokens"], 3)
            row["cpu_recompute_over_restore"] = round(row["recompute_cpu_s"] / row["restore_cpu_s"], 2)
            row["wall_recompute_over_restore"] = round(row["recompute_s"] / row["restore_s"], 2)
            rows.append(row)
        metrics = rollouts.kv.metrics() if rollouts.kv is not None else None
        return {
            "model": args.model, "prompt": args.prompt, "turns": args.turns, "turn_tokens": args.turn_tokens,
            "tool_tokens": args.tool_tokens, "block_size": args.block_size, "reps": args.reps, "rows": rows,
            "median_prefill_saved": statistics.median(r["prefill_saved"] for r in rows),
            **{f"median_{k}": statistics.median(r[k] for r in rows)
               for k in ("restore_s", "recompute_s", "restore_cpu_s", "recompute_cpu_s",
                         "cpu_recompute_over_restore", "wall_recompute_over_restore")},
            "kv_bytes_per_token": round(metrics.bytes / max(metrics.blocks, 1) / args.block_size) if metrics else 0,
            "load": os.getloadavg(),
        }
    finally:
        for engine in engines:
            engine.request_shutdown()
        for engine in engines:
            engine.close()
        shutil.rmtree(directory, ignore_errors=True)
        shutil.rmtree(tmp, ignore_errors=True)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="qwen3-30m", help="tiny, qwen3-30m, qwen3-0.2b, qwen3-0.4b")
    parser.add_argument("--rollouts", type=int, default=4)
    parser.add_argument("--prompt", type=int, default=512)
    parser.add_argument("--turns", type=int, default=3, help="complete turns on engine A before it is killed")
    parser.add_argument("--turn-tokens", type=int, default=32)
    parser.add_argument("--tool-tokens", type=int, default=32)
    parser.add_argument("--block-size", type=int, default=32)
    parser.add_argument("--kv-cache-mib", type=int, default=256)
    parser.add_argument("--reps", type=int, default=3, help="measurements of each mode per rollout (medians)")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args(argv)
    result = run(args)
    if args.json:
        print(json.dumps(result))
        return 0
    print("| rollout | context tokens | restored (connector / vLLM) | computed: restore / recompute | first token, "
          "engine CPU s: restore / recompute | ratio | wall s: restore / recompute | ratio | same token |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- | --- |")
    for r in result["rows"]:
        print(f"| {r['rollout']} | {r['context_tokens']} | {r['restored_tokens']} / {r['restored_tokens_vllm']} | "
              f"{r['restore_computed_tokens']} / {r['recompute_computed_tokens']} | {r['restore_cpu_s']} / "
              f"{r['recompute_cpu_s']} | {r['cpu_recompute_over_restore']} | {r['restore_s']} / {r['recompute_s']} | "
              f"{r['wall_recompute_over_restore']} | {r['same_token']} |")
    print(f"prefill saved per resumed rollout (median): {result['median_prefill_saved']:.1%}; time to resume "
          f"(first token on the new engine), engine CPU: {result['median_restore_cpu_s']:.3f} s restored against "
          f"{result['median_recompute_cpu_s']:.3f} s recomputed ({result['median_cpu_recompute_over_restore']}x); "
          f"wall: {result['median_restore_s']:.3f} s against {result['median_recompute_s']:.3f} s "
          f"({result['median_wall_recompute_over_restore']}x); {result['kv_bytes_per_token']} bytes of KV per token; "
          f"load {tuple(round(x, 1) for x in result['load'])}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
