"""The engine matrix's trainer-side cell with vLLM's engine core in a child process: this process
hosts an ``LLM`` (``VLLM_ENABLE_V1_MULTIPROCESSING=1``, the default) with the ``"weightsync"``
backend and the trainer's transformers model, and drives vLLM's trainer-side API over ``LLMClient``.

    python tests/_matrix_child.py --checkpoint X/ --config '<json>' --seeds 2,1 --job j

Prints one ``RESULT`` JSON line before any version and one after each: the greedy tokens and the
engine's state as digests, read through the backend (``weightsync.engines.vllm_state.engine_state``).
"""

from __future__ import annotations

import argparse
import json
import sys

import torch


def main() -> int:
    from vllm.distributed.weight_transfer.factory import WeightTransferTrainerFactory

    from _engine_matrix import greedy, start_llm
    from _frontier_trainer import add_mtp_layers
    from weightsync.engines.vllm_state import engine_state
    from weightsync.integrations.vllm_trainer import LLMClient, WeightSyncTrainerInitInfo
    from weightsync.sources.module import ModuleSource
    from weightsync.tools.engine_state import state_to_wire
    from weightsync.tools.tiny import canonical_weights
    from weightsync.tools.torch_layout import fill_from_canonical

    parser = argparse.ArgumentParser()
    parser.add_argument("--checkpoint", required=True)
    parser.add_argument("--config", required=True, type=json.loads)
    parser.add_argument("--seeds", required=True)
    parser.add_argument("--job", required=True)
    args = parser.parse_args()
    llm = start_llm(args.checkpoint, args.config)

    def report(version: int) -> None:
        _, state = engine_state(llm)  # digests: the engine core runs in another process
        print("RESULT " + json.dumps({"version": version, "tokens": greedy(llm), "state": state_to_wire(state),
                                      "weight_version": llm.get_weight_version()}), flush=True)

    try:
        report(0)
        import transformers

        hf = transformers.AutoConfig.for_model(**{k: v for k, v in args.config.items() if k != "architectures"})
        model = transformers.AutoModelForCausalLM.from_config(hf, dtype=torch.float32)
        add_mtp_layers(model, args.config)
        source = ModuleSource(model, args.config)
        trainer = WeightTransferTrainerFactory.trainer_init(
            WeightSyncTrainerInitInfo(rank=0, job=args.job, timeout=240.0), client=LLMClient(llm), source=source)
        try:
            for version, seed in enumerate((int(s) for s in args.seeds.split(",")), start=1):
                with torch.no_grad():
                    fill_from_canonical(source.layout(), source.tensors(), canonical_weights(args.config, seed))
                trainer.send_weights(version)
                report(version)
        finally:
            trainer.shutdown()
    finally:
        llm.llm_engine.engine_core.shutdown()
    return 0


if __name__ == "__main__":
    sys.exit(main())
