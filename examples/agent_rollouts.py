"""A tool-calling agent loop whose rollouts survive the death of the engine that ran them.

Two vLLM engines, each a process of its own, share one rollout store and KV store under
``/dev/shm``. Each rollout alternates generated turns and tool results; after ``--kill-after``
turns the engine running them is SIGKILLed, and every rollout goes on on the other engine from
its last complete turn, with the KV its first engine saved (so the resumed engine prefills only
the tail of the context). The record of each rollout says what happened.

    python examples/agent_rollouts.py                  # a tiny random model it writes itself
    python examples/agent_rollouts.py --model PATH --rollouts 4 --turns 4 --kill-after 2

A real agent parses the tool call out of the text its tokenizer decodes (vLLM's tool parsers);
a random tiny model writes no JSON, so the loop here reads the call's argument from the last
tokens of each turn. Everything else is what a framework does with ``weightsync.roles.rollouts``.
"""

from __future__ import annotations

import argparse
import json
import secrets
import shutil
import tempfile
from pathlib import Path

from weightsync.integrations.vllm_rollout_host import HostedTurnEngine
from weightsync.roles.rollouts import KVStore, KVStoreConfig, Rollouts, RolloutStore, Sampling, ToolCall, Turn

LLM = {"dtype": "float32", "enforce_eager": True, "max_model_len": 1024, "max_num_seqs": 4, "seed": 0,
       "kv_cache_memory_bytes": 64 << 20}


def call_tool(turn: Turn) -> Turn:
    """The agent's tool: ``lookup(key)`` answers with a short deterministic record, as tokens."""
    key = sum(turn.token_ids[-4:])
    answer = f"{key * 31 % 1000:03d}"
    return Turn(kind="tool", token_ids=tuple(10 + int(d) for d in answer) + (3,),
                tool_call=ToolCall(name="lookup", arguments=json.dumps({"key": key}), call_id=f"call-{key}"),
                tool_result=answer)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", help="a checkpoint directory vLLM loads (default: a tiny random Qwen3)")
    parser.add_argument("--rollouts", type=int, default=2)
    parser.add_argument("--turns", type=int, default=3, help="generated turns per rollout")
    parser.add_argument("--kill-after", type=int, default=2, help="kill the first engine after this many turns")
    args = parser.parse_args()

    tmp = Path(tempfile.mkdtemp(prefix="agent-rollouts-"))
    directory = f"/dev/shm/weightsync-rl-example-{secrets.token_hex(4)}"
    model = args.model
    if model is None:
        from weightsync.tools.tiny import tiny_config, write_checkpoint

        model = str(tmp / "model")
        write_checkpoint(Path(model), tiny_config(), seed=1)
    engines = [HostedTurnEngine.spawn(model, name=name, version=1, kv_directory=directory, llm=LLM,
                                      env={"HF_HUB_OFFLINE": "1"}) for name in ("e0", "e1")]
    try:
        for engine in engines:
            engine.wait_ready(timeout=900)
        kv = KVStore(KVStoreConfig(directory=directory, budget_bytes=256 << 20))
        rollouts = Rollouts(RolloutStore(directory), kv)
        sampling = Sampling(temperature=0.0, max_tokens=24, ignore_eos=True, seed=7)
        ids = [f"agent-{i}" for i in range(args.rollouts)]
        for i, rid in enumerate(ids):
            rollouts.start(rid, [4 + (i * 37 + j * 11) % 500 for j in range(80)], sampling=sampling)

        fleet = list(engines)
        for turn_index in range(args.turns):
            if turn_index == args.kill_after:
                print(f"killing engine {fleet[0].name} with {len(ids)} rollouts in flight")
                fleet[0].kill()
            for rid in ids:
                turn = rollouts.generate(rid, fleet if turn_index >= args.kill_after else fleet[:1], timeout=300)
                if turn_index < args.turns - 1:
                    rollouts.append_turn(rid, call_tool(turn))

        for rid in ids:
            record = rollouts.finish(rid)
            kinds = " ".join(f"{t.kind}[{len(t.token_ids)}]" + (f"@{t.engine}/v{t.weight_version}"
                                                                 if t.kind == "generated" else "")
                             for t in record.turns)
            print(f"{rid}: {kinds}")
            for resume in record.resumes:
                print(f"  resumed at turn {resume.turn}: {resume.from_engine} -> {resume.to_engine} ({resume.reason})")
        m = kv.metrics()
        print(f"KV store: {m.saved_blocks} blocks saved, {m.loaded_blocks} loaded by the resuming engine, "
              f"{m.dropped_finished_blocks} dropped when the rollouts finished, {m.bytes} bytes left")
        survivor = fleet[-1].info()["kv"]  # the connector's figures on the engine's Prometheus registry
        print(f"{fleet[-1].name}'s vllm:weightsync_kv_* metrics: {int(survivor['loaded_blocks'])} blocks loaded "
              f"({int(survivor['loaded_bytes'])} bytes), {int(survivor['missed_blocks'])} missed")
    finally:
        for engine in engines:
            engine.request_shutdown()
        for engine in engines:
            engine.close()
        shutil.rmtree(directory, ignore_errors=True)
        shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    main()
