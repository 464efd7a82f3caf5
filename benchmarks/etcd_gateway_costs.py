"""What one request to etcd's HTTP/JSON gateway costs, on the client and on the members.

    python benchmarks/etcd_gateway_costs.py            # 640 clients, a 3-member cluster on loopback
    python benchmarks/etcd_gateway_costs.py --json

Two measurements behind docs/benchmarks.md's analysis of the meta-scale job on etcd:

* **client CPU per request** (``time.process_time`` over 400 transactions in a row, one
  connection): through ``aiohttp`` (what :class:`~weightsync.meta.etcd.gateway.AsyncEtcdKV`
  uses), through ``httpx.AsyncClient`` (what the embedded server's ``AsyncMetaClient`` uses, and
  the etcd client used before wave 12), through ``httpcore`` (httpx's transport) alone, and as a
  bare asyncio HTTP/1.1 exchange;
* **members' CPU per request** (the three etcd processes' CPU from ``/proc``, over 640 clients,
  64 at a time): a read-only transaction, a join transaction as
  :mod:`weightsync.meta.etcd.barrier` sends it (its registration, its blob, the barrier and the
  four reads), the same without the reads, and a watch that receives one event of 100 bytes,
  15 KB (a compressed 1280-rank roster) or 60 KB (uncompressed).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import sys
import tempfile
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import aiohttp
import httpcore
import httpx

from weightsync.clock.deadline import Deadline
from weightsync.meta.etcd import barrier, ops
from weightsync.meta.etcd.async_client import AsyncEtcdMetaClient
from weightsync.meta.etcd.cluster import LocalEtcdCluster
from weightsync.meta.etcd.schema import JobKeys
from weightsync.ports.records import Participant


def _members_cpu(cluster: LocalEtcdCluster) -> float:
    total = 0.0
    for proc in cluster.procs:
        assert proc is not None
        fields = Path(f"/proc/{proc.pid}/stat").read_text().rsplit(")", 1)[1].split()
        total += (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
    return total


async def client_cpu(url: str, n: int = 400) -> dict[str, float]:
    """Milliseconds of this process's CPU per read-only transaction, by HTTP library."""
    body = {"compare": [], "success": [ops.read("nothing")], "failure": []}
    raw = json.dumps(body).encode()
    out: dict[str, float] = {}

    async def timed(name: str, call: Callable[[], Awaitable[Any]]) -> None:
        await call()  # the connection is open before the clock starts
        cpu = time.process_time()
        for _ in range(n):
            await call()
        out[name] = round((time.process_time() - cpu) / n * 1e3, 3)

    async with aiohttp.ClientSession() as session:
        async def through_aiohttp() -> Any:
            async with session.post(f"{url}/v3/kv/txn", data=raw, headers={"Content-Type": "application/json"}) as r:
                return json.loads(await r.read())
        await timed("aiohttp", through_aiohttp)
    async with httpx.AsyncClient(trust_env=False) as client:
        await timed("httpx", lambda: client.post(f"{url}/v3/kv/txn", json=body))
    async with httpcore.AsyncConnectionPool() as pool:
        await timed("httpcore", lambda: pool.request("POST", f"{url}/v3/kv/txn", content=raw,
                                                     headers=[(b"Content-Type", b"application/json")]))
    host, port = url.removeprefix("http://").rsplit(":", 1)
    reader, writer = await asyncio.open_connection(host, int(port))
    request = (b"POST /v3/kv/txn HTTP/1.1\r\nHost: etcd\r\nContent-Type: application/json\r\n"
               b"Content-Length: %d\r\n\r\n" % len(raw)) + raw

    async def bare() -> Any:
        writer.write(request)
        head = await reader.readuntil(b"\r\n\r\n")
        length = next(int(line.split(b":")[1]) for line in head.split(b"\r\n")
                      if line.lower().startswith(b"content-length"))
        return json.loads(await reader.readexactly(length))

    await timed("bare asyncio", bare)
    writer.close()
    return out


async def members_cpu(cluster: LocalEtcdCluster, clients: int = 640) -> dict[str, float]:
    """Milliseconds of the three members' CPU per request, by kind."""
    metas = [AsyncEtcdMetaClient(cluster.address, job="costs", timeout=60) for _ in range(clients)]
    limit = asyncio.Semaphore(64)
    out: dict[str, float] = {}

    async def each(name: str, call: Callable[[int, AsyncEtcdMetaClient], Awaitable[Any]]) -> None:
        async def one(i: int, meta: AsyncEtcdMetaClient) -> None:
            async with limit:
                await call(i, meta)
        cpu = _members_cpu(cluster)
        await asyncio.gather(*(one(i, m) for i, m in enumerate(metas)))
        out[name] = round((_members_cpu(cluster) - cpu) / clients * 1e3, 3)

    def join(job: str, reads: bool) -> Callable[[int, AsyncEtcdMetaClient], Awaitable[Any]]:
        keys = JobKeys("weightsync", job)

        def txn(i: int, meta: AsyncEtcdMetaClient) -> Awaitable[Any]:
            p = Participant("writer", i, "train", f"node-{i // 8}", {"tcp": f"10.0.{i // 250}.{i % 250}:29500"},
                            b"L" * 60)
            puts = barrier.registration_puts(keys, p, None) or []
            reading = barrier.state_reads(keys) if reads else []
            return meta.kv.txn([ops.unchanged(keys.part("writer", i), 0)],
                               [*puts, ops.put(keys.barrier(clients, 0), b""), *reading])
        return txn

    try:
        await each("read-only transaction (connections opened)", lambda i, m: m.kv.txn([], [ops.read("nothing")]))
        await each("read-only transaction", lambda i, m: m.kv.txn([], [ops.read("nothing")]))
        await each("join transaction", join("j1", reads=True))
        await each("join transaction without its reads", join("j2", reads=False))
        for size, label in ((100, "100 B"), (15_000, "15 KB"), (60_000, "60 KB")):
            key = f"costs/event-{size}"
            revision = (await metas[0].kv.txn([], [ops.put(key, os.urandom(size))])).revision

            async def watch(i: int, meta: AsyncEtcdMetaClient, key: str = key, revision: int = revision) -> None:
                rows = await meta.kv.watch_rows(key, prefix=False, after=revision - 1, deadline=Deadline.after(60))
                assert rows, "the event was not delivered"
                await meta.kv.release_watch()
            await each(f"watch and its {label} event", watch)
    finally:
        await asyncio.gather(*(m.aclose() for m in metas))
    return out


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--clients", type=int, default=640)
    p.add_argument("--json", action="store_true")
    args = p.parse_args()
    with tempfile.TemporaryDirectory(prefix="weightsync-etcd-costs-") as tmp, \
            LocalEtcdCluster(Path(tmp), members=3, heartbeat_ms=100, election_ms=1000) as cluster:
        result = {"client_cpu_ms_per_request": asyncio.run(client_cpu(cluster.urls[0])),
                  "members_cpu_ms_per_request": asyncio.run(members_cpu(cluster, args.clients)),
                  "machine": f"{platform.machine()}, {os.cpu_count()} cores, Python {platform.python_version()}, "
                             f"aiohttp {aiohttp.__version__}, httpx {httpx.__version__}, "
                             f"httpcore {httpcore.__version__}"}
    if args.json:
        print(json.dumps(result))
    else:
        for section in ("client_cpu_ms_per_request", "members_cpu_ms_per_request"):
            print(section.replace("_", " ") + ":")
            for name, ms in result[section].items():
                print(f"  {name}: {ms} ms")
        print(result["machine"])
    return 0


if __name__ == "__main__":
    sys.exit(main())
