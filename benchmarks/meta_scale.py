"""Meta-server scale: a 1T-parameter MoE job's metadata, published and fetched by every rank.

    python benchmarks/meta_scale.py                       # 1024 writers + 256 readers, 2 client processes
    python benchmarks/meta_scale.py --state-dir --json    # with the durable store (one fsynced commit per change)
    python benchmarks/meta_scale.py --mode separate       # register, then a separate barrier fetch
    python benchmarks/meta_scale.py --materialize         # also build all 1280 Participant objects per rank
    python benchmarks/meta_scale.py --backend both        # the embedded server and a 3-member etcd cluster

A real ``weightsync meta-server`` process serves; the participants are simulated by asyncio
tasks in ``--procs`` client processes, one :class:`AsyncMetaClient` (own TCP connection) each.
The clock starts when all participants are released at once and stops when the last one holds
the whole job's metadata: every rank registered (its endpoints and layout descriptor
published), the barrier passed, the full roster (1280 rows, two distinct layout blobs) fetched
and decoded, and the model config document fetched. Writer 0 publishes the config document
(the bundled ``moe-1t`` HF config) before it joins, as weightsync's writer does; every rank
asks for it with the roster (``documents=[key]``), so ``--mode join`` is one round trip per rank
and ``--mode separate`` two.

With ``--backend etcd`` the coordinator is a 3-member etcd cluster on loopback
(:class:`~weightsync.meta.etcd.cluster.LocalEtcdCluster`, with etcd's default heartbeat and
election timeout), and the participants are asyncio
tasks in the same client processes, each with its own
:class:`~weightsync.meta.etcd.async_client.AsyncEtcdMetaClient` (own HTTP connections), doing the
same calls: writer 0 stores the config, every rank joins (one transaction registers it and
announces the barrier, a watch waits for the roster, the config document is read with it) and
decodes the roster. ``--backend both`` runs the two one after the other, in one invocation, on
the same machine, so the two are compared like for like.

Layouts: writers ``megatron:tp=8,pp=16,dp=8,ep=64,etp=1`` (1024 ranks, 8 per host), readers
``vllm:tp=16,replicas=16`` (256 ranks, 8 per host); each rank has two transport endpoints.
"""

from __future__ import annotations

import argparse
import asyncio
import cProfile
import json
import multiprocessing as mp
import os
import platform
import pstats
import signal
import subprocess
import sys
import tempfile
import time
from importlib import resources
from pathlib import Path
from typing import Any

import httpx
import msgpack

from weightsync.meta import AsyncMetaClient, Participant
from weightsync.meta.config import ensure_token_file
from weightsync.meta.embedded import raise_open_file_limit

WRITER_LAYOUT = "megatron:tp=8,pp=16,dp=8,ep=64,etp=1"
READER_LAYOUT = "vllm:tp=16,replicas=16"
MODEL_KEY = "model/moe-1t"
JOB = "moe-1t"


def participant(role: str, rank: int) -> Participant:
    layout = WRITER_LAYOUT if role == "writer" else READER_LAYOUT
    node = rank // 8 + (0 if role == "writer" else 1000)
    ip = f"10.{node // 250}.{node % 250}.{rank % 8 + 1}"
    return Participant(role, rank, "train" if role == "writer" else "rollout", f"node-{node:04d}.cluster",
                       {"nixl": f"{ip}:5555/agent-{role[0]}{rank}", "tcp": f"{ip}:{29500 + rank % 8}"},
                       msgpack.packb({"layout": layout, "model": MODEL_KEY}))


async def _one(client: Any, p: Participant, args: argparse.Namespace, config: bytes) -> float:
    """One rank, on either backend (:class:`AsyncMetaClient` or :class:`AsyncEtcdMetaClient`: the same calls)."""
    if p.role == "writer" and p.rank == 0:
        await client.put_document(MODEL_KEY, config)
    if args.mode == "join":
        table = await client.join(p, writers=args.writers, readers=args.readers, timeout=120, documents=[MODEL_KEY])
    else:
        await client.register(p)
        table = await client.wait_table(writers=args.writers, readers=args.readers, timeout=120,
                                        documents=[MODEL_KEY])
    _check(table, p, args)
    model = table.documents.get(MODEL_KEY) or await client.get_document(MODEL_KEY, wait=60)
    assert model == config
    return time.monotonic()


