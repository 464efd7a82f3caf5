"""Engines that join a running job: from the trainers, or from the engines beside them (issue 36).

A job of one writer process and ``--peers`` engines that hold version 1; then ``--joiners``
engines join at once and take their first version. Two modes, one after the other in one
invocation, on the same model and weights: ``peer_sources=0`` (the joiners read the writer's
slots, as before peer copies) and ``peer_sources=PEERS`` (the joiners read the peers' copies).
Reported per mode: the joiners' first update (median and slowest), the bytes the joiners read
from the writer's memory and from peers, what keeping the copies cost the peers (their ``keep``
phase), and every joiner checked bitwise against version 1. All engines are threads of this
process (each its own meta client), the writer a process of its own; shared memory, the
embedded meta server.

With ``--across-hosts`` the joiners run on another host than the peers and the writer (host
names on this one machine), every rank reads over NIXL (pull), and the second mode is
``peers_across_hosts=True``: the joiners read the peers' copies over NIXL instead of the writer's
memory.

    python benchmarks/peer_copies.py --peers 4 --joiners 4 [--size 350M] [--across-hosts] [--json]
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import statistics
import sys
import threading
import time
import uuid
from typing import Any

import torch

from weightsync.engines.buffers import ShardedEngine
from weightsync.tools.tiny import canonical_weights

#: bf16 Qwen3s (bytes per engine): every weight random
SIZES = {
    "40M": {"hidden_size": 512, "intermediate_size": 1536, "num_hidden_layers": 4, "vocab_size": 8192},
    "350M": {"hidden_size": 1024, "intermediate_size": 3072, "num_hidden_layers": 8, "vocab_size": 32768},
}
SEED = 7


def model_config(size: str) -> dict[str, Any]:
    return {"architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3", "num_attention_heads": 8,
            "num_key_value_heads": 4, "head_dim": 128, "torch_dtype": "bfloat16", **SIZES[size]}


def job_config(job: str, peer_sources: int, across: bool, host: str = "") -> Any:
    """Every rank's settings: shared memory on one host, or NIXL pull with the joiners afar."""
    from weightsync.session.sync_session import SyncConfig
    from weightsync.transport import TransportOptions

    if not across:
        return SyncConfig(num_writers=1, num_readers=None, job=job, transport="shm", peer_sources=peer_sources,
                          timeout=600, host=host)
    return SyncConfig(num_writers=1, num_readers=None, job=job, transport="nixl", peer_sources=peer_sources,
                      peers_across_hosts=peer_sources > 0, timeout=600, host=host,
                      transport_options=TransportOptions(nixl_mode="pull"))


def _writer(address: str, token: str, job: str, size: str, peer_sources: int, across: bool, done: Any,
            out: Any) -> None:
    """Write version 1 once, report the bytes it packed, and hold it until the run is over."""
    from weightsync.meta.client import MetaClient
    from weightsync.roles.writer import WeightWriter
    from weightsync.sources.module import ShardedSource
    from weightsync.tools.torch_layout import fill_from_canonical

    torch.set_num_threads(1)
    cfg = model_config(size)
    source = ShardedSource("fsdp:dp=1", cfg, 0)
    fill_from_canonical(source.layout(), source.tensors(), canonical_weights(cfg, SEED))
    sync = job_config(job, peer_sources, across, "node-a" if across else "")
    with MetaClient(address, job=job, token=token) as meta, WeightWriter(source, rank=0, config=sync,
                                                                         meta=meta) as writer:
        result = writer.write(1)
        out.put(result.nbytes)
        done.wait(600)


