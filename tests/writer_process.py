"""A training rank for end-to-end tests: tiny-model weights in a training layout, written as versions.

    WEIGHTSYNC_META_ADDR=... WEIGHTSYNC_META_TOKEN=... python tests/writer_process.py \\
        --config '<hf config json>' --layout megatron:tp=2 --rank 0 --readers 1 --job j --seeds 2,1

Version ``i`` (from 1) holds ``tiny_models.canonical_weights(config, seeds[i - 1])``.
"""

from __future__ import annotations

import argparse
import json
import sys

import torch

from tiny_models import canonical_weights
from weightsync.layout import parse_layout
from weightsync.session import SyncConfig
from weightsync.sources.module import ShardedSource, fill_from_canonical
from weightsync.writer import WeightWriter


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--config", required=True)
    parser.add_argument("--layout", required=True)
    parser.add_argument("--rank", type=int, required=True)
    parser.add_argument("--readers", type=int, default=1)
    parser.add_argument("--job", default="default")
    parser.add_argument("--seeds", required=True)
    parser.add_argument("--timeout", type=float, default=120.0)
    args = parser.parse_args()
    torch.set_num_threads(1)
    config = json.loads(args.config)
    source = ShardedSource(args.layout, config, args.rank)
    sync = SyncConfig(num_writers=parse_layout(args.layout).world_size, num_readers=args.readers, job=args.job,
                      timeout=args.timeout)
    with WeightWriter(source, rank=args.rank, config=sync) as writer:
        for version, seed in enumerate((int(s) for s in args.seeds.split(",")), start=1):
            fill_from_canonical(source.layout(), source.tensors(), canonical_weights(config, seed))
            writer.write(version)
    return 0


if __name__ == "__main__":
    sys.exit(main())
