"""``weightsync doctor --engines``: update a live vLLM engine through weightsync, and prove it.

The proof is :mod:`weightsync.integrations.selfcheck`'s (version 1 changes the greedy output,
version 2 restores it token for token), on a vLLM ``LLM``. It runs in a child process (an
in-process vLLM binds threads and sets global parallel state), on the GPU when there is one.

    ok, detail = self_check(timeout=300)
    python -m weightsync.integrations.vllm_selfcheck        # what self_check runs; prints one JSON line
"""

from __future__ import annotations

import json
import os
import sys
import tempfile
from pathlib import Path
from typing import Any

from weightsync.integrations.selfcheck import round_trip, run_child, verdict

PREFIX = "WSVLLMCHECK "


def self_check(*, timeout: float) -> tuple[bool, str]:
    """Run the check in a child process; (passed, what happened)."""
    return run_child("weightsync.integrations.vllm_selfcheck", PREFIX, what="vLLM", timeout=timeout,
                     env={"VLLM_ENABLE_V1_MULTIPROCESSING": "0", "HF_HUB_OFFLINE": "1", "VLLM_HOST_IP": "127.0.0.1",
                          "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "2")})


def _greedy(llm: Any) -> list[int]:
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    params = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True, detokenize=False)
    prompt = TokensPrompt(prompt_token_ids=[(7 * i + 3) % 500 + 4 for i in range(40)])
    return list(llm.generate([prompt], params, use_tqdm=False)[0].outputs[0].token_ids)


def main() -> int:
    import torch
    from vllm import LLM

    from weightsync.engines.vllm import VLLMEngine
    from weightsync.meta import EmbeddedMetaServer
    from weightsync.tools.tiny import canonical_weights, tiny_config, write_checkpoint

    device = "cuda" if torch.cuda.is_available() else "cpu"
    config = tiny_config()
    with tempfile.TemporaryDirectory(prefix="weightsync-selfcheck-") as tmp, EmbeddedMetaServer() as server:
        b = write_checkpoint(Path(tmp) / "B", config, seed=2)
        llm = LLM(model=str(Path(tmp) / "B"), dtype="float32", enforce_eager=True, max_model_len=256, max_num_seqs=1,
                  seed=0, kv_cache_memory_bytes=32 << 20, skip_tokenizer_init=True)
        ref_b = _greedy(llm)
        out_a, out_b, results = round_trip(VLLMEngine(llm), lambda: _greedy(llm), config, server,
                                           (canonical_weights(config, seed=1), b))
        ok, detail = verdict(out_a, out_b, ref_b, where=f"on {device}: ")
        if ok:
            detail += (f" ({sum(r.nbytes for r in results)} bytes, "
                       f"{sum(r.seconds for r in results):.2f}s)")
        print(PREFIX + json.dumps({"ok": ok, "detail": detail}), flush=True)
        llm.llm_engine.engine_core.shutdown()
    return 0


if __name__ == "__main__":
    sys.exit(main())
