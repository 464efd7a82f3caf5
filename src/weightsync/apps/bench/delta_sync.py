"""``weightsync bench --delta``: delta sync against full syncs of really trained models.

The parent process trains a small Qwen3 per model (``qwen3-30m``, ``qwen3-0.2b``) for a few
steps the way RL trainers do: fp32 master weights, AdamW at lr 1e-6, the synced copy cast to
bf16. Each step's bf16 weights go to a safetensors file. Then the same syncs run twice over
each transport that carries deltas (:func:`delta_variants`, from the same rules that refuse
``delta_anchor_every`` elsewhere: torch/gloo, shm snapshot and zero-copy, routed, NIXL pull,
file), 2 FSDP writers -> 1 reader: version v sends step v's weights,
once with
``delta_anchor_every=0`` (full) and once with deltas (``delta_anchor_every=1000``: only the
first version is full). Every version the reader receives is checked bitwise against the
step's weights, and the writers start each ``write()`` only once the reader is idle and
waiting (it checks the previous version in between), so that the times are the sync's own.

Reported per model, transport and mode (medians over versions 2..N; version 1 plans, connects
and is always full): bytes on the wire (what the reader received: over shm, what it copied out
of the writers' segments); the slower writer's whole ``write()`` (publish, transfer,
wait for the reader's report); the *transfer phase*, the reader's ``receive()`` from its
first receive to the last byte in place (for delta: the writers' comparisons, the wire and
the reader's apply); and what ``write()`` spends outside it (meta-server round trips, the
reader waking up), which is the same for both modes. Plus the fraction of bf16 elements each
step changed.

    rows, changed = run_delta(models=["qwen3-30m", "qwen3-0.2b"], steps=8)
    rows, changed = run_delta(models=["qwen3-0.2b"], links=[None, 10.0])  # and over a 10 Gbit/s link (root)
    rows, changed = run_delta(transports=["shm"])                          # one transport
    variants, left_out = delta_variants()                                   # what runs, and why not the rest
"""

from __future__ import annotations

import argparse
import json
import os
import select
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal, cast

import torch

from weightsync.apps.bench.vllm_memory import MODELS, model_config
from weightsync.sources.trained import train_snapshots

MODES = {"full": 0, "delta": 1000}
#: a Qwen3 of 0.6M parameters for the bench's own tests (seconds, not figures)
TEST_MODEL = "qwen3-tiny"


