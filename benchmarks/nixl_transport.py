"""NIXL transport throughput: ~1 GB of bf16 weights, Megatron TP2 -> vLLM TP1, two processes.

One process holds both writer ranks (two NixlTransport instances, one agent each), the
other the reader. For each mode, every version is timed on its own: in pull the writers
pack their slots first and the reader's receive() is timed; in push the writers' send()
(ready handshake + WRITEs) is timed. A plain single-threaded ``torch`` copy of the same
bytes in the reader process is the baseline (cma, NIXL's host-to-host path, is one kernel
copy on the initiating thread). Registration, connection and preparation are timed once.

    python benchmarks/nixl_transport.py                 # both modes, 5 versions, ~1 GB
    python benchmarks/nixl_transport.py --mode pull --layers 2 --json out.json
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

# A Qwen2-style dense model sized so that 6 layers are ~1 GB in bf16.
MODEL = {
    "architectures": ["Qwen2ForCausalLM"], "model_type": "qwen2", "hidden_size": 2048,
    "intermediate_size": 8192, "num_hidden_layers": 6, "num_attention_heads": 16,
    "num_key_value_heads": 2, "vocab_size": 32000, "tie_word_embeddings": False, "torch_dtype": "bfloat16",
}
SOURCE, TARGET = "megatron:tp=2", "vllm:tp=1"
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
                time.sleep(0.005)


def _layouts(layers: int) -> tuple[list[Any], list[Any]]:
    from weightsync.layout import parse_layout
    from weightsync.layout.model import ModelSpec

    spec = ModelSpec.from_hf_config({**MODEL, "num_hidden_layers": layers})
    return parse_layout(SOURCE).all_rank_layouts(spec), parse_layout(TARGET).all_rank_layouts(spec)


def _tensors(layout: Any, values: dict[str, Any] | None) -> dict[str, Any]:
    import torch

    from weightsync.plan.reference import cut_shards, empty_shards
    from weightsync.transport.tensors import TORCH_DTYPES

    arrays = cut_shards(layout, values) if values is not None else empty_shards(layout)
    dtypes = {s.name: TORCH_DTYPES[s.dtype] for s in layout.shards}
    return {n: torch.from_numpy(a).view(dtypes[n]) for n, a in arrays.items()}


def _context(role: str, rank: int, mode: str, meta_root: str) -> Any:
    from weightsync.transport import TransportContext, TransportOptions

    return TransportContext(role=role, rank=rank, num_writers=2, num_readers=1, meta=DirDocuments(meta_root),
                            options=TransportOptions(nixl_mode=mode))  # type: ignore[arg-type]


def _writers_main(mode: str, layers: int, versions: int, meta_root: str, barrier: Any, out: Any) -> None:
    import torch

    from weightsync.plan import build_local_plan
    from weightsync.plan.reference import random_canonical
    from weightsync.transport import create_transport

    torch.set_num_threads(1)
    writers, readers = _layouts(layers)
    values = random_canonical(writers[0].canonical, seed=1)
    ranks = []
    for w in writers:
        plan = build_local_plan(writers, readers, role="writer", rank=w.rank)
        transport = create_transport("nixl", _context("writer", w.rank, mode, meta_root))
        ranks.append((transport, plan, _tensors(w, values)))
    del values
    for transport, plan, tensors in ranks:
        transport.prepare(plan, tensors, generation=0, timeout=TIMEOUT)
    barrier.wait(TIMEOUT)
    seconds, nbytes, phases = [], 0, []
    for v in range(1, versions + 1):
        barrier.wait(TIMEOUT)
        t0 = time.perf_counter()
        stats = [transport.send(v, timeout=TIMEOUT) for transport, _, _ in ranks]
        seconds.append(time.perf_counter() - t0)
        nbytes = sum(s.nbytes for s in stats)
        phases.append({k: sum(s.phases.get(k, 0.0) for s in stats) for k in stats[0].phases})
        barrier.wait(TIMEOUT)
    out.put(("writers", {"setup": [dict(t.setup) for t, _, _ in ranks], "send_seconds": seconds,
                         "send_bytes": nbytes, "phases": phases}))
    barrier.wait(TIMEOUT)
    for transport, _, _ in ranks:
        transport.close()


def _reader_main(mode: str, layers: int, versions: int, meta_root: str, barrier: Any, out: Any) -> None:
    import torch

    from weightsync.plan import build_local_plan
    from weightsync.plan.reference import random_canonical
    from weightsync.transport import create_transport

    torch.set_num_threads(1)
    writers, readers = _layouts(layers)
    plan = build_local_plan(writers, readers, role="reader", rank=0)
    tensors = _tensors(readers[0], None)
    ptrs = [t.data_ptr() for t in tensors.values()]
    transport = create_transport("nixl", _context("reader", 0, mode, meta_root))
    transport.prepare(plan, tensors, generation=0, timeout=TIMEOUT)
    barrier.wait(TIMEOUT)
    seconds, phases, nbytes = [], [], 0
    for v in range(1, versions + 1):
        if mode == "pull":
            barrier.wait(TIMEOUT)  # writers pack ...
            barrier.wait(TIMEOUT)  # ... and are done: time the reads alone
            t0 = time.perf_counter()
            stats = transport.receive(v, timeout=TIMEOUT)
        else:
            t0 = time.perf_counter()
            barrier.wait(TIMEOUT)
            stats = transport.receive(v, timeout=TIMEOUT)
            barrier.wait(TIMEOUT)
        seconds.append(time.perf_counter() - t0)
        phases.append(dict(stats.phases))
        nbytes = stats.nbytes
    want = _tensors(readers[0], random_canonical(writers[0].canonical, seed=1))
    wrong = [n for n, t in tensors.items() if not torch.equal(t.view(torch.uint8), want[n].view(torch.uint8))]
    del want
    memcpy = _memcpy(nbytes, repeats=versions)
    out.put(("reader", {"setup": dict(transport.setup), "receive_seconds": seconds, "phases": phases,
                        "receive_bytes": nbytes, "wrong_tensors": wrong, "memcpy": memcpy,
                        "ptrs_unchanged": ptrs == [t.data_ptr() for t in tensors.values()]}))
    barrier.wait(TIMEOUT)
    transport.close()


def _memcpy(nbytes: int, repeats: int) -> dict[str, float]:
    """GB/s of torch copies of the same bytes, one thread and all threads (median)."""
    import torch

    src = torch.ones(nbytes, dtype=torch.uint8)
    dst = torch.zeros(nbytes, dtype=torch.uint8)
    out = {}
    for threads in (1, os.cpu_count() or 1):
        torch.set_num_threads(threads)
        times = []
        for _ in range(repeats):
            t0 = time.perf_counter()
            dst.copy_(src)
            times.append(time.perf_counter() - t0)
        out[f"threads_{threads}_gbps"] = nbytes / statistics.median(times) / 1e9
    torch.set_num_threads(1)
    return out


def run_mode(mode: str, layers: int, versions: int) -> dict[str, Any]:
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    barrier = ctx.Barrier(2)
    with tempfile.TemporaryDirectory() as meta_root:
        procs = [ctx.Process(target=f, args=(mode, layers, versions, meta_root, barrier, results), daemon=True)
                 for f in (_writers_main, _reader_main)]
        for p in procs:
            p.start()
        try:
            got = dict(results.get(timeout=TIMEOUT * (versions + 2)) for _ in procs)
            for p in procs:
                p.join(TIMEOUT)
        finally:
            for p in procs:
                if p.is_alive():
                    p.kill()
                    p.join(5)
    return _summarise(mode, got["writers"], got["reader"])


def _summarise(mode: str, writers: dict[str, Any], reader: dict[str, Any]) -> dict[str, Any]:
    nbytes = reader["receive_bytes"]
    timed = reader["receive_seconds"] if mode == "pull" else writers["send_seconds"]
    med = statistics.median(timed)
    phase_names = sorted({k for p in reader["phases"] + writers["phases"] for k in p})
    return {
        "mode": mode,
        "bytes": nbytes,
        "seconds_median": med,
        "gbps_median": nbytes / med / 1e9,
        "gbps_best": nbytes / min(timed) / 1e9,
        "timed": "reader receive()" if mode == "pull" else "both writers' send()",
        "reader_receive_seconds": reader["receive_seconds"],
        "writer_send_seconds": writers["send_seconds"],
        "reader_phases_median": {k: statistics.median(p.get(k, 0.0) for p in reader["phases"])
                                 for k in phase_names},
        "writer_phases_median": {k: statistics.median(p.get(k, 0.0) for p in writers["phases"])
                                 for k in phase_names},
        "memcpy": reader["memcpy"],
        "setup": {"reader": reader["setup"], "writers": writers["setup"]},
        "correct": not reader["wrong_tensors"] and reader["ptrs_unchanged"],
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--mode", nargs="+", default=["pull", "push"], choices=["pull", "push"])
    parser.add_argument("--layers", type=int, default=MODEL["num_hidden_layers"])
    parser.add_argument("--versions", type=int, default=5)
    parser.add_argument("--json", help="also write the results to this file")
    args = parser.parse_args()
    os.environ.setdefault("NIXL_LOG_LEVEL", "WARN")
    results = {"machine": {"cpus": os.cpu_count(), "python": platform.python_version(),
                           "platform": platform.platform()},
               "model": {**MODEL, "num_hidden_layers": args.layers}, "source": SOURCE, "target": TARGET,
               "runs": [run_mode(mode, args.layers, args.versions) for mode in args.mode]}
    for r in results["runs"]:
        rs, ws = r["setup"]["reader"], r["setup"]["writers"]
        print(f"{r['mode']}: {r['bytes'] / 1e9:.3f} GB, {r['gbps_median']:.2f} GB/s median "
              f"({r['gbps_best']:.2f} best) timing {r['timed']}; memcpy 1 thread "
              f"{r['memcpy']['threads_1_gbps']:.2f} GB/s; correct={r['correct']}")
        print(f"   reader phases {_fmt(r['reader_phases_median'])}; writer phases {_fmt(r['writer_phases_median'])}")
        writer_ms = ", ".join(f"{w['register_seconds'] * 1e3:.1f} ms" for w in ws)
        print(f"   register: reader {rs['register_seconds'] * 1e3:.1f} ms for {rs['registered_bytes'] / 1e9:.2f} GB, "
              f"writers {writer_ms} for "
              f"{sum(w['registered_bytes'] for w in ws) / 1e9:.2f} GB; descriptors reader "
              f"{rs.get('descriptors', 0)}, writers {sum(w.get('descriptors', 0) for w in ws)}")
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=1))


def _fmt(phases: dict[str, float]) -> str:
    return ", ".join(f"{k} {v:.3f}s" for k, v in phases.items() if v)


if __name__ == "__main__":
    main()
