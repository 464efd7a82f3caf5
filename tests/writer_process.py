"""A training rank for end-to-end tests: tiny-model weights in a training layout, written as versions.

    WEIGHTSYNC_META_ADDR=... WEIGHTSYNC_META_TOKEN=... python tests/writer_process.py \\
        --config '<hf config json>' --layout megatron:tp=2 --rank 0 --readers 1 --job j --seeds 2,1

Version ``i`` (from 1) holds ``weightsync.tools.tiny.canonical_weights(config, seeds[i - 1])``.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch

from launcher import launch as launch_process
from weightsync.layout import parse_layout
from weightsync.roles.writer import WeightWriter
from weightsync.session.sync_session import SyncConfig, TransportOptions
from weightsync.sources.module import ShardedSource
from weightsync.tools.tiny import canonical_weights
from weightsync.tools.torch_layout import fill_from_canonical

HERE = Path(__file__).resolve().parent


@contextlib.contextmanager
def writer_processes(server: Any, config: dict[str, Any], layout: str, *, job: str, seeds: list[int],
                     extra: tuple[str, ...] = ()) -> Iterator[list[subprocess.Popen[str]]]:
    """Training ranks in subprocesses, writing versions 1.. with ``seeds``' weights.

    ``extra``: more flags (``--transport shm``, ``--bucket 65536``, ``--layer-phases``, ``--hosts a,b``, ``--delta 4``,
    ``--nixl-mode push``, ``--elastic``, ``--peer-sources 4``, ``--peers-across-hosts``, ``--results FILE``)."""
    env = {**os.environ, "WEIGHTSYNC_META_ADDR": server.address, "WEIGHTSYNC_META_TOKEN": server.token,
           "OMP_NUM_THREADS": "1", "PYTHONPATH": os.pathsep.join([str(HERE), os.environ.get("PYTHONPATH", "")])}
    procs = [launch_process([sys.executable, str(HERE / "writer_process.py"), "--config", json.dumps(config),
                             "--layout", layout, "--rank", str(rank), "--job", job,
                             "--seeds", ",".join(map(str, seeds)), *extra], env=env)
             for rank in range(parse_layout(layout).world_size)]
    try:
        yield procs
        for proc in procs:
            _, err = proc.communicate(timeout=120)
            assert proc.returncode == 0, err[-2000:]
    finally:
        for rank, proc in enumerate(procs):
            if proc.poll() is None:
                proc.kill()
            _, err = proc.communicate()
            if proc.returncode:
                print(f"writer {rank} exited {proc.returncode}:\n{err[-3000:]}", file=sys.stderr)


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--config", required=True)
    parser.add_argument("--layout", required=True)
    parser.add_argument("--rank", type=int, required=True)
    parser.add_argument("--readers", type=int, default=1)
    parser.add_argument("--elastic", action="store_true", help="num_readers=None: the readers that joined")
    parser.add_argument("--job", default="default")
    parser.add_argument("--seeds", required=True)
    parser.add_argument("--timeout", type=float, default=120.0)
    parser.add_argument("--transport", default="auto")
    parser.add_argument("--bucket", type=int, default=64 << 20)
    parser.add_argument("--layer-phases", action="store_true")
    parser.add_argument("--hosts", default="", help="each rank's node name, comma-separated (routed)")
    parser.add_argument("--delta", type=int, default=0, help="delta_anchor_every")
    parser.add_argument("--nixl-mode", default="auto", help="TransportOptions.nixl_mode")
    parser.add_argument("--peer-sources", type=int, default=0, help="SyncConfig.peer_sources")
    parser.add_argument("--peers-across-hosts", action="store_true", help="SyncConfig.peers_across_hosts")
    parser.add_argument("--completion", default="all", help="SyncConfig.completion")
    parser.add_argument("--integrity", action="store_true", help="SyncConfig.integrity")
    parser.add_argument("--results", default="", help="a file to append each write's version and bytes to (JSON lines)")
    args = parser.parse_args()
    torch.set_num_threads(1)
    config = json.loads(args.config)
    source = ShardedSource(args.layout, config, args.rank)
    sync = SyncConfig(num_writers=parse_layout(args.layout).world_size, num_readers=None if args.elastic else args.readers,
                      job=args.job,
                      timeout=args.timeout, transport=args.transport, layer_phases=args.layer_phases,
                      host=args.hosts.split(",")[args.rank] if args.hosts else "", peer_sources=args.peer_sources,
                      integrity=args.integrity, peers_across_hosts=args.peers_across_hosts, completion=args.completion,
                      transport_options=TransportOptions(max_bucket_bytes=args.bucket, delta_anchor_every=args.delta,
                                                                         nixl_mode=args.nixl_mode))
    with WeightWriter(source, rank=args.rank, config=sync) as writer:
        for version, seed in enumerate((int(s) for s in args.seeds.split(",")), start=1):
            fill_from_canonical(source.layout(), source.tensors(), canonical_weights(config, seed))
            result = writer.write(version)
            if args.results:
                with open(args.results, "a") as out:
                    out.write(json.dumps({"rank": args.rank, "version": version, "nbytes": result.nbytes}) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
