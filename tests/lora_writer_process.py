"""A tensor-parallel training rank holding a LoRA adapter, written as versions (for end-to-end tests).

    WEIGHTSYNC_META_ADDR=... WEIGHTSYNC_META_TOKEN=... python tests/lora_writer_process.py \\
        --config '<hf config json>' --r 8 --alpha 16 --tp 2 --rank 0 --job j --seeds 2,3

Version ``i`` (from 1) holds ``weightsync.tools.tiny.lora_weights(config, lora, seeds[i - 1])``, this
rank's TP slice of it (column-parallel layers' B rows, row-parallel layers' A columns).
"""

from __future__ import annotations

import argparse
import json
import sys

import torch

from weightsync.layout import ModelSpec
from weightsync.layout.lora import LoraSpec
from weightsync.roles.writer import WeightWriter
from weightsync.session.sync_session import SyncConfig
from weightsync.sources.lora import LoraSource
from weightsync.tools.tiny import lora_weights
from weightsync.tools.torch_layout import allocate, fill_from_canonical


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--config", required=True)
    parser.add_argument("--r", type=int, required=True)
    parser.add_argument("--alpha", type=float, required=True)
    parser.add_argument("--tp", type=int, default=1)
    parser.add_argument("--rank", type=int, required=True)
    parser.add_argument("--job", default="default")
    parser.add_argument("--seeds", required=True)
    parser.add_argument("--timeout", type=float, default=120.0)
    args = parser.parse_args()
    torch.set_num_threads(1)
    config = json.loads(args.config)
    lora = LoraSpec(r=args.r, alpha=args.alpha)
    # the trainer's own tensors: this TP rank's slices, under live PeftModel names
    layout = lora.rank_layout(ModelSpec.from_hf_config(config), args.rank, tp=args.tp, tp_rank=args.rank)
    local = allocate(layout)
    peft_live = {name.replace(".weight", ".default.weight"): t for name, t in local.items()}
    source = LoraSource(peft_live, config, lora, tp=args.tp, tp_rank=args.rank, rank=args.rank)
    sync = SyncConfig(num_writers=args.tp, num_readers=1, job=args.job, timeout=args.timeout)
    with WeightWriter(source, rank=args.rank, config=sync) as writer:
        for version, seed in enumerate((int(s) for s in args.seeds.split(",")), start=1):
            fill_from_canonical(source.layout(), source.tensors(), lora_weights(config, lora, seed))
            writer.write(version)
    return 0


if __name__ == "__main__":
    sys.exit(main())