def _client(address: str, token: str | None) -> Any:
    """A simulated rank's own client: of the meta server (a token), else of the etcd cluster."""
    if token is None:
        from weightsync.meta.etcd.async_client import AsyncEtcdMetaClient

        return AsyncEtcdMetaClient(address, job=JOB, timeout=120)
    return AsyncMetaClient(address, job=JOB, token=token, timeout=120)


def _worker(index: int, args: argparse.Namespace, address: str, token: str | None, barrier: Any, out: Any) -> None:
    raise_open_file_limit()  # hundreds of connections per client process
    everyone = [("writer", r) for r in range(args.writers)] + [("reader", r) for r in range(args.readers)]
    mine = [participant(role, rank) for role, rank in everyone[index::args.procs]]
    config = (resources.files("weightsync.configs") / "moe-1t.json").read_bytes()

    profile = cProfile.Profile() if args.profile and index == 0 else None

    async def main() -> tuple[float, float, float]:
        clients = [_client(address, token) for _ in mine]
        try:
            await asyncio.get_running_loop().run_in_executor(None, barrier.wait)
            start, cpu = time.monotonic(), time.process_time()
            if profile is not None:
                profile.enable()
            done = await asyncio.gather(*(_one(c, p, args, config) for c, p in zip(clients, mine, strict=True)))
            if profile is not None:
                profile.disable()
            return start, max(done), time.process_time() - cpu
        finally:
            await asyncio.gather(*(c.aclose() for c in clients))

    out.put((index, *asyncio.run(main()), _by_package(profile) if profile is not None else None))


def _by_package(profile: cProfile.Profile) -> dict[str, float]:
    """Where a client process spent its CPU (``--profile``): each function's own time, summed per
    top-level package (``asyncio`` for the event loop, ``builtins`` for C functions), as shares."""
    spent: dict[str, float] = {}
    for (filename, _, _), (_, _, own, _, _) in pstats.Stats(profile).stats.items():  # type: ignore[attr-defined]
        if filename == "~":
            package = "builtins"
        else:
            parts = Path(filename).parts
            if "site-packages" in parts:
                package = parts[parts.index("site-packages") + 1].split(".")[0]
            elif "weightsync" in parts:
                package = "weightsync"
            else:  # the standard library: its package (asyncio), else its module (contextlib)
                folder = Path(filename).parent.name
                package = Path(filename).stem if folder.startswith("python3") else folder
        spent[package] = spent.get(package, 0.0) + own
    total = sum(spent.values()) or 1.0
    return {k: round(v / total, 3) for k, v in sorted(spent.items(), key=lambda kv: -kv[1])[:12]}


def _check(table: Any, p: Participant, args: argparse.Namespace) -> None:
    layouts = {role: {msgpack.unpackb(blob)["layout"]: len(ranks) for blob, ranks in table.layouts(role).items()}
               for role in ("writer", "reader")}
    assert layouts == {"writer": {WRITER_LAYOUT: args.writers}, "reader": {READER_LAYOUT: args.readers}}, layouts
    if args.materialize:
        assert len(table.participants()) == args.writers + args.readers
    else:
        peer = table.get("reader" if p.role == "writer" else "writer", 0)
        assert peer is not None and peer.endpoints


