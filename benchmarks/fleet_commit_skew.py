"""Switch skew of a fleet of engines: ``commit="each"`` against ``commit="fleet"``, side by side (issue 37).

The switch skew of a version is the time between the first and the last engine's switch to
it: while it lasts, requests routed to the fleet see a mix of versions. One writer process and
``--readers`` reader processes on this host (shared memory, the embedded meta server in this
process); each reader is a Hugging Face transformers model that stages like vLLM (its loader
copies staging into the model's parameters) and stamps the wall clock when it starts to apply a
version. Both modes run
in one invocation, one after the other, on the same model and versions, and every engine is
checked bitwise against each version it applied.

    python benchmarks/fleet_commit_skew.py --readers 8 --versions 20 [--size 30M] [--json]
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import statistics
import sys
import time
import uuid
from typing import Any

import torch

from weightsync.engines.staging import StagedWeights
from weightsync.layout import ModelSpec
from weightsync.tools.tiny import canonical_weights, checkpoint_tensors

#: float32 Qwen3s small enough that nine processes share two cores; every weight changes every version
SIZES = {
    "3M": {"hidden_size": 256, "intermediate_size": 512, "num_hidden_layers": 4, "vocab_size": 4096},
    "30M": {"hidden_size": 512, "intermediate_size": 1536, "num_hidden_layers": 6, "vocab_size": 16384},
}
CONFIG: dict[str, Any] = {}
SEEDS = 5


class SwitchingEngine(StagedWeights):
    """A Hugging Face transformers model served from staging: its loader copies each staged tensor
    into the model's parameter of that name. ``switched[v]``: when it began to apply version v."""

    def __init__(self, rank: int) -> None:
        import transformers

        super().__init__(ModelSpec.from_hf_config(CONFIG), dtype=torch.float32, device="cpu", rank=rank)
        hf = transformers.AutoConfig.for_model(**{k: v for k, v in CONFIG.items() if k != "architectures"})
        self.hf = transformers.AutoModelForCausalLM.from_config(hf, dtype=torch.float32).eval()
        self.params = self.hf.state_dict()
        self.switched: dict[int, float] = {}

    def apply(self, version: int) -> None:
        self.switched[version] = time.time()
        super().apply(version)

    def _load_items(self, items: list[tuple[str, torch.Tensor]]) -> None:
        with torch.no_grad():
            for name, tensor in items:
                self.params[name].copy_(tensor)


def use_size(size: str) -> None:
    """Set the model every process of a run uses (a spawned process sets it again from its arguments)."""
    CONFIG.clear()
    CONFIG.update({"architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3", "num_attention_heads": 4,
                   "num_key_value_heads": 2, "head_dim": 64, "torch_dtype": "float32", **SIZES[size]})


def _sync(mode: str, readers: int, job: str) -> Any:
    from weightsync.session.sync_session import SyncConfig

    return SyncConfig(num_writers=1, num_readers=readers, job=job, transport="shm", commit=mode, timeout=120)


def _reader(rank: int, mode: str, readers: int, versions: int, job: str, size: str, out: Any) -> None:
    from weightsync.roles.reader import WeightReader

    use_size(size)
    torch.set_num_threads(1)
    pool = {seed: checkpoint_tensors(canonical_weights(CONFIG, seed)) for seed in range(SEEDS)}
    engine = SwitchingEngine(rank)
    engine.update(pool[0], version=0)
    wrong = 0
    with WeightReader(engine, rank=rank, config=_sync(mode, readers, job)) as reader:
        for version in range(1, versions + 1):
            reader.update(version, timeout=120)
            want = pool[version % SEEDS]
            wrong += sum(not torch.equal(engine.params[n], t) for n, t in want.items())
    out.put(("reader", rank, engine.switched, wrong))


def _writer(mode: str, readers: int, versions: int, job: str, size: str, out: Any) -> None:
    from weightsync.roles.writer import WeightWriter
    from weightsync.tools.tiny import CanonicalSource
    from weightsync.tools.torch_layout import fill_from_canonical

    use_size(size)
    torch.set_num_threads(1)
    source = CanonicalSource(CONFIG)
    pool = {seed: canonical_weights(CONFIG, seed) for seed in range(SEEDS)}
    seconds = []
    with WeightWriter(source, rank=0, config=_sync(mode, readers, job)) as writer:
        for version in range(1, versions + 1):
            fill_from_canonical(source.layout(), source.tensors(), pool[version % SEEDS])
            t0 = time.perf_counter()
            writer.write(version)
            seconds.append(time.perf_counter() - t0)
    out.put(("writer", 0, seconds, 0))


def run_mode(mode: str, *, readers: int, versions: int, size: str) -> dict[str, Any]:
    """One job of ``readers`` engines and ``versions`` versions under ``commit=mode``."""
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    job = f"skew-{mode}-{uuid.uuid4().hex[:6]}"
    procs = [ctx.Process(target=_reader, args=(r, mode, readers, versions, job, size, out)) for r in range(readers)]
    procs.append(ctx.Process(target=_writer, args=(mode, readers, versions, job, size, out)))
    for p in procs:
        p.start()
    try:
        got = [out.get(timeout=600) for _ in procs]
    finally:
        for p in procs:
            p.join(timeout=60)
            if p.is_alive():
                p.kill()
    switched = {rank: times for role, rank, times, _ in got if role == "reader"}
    writes = next(times for role, _, times, _ in got if role == "writer")
    # version 1 includes every process's first plan and connections: measured from version 2 on
    skews = [max(switched[r][v] for r in switched) - min(switched[r][v] for r in switched)
             for v in range(2, versions + 1)]
    return {"commit": mode, "model": size, "readers": readers, "versions": versions,
            "skew_ms_p50": 1e3 * statistics.median(skews),
            "skew_ms_p90": 1e3 * sorted(skews)[int(0.9 * (len(skews) - 1))],
            "skew_ms_max": 1e3 * max(skews), "write_ms_p50": 1e3 * statistics.median(writes[1:]),
            "wrong_tensors": sum(w for role, _, _, w in got if role == "reader")}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n", 1)[0])
    parser.add_argument("--readers", type=int, default=8)
    parser.add_argument("--versions", type=int, default=20)
    parser.add_argument("--size", choices=sorted(SIZES), default="3M", help="the model's parameters")
    parser.add_argument("--json", action="store_true", help="print the rows as JSON")
    args = parser.parse_args(argv)
    from weightsync.meta import EmbeddedMetaServer

    with EmbeddedMetaServer() as server:
        os.environ["WEIGHTSYNC_META_ADDR"], os.environ["WEIGHTSYNC_META_TOKEN"] = server.address, server.token
        rows = [run_mode(mode, readers=args.readers, versions=args.versions, size=args.size)
                for mode in ("each", "fleet")]
    if args.json:
        print(json.dumps(rows, indent=2))
    else:
        print(f"{'commit':>6} | skew p50 | skew p90 | skew max | write p50 | wrong tensors")
        for row in rows:
            print(f"{row['commit']:>6} | {row['skew_ms_p50']:6.1f} ms | {row['skew_ms_p90']:6.1f} ms | "
                  f"{row['skew_ms_max']:6.1f} ms | {row['write_ms_p50']:6.1f} ms | {row['wrong_tensors']}")
    return 0 if all(row["wrong_tensors"] == 0 for row in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
