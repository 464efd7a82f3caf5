"""One writer process of a TensorStore scenario: ``python tests/_store_worker.py '<json>'``.

Puts its slice of every tensor of :func:`store_values` for each version, completes it, then
waits until the test (the reader) says ``done`` before closing (closing unlinks its arenas).
The meta server address comes from WEIGHTSYNC_META_ADDR / _TOKEN.
"""

from __future__ import annotations

import json
import sys

import torch

from weightsync.roles.tensorstore import StoreConfig, TensorSlice, TensorStore, slice_of


def store_values(version: int) -> dict[str, torch.Tensor]:
    """Non-weight tensors of every kind, different for every version (same in every process)."""
    g = torch.Generator().manual_seed(1000 + version)
    return {
        "rollout/tokens": torch.randint(0, 50_000, (6, 33), generator=g),
        "rollout/mask": torch.rand(6, 33, generator=g) > 0.5,
        "rollout/logprobs": torch.randn(6, 33, generator=g).to(torch.bfloat16),
        "value_head.weight": torch.randn(9, 7, generator=g, dtype=torch.float64),
        "stats/reward_mean": torch.tensor(float(version) + 0.25),
        "stats/empty": torch.empty(0, 4, dtype=torch.int32),
    }


#: Tensors each writer holds a part of (along dim 0); the others only writer 0 puts whole.
SHARDED = ("rollout/tokens", "rollout/logprobs", "value_head.weight")


def main() -> None:
    args = json.loads(sys.argv[1])
    rank, writers = args["rank"], args["num_writers"]
    store = TensorStore(StoreConfig(job=args["job"], num_writers=writers, slots=args["slots"]), rank=rank)
    try:
        for version in args["versions"]:
            values = store_values(version)
            for name, tensor in values.items():
                if name in SHARDED:
                    where = TensorSlice.part(tensor.shape, index=rank, count=writers)
                    store.put(name, slice_of(tensor, where).contiguous(), where=where)
                    tensor.zero_()  # the put copied: changing the source now must not matter
                elif rank == 0:
                    store.put(name, tensor)
            store.complete(version)
            print(f"completed {version}", flush=True)
        if store.meta.get_document("done", wait=args["timeout"]) is None:
            sys.exit("the reader never said done")
    finally:
        store.close()


if __name__ == "__main__":
    main()
