"""NIXL pull and push beside torch (gloo) and shared memory: one plan, one run, real processes.

Megatron TP2 -> vLLM TP1 of a Qwen2-style dense model in bf16 (``--layers 2``: ~0.5 GB,
``--layers 6``: ~1 GB; ``--source``/``--target`` change the layouts): one process per
rank (two writers and one reader by default), each building its own local plan, as in a
real job. Each version is timed end to end, from a barrier to the moment the last rank
is done (writers' ``send`` and, for one-sided transports, the publication the readers
wait for; the readers' ``receive``); "writers busy" is the longest writer's part alone
(what a training step waits for). Version 0 includes ``prepare`` (rendezvous, memory
registration, metadata exchange, handle preparation) as WeightWriter's first write does;
the later versions show what is left once that cost is paid. Readers zero their tensors
before every version (untimed) and check the last version bitwise. A single-threaded
``torch`` copy of one reader's bytes in its process is the baseline.

    python benchmarks/nixl_transport.py                       # ~0.5 GB, 5 versions, all transports
    python benchmarks/nixl_transport.py --layers 6 --json out.json
    python benchmarks/nixl_transport.py --transports nixl-pull shm
    python benchmarks/nixl_transport.py --source hf --target vllm:tp=1,replicas=3 --transports nixl-pull nixl-push
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import platform
import statistics
import tempfile
import time
import urllib.parse
from pathlib import Path
from typing import Any

# A Qwen2-style dense model: ~0.26 GB of embeddings + ~0.12 GB per layer in bf16.
MODEL = {
    "architectures": ["Qwen2ForCausalLM"], "model_type": "qwen2", "hidden_size": 2048,
    "intermediate_size": 8192, "num_hidden_layers": 2, "num_attention_heads": 16,
    "num_key_value_heads": 2, "vocab_size": 32000, "tie_word_embeddings": False, "torch_dtype": "bfloat16",
}
SOURCE, TARGET = "megatron:tp=2", "vllm:tp=1"
#: benchmark name -> (registry name, TransportOptions overrides)
TRANSPORTS = {
    "nixl-pull": ("nixl", {"nixl_mode": "pull"}),
    "nixl-push": ("nixl", {"nixl_mode": "push"}),
    "torch": ("torch", {}),
    "shm": ("shm", {}),
}
TIMEOUT = 120.0


class DirDocuments:
    """put_document/get_document over a directory: the meta server's role in this benchmark."""

    def __init__(self, root: str) -> None:
        self.root = Path(root)

    def put_document(self, key: str, value: bytes) -> None:
        tmp = self.root / f".tmp-{os.getpid()}"
        tmp.write_bytes(value)
        tmp.replace(self.root / urllib.parse.quote(key, safe=""))

    def get_document(self, key: str, *, wait: float = 0.0) -> bytes | None:
        deadline = time.monotonic() + wait
        while True:
            try:
                return (self.root / urllib.parse.quote(key, safe="")).read_bytes()
            except FileNotFoundError:
                if time.monotonic() >= deadline:
                    return None
                time.sleep(0.001)


def _layouts(layers: int, source: str, target: str) -> tuple[list[Any], list[Any]]:
    from weightsync.layout import parse_layout
    from weightsync.layout.model import ModelSpec

    spec = ModelSpec.from_hf_config({**MODEL, "num_hidden_layers": layers})
    return parse_layout(source).all_rank_layouts(spec), parse_layout(target).all_rank_layouts(spec)


def _tensors(layout: Any, values: dict[str, Any] | None) -> dict[str, Any]:
    import torch

    from weightsync.plan.reference import cut_shards, empty_shards
    from weightsync.tools.torch_layout import TORCH_DTYPES

    arrays = cut_shards(layout, values) if values is not None else empty_shards(layout)
    dtypes = {s.name: TORCH_DTYPES[s.dtype] for s in layout.shards}
    return {n: torch.from_numpy(a).view(dtypes[n]) for n, a in arrays.items()}


