"""An ``LLM`` whose engine core runs in a child process, as ``vllm serve`` runs it, with the
``"weightsync"`` backend: its worker stamps vLLM invalid when a version fails after phases of it
were loaded, and the next version recovers it. Run by ``tests/test_invalid_vllm.py``.

    python tests/_invalid_child_core.py --checkpoint A --seeds 1,2,3 --meta URL --token T

Version 1 (seed 1, what the engine holds) goes through; version 2 (seed 2) breaks off on the
trainer's side after phase 2 of 10 (the worker's receive of phase 3 times out after the phases
before it were loaded); version 3 (seed 3) recovers. After versions 2 and 3 a ``RESULT`` line
gives vLLM's weight version, the stamps of a greedy completion and its tokens.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import uuid
from typing import Any

PROMPT = [random.Random(0).randrange(4, 512) for _ in range(300)]
NEW_TOKENS = 16


def greedy(llm: Any) -> dict[str, Any]:
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    params = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True, detokenize=False)
    out = llm.generate([TokensPrompt(prompt_token_ids=PROMPT)], params, use_tqdm=False)[0].outputs[0]
    return {"tokens": list(out.token_ids), "stamps": [s.version for s in out.weight_versions or []],
            "weight_version": llm.get_weight_version()}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--checkpoint", required=True)
    parser.add_argument("--seeds", required=True)
    parser.add_argument("--meta", required=True)
    parser.add_argument("--token", required=True)
    args = parser.parse_args()
    seeds = [int(s) for s in args.seeds.split(",")]
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "1"
    from vllm import LLM

    from engine_faults import Trainer
    from weightsync.engines.vllm import update_llm
    from weightsync.session.sync_session import SyncConfig
    from weightsync.tools.tiny import tiny_config
    from weightsync.transport import TransportError, TransportOptions

    sync = SyncConfig(num_writers=1, num_readers=1, job=f"child-{uuid.uuid4().hex[:8]}", timeout=60,
                      layer_phases=True, transport_options=TransportOptions(max_bucket_bytes=1 << 16))
    llm = LLM(model=args.checkpoint, dtype="float32", enforce_eager=True, max_model_len=512, max_num_seqs=2, seed=0,
              kv_cache_memory_bytes=32 << 20, skip_tokenizer_init=True,
              weight_transfer_config={"backend": "weightsync"})
    wire = {k: v for k, v in sync.to_wire().items() if k not in ("host", "transport_host")}
    llm.init_weight_transfer_engine({"init_info": {**wire, "meta_address": args.meta, "meta_token": args.token,
                                                   "rank": 0}})
    trainer = Trainer(tiny_config(), sync, args.meta, args.token)
    try:
        done = trainer.write(1, seeds[0])
        update_llm(llm, 1)
        done.result(60)
        transport = trainer._writer.session.planned.transport
        send = transport.send

        def stops_after_phase_2(version: int, *, timeout: float, phase: int = 0) -> Any:
            if version == 2 and phase == 3:
                raise TransportError("injected: the trainer stopped after phase 2")
            return send(version, timeout=timeout, phase=phase)

        transport.send = stops_after_phase_2
        done = trainer.write(2, seeds[1])
        try:
            update_llm(llm, 2, timeout=5.0)
            error = ""
        except Exception as exc:  # the worker's error, through the engine core
            error = str(exc)
        done.exception(60)
        print("RESULT " + json.dumps({"error": error, **greedy(llm)}), flush=True)
        done = trainer.write(3, seeds[2])
        update_llm(llm, 3)
        done.result(60)
        print("RESULT " + json.dumps({"error": "", **greedy(llm)}), flush=True)
    finally:
        trainer.close()
        llm.shutdown_weight_transfer_engine()
        llm.llm_engine.engine_core.shutdown()


if __name__ == "__main__":
    main()