def delta_model_config(name: str) -> dict[str, Any]:
    """The fp32 config of a model of the bench (:data:`MODELS`, or :data:`TEST_MODEL`)."""
    if name == TEST_MODEL:
        return {**model_config("qwen3-30m"), "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
                "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16, "vocab_size": 512}
    return model_config(name)


@dataclass(frozen=True)
class Variant:
    """One way the bench runs a transport: its row name, the transport, and what differs."""

    name: str
    transport: str
    #: the writers' parameters live in /dev/shm, so shm goes zero-copy
    zero_copy: bool = False
    nixl_mode: Literal["auto", "pull", "push"] = "auto"
    #: ``SyncConfig.host`` of writers 0 and 1 and of the reader ("": the host name)
    writer_hosts: tuple[str, str] = ("", "")
    reader_host: str = ""


#: transport -> the variants the bench runs of it, if it carries deltas; routed puts writer 0 on the
#: reader's node (its pair goes over shm) and writer 1 on another (gloo), so both routes carry half
VARIANTS: dict[str, tuple[Variant, ...]] = {
    "torch": (Variant("torch", "torch"),),
    "shm": (Variant("shm", "shm"), Variant("shm-zero-copy", "shm", zero_copy=True)),
    "routed": (Variant("routed", "routed", writer_hosts=("node-a", "node-b"), reader_host="node-a"),),
    "nixl": (Variant("nixl-pull", "nixl", nixl_mode="pull"), Variant("nixl-push", "nixl", nixl_mode="push")),
    "file": (Variant("file", "file"),),
}


def _sync_config(variant: Variant, *, job: str, timeout: float, anchor: int, host: str, file_dir: str) -> Any:
    from weightsync.session.sync_session import SyncConfig, TransportOptions

    return SyncConfig(num_writers=2, num_readers=1, job=job, timeout=timeout, transport=variant.transport, host=host,
                      transport_options=TransportOptions(delta_anchor_every=anchor, nixl_mode=variant.nixl_mode,
                                                         file_dir=file_dir if variant.transport == "file" else ""))


def delta_variants() -> tuple[list[Variant], dict[str, str]]:
    """The variants of every transport that carries deltas here, decided by the rules that refuse
    ``delta_anchor_every`` (``SyncConfig``'s combination check and the transport's own
    ``check_delta_carried``), so a transport or mode appears here the day it carries deltas;
    and, for every variant left out, the refusal or the reason it cannot run on this machine."""
    from weightsync.job.channel import JobChannel
    from weightsync.transport import TransportContext, available_transports, check_delta_carried, unavailable_reason

    carried: list[Variant] = []
    left_out: dict[str, str] = {}
    for transport in [*VARIANTS, *sorted(set(available_transports()) - set(VARIANTS))]:
        for variant in VARIANTS.get(transport, (Variant(transport, transport),)):
            reason = unavailable_reason(transport)
            if reason is None:
                try:
                    sync = _sync_config(variant, job="probe", timeout=1.0, anchor=1, host="", file_dir="/tmp")
                    ctx = TransportContext(channel=JobChannel(cast(Any, None), role="writer", rank=0), num_writers=2,
                                           num_readers=1, options=sync.transport_options)
                    check_delta_carried(transport, ctx)
                except ValueError as exc:  # CombinationError is one
                    reason = str(exc)
            if reason is None:
                carried.append(variant)
            else:
                left_out[variant.name] = reason
    return carried, left_out


def variant_named(name: str) -> Variant:
    for variants in VARIANTS.values():
        for variant in variants:
            if variant.name == name:
                return variant
    return Variant(name, name)


def _config(model: str) -> dict[str, Any]:
    return {**delta_model_config(model), "torch_dtype": "bfloat16"}


def _writer(model: str, job: str, rank: int, *, snapshots: str, versions: int, anchor: int, timeout: float,
            transport: str, file_dir: str) -> None:
    import contextlib

    from safetensors.torch import load_file

    from weightsync.roles.writer import WeightWriter
    from weightsync.sources.module import ShardedSource
    from weightsync.tools.torch_layout import fill_from_canonical
    from weightsync.transport.shm.files import share_tensors

    torch.set_num_threads(1)
    variant = variant_named(transport)
    source = ShardedSource("fsdp:dp=2", _config(model), rank)
    sync = _sync_config(variant, job=job, timeout=timeout, anchor=anchor, host=variant.writer_hosts[rank],
                        file_dir=file_dir)
    with contextlib.ExitStack() as stack:
        if variant.zero_copy:
            files = share_tensors(source.tensors())
            stack.callback(files.close)
            source = ShardedSource("fsdp:dp=2", _config(model), rank, tensors=files.tensors)
        writer = stack.enter_context(WeightWriter(source, rank=rank, config=sync))
        for version in range(1, versions + 1):
            fill_from_canonical(source.layout(), source.tensors(), load_file(f"{snapshots}/step{version}.safetensors"))
            _wait_for_go(version, timeout)
            result = writer.write(version)
            print("WSDELTA " + json.dumps({"version": version, "seconds": result.seconds, "nbytes": result.nbytes,
                                           "phases": result.phases}), flush=True)


def _wait_for_go(version: int, timeout: float) -> None:
    """Block until the bench says the reader is idle (it checks each version between syncs)."""
    ready, _, _ = select.select([sys.stdin], [], [], timeout)
    line = sys.stdin.readline() if ready else ""
    if line.strip() != str(version):
        raise SystemExit(f"writer: expected the go for version {version} within {timeout}s, got {line!r}")


def _case(model: str, mode: str, *, transport: str, snapshots: Path, versions: int, timeout: float,
          env: dict[str, str], address: str, token: str) -> dict[str, Any]:
    from safetensors.torch import load_file

    from weightsync.engines.buffers import ShardedEngine
    from weightsync.meta.client import MetaClient
    from weightsync.roles.reader import WeightReader

    job = f"delta-{uuid.uuid4().hex[:8]}"
    anchor = MODES[mode]
    variant = variant_named(transport)
    file_dir = str(snapshots / f"files-{job}")
    writers = [subprocess.Popen([sys.executable, "-m", "weightsync.apps.bench.delta_sync", "writer", "--model", model,
                                 "--job", job, "--rank", str(rank), "--versions", str(versions), "--snapshots",
                                 str(snapshots), "--anchor", str(anchor), "--timeout", str(timeout),
                                 "--transport", transport, "--file-dir", file_dir], env=env,
                                stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
               for rank in (0, 1)]
    engine = ShardedEngine("hf", _config(model), 0)
    sync = _sync_config(variant, job=job, timeout=timeout, anchor=anchor, host=variant.reader_host, file_dir=file_dir)
    row: dict[str, Any] = {"model": model, "transport": transport, "mode": mode, "versions": versions}
    wrong: list[str] = []
    received: dict[int, dict[str, float]] = {}
    got: dict[int, int] = {}  # bytes the reader received (one-sided writers cannot tell what readers copy)
    try:
        with MetaClient(address, job=job, token=token) as meta, \
                WeightReader(engine, rank=0, config=sync, meta=meta) as reader:
            for version in range(1, versions + 1):
                for w in writers:  # the writers time write() with this reader idle, waiting
                    assert w.stdin is not None
                    w.stdin.write(f"{version}\n")
                    w.stdin.flush()
                result = reader.update(version, timeout=timeout)
                received[version], got[version] = result.phases, result.nbytes
                want = load_file(str(snapshots / f"step{version}.safetensors"))
                wrong += [f"v{version} {n}" for n, t in engine.tensors.items() if not torch.equal(t, want[n])]
        outs = [w.communicate(timeout=timeout) for w in writers]
    except Exception as exc:  # a failed case is a row with its error, not a crashed suite
        for w in writers:
            w.kill()
            w.wait(10)
        return row | {"error": f"{type(exc).__name__}: {exc}"[:300]}
    records: dict[int, list[dict[str, Any]]] = {}
    for w, (out, err) in zip(writers, outs, strict=True):
        if w.returncode:
            return row | {"error": f"writer exit {w.returncode}: {err.strip().splitlines()[-1:]}"}
        for line in out.splitlines():
            if line.startswith("WSDELTA "):
                rec = json.loads(line[len("WSDELTA "):])
                records.setdefault(rec["version"], []).append(rec)
    row |= _medians(records, received)
    row["nbytes"] = statistics.median(got[v] for v in sorted(got) if v > 1)
    row["nbytes_per_version"] = [got[v] for v in sorted(got)]
    row["verified"] = not wrong
    if wrong:
        row["error"] = f"{len(wrong)} tensors differ, e.g. {wrong[:3]}"
    return row


def _medians(records: dict[int, list[dict[str, Any]]], received: dict[int, dict[str, float]]) -> dict[str, Any]:
    """Medians over versions 2..N: write() of the slower writer, its phases, the reader's receive()."""
    timed = [v for v in sorted(records) if v > 1]
    slower = [max(records[v], key=lambda r: r["seconds"]) for v in timed]
    names = sorted({n for r in slower for n in r["phases"]})
    reader_names = sorted({n for v in timed for n in received[v]})
    return {
        "seconds": statistics.median(r["seconds"] for r in slower),
        "transfer_seconds": statistics.median(
            sum(s for n, s in received[v].items() if n.startswith("receive.")) for v in timed),
        "nbytes": statistics.median(sum(r["nbytes"] for r in records[v]) for v in timed),
        "phases": {n: statistics.median(r["phases"].get(n, 0.0) for r in slower) for n in names},
        "reader_phases": {n: statistics.median(received[v].get(n, 0.0) for v in timed) for n in reader_names},
    }


def run_delta(*, models: list[str] | None = None, steps: int = 8, lr: float = 1e-6, timeout: float = 600.0,
              links: list[float | None] | None = None, transports: list[str] | None = None,
              ) -> tuple[list[dict[str, Any]], dict[str, list[float]]]:
    """Per model: train, then sync every step's weights full and as deltas over each transport
    (``transports``: variant names, default every one :func:`delta_variants` finds; one-sided shm
    ignores the link, its bytes never touch it, and routed's shm half too), over plain loopback
    (``None``) and over loopback shaped to each rate in ``links`` (Gbit/s, see
    :mod:`weightsync.apps.bench.link`); rows with ratios to the full sync on the same link."""
    from weightsync.apps.bench.link import shaped_loopback
    from weightsync.meta.client import EmbeddedMetaServer

    rows: list[dict[str, Any]] = []
    changed: dict[str, list[float]] = {}
    for model in models or ["qwen3-30m"]:
        with tempfile.TemporaryDirectory(prefix="weightsync-delta-") as tmp, EmbeddedMetaServer() as server:
            changed[model] = train_snapshots(delta_model_config(model), steps, lr, Path(tmp))
            env = {**os.environ, "WEIGHTSYNC_META_ADDR": server.address, "WEIGHTSYNC_META_TOKEN": server.token,
                   "OMP_NUM_THREADS": "1"}
            for gbit in links or [None]:
                with shaped_loopback(gbit) as link:
                    for transport in transports or [v.name for v in delta_variants()[0]]:
                        for mode in MODES:  # full, then delta, on the same link and transport
                            started = time.perf_counter()
                            row = _case(model, mode, transport=transport, snapshots=Path(tmp), versions=steps,
                                        timeout=timeout, env=env, address=server.address, token=server.token)
                            row["wall_seconds"] = time.perf_counter() - started
                            rows.append(row | {"link": link, "link_gbit": gbit})
    for r in rows:
        full = next((f for f in rows if (f["model"], f["link"], f["transport"]) == (r["model"], r["link"],
                     r["transport"]) and f["mode"] == "full" and "error" not in f), None)
        if full is not None and "error" not in r:
            r["bytes_vs_full"] = r["nbytes"] / full["nbytes"]
            r["seconds_vs_full"] = r["seconds"] / full["seconds"]
            r["transfer_vs_full"] = r["transfer_seconds"] / full["transfer_seconds"]
    return rows, changed


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m weightsync.apps.bench.delta_sync")
    sub = parser.add_subparsers(dest="cmd", required=True)
    w = sub.add_parser("writer")
    w.add_argument("--model", required=True, choices=[*sorted(MODELS), TEST_MODEL])
    w.add_argument("--job", required=True)
    w.add_argument("--rank", type=int, required=True)
    w.add_argument("--versions", type=int, required=True)
    w.add_argument("--snapshots", required=True)
    w.add_argument("--anchor", type=int, required=True)
    w.add_argument("--timeout", type=float, default=600.0)
    w.add_argument("--transport", choices=sorted(v.name for vs in VARIANTS.values() for v in vs), default="torch")
    w.add_argument("--file-dir", default="")
    args = parser.parse_args(argv)
    _writer(args.model, args.job, args.rank, snapshots=args.snapshots, versions=args.versions, anchor=args.anchor,
            timeout=args.timeout, transport=args.transport, file_dir=args.file_dir)
    return 0


if __name__ == "__main__":
    sys.exit(main())
