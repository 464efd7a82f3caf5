"""One site of tests/test_sites_netns.py: the writers' site (with the meta server) or a readers' site.

Every process computes the same two-level plan (weightsync.plan.sites) from the same layouts and
runs its ranks as threads:

* site ``a``: the meta server and writers 0 and 1 (Megatron TP2), job ``across`` over torch (gloo);
* a reader site: four readers (vLLM TP1 replicas). Each takes what the plan sends it across the
  slow link (job ``across``, its ``first`` layout), then, in job ``inside-<site>`` (shared memory),
  sends it to the site's other readers as a writer (the same layout) while it receives the rest
  as a reader (its ``second`` layout); then it checks every byte it holds against the version.

Output: JSON lines (``SITE {...}``) on stdout; the first line of site ``a`` is the meta server's
address. Nothing crosses but msgpack/JSON.

    python tests/_site_worker.py --site a --host 10.77.0.1 --versions 2
    python tests/_site_worker.py --site b --host 10.77.1.2 --meta http://10.77.0.1:PORT --token T
"""

from __future__ import annotations

import argparse
import contextlib
import json
import sys
import threading
from typing import Any

import torch

from weightsync.apps.demo import canonical_values
from weightsync.engines.buffers import _InPlace
from weightsync.layout import ModelSpec, parse_layout
from weightsync.layout.types import RankLayout
from weightsync.meta import EmbeddedMetaServer, MetaClient
from weightsync.plan.sites import Sites, plan_sites
from weightsync.roles.reader import WeightReader
from weightsync.roles.writer import WeightWriter
from weightsync.session.config import SyncConfig
from weightsync.tools.torch_layout import allocate, fill_from_canonical
from weightsync.transport import TransportOptions

#: A Qwen3 of about 20M parameters (42 MB in bf16): big enough that the link counters are the
#: bytes of the weights, not of the meta server's polls.
CONFIG = {"architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3", "hidden_size": 512,
          "intermediate_size": 1536, "num_hidden_layers": 4, "num_attention_heads": 8, "num_key_value_heads": 4,
          "head_dim": 64, "vocab_size": 8192, "tie_word_embeddings": False, "torch_dtype": "bfloat16"}
SOURCE, TARGET = "megatron:tp=2", "vllm:tp=1"
WRITER_SITES, READER_SITES = "a", "b*4,c*4"
TIMEOUT = 120.0


def layouts() -> tuple[list[RankLayout], list[RankLayout], Sites]:
    spec = ModelSpec.from_hf_config(CONFIG)
    source, target = parse_layout(SOURCE), parse_layout(TARGET)
    writers = [source.rank_layout(spec, r) for r in range(source.world_size)]
    sites = Sites.parse(WRITER_SITES, READER_SITES, num_writers=len(writers), num_readers=8)
    readers = [target.rank_layout(spec, 0).with_rank(r) for r in range(len(sites.readers))]
    return writers, readers, sites


class LayoutSource:
    """A writer's tensors under an explicit layout (what it sends)."""

    def __init__(self, layout: RankLayout, tensors: dict[str, torch.Tensor]) -> None:
        self._layout, self._tensors = layout, {s.name: tensors[s.name] for s in layout.shards}

    def layout(self) -> RankLayout:
        return self._layout

    def tensors(self) -> dict[str, torch.Tensor]:
        return self._tensors

    def descriptor(self) -> None:
        return None


class LayoutEngine(_InPlace):
    """A reader's tensors under an explicit layout (what one job lands in them), in place; the
    version and validity bookkeeping is the in-place engines' own."""

    def __init__(self, layout: RankLayout, tensors: dict[str, torch.Tensor]) -> None:
        super().__init__()
        self._layout, self._tensors = layout, {s.name: tensors[s.name] for s in layout.shards}

    def layout(self) -> RankLayout:
        return self._layout

    def receive_buffers(self) -> dict[str, torch.Tensor]:
        return self._tensors

    def descriptor(self) -> None:
        return None


def emit(record: dict[str, Any]) -> None:
    print("SITE " + json.dumps(record), flush=True)


def config(job: str, writers: int, readers: int, *, transport: str, node: str, host: str) -> SyncConfig:
    return SyncConfig(job=job, num_writers=writers, num_readers=readers, transport=transport, timeout=TIMEOUT,
                      host=node, transport_options=TransportOptions(host=host))