def _rank_main(bench: str, role: str, rank: int, layers: int, layouts: tuple[str, str], versions: int,
               meta_root: str, barrier: Any, out: Any) -> None:
    """One rank: prepare inside version 0, then send or receive every version, timed."""
    import torch

    from weightsync.clock.deadline import Deadline
    from weightsync.job.channel import JobChannel
    from weightsync.plan import build_local_plan
    from weightsync.plan.reference import random_canonical
    from weightsync.transport import TransportContext, TransportOptions, create_transport

    torch.set_num_threads(1)
    name, overrides = TRANSPORTS[bench]
    writers, readers = _layouts(layers, *layouts)
    layout = (writers if role == "writer" else readers)[rank]
    plan = build_local_plan(writers, readers, role=role, rank=rank)
    values = random_canonical(writers[0].canonical, seed=1)
    tensors = _tensors(layout, values if role == "writer" else None)
    want = _tensors(layout, values) if role == "reader" else None
    del values
    meta = DirDocuments(meta_root)
    ctx = TransportContext(channel=JobChannel(meta, role=role, rank=rank), num_writers=len(writers),
                           num_readers=len(readers), options=TransportOptions(**overrides))
    transport = create_transport(name, ctx)
    spans, phases, nbytes, prepare_s = [], [], 0, 0.0
    for v in range(versions):
        if role == "reader":
            for t in tensors.values():
                t.zero_()
        barrier.wait(TIMEOUT)
        t0 = time.monotonic()
        if v == 0:
            transport.prepare(plan, tensors, epoch=0, deadline=Deadline.after(TIMEOUT))
            prepare_s = time.monotonic() - t0
        if role == "writer":
            stats = transport.send(v, deadline=Deadline.after(TIMEOUT))
            if transport.one_sided:
                meta.put_document(f"sent/{v}/{rank}", b"1")
        else:
            if transport.one_sided:
                for w in range(len(writers)):
                    if meta.get_document(f"sent/{v}/{w}", wait=TIMEOUT) is None:
                        raise TimeoutError(f"writer {w} did not publish version {v}")
            stats = transport.receive(v, deadline=Deadline.after(TIMEOUT))
        spans.append((t0, time.monotonic()))
        phases.append(dict(stats.phases))
        nbytes = stats.nbytes
    report: dict[str, Any] = {"spans": spans, "phases": phases, "bytes": nbytes, "prepare_s": prepare_s,
                              "setup": dict(getattr(transport, "setup", {}))}
    if want is not None:
        report["wrong"] = [n for n, t in tensors.items() if not torch.equal(t.view(torch.uint8),
                                                                               want[n].view(torch.uint8))]
        report["needed"] = plan.total_bytes
        report["memcpy_gbps"] = _memcpy_gbps(nbytes)
    barrier.wait(TIMEOUT)  # nobody closes while a peer may still read its memory
    transport.close()
    out.put((role, rank, report))


def _memcpy_gbps(nbytes: int, repeats: int = 3) -> float:
    import torch

    src = torch.ones(nbytes, dtype=torch.uint8)
    dst = torch.zeros(nbytes, dtype=torch.uint8)
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        dst.copy_(src)
        times.append(time.perf_counter() - t0)
    return nbytes / min(times) / 1e9


