"""``weightsync doctor --engines``: update a live vLLM engine through weightsync, and prove it.

One engine, started on a tiny checkpoint B (``weightsync.tiny``), generates greedily; a
weightsync writer then syncs version 1 (weights A) into it, the output must change, and
version 2 (B again) must bring back B's greedy output token for token. One engine start,
and the update is shown both to take effect and to be exact. Runs in a child process (an
in-process vLLM binds threads and sets global parallel state), on the GPU when there is one.

    ok, detail = self_check(timeout=300)
    python -m weightsync.integrations.vllm_selfcheck        # what self_check runs; prints one JSON line
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import threading
from pathlib import Path
from typing import Any

PREFIX = "WSVLLMCHECK "


def self_check(*, timeout: float) -> tuple[bool, str]:
    """Run the check in a child process; (passed, what happened)."""
    env = {**os.environ, "VLLM_ENABLE_V1_MULTIPROCESSING": "0", "HF_HUB_OFFLINE": "1",
           "VLLM_HOST_IP": "127.0.0.1", "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "2")}
    try:
        proc = subprocess.run([sys.executable, "-m", "weightsync.integrations.vllm_selfcheck"], env=env, text=True,
                              capture_output=True, timeout=timeout, check=False)
    except subprocess.TimeoutExpired:
        return False, f"the vLLM self-check did not finish within {timeout:.0f}s"
    lines = [line[len(PREFIX):] for line in proc.stdout.splitlines() if line.startswith(PREFIX)]
    if proc.returncode != 0 or not lines:
        tail = " | ".join(proc.stderr.strip().splitlines()[-3:])
        return False, f"exit {proc.returncode}: {tail}"[:500]
    out = json.loads(lines[-1])
    return bool(out["ok"]), str(out["detail"])


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
    from weightsync.meta.client import MetaClient
    from weightsync.reader import WeightReader
    from weightsync.session import SyncConfig
    from weightsync.tiny import CanonicalSource, canonical_weights, tiny_config, write_checkpoint
    from weightsync.torch_layout import fill_from_canonical
    from weightsync.writer import WeightWriter

    device = "cuda" if torch.cuda.is_available() else "cpu"
    config = tiny_config()
    with tempfile.TemporaryDirectory(prefix="weightsync-selfcheck-") as tmp, EmbeddedMetaServer() as server:
        b = write_checkpoint(Path(tmp) / "B", config, seed=2)
        a = canonical_weights(config, seed=1)
        llm = LLM(model=str(Path(tmp) / "B"), dtype="float32", enforce_eager=True, max_model_len=256, max_num_seqs=1,
                  seed=0, kv_cache_memory_bytes=32 << 20, skip_tokenizer_init=True)
        ref_b = _greedy(llm)
        sync = SyncConfig(num_writers=1, num_readers=1, job="selfcheck", timeout=120.0)
        engine = VLLMEngine(llm)
        source = CanonicalSource.beside(engine, config)  # the engine stages on GPU where there is one
        errors: list[BaseException] = []

        def train() -> None:
            try:
                with WeightWriter(source, rank=0, config=sync,
                                  meta=MetaClient(server.address, job="selfcheck", token=server.token)) as writer:
                    for version, weights in ((1, a), (2, b)):
                        fill_from_canonical(source.layout(), source.tensors(), weights)
                        writer.write(version)
            except BaseException as exc:  # reported by the main thread
                errors.append(exc)

        trainer = threading.Thread(target=train, name="selfcheck-trainer")
        trainer.start()
        with WeightReader(engine, rank=0, config=sync,
                          meta=MetaClient(server.address, job="selfcheck", token=server.token)) as reader:
            first = reader.update(1)
            out_a = _greedy(llm)
            second = reader.update(2)
            out_b = _greedy(llm)
        trainer.join(120)
        if errors:
            raise errors[0]
        ok = out_a != ref_b and out_b == ref_b
        detail = (f"on {device}: version 1 changed the output, version 2 restored it token for token "
                  f"({first.nbytes + second.nbytes} bytes, {first.seconds + second.seconds:.2f}s)" if ok else
                  f"on {device}: outputs {'did not change' if out_a == ref_b else 'were not restored'} "
                  "after the updates")
        print(PREFIX + json.dumps({"ok": ok, "detail": detail}), flush=True)
        llm.llm_engine.engine_core.shutdown()
    return 0


if __name__ == "__main__":
    sys.exit(main())