def run_writers(args: argparse.Namespace) -> None:
    writers, readers, _ = layouts()
    with EmbeddedMetaServer(host=args.host) as server:
        emit({"meta": server.address, "token": server.token})
        errors: list[str] = []
        done: list[dict[str, Any]] = []

        def writer(rank: int) -> None:
            try:
                tensors = allocate(writers[rank])
                meta = MetaClient(server.address, token=server.token, job="across")
                cfg = config("across", len(writers), len(readers), transport="torch", node="a", host=args.host)
                with WeightWriter(LayoutSource(writers[rank], tensors), rank=rank, config=cfg, meta=meta) as w:
                    sent = 0
                    for v in range(args.versions):
                        fill_from_canonical(writers[rank], tensors, canonical_values(CONFIG, v))
                        sent += w.write(v).nbytes
                    w.meta.wait_readers(min_version=args.versions - 1, readers=len(readers), timeout=TIMEOUT)
                done.append({"writer": rank, "sent_bytes": sent})
                meta.close()
            except BaseException as exc:  # reported on stdout; the test fails on it
                errors.append(f"writer {rank}: {type(exc).__name__}: {exc}")

        threads = [threading.Thread(target=writer, args=(r,)) for r in range(len(writers))]
        for t in threads:
            t.start()
        for t in threads:
            t.join(TIMEOUT * (args.versions + 2))
        emit({"site": "a", "writers": done, "errors": errors})
        # readers may still be forwarding inside their sites: the server stays up until told
        sys.stdin.readline()


def run_readers(args: argparse.Namespace) -> None:
    writers, readers, sites = layouts()
    split = plan_sites(writers, readers, sites)
    mine = split.site_readers(args.site)
    errors: list[str] = []
    done: list[dict[str, Any]] = []
    want = {v: canonical_values(CONFIG, v) for v in range(args.versions)}
    client = lambda job: MetaClient(args.meta, token=args.token, job=job)  # noqa: E731
    # a rank that leaves a job (its lease released) fails a writer still waiting in it: every reader
    # stays until the test has every site's results (a line on stdin)
    finished, leave = threading.Barrier(len(mine) + 1), threading.Event()

    def reader(rank: int) -> None:
        local = mine.index(rank)  # this reader's rank among its site's (job inside-<site>)
        tensors = allocate(readers[rank])
        inside = f"inside-{args.site}"
        metas = [client("across"), client(inside), client(inside)]
        try:
            across = WeightReader(LayoutEngine(split.first[rank], tensors), rank=rank, meta=metas[0],
                                  config=config("across", len(writers), len(readers), transport="torch",
                                                node=args.site, host=args.host))
            cfg = config(inside, len(mine), len(mine), transport="shm", node=args.site, host=args.host)
            forward = WeightWriter(LayoutSource(split.first[rank].with_rank(local), tensors), rank=local,
                                   config=cfg, meta=metas[1])
            rest = WeightReader(LayoutEngine(split.second[rank].with_rank(local), tensors), rank=local,
                                config=cfg, meta=metas[2])
            took, forwarded, got, exact = 0, 0, 0, []
            with across, forward, rest:
                for v in range(args.versions):
                    took += across.update(v, timeout=TIMEOUT).nbytes
                    sending: dict[str, Any] = {}
                    sender = threading.Thread(target=lambda v=v: sending.update(r=forward.write(v)))
                    sender.start()
                    got += rest.update(v, timeout=TIMEOUT).nbytes
                    sender.join(TIMEOUT)
                    forwarded += sending["r"].nbytes
                    expected = allocate(readers[rank])
                    fill_from_canonical(readers[rank], expected, want[v])
                    exact.append(all(torch.equal(tensors[n], expected[n]) for n in expected))
                done.append({"reader": rank, "across_bytes": took, "forwarded_bytes": forwarded,
                             "inside_bytes": got, "exact": exact})
                finished.wait(TIMEOUT * (args.versions + 2))
                leave.wait(TIMEOUT)
        except BaseException as exc:  # reported on stdout; the test fails on it
            errors.append(f"reader {rank}: {type(exc).__name__}: {exc}")
            finished.abort()
        finally:
            for m in metas:
                m.close()

    threads = [threading.Thread(target=reader, args=(r,)) for r in mine]
    for t in threads:
        t.start()
    with contextlib.suppress(threading.BrokenBarrierError):
        finished.wait(TIMEOUT * (args.versions + 2))
    emit({"site": args.site, "readers": sorted(done, key=lambda d: d["reader"]), "errors": errors,
          "planned_across_bytes": sum(sum(r.numel * 2 for _, r in split.first[x].regions()) for x in mine)})
    sys.stdin.readline()
    leave.set()
    for t in threads:
        t.join(TIMEOUT)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--site", required=True)
    parser.add_argument("--host", required=True, help="this site's address (the transports' host)")
    parser.add_argument("--meta", default="")
    parser.add_argument("--token", default="")
    parser.add_argument("--versions", type=int, default=2)
    args = parser.parse_args()
    torch.set_num_threads(1)
    if args.site == "a":
        run_writers(args)
    else:
        run_readers(args)


if __name__ == "__main__":
    main()
