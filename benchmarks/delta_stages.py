"""Where a delta sync's CPU time goes, stage by stage, on one core (a script, not a timed test).

``weightsync bench --delta`` times whole syncs; this times the stages of one writer's share
alone, so the floor each stage is up against is visible. It trains a model a few AdamW steps
(as the bench does), takes FSDP writer 0's half (dim 0) of every tensor of steps k-1 and k,
and measures with one thread:

* the memory floor: reading the new payload and the writer's previous copy once (compare
  only, nothing written);
* finding the changes and refreshing the previous copy: numba kernel, numpy fallback, and the
  method of the first delta implementation (int16 ``!=``, ``flatnonzero``, gather, full copy);
* the reader's apply of the encoded deltas: numba, numpy, and ``torch`` ``index_put_``;
* how spread the changes are: changed elements, 8-byte words and 64-byte cache lines;
* the machine's memory read bandwidth with one and with two processes streaming at once
  (two writers share the memory bus in the bench).

    python benchmarks/delta_stages.py --model qwen3-0.2b [--json]
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import statistics
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import torch


def _median_ms(run: Callable[[], Any], setup: Callable[[], Any], reps: int) -> float:
    times = []
    for _ in range(reps):
        setup()
        start = time.perf_counter()
        run()
        times.append(time.perf_counter() - start)
    return round(statistics.median(times) * 1e3, 1)


def _stream(nbytes: int, barrier: Any, out: Any, slot: int) -> None:
    """Read two buffers of ``nbytes`` as 8-byte words (a compare, nothing kept); best GB/s of 3."""
    a = np.ones(nbytes // 8, dtype=np.uint64)
    b = a.copy()
    mask = np.empty(1 << 16, dtype=np.bool_)
    best = float("inf")
    for _ in range(3):
        barrier.wait(timeout=120)
        start = time.perf_counter()
        for at in range(0, a.size, mask.size):
            np.not_equal(a[at: at + mask.size], b[at: at + mask.size], out=mask[: a[at: at + mask.size].size])
        best = min(best, time.perf_counter() - start)
    out[slot] = 2 * nbytes / best / 1e9


def stream_bandwidth(nbytes: int, processes: int) -> list[float]:
    """GB/s each of ``processes`` processes reads at once (memory bandwidth, not the cache)."""
    ctx = multiprocessing.get_context("spawn")
    barrier, out = ctx.Barrier(processes), ctx.Array("d", processes)
    workers = [ctx.Process(target=_stream, args=(nbytes, barrier, out, i)) for i in range(processes)]
    for w in workers:
        w.start()
    for w in workers:
        w.join(timeout=300)
        if w.is_alive():
            w.kill()
            w.join(10)
            raise TimeoutError("a bandwidth worker did not finish in 300 s")
    return [round(x, 1) for x in out]


def _first_method(new: list[torch.Tensor], old: list[torch.Tensor]) -> None:
    """The first implementation: int16 compare, flatnonzero, gather, then a full copy of `new`."""
    for n, o in zip(new, old, strict=True):
        index = torch.from_numpy(np.flatnonzero(n.view(torch.int16).numpy() != o.view(torch.int16).numpy()))
        torch.cat([index.to(torch.int32).view(torch.uint8), n.view(torch.int16)[index].view(torch.uint8)])
        o.copy_(n)


def measure(model: str, steps: int, reps: int) -> dict[str, Any]:
    from safetensors.torch import load_file

    from weightsync.apps.bench.vllm_memory import model_config
    from weightsync.sources.trained import train_snapshots
    from weightsync.tools.codecs.delta import apply, diff

    torch.set_num_threads(1)
    with tempfile.TemporaryDirectory(prefix="weightsync-stages-") as tmp:
        train_snapshots(model_config(model), steps, 1e-6, Path(tmp))
        before, after = (load_file(f"{tmp}/step{k}.safetensors") for k in (steps - 1, steps))

    def half(weights: dict[str, torch.Tensor]) -> list[torch.Tensor]:
        return [w[: (w.shape[0] + 1) // 2].contiguous().reshape(-1).view(torch.uint8) for w in weights.values()]

    new, base = half(after), half(before)
    old = [b.clone() for b in base]
    nbytes = sum(t.numel() for t in new)

    def reset() -> None:
        for o, b in zip(old, base, strict=True):
            o.copy_(b)

    def floor() -> None:
        for n, o in zip(new, old, strict=True):
            words = n.numel() // 8
            np.not_equal(n.numpy()[: words * 8].view(np.uint64), o.numpy()[: words * 8].view(np.uint64))

    def kernel(compiled: bool) -> Callable[[], Any]:
        return lambda: [diff(n, o, unit=2, update_old=True, compiled=compiled) for n, o in zip(new, old, strict=True)]

    diff(new[0][:64], old[0][:64].clone(), unit=2, update_old=True)  # compile (or load numba's cache)
    row: dict[str, Any] = {"model": model, "writer_bytes": nbytes}
    row["floor_ms"] = _median_ms(floor, reset, reps)
    row["diff_numba_ms"] = _median_ms(kernel(True), reset, reps)
    row["diff_numpy_ms"] = _median_ms(kernel(False), reset, reps)
    row["diff_first_ms"] = _median_ms(lambda: _first_method(new, old), reset, reps)

    encoded = [diff(n, b.clone(), unit=2).encode() for n, b in zip(new, base, strict=True)]
    payloads = [e.payload for e in encoded]
    dests = [b.clone() for b in base]

    def reset_dests() -> None:
        for d, b in zip(dests, base, strict=True):
            d.copy_(b)

    def applied(compiled: bool) -> Callable[[], Any]:
        return lambda: [apply(e.kind, p, d, unit=2, changed=e.changed, compiled=compiled)
                        for e, p, d in zip(encoded, payloads, dests, strict=True)]

    def index_put() -> None:
        for e, p, d in zip(encoded, payloads, dests, strict=True):
            index = p[: 4 * e.changed].clone().view(torch.int32).to(torch.int64)
            d.view(torch.int16)[index] = p[4 * e.changed:].clone().view(torch.int16)

    row["apply_numba_ms"] = _median_ms(applied(True), reset_dests, reps)
    row["apply_numpy_ms"] = _median_ms(applied(False), reset_dests, reps)
    row["apply_index_put_ms"] = _median_ms(index_put, reset_dests, reps)
    elements = nbytes // 2
    changed = sum(e.changed for e in encoded)
    words = lines = 0
    for n, b in zip(new, base, strict=True):
        usable = n.numel() // 64 * 64
        a, c = n.numpy()[:usable], b.numpy()[:usable]
        words += int((a.view(np.uint64) != c.view(np.uint64)).sum())
        lines += int((a.reshape(-1, 64) != c.reshape(-1, 64)).any(axis=1).sum())
    row |= {"changed_elements": changed / elements, "changed_words": words / (nbytes / 8),
            "changed_lines": lines / (nbytes / 64), "encoded_bytes": sum(e.nbytes for e in encoded)}
    row["stream_gbps_1"] = stream_bandwidth(nbytes, 1)
    row["stream_gbps_2"] = stream_bandwidth(nbytes, 2)
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="qwen3-0.2b")
    parser.add_argument("--steps", type=int, default=3, help="training steps; the last two are compared")
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    row = measure(args.model, args.steps, args.reps)
    if args.json:
        print(json.dumps(row))
        return
    mb = row["writer_bytes"] / 1e6
    print(f"{args.model}, FSDP writer 0's half: {mb:.0f} MB of bf16; changed: {row['changed_elements']:.2%} of "
          f"elements, {row['changed_words']:.1%} of 8-byte words, {row['changed_lines']:.1%} of 64-byte lines")
    for key, label in [("floor_ms", "read new + previous copy once (floor)"),
                       ("diff_numba_ms", "find changes + refresh copy: numba"),
                       ("diff_numpy_ms", "find changes + refresh copy: numpy"),
                       ("diff_first_ms", "find changes + refresh copy: first implementation"),
                       ("apply_numba_ms", "reader apply: numba"), ("apply_numpy_ms", "reader apply: numpy"),
                       ("apply_index_put_ms", "reader apply: torch index_put_")]:
        print(f"  {label:52s} {row[key]:7.1f} ms  ({2 * mb / row[key]:.1f} GB/s of new + old)"
              if key.startswith(("floor", "diff")) else f"  {label:52s} {row[key]:7.1f} ms")
    print(f"  memory read bandwidth (2 x {mb:.0f} MB compared): one process {row['stream_gbps_1'][0]} GB/s, "
          f"two at once {' + '.join(map(str, row['stream_gbps_2']))} GB/s")


if __name__ == "__main__":
    main()
