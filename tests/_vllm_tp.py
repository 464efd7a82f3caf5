"""Processes for tests/test_vllm_tp.py: a vLLM engine of two TP workers (CPU, ``mp`` executor)
updated through the ``weightsync`` backend by two trainer ranks, each writing its own FSDP shard.

    python tests/_vllm_tp.py tp-engine --checkpoint DIR --seeds 1,2

Prints one ``RESULT`` line at start and per version: the engine's greedy tokens, its weight
version, the bytes each trainer rank sent and each worker's reader received.
"""

from __future__ import annotations

import argparse
import json
import sys
import threading
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent


def tp_engine(checkpoint: str, seeds: list[int]) -> None:
    from vllm.distributed.weight_transfer.factory import WeightTransferTrainerFactory

    from weightsync.integrations.vllm_trainer import LLMClient, WeightSyncTrainerInitInfo
    from weightsync.meta.client import MetaClient
    from weightsync.meta.embedded import EmbeddedMetaServer
    from weightsync.sources.module import ShardedSource
    from weightsync.tools.tiny import canonical_weights
    from weightsync.tools.torch_layout import fill_from_canonical

    sys.path.insert(0, str(HERE))
    from _vllm_native import _engine, _greedy

    config = json.loads((Path(checkpoint) / "config.json").read_text())
    llm = _engine(checkpoint, tensor_parallel_size=2, distributed_executor_backend="mp",
                  weight_transfer_config={"backend": "weightsync"})
    print("RESULT " + json.dumps({"version": 0, "tokens": _greedy(llm)}), flush=True)
    server = EmbeddedMetaServer().start()
    sources = [ShardedSource("fsdp:dp=2", config, r) for r in (0, 1)]
    infos = [WeightSyncTrainerInitInfo(rank=r, num_writers=2, num_readers=2, meta_address=server.address,
                                       meta_token=server.token, model_config=config, timeout=240.0, job="tp")
             for r in (0, 1)]
    engines: list[Any] = [None, None]

    def init(r: int) -> None:
        engines[r] = WeightTransferTrainerFactory.trainer_init(infos[r], client=LLMClient(llm), source=sources[r])

    _both(init)
    for version, seed in enumerate(seeds, start=1):
        for source in sources:
            fill_from_canonical(source.layout(), source.tensors(), canonical_weights(config, seed))
        _both(lambda r, v=version: engines[r].send_weights(v))
        with MetaClient(server.address, job="tp", token=server.token) as meta:
            received = {row["rank"]: row["nbytes"] for row in meta.status()["reader_state"]}
        print("RESULT " + json.dumps({"version": version, "tokens": _greedy(llm), "received": received,
                                      "weight_version": llm.get_weight_version(),
                                      "sent": [e.last_result.nbytes for e in engines],
                                      "held": [sum(t.numel() * t.element_size() for t in s.tensors().values())
                                               for s in sources]}), flush=True)
    _both(lambda r: engines[r].shutdown())
    server.stop()
    llm.llm_engine.engine_core.shutdown()


def _both(call: Any) -> None:
    """``call(1)`` on a thread while ``call(0)`` runs here (rank 0 drives vLLM); raises either's error."""
    errors: list[BaseException] = []

    def run() -> None:
        try:
            call(1)
        except BaseException as exc:  # surfaced below
            errors.append(exc)

    thread = threading.Thread(target=run, name="trainer-rank-1")
    thread.start()
    try:
        call(0)
    finally:
        thread.join(300)
    if errors:
        raise errors[0]


def main() -> int:
    parser = argparse.ArgumentParser()
    sub = parser.add_subparsers(dest="cmd", required=True)
    t = sub.add_parser("tp-engine")
    t.add_argument("--checkpoint", required=True)
    t.add_argument("--seeds", required=True)
    args = parser.parse_args()
    tp_engine(args.checkpoint, [int(s) for s in args.seeds.split(",")])
    return 0


if __name__ == "__main__":
    sys.exit(main())