def run_etcd(args: argparse.Namespace) -> dict[str, Any]:
    """The same job on a 3-member etcd cluster on loopback (see module docstring)."""
    from weightsync.meta.etcd.client import EtcdMetaClient
    from weightsync.meta.etcd.cluster import LocalEtcdCluster

    with tempfile.TemporaryDirectory(prefix="weightsync-meta-scale-etcd-") as tmp, \
            LocalEtcdCluster(Path(tmp), members=3, heartbeat_ms=100, election_ms=1000) as cluster:
        ctx = mp.get_context("spawn")
        barrier, out = ctx.Barrier(args.procs + 1), ctx.Queue()
        procs = [ctx.Process(target=_worker, args=(i, args, cluster.address, None, barrier, out))
                 for i in range(args.procs)]
        for p in procs:
            p.start()
        barrier.wait(timeout=120)
        etcd_pids = [proc.pid for proc in cluster.procs if proc is not None]
        members_cpu, before = [_cpu_seconds(pid) for pid in etcd_pids], _etcd_requests(cluster.urls)
        results = sorted((out.get(timeout=300) for _ in procs), key=lambda r: r[0])
        for p in procs:
            p.join(timeout=30)
        members_cpu = [_cpu_seconds(pid) - cpu for pid, cpu in zip(etcd_pids, members_cpu, strict=True)]
        after = _etcd_requests(cluster.urls)
        leader = cluster.leader()
        requests = {method: after[method] - before.get(method, 0) for method in sorted(after)}
        with EtcdMetaClient(cluster.address, job=JOB) as client:
            roster = len(client.kv.get(client.keys.roster)[0].value)  # type: ignore[union-attr]
    start = min(r[1] for r in results)
    return {
        "backend": "etcd (3 members, loopback)", "writers": args.writers, "readers": args.readers, "mode": args.mode,
        "procs": args.procs, "state_dir": True, "materialize": args.materialize,
        "seconds": round(max(r[2] for r in results) - start, 3), "roster_bytes": roster,
        "requests": sum(requests.values()), "requests_by_method": {m: n for m, n in requests.items() if n},
        "client_cpu_seconds": round(sum(r[3] for r in results), 2), "server_cpu_seconds": round(sum(members_cpu), 2),
        "member_cpu_seconds": [round(c, 2) for c in members_cpu], "leader": leader,
        "client_profile": results[0][4],
        "machine": f"{platform.machine()}, {os.cpu_count()} cores, Python {platform.python_version()}",
    }


def _server_requests(address: str, headers: dict[str, str]) -> int:
    """HTTP requests the meta server answered so far (its /metrics), long-polls asked again included."""
    text = httpx.get(f"{address}/metrics", headers=headers, timeout=30).text
    return sum(int(float(line.rsplit(" ", 1)[1])) for line in text.splitlines()
               if line.startswith("weightsync_meta_requests_total{"))


def _etcd_requests(urls: list[str]) -> dict[str, int]:
    """gRPC calls the members started, by method, from their /metrics: every gateway request
    (a transaction, a watch stream, ...) is one gRPC call of the member it reached."""
    import urllib.request

    counts: dict[str, int] = {}
    for url in urls:
        with urllib.request.urlopen(f"{url}/metrics", timeout=10) as r:
            for line in r.read().decode().splitlines():
                if line.startswith("grpc_server_started_total{"):
                    method = line.split('grpc_method="', 1)[1].split('"', 1)[0]
                    counts[method] = counts.get(method, 0) + int(float(line.rsplit(" ", 1)[1]))
    return counts


def _cpu_seconds(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _start_server(tmp: Path, state_dir: bool) -> tuple[subprocess.Popen[str], str, str]:
    token = ensure_token_file(tmp / "token")
    cmd = [sys.executable, "-m", "weightsync.cli", "meta-server", "--port", "0", "--token-file", str(tmp / "token")]
    if state_dir:
        cmd += ["--state-dir", str(tmp / "state")]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, text=True)
    assert proc.stdout is not None
    line = proc.stdout.readline()  # the server prints its address at once; a dead one closes stdout
    if "listening on" not in line:
        proc.kill()
        raise RuntimeError(f"meta server did not start: {line!r}")
    return proc, line.rsplit(" ", 1)[1].strip(), token


