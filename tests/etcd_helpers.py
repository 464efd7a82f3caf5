"""A real 3-member etcd cluster for tests, and a small sync job (2 writers, 2 readers) run on it.

    cluster = etcd_cluster(tmp_path)          # skips (or fails in CI) when etcd or etcd3gw is missing
    outcome = run_sync(cluster.address, versions=[0, 1, 2], job="j")

Where etcd or etcd3gw is missing the etcd tests skip, naming the install command; with ``CI`` or
``WEIGHTSYNC_REQUIRE_ETCD`` set (``.ci/run`` sets both) they fail instead: CI never skips them.
"""

from __future__ import annotations

import importlib.util
import os
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
import torch

from weightsync.apps.demo import canonical_values
from weightsync.configs import load_spec
from weightsync.engines.buffers import ShardedEngine
from weightsync.sources.module import ShardedSource
from weightsync.tools.torch_layout import allocate, fill_from_canonical

REQUIRE = ("CI", "WEIGHTSYNC_REQUIRE_ETCD")
CONFIG = load_spec("tiny-qwen3-moe").to_hf_config()
SOURCE, TARGET = "megatron:tp=2", "vllm:tp=1,replicas=2"


def etcd_missing() -> str | None:
    """Why the etcd tests cannot run here (the install command), or None."""
    from weightsync.meta.etcd.cluster import INSTALL, etcd_binary

    if importlib.util.find_spec("etcd3gw") is None:
        return "etcd3gw is not installed: pip install 'weightsync[etcd]' (or pip install etcd3gw)"
    if etcd_binary() is None:
        return f"etcd is not installed: {INSTALL}"
    return None


def require_etcd() -> None:
    """Skip the calling test when etcd is missing, or fail it where it is required (CI)."""
    reason = etcd_missing()
    if reason is None:
        return
    required = [name for name in REQUIRE if os.environ.get(name)]
    if required:
        pytest.fail(f"the etcd tests must run here ({' and '.join(required)} set) but {reason}", pytrace=False)
    pytest.skip(reason)


def etcd_cluster(directory: Path, members: int = 3, tls: Any = None) -> Any:
    """A started :class:`~weightsync.meta.etcd.cluster.LocalEtcdCluster` (the caller stops it)."""
    require_etcd()
    from weightsync.meta.etcd.cluster import LocalEtcdCluster

    cluster = LocalEtcdCluster(directory, members=members, tls=tls)
    try:
        return cluster.start()
    except BaseException:
        cluster.stop()
        raise


def certificates(directory: Path, *, member_client_auth: bool = True) -> Any:
    """A throwaway PKI made with ``openssl``: a CA, a member certificate for 127.0.0.1 and a client
    certificate (client auth), EC P-256, valid for a day; an
    :class:`~weightsync.meta.etcd.cluster.EtcdTLS` of their files.

    The member certificate allows server and client auth: etcd's HTTP gateway dials the member's
    own gRPC server with it (``member_client_auth=False`` makes the certificate etcd then fails with).
    """
    import subprocess

    from weightsync.meta.etcd.cluster import EtcdTLS

    directory.mkdir(parents=True, exist_ok=True)
    key = ["-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes"]

    def openssl(*args: str) -> None:
        proc = subprocess.run(["openssl", *args], capture_output=True, text=True, timeout=30, check=False)
        assert proc.returncode == 0, f"openssl {args[0]}: {proc.stderr[-1000:]}"

    ca, ca_key = str(directory / "ca.pem"), str(directory / "ca.key")
    openssl("req", "-x509", *key, "-keyout", ca_key, "-out", ca, "-days", "1", "-subj", "/CN=weightsync test CA")
    files = {}
    usage = "serverAuth,clientAuth" if member_client_auth else "serverAuth"
    for name, extensions in (("server", f"subjectAltName=IP:127.0.0.1\nextendedKeyUsage={usage}\n"),
                             ("client", "extendedKeyUsage=clientAuth\n")):
        (directory / f"{name}.ext").write_text(extensions)
        csr = str(directory / f"{name}.csr")
        files[name] = (str(directory / f"{name}.pem"), str(directory / f"{name}.key"))
        openssl("req", *key, "-keyout", files[name][1], "-out", csr, "-subj", f"/CN=weightsync test {name}")
        openssl("x509", "-req", "-in", csr, "-CA", ca, "-CAkey", ca_key, "-CAcreateserial", "-out", files[name][0],
                "-days", "1", "-extfile", str(directory / f"{name}.ext"))
    return EtcdTLS(ca=ca, server_cert=files["server"][0], server_key=files["server"][1],
                   client_cert=files["client"][0], client_key=files["client"][1])


