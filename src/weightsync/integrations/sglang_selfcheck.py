"""``weightsync doctor --engines``: update a live SGLang engine through weightsync (GPU only).

The same proof as :mod:`weightsync.integrations.vllm_selfcheck`: an engine started on a tiny
checkpoint B, version 1 (weights A) changes its greedy output, version 2 (B) restores it
token for token. ``mode="tensor"`` (staged CUDA tensors handed over by IPC), one GPU.

    python -m weightsync.integrations.sglang_selfcheck      # prints one JSON line
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

PREFIX = "WSSGLANGCHECK "


def self_check(*, timeout: float) -> tuple[bool, str]:
    """Run the check in a child process; (passed, what happened)."""
    try:
        proc = subprocess.run([sys.executable, "-m", "weightsync.integrations.sglang_selfcheck"], text=True,
                              capture_output=True, timeout=timeout, check=False,
                              env={**os.environ, "HF_HUB_OFFLINE": "1"})
    except subprocess.TimeoutExpired:
        return False, f"the SGLang self-check did not finish within {timeout:.0f}s"
    lines = [line[len(PREFIX):] for line in proc.stdout.splitlines() if line.startswith(PREFIX)]
    if proc.returncode != 0 or not lines:
        return False, f"exit {proc.returncode}: {' | '.join(proc.stderr.strip().splitlines()[-3:])}"[:500]
    out = json.loads(lines[-1])
    return bool(out["ok"]), str(out["detail"])


def _greedy(engine: Any) -> list[int]:
    prompt = [(7 * i + 3) % 500 + 4 for i in range(40)]
    params = {"temperature": 0.0, "max_new_tokens": 16, "ignore_eos": True}
    return list(engine.generate(input_ids=prompt, sampling_params=params)["output_ids"])


def main() -> int:
    import sglang
    import torch

    from weightsync.engines.sglang import SGLangEngine
    from weightsync.meta import EmbeddedMetaServer
    from weightsync.meta.client import MetaClient
    from weightsync.reader import WeightReader
    from weightsync.session import SyncConfig
    from weightsync.tiny import CanonicalSource, canonical_weights, tiny_config, write_checkpoint
    from weightsync.torch_layout import fill_from_canonical
    from weightsync.writer import WeightWriter

    config = tiny_config(tie=True)
    with tempfile.TemporaryDirectory(prefix="weightsync-selfcheck-") as tmp, EmbeddedMetaServer() as server:
        b = write_checkpoint(Path(tmp) / "B", config, seed=2)
        a = canonical_weights(config, seed=1)
        engine = sglang.Engine(model_path=str(Path(tmp) / "B"), dtype="float32", skip_tokenizer_init=True,
                               mem_fraction_static=0.3, random_seed=0)
        try:
            ref_b = _greedy(engine)
            sync = SyncConfig(num_writers=1, num_readers=1, job="selfcheck", timeout=120.0)
            adapter = SGLangEngine(engine, config, dtype=torch.float32)
            source = CanonicalSource.beside(adapter, config)  # the engine stages on GPU where there is one
            errors: list[BaseException] = []

            def train() -> None:
                try:
                    with WeightWriter(source, rank=0, config=sync,
                                      meta=MetaClient(server.address, job="selfcheck", token=server.token)) as w:
                        for version, weights in ((1, a), (2, b)):
                            fill_from_canonical(source.layout(), source.tensors(), weights)
                            w.write(version)
                except BaseException as exc:  # reported by the main thread
                    errors.append(exc)

            trainer = threading.Thread(target=train, name="selfcheck-trainer")
            trainer.start()
            with WeightReader(adapter, rank=0, config=sync,
                              meta=MetaClient(server.address, job="selfcheck", token=server.token)) as reader:
                reader.update(1)
                out_a = _greedy(engine)
                reader.update(2)
                out_b = _greedy(engine)
            trainer.join(120)
            if errors:
                raise errors[0]
        finally:
            engine.shutdown()
        ok = out_a != ref_b and out_b == ref_b
        detail = ("version 1 changed the output, version 2 restored it token for token" if ok else
                  f"outputs {'did not change' if out_a == ref_b else 'were not restored'} after the updates")
        print(PREFIX + json.dumps({"ok": ok, "detail": detail}), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
