"""An FSDP2 training rank holding a transformers model of a frontier family (DeepSeek-V3, GLM-4.5,
gpt-oss), MTP layers included, writing versions through ``DTensorSource``.

    WEIGHTSYNC_META_ADDR=... WEIGHTSYNC_META_TOKEN=... MASTER_ADDR=127.0.0.1 MASTER_PORT=...
    python tests/_frontier_trainer.py --config '<hf config json>' --rank R --world 2 --seeds 1,2 --job j

transformers builds no MTP layer (it ignores ``num_nextn_predict_layers``); a trainer of
DeepSeek-V3's MTP head appends one, as RL frameworks that train it do: a decoder layer plus
``enorm``, ``hnorm``, ``eh_proj`` and ``shared_head.norm`` at ``model.layers.{N}``, the names of the
checkpoint (transformers runs only the first ``num_hidden_layers`` layers). Version ``i`` holds
``weightsync.tools.tiny.canonical_weights(config, seeds[i - 1])``, written into each rank's local shards.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Callable
from typing import Any

import torch


def add_mtp_layers(model: torch.nn.Module, config: dict[str, Any]) -> None:
    """Append the config's MTP layers to a transformers DeepSeek-V3 / GLM-4.5 model."""
    layers = model.model.layers  # type: ignore[union-attr]
    first = int(config["num_hidden_layers"])
    hidden = int(config["hidden_size"])
    norm_cls = type(model.model.norm)  # type: ignore[union-attr]
    for index in range(first, first + int(config.get("num_nextn_predict_layers") or 0)):
        layer = type(layers[-1])(model.config, index)
        layer.enorm = norm_cls(hidden)
        layer.hnorm = norm_cls(hidden)
        layer.eh_proj = torch.nn.Linear(2 * hidden, hidden, bias=False)
        layer.shared_head = torch.nn.Module()
        layer.shared_head.norm = norm_cls(hidden)
        layers.append(layer)


def run_rank(build: Callable[[dict[str, Any], argparse.Namespace], tuple[Any, Callable[[int], None]]],
             *extra: str, close: Callable[[], None] | None = None) -> int:
    """What every trainer rank of these tests does around its model: parse the common arguments
    (and ``extra`` ones, as JSON), join the ranks' gloo group, and write one version per seed.

    ``build(config, args)`` makes the rank's model and returns its training source and its
    "training step": ``step(seed)`` puts ``canonical_weights(config, seed)`` into the model.
    ``close()`` runs before the group is destroyed.
    """
    import torch.distributed as dist

    from weightsync.roles.writer import WeightWriter
    from weightsync.session.sync_session import SyncConfig

    parser = argparse.ArgumentParser()
    for name in ("config", *extra):
        parser.add_argument(f"--{name}", required=True, type=json.loads)
    parser.add_argument("--rank", type=int, required=True)
    parser.add_argument("--world", type=int, required=True)
    parser.add_argument("--seeds", required=True)
    parser.add_argument("--job", required=True)
    args = parser.parse_args()
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=args.rank, world_size=args.world)
    try:
        source, step = build(args.config, args)
        sync = SyncConfig(num_writers=args.world, num_readers=1, job=args.job, timeout=240.0)
        with WeightWriter(source, rank=args.rank, config=sync) as writer:
            for version, seed in enumerate((int(s) for s in args.seeds.split(",")), start=1):
                with torch.no_grad():
                    step(seed)
                writer.write(version)
    finally:
        if close is not None:
            close()
        dist.destroy_process_group()
    return 0


def fsdp2_rank(config: dict[str, Any], args: argparse.Namespace) -> tuple[Any, Callable[[int], None]]:
    """The transformers model of ``config``, MTP layers appended, sharded with FSDP2 over the ranks."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from transformers import AutoConfig, AutoModelForCausalLM

    from weightsync.sources import DTensorSource
    from weightsync.tools.tiny import canonical_weights
    from weightsync.tools.torch_layout import fill_from_canonical

    hf = AutoConfig.for_model(**{k: v for k, v in config.items() if k != "architectures"})
    model = AutoModelForCausalLM.from_config(hf, dtype=torch.float32)
    add_mtp_layers(model, config)
    mesh = init_device_mesh("cpu", (args.world,))
    for layer in model.model.layers:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    source = DTensorSource(model, config, rank=args.rank)
    return source, lambda seed: fill_from_canonical(source.layout(), source.tensors(), canonical_weights(config, seed))


if __name__ == "__main__":
    sys.exit(run_rank(fsdp2_rank))