def run(bench: str, layers: int, layouts: tuple[str, str], versions: int) -> dict[str, Any]:
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    writers, readers = _layouts(layers, *layouts)
    ranks = [("writer", w.rank) for w in writers] + [("reader", r.rank) for r in readers]
    barrier = ctx.Barrier(len(ranks))
    with tempfile.TemporaryDirectory() as meta_root:
        procs = [ctx.Process(target=_rank_main, args=(bench, role, rank, layers, layouts, versions, meta_root,
                                                      barrier, results), daemon=True) for role, rank in ranks]
        for p in procs:
            p.start()
        try:
            got = {}
            for _ in procs:
                role, rank, report = results.get(timeout=TIMEOUT * (versions + 2))
                got[role, rank] = report
            for p in procs:
                p.join(TIMEOUT)
        finally:
            for p in procs:
                if p.is_alive():
                    p.kill()
                    p.join(5)
    reader = got["reader", 0]
    received = sum(r["bytes"] for (role, _), r in got.items() if role == "reader")
    seconds = [max(r["spans"][v][1] for r in got.values()) - min(r["spans"][v][0] for r in got.values())
               for v in range(versions)]
    later = seconds[1:] or seconds
    # How long the writers are busy per version (what a training step waits for in send).
    busy = [max(r["spans"][v][1] - r["spans"][v][0] for (role, _), r in got.items() if role == "writer")
            for v in range(versions)]
    return {
        "transport": bench, "bytes": received,
        "correct": all(not r["wrong"] and r["bytes"] == r["needed"] for (role, _), r in got.items()
                       if role == "reader"),
        "version_seconds": seconds, "first_s": seconds[0], "later_median_s": statistics.median(later),
        "later_gbps": received / statistics.median(later) / 1e9,
        "writer_busy_later_median_s": statistics.median(busy[1:] or busy),
        "prepare_s": {f"{role}{rank}": r["prepare_s"] for (role, rank), r in got.items()},
        "setup": {f"{role}{rank}": r["setup"] for (role, rank), r in got.items()},
        "reader_phases": reader["phases"], "memcpy_gbps": reader["memcpy_gbps"],
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--transports", nargs="+", default=list(TRANSPORTS), choices=list(TRANSPORTS))
    parser.add_argument("--layers", type=int, default=MODEL["num_hidden_layers"])
    parser.add_argument("--versions", type=int, default=5)
    parser.add_argument("--source", default=SOURCE, help=f"training layout (default {SOURCE})")
    parser.add_argument("--target", default=TARGET, help=f"inference layout (default {TARGET})")
    parser.add_argument("--json", help="also write the results to this file")
    args = parser.parse_args()
    os.environ.setdefault("NIXL_LOG_LEVEL", "WARN")
    os.environ.setdefault("UCX_NET_DEVICES", "lo")
    runs = [run(bench, args.layers, (args.source, args.target), args.versions) for bench in args.transports]
    print(f"{args.source} -> {args.target}, {runs[0]['bytes'] / 1e9:.3f} GB per version to the readers, "
          f"{os.cpu_count()} CPUs, {args.versions} versions")
    print("| transport | version 0 (with prepare) | later versions (median) | GB/s later | writers busy later | "
          "reader prepare | NIXL registration (readers / writers) | correct |")
    print("|---|---|---|---|---|---|---|---|")
    for r in runs:
        setup = r["setup"]
        reg = "-"
        if "register_seconds" in setup["reader0"]:
            ms = {role: " + ".join(f"{v['register_seconds'] * 1e3:.1f}" for k, v in setup.items()
                                   if k.startswith(role)) for role in ("reader", "writer")}
            reg = f"{ms['reader']} ms / {ms['writer']} ms"
        print(f"| {r['transport']} | {r['first_s']:.3f} s | {r['later_median_s']:.3f} s | {r['later_gbps']:.2f} | "
              f"{r['writer_busy_later_median_s']:.3f} s | "
              f"{r['prepare_s']['reader0']:.3f} s | {reg} | {r['correct']} |")
    print(f"single-threaded torch copy of one reader's bytes in its process: "
          f"{statistics.median(r['memcpy_gbps'] for r in runs):.2f} GB/s (median over the runs)")
    for r in runs:
        print(f"{r['transport']}: versions " + ", ".join(f"{s:.3f}" for s in r["version_seconds"]) + " s")
    if args.json:
        Path(args.json).write_text(json.dumps({
            "machine": {"cpus": os.cpu_count(), "python": platform.python_version(),
                        "platform": platform.platform()},
            "model": {**MODEL, "num_hidden_layers": args.layers}, "source": args.source, "target": args.target,
            "runs": runs}, indent=1))


if __name__ == "__main__":
    main()