def run_mode(server: Any, *, peers: int, joiners: int, size: str, peer_sources: int,
             across: bool = False) -> dict[str, Any]:
    from weightsync.meta.client import MetaClient
    from weightsync.roles.reader import WeightReader

    cfg = model_config(size)
    job = f"peers-{peer_sources}-{uuid.uuid4().hex[:6]}"
    engines = [ShardedEngine(f"hf:replicas={peers + joiners}", cfg, seat) for seat in range(peers + joiners)]
    ctx = mp.get_context("spawn")
    done, out = ctx.Event(), ctx.Queue()
    writer = ctx.Process(target=_writer, args=(server.address, server.token, job, size, peer_sources, across, done,
                                               out))
    writer.start()
    metas = [MetaClient(server.address, job=job, token=server.token) for _ in engines]
    hosts = ["node-a" if seat < peers else "node-b" for seat in range(peers + joiners)] if across else [""] * (
        peers + joiners)
    readers = [WeightReader(e, rank=seat, config=job_config(job, peer_sources, across, hosts[seat]), meta=m)
               for seat, (e, m) in enumerate(zip(engines, metas, strict=True))]
    results: dict[int, Any] = {}
    seconds: dict[int, float] = {}

    def update(seat: int) -> None:
        t0 = time.perf_counter()
        results[seat] = readers[seat].update(timeout=600)
        seconds[seat] = time.perf_counter() - t0

    def together(seats: range) -> None:
        threads = [threading.Thread(target=update, args=(seat,)) for seat in seats]
        for t in threads:
            t.start()
        for t in threads:
            t.join(600)

    try:
        together(range(peers))
        written = out.get(timeout=600)
        together(range(peers, peers + joiners))
    finally:
        done.set()
        for reader in readers:
            reader.close()
        for meta in metas:
            meta.close()
        writer.join(60)
        if writer.is_alive():
            writer.kill()
    expected = {n: t.to(torch.bfloat16) for n, t in canonical_weights(cfg, SEED).items()}
    wrong = sum(not torch.equal(engines[s].tensors[n], w) for s in range(peers + joiners) for n, w in expected.items())
    joined = [results[s] for s in range(peers, peers + joiners)]
    share = sum(t.numel() * t.element_size() for t in engines[0].tensors.values())
    from_peers = sum(sum(r.peers.values()) for r in joined)
    return {"peer_sources": peer_sources, "across_hosts": across, "model": size, "bytes_per_engine": share,
            "peers": peers, "joiners": joiners,
            "writer_packed_bytes": written,
            "joiner_first_s_p50": statistics.median(seconds[s] for s in range(peers, peers + joiners)),
            "joiner_first_s_max": max(seconds[s] for s in range(peers, peers + joiners)),
            "joiners_bytes_from_peers": from_peers,
            "joiners_bytes_from_writer": sum(r.nbytes for r in joined) - from_peers,
            "peer_keep_s_p50": statistics.median(results[s].phases.get("keep", 0.0) for s in range(peers)),
            "joiner_phases_p50": {k: statistics.median(r.phases.get(k, 0.0) for r in joined)
                                  for k in sorted({k for r in joined for k in r.phases})},
            "wrong_tensors": wrong}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n", 1)[0])
    parser.add_argument("--peers", type=int, default=4)
    parser.add_argument("--joiners", type=int, default=4)
    parser.add_argument("--size", choices=sorted(SIZES), default="350M")
    parser.add_argument("--across-hosts", action="store_true",
                        help="joiners on another host, every rank over NIXL pull, peers serving over NIXL")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args(argv)
    os.environ.setdefault("NIXL_LOG_LEVEL", "WARN")  # NIXL's INFO lines go to stdout, before the JSON
    from weightsync.meta import EmbeddedMetaServer

    torch.set_num_threads(1)
    with EmbeddedMetaServer() as server:
        rows = [run_mode(server, peers=args.peers, joiners=args.joiners, size=args.size, peer_sources=k,
                         across=args.across_hosts) for k in (0, args.peers)]
    if args.json:
        print(json.dumps(rows, indent=2))
    else:
        print("peer_sources | joiner first update p50 / max | joiners' bytes from writer / from peers | "
              "writer packed | peers' keep p50 | wrong")
        for r in rows:
            print(f"{r['peer_sources']:>12} | {r['joiner_first_s_p50']:.3f} s / {r['joiner_first_s_max']:.3f} s | "
                  f"{r['joiners_bytes_from_writer'] / 1e6:.0f} MB / {r['joiners_bytes_from_peers'] / 1e6:.0f} MB | "
                  f"{r['writer_packed_bytes'] / 1e6:.0f} MB | {r['peer_keep_s_p50']:.3f} s | {r['wrong_tensors']}")
    return 0 if all(r["wrong_tensors"] == 0 for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