def meta(address: str, job: str, timeout: float = 10.0) -> Any:
    from weightsync.meta.etcd.client import EtcdMetaClient

    return EtcdMetaClient(address, job=job, timeout=timeout)


@dataclass
class SyncOutcome:
    writes: dict[int, list[tuple[int, float]]] = field(default_factory=dict)  # rank -> (version, seconds)
    reads: dict[int, list[int]] = field(default_factory=dict)  # rank -> versions applied, in order
    exact: dict[int, list[bool]] = field(default_factory=dict)
    errors: list[BaseException] = field(default_factory=list)


def values(version: int) -> dict[str, torch.Tensor]:
    return canonical_values(CONFIG, version + 100)


def run_sync(address: str, versions: list[int], *, job: str, timeout: float = 30.0,
             after_write: Callable[[int], None] | None = None, in_config: bool = False) -> SyncOutcome:
    """Two Megatron TP2 writers and two vLLM TP1 readers on shared memory, in threads, each with its
    own etcd client, syncing ``versions``; every reader checks every version bitwise.
    ``after_write(v)`` runs in writer 0's thread once its ``write(v)`` returned (a fault there).
    ``in_config``: the roles open their clients from ``SyncConfig.meta_address`` instead of being
    given one."""
    from weightsync.roles.reader import WeightReader
    from weightsync.roles.writer import WeightWriter
    from weightsync.session.sync_session import SyncConfig

    out = SyncOutcome()
    config = SyncConfig(num_writers=2, num_readers=2, transport="shm", timeout=timeout, job=job,
                        meta_address=address if in_config else "")
    done = threading.Barrier(4)

    def client() -> Any:
        return None if in_config else meta(address, job)

    def writer(rank: int) -> None:
        source = ShardedSource(SOURCE, CONFIG, rank)
        log = out.writes.setdefault(rank, [])
        with WeightWriter(source, rank=rank, config=config, meta=client()) as w:
            for v in versions:
                fill_from_canonical(source.layout(), source.tensors(), values(v))
                t0 = time.monotonic()
                w.write(v)
                log.append((v, time.monotonic() - t0))
                if rank == 0 and after_write is not None:
                    after_write(v)
            done.wait(timeout * len(versions))

    def reader(rank: int) -> None:
        engine = ShardedEngine(TARGET, CONFIG, rank)
        with WeightReader(engine, rank=rank, config=config, meta=client()) as r:
            for v in versions:
                result = r.update(v, timeout=timeout)
                out.reads.setdefault(rank, []).append(result.version)
                want = allocate(engine.layout())
                fill_from_canonical(engine.layout(), want, values(result.version))
                out.exact.setdefault(rank, []).append(all(torch.equal(engine.tensors[n], want[n]) for n in want))
            done.wait(timeout * len(versions))

    def guard(fn: Callable[[int], None], rank: int) -> None:
        try:
            fn(rank)
        except BaseException as exc:
            out.errors.append(exc)
            done.abort()

    threads = [threading.Thread(target=guard, args=(fn, rank), daemon=True)
               for fn in (writer, reader) for rank in (0, 1)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout * (len(versions) + 2))
    assert not any(t.is_alive() for t in threads), "a rank of the sync job did not finish"
    return out