def run(args: argparse.Namespace) -> dict[str, Any]:
    with tempfile.TemporaryDirectory(prefix="weightsync-meta-scale-") as tmp:
        server, address, token = _start_server(Path(tmp), args.state_dir)
        try:
            ctx = mp.get_context("spawn")
            barrier, out = ctx.Barrier(args.procs + 1), ctx.Queue()
            procs = [ctx.Process(target=_worker, args=(i, args, address, token, barrier, out))
                     for i in range(args.procs)]
            for p in procs:
                p.start()
            headers = {"Authorization": f"Bearer {token}", "Accept": "application/msgpack"}
            barrier.wait(timeout=120)
            server_cpu, before = _cpu_seconds(server.pid), _server_requests(address, headers)
            results = sorted((out.get(timeout=300) for _ in procs), key=lambda r: r[0])
            for p in procs:
                p.join(timeout=30)
            start = min(r[1] for r in results)
            total = max(r[2] for r in results) - start
            server_cpu = _cpu_seconds(server.pid) - server_cpu
            requests = _server_requests(address, headers) - before - 1  # the first /metrics counts once done
            roster = httpx.get(f"{address}/v1/jobs/{JOB}/participants", headers=headers, timeout=30).content
            metrics = httpx.get(f"{address}/metrics", headers=headers, timeout=30).text
            fsyncs = next((float(line.split()[-1]) for line in metrics.splitlines()
                           if line.startswith("weightsync_meta_store_commits_total")), None)
        finally:
            server.terminate()
            server.wait(timeout=30)
    return {
        "backend": "embedded (weightsync meta-server)",
        "writers": args.writers, "readers": args.readers, "mode": args.mode, "procs": args.procs,
        "state_dir": args.state_dir, "materialize": args.materialize,
        "seconds": round(total, 3), "requests": requests,
        "roster_bytes": len(roster), "client_cpu_seconds": round(sum(r[3] for r in results), 2),
        "server_cpu_seconds": round(server_cpu, 2),
        "store_commits": fsyncs, "client_profile": results[0][4],
        "machine": f"{platform.machine()}, {os.cpu_count()} cores, Python {platform.python_version()}",
    }


def main() -> int:
    # a TERM (e.g. from `timeout`) unwinds like an exception, so the servers and etcd members it started stop
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--writers", type=int, default=1024)
    p.add_argument("--readers", type=int, default=256)
    p.add_argument("--procs", type=int, default=2, help="client processes simulating the participants")
    p.add_argument("--mode", choices=("join", "separate"), default="join",
                   help="join: register + barrier + roster in one call; separate: register, then wait_table")
    p.add_argument("--state-dir", action="store_true", help="run the server with a durable state directory")
    p.add_argument("--materialize", action="store_true", help="build every Participant object on every rank")
    p.add_argument("--repeat", type=int, default=1, help="runs; the best and all are reported")
    p.add_argument("--backend", choices=("embedded", "etcd", "both"), default="embedded",
                   help="the coordinator: the embedded meta server, a 3-member etcd cluster on loopback, or both")
    p.add_argument("--profile", action="store_true",
                   help="profile the first client process (slower: for where its CPU goes, not for timings)")
    p.add_argument("--json", action="store_true")
    args = p.parse_args()
    backends = {"embedded": [run], "etcd": [run_etcd], "both": [run, run_etcd]}[args.backend]
    for runner in backends:
        _report(args, [runner(args) for _ in range(args.repeat)])
    return 0


def _report(args: argparse.Namespace, runs: list[dict[str, Any]]) -> None:
    best = min(runs, key=lambda r: r["seconds"])
    best["all_seconds"] = [r["seconds"] for r in runs]
    best["all_requests"] = [r["requests"] for r in runs]
    if args.json:
        print(json.dumps(best))
    else:
        print(f"{best['backend']}: {args.writers} writers + {args.readers} readers ({args.mode}, "
              f"{args.procs} client processes"
              f"{', state dir' if args.state_dir else ''}{', materialized' if args.materialize else ''}): "
              f"{best['seconds']:.3f} s (runs: {best['all_seconds']}); roster {best['roster_bytes']} bytes; "
              f"{best.get('requests', '-')} requests; CPU: clients {best['client_cpu_seconds']} s, "
              f"server {best['server_cpu_seconds']} s; "
              f"commits {best.get('store_commits', '-')}; {best['machine']}")
        if best.get("member_cpu_seconds"):
            print(f"  etcd members' CPU: {best['member_cpu_seconds']} s (leader: member {best['leader']}); "
                  f"gRPC calls: {best['requests_by_method']}")
        if best.get("client_profile"):
            print(f"  client process 0's CPU by package: {best['client_profile']}")


if __name__ == "__main__":
    sys.exit(main())
