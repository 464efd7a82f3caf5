"""``weightsync doctor --engines``: update a live SGLang engine through weightsync (GPU only).

The proof of :mod:`weightsync.integrations.selfcheck` (version 1 changes the greedy output,
version 2 restores it token for token), on an SGLang engine: ``mode="tensor"`` (staged CUDA
tensors handed over by IPC), one GPU.

    python -m weightsync.integrations.sglang_selfcheck      # prints one JSON line
"""

from __future__ import annotations

import json
import sys
import tempfile
from pathlib import Path
from typing import Any

from weightsync.integrations.selfcheck import round_trip, run_child, verdict

PREFIX = "WSSGLANGCHECK "


def self_check(*, timeout: float) -> tuple[bool, str]:
    """Run the check in a child process; (passed, what happened)."""
    return run_child("weightsync.integrations.sglang_selfcheck", PREFIX, what="SGLang", timeout=timeout,
                     env={"HF_HUB_OFFLINE": "1"})


def _greedy(engine: Any) -> list[int]:
    prompt = [(7 * i + 3) % 500 + 4 for i in range(40)]
    params = {"temperature": 0.0, "max_new_tokens": 16, "ignore_eos": True}
    return list(engine.generate(input_ids=prompt, sampling_params=params)["output_ids"])


def main() -> int:
    import sglang
    import torch

    from weightsync.engines.sglang import SGLangEngine
    from weightsync.meta import EmbeddedMetaServer
    from weightsync.tools.tiny import canonical_weights, tiny_config, write_checkpoint

    config = tiny_config(tie=True)
    with tempfile.TemporaryDirectory(prefix="weightsync-selfcheck-") as tmp, EmbeddedMetaServer() as server:
        b = write_checkpoint(Path(tmp) / "B", config, seed=2)
        engine = sglang.Engine(model_path=str(Path(tmp) / "B"), dtype="float32", skip_tokenizer_init=True,
                               mem_fraction_static=0.3, random_seed=0)
        try:
            ref_b = _greedy(engine)
            out_a, out_b, _ = round_trip(SGLangEngine(engine, config, dtype=torch.float32), lambda: _greedy(engine),
                                         config, server, (canonical_weights(config, seed=1), b))
        finally:
            engine.shutdown()
        ok, detail = verdict(out_a, out_b, ref_b)
        print(PREFIX + json.dumps({"ok": ok, "detail": detail}), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
