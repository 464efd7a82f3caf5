"""``weightsync bench``: weightsync against today's baselines, side by side in one run.

    weightsync bench --quick                       # < 5 minutes on 2 cores
    weightsync bench --quick --json --plot out.png # last stdout line: one JSON object
    weightsync bench --models llama-0.1b,qwen3-1.7b --dtypes bf16 --layouts tp2->tp1x2

See docs/benchmarks.md for what every method and ratio means.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from typing import Any


def _csv(text: str) -> list[str]:
    return [x.strip() for x in text.split(",") if x.strip()]


def _link_rates(text: str) -> list[float | None]:
    """``--link-gbit lo,10,25``: plain loopback (``lo``) or positive rates in Gbit/s."""
    rates: list[float | None] = []
    for item in _csv(text):
        try:
            rate = None if item == "lo" else float(item)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{item!r} is neither 'lo' nor a rate in Gbit/s") from None
        if rate is not None and not rate > 0:
            raise argparse.ArgumentTypeError(f"link rate must be positive, got {item}")
        rates.append(rate)
    return rates


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--quick", action="store_true", help="the quick suite (one small model, every method)")
    p.add_argument("--suite", choices=["quick", "full", "test", "vllm-memory", "vllm-prefetch", "fewer-bytes", "load",
                                        "delta"],
                   default=None,
                   help="quick | full (every model, dtype and layout that fits in memory) | test (tiny) | "
                        "vllm-memory (a vLLM reader's extra memory: whole-model staging vs phases) | "
                        "vllm-prefetch (a vLLM engine's pause per update with and without prefetch; "
                        "tokens/s during a sync vs idle; --models, --reps updates, --vllm-paths) | "
                        "fewer-bytes (FP8 quantize-on-send vs full bf16 syncs, same layout, one run) | "
                        "load (--load-readers readers x --load-versions back-to-back versions: flat memory?)")
    p.add_argument("--delta", action="store_true",
                   help="delta vs full syncs of really trained models (same as --suite delta; --models, "
                        "default qwen3-30m,qwen3-0.2b)")
    p.add_argument("--delta-steps", type=int, default=8, help="training steps (one sync each) of --delta")
    p.add_argument("--delta-lr", type=float, default=1e-6, help="AdamW lr of --delta (fp32 master weights)")
    p.add_argument("--delta-transports", type=_csv, default=None,
                   help="transports of --delta, full and delta side by side on each (default: every transport "
                        "that carries deltas here: torch, shm, shm-zero-copy, routed, nixl-pull where NIXL is "
                        "installed, file; the others are listed with their refusal)")
    p.add_argument("--link-gbit", type=_link_rates, default=[None],
                   help="--delta also over loopback shaped to these rates (Gbit/s, e.g. 10,25; needs root and "
                        "tc; 'lo' = plain loopback), full and delta side by side on each; on a shared machine "
                        "run it in its own network namespace: unshare -n sh -c 'ip link set lo up && weightsync "
                        "bench --delta --link-gbit lo,10'")
    p.add_argument("--vllm-paths", type=_csv, default=["engine", "backend", "serve"],
                   help="paths of --suite vllm-prefetch: engine (in-process VLLMEngine), backend (the worker "
                        "backend of an in-process LLM), serve (a vllm serve process, HTTP clients)")
    p.add_argument("--serve-pause-modes", type=_csv, default=["abort"],
                   help="how --vllm-paths serve's driver pauses a prefetched update, each mode in turn in one "
                        "run: abort (vLLM's default), keep (frozen requests, recomputed on the new weights), both "
                        "reset by vLLM's /pause; keep-stale (clear_cache=false: frozen requests go on with KV of "
                        "the old weights, the old prefixes stay cached); abort-reset, keep-reset (the earlier "
                        "driver: its own /reset_prefix_cache after the finish)")
    p.add_argument("--load-readers", type=int, default=16, help="readers of the load suite")
    p.add_argument("--load-versions", type=int, default=200, help="versions of the load suite")
    p.add_argument("--models", type=_csv, default=[], help="comma-separated model names (see bench.cases.MODELS)")
    p.add_argument("--dtypes", type=_csv, default=[], help="bf16,fp32")
    p.add_argument("--layouts", type=_csv, default=[], help="tp2->tp1x2,fsdp2->tp2,same")
    p.add_argument("--transports", type=_csv, default=[],
                   help="weightsync transports to run (default: every available one)")
    p.add_argument("--methods", type=_csv, default=[],
                   help="run exactly these methods in every case: weightsync-<transport>, a baseline, or "
                        "pkg.module:Class (a bench.baselines.Method of your own)")
    p.add_argument("--reps", type=int, default=0, help="timed syncs per method (after one warm-up)")
    p.add_argument("--max-bucket-mb", type=int, default=64, help="weightsync staging bound per process")
    p.add_argument("--baseline-bucket-mb", type=int, default=512,
                   help="bucket of the bucketed-broadcast baseline (slime's and verl's default is 512)")
    p.add_argument("--no-peer", action="store_true", help="skip the awex peer case")
    p.add_argument("--awex-python", default=os.environ.get("WEIGHTSYNC_AWEX_PYTHON", ""),
                   help="Python of a venv with awex installed (env WEIGHTSYNC_AWEX_PYTHON); "
                        "without it the peer row is skipped")
    p.add_argument("--awex-script", default="", help="awex_p2p_bench.py (default: benchmarks/awex_peer/)")
    p.add_argument("--timeout", type=float, default=900.0, help="seconds allowed for one case")
    p.add_argument("--json", action="store_true", help="end with one JSON object on the last line of stdout")
    p.add_argument("--plot", default="", help="write a figure (PNG) of the results here")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")


def run(args: argparse.Namespace) -> int:
    from rich.console import Console
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    from weightsync.apps.bench import BenchOptions, run_bench, suite
    from weightsync.apps.bench.report import plot, print_table
    from weightsync.transport import available_transports

    kind = args.suite or ("quick" if args.quick else "full")
    if kind == "vllm-memory":
        return _vllm_memory(args)
    if kind == "vllm-prefetch":
        return _vllm_prefetch(args)
    if kind == "fewer-bytes":
        return _fewer_bytes(args)
    if kind == "delta" or args.delta:
        return _delta(args)
    if kind == "load":
        return _load(args)
    transports = args.transports or available_transports()
    unknown = sorted(set(transports) - set(available_transports()))
    if unknown:
        raise ValueError(f"transport(s) {unknown} are not available here; available: {available_transports()}")
    cases = suite(kind, transports, models=args.models, dtypes=args.dtypes, layouts=args.layouts,
                  reps=args.reps, peer=not args.no_peer, methods=args.methods)
    if args.max_bucket_mb < 1 or args.baseline_bucket_mb < 1:
        raise ValueError("--max-bucket-mb and --baseline-bucket-mb must be >= 1")
    options = BenchOptions(max_bucket_bytes=args.max_bucket_mb << 20,
                           baseline_bucket_bytes=args.baseline_bucket_mb << 20, timeout=args.timeout,
                           awex_python=args.awex_python, awex_script=args.awex_script)
    console = Console(stderr=args.json, width=200)
    total = sum(len(c.methods) + (1 if c.peer else 0) for c in cases)
    progress = Progress(TextColumn("[bold]{task.description}"), BarColumn(), MofNCompleteColumn(),
                        TimeElapsedColumn(), console=Console(stderr=True), disable=args.no_progress, transient=False)
    with progress:
        task = progress.add_task("bench", total=total)

        def on_method(case: Any, method: str) -> None:
            progress.update(task, advance=1, description=f"{case.name}: {method} done")

        result = run_bench(cases, options, on_method=on_method)
    print_table(result["rows"], console=console,
                title=f"weightsync bench ({kind}; {result['machine']['nproc']} cores, {result['machine']['cpu']})")
    for key, value in result["ratios"].items():
        console.print(f"{key}: {value:.2f}")
    for line in result["skipped"]:
        console.print(f"[yellow]skipped[/yellow] {line}")
    for line in result["failures"]:
        console.print(f"[red]FAILED[/red] {line}")
    if args.plot:
        plot(result["rows"], result["limits"], args.plot,
             title=f"weightsync bench ({kind}), {result['machine']['nproc']} cores {result['machine']['cpu']}")
        console.print(f"figure written to {args.plot}")
    if args.json:
        sys.stdout.flush()
        print(json.dumps(result), flush=True)
    return 1 if result["failures"] else 0


def _vllm_memory(args: argparse.Namespace) -> int:
    """``--suite vllm-memory``: see :mod:`weightsync.apps.bench.vllm_memory`."""
    from rich.console import Console
    from rich.table import Table

    from weightsync.apps.bench import machine
    from weightsync.apps.bench.vllm_memory import run_vllm_memory

    rows = run_vllm_memory(bucket_bytes=args.max_bucket_mb << 20, models=args.models or None, timeout=args.timeout)
    console = Console(stderr=args.json, width=200)
    table = Table(title=f"vLLM reader: extra memory during an update (max_bucket_bytes {args.max_bucket_mb} MB)")
    for col in ("model", "params", "staging", "staging MB", "peak extra MB", "bucket + largest layer MB",
                "within", "x model", "update s", "outputs restored"):
        table.add_column(col, justify="right")
    mb = 1 << 20
    for r in rows:
        if "error" in r:
            table.add_row(r["model"], "", r["mode"], "", "", "", "", "", "", f"[red]{r['error'][:60]}[/red]")
            continue
        table.add_row(r["model"], f"{r['parameters'] / 1e6:.0f}M", r["mode"], f"{r['staging_bytes'] / mb:.0f}",
                      f"{r['peak_extra_bytes'] / mb:.0f}", f"{r['bound_bytes'] / mb:.0f}",
                      "yes" if r["peak_extra_bytes"] <= r["bound_bytes"] else "no",
                      f"{r['peak_extra_bytes'] / r['model_bytes']:.2f}", f"{r['seconds']:.2f}",
                      "yes" if r["verified"] else "[red]NO[/red]")
    console.print(table)
    if args.json:
        sys.stdout.flush()
        print(json.dumps({"rows": rows, "machine": machine()}), flush=True)
    return 0 if all(r.get("verified") for r in rows) else 1


def _vllm_prefetch(args: argparse.Namespace) -> int:
    """``--suite vllm-prefetch``: see :mod:`weightsync.apps.bench.vllm_prefetch`."""
    from rich.console import Console
    from rich.table import Table

    from weightsync.apps.bench import machine
    from weightsync.apps.bench.vllm_prefetch import run_vllm_prefetch

    if args.transports and len(args.transports) > 1:
        raise ValueError(f"--suite vllm-prefetch runs one transport per run; got --transports {args.transports}")
    transport = args.transports[0] if args.transports else "auto"
    rows = [row for model in (args.models or ["qwen3-30m"])  # each model in turn, its rows side by side
            for row in run_vllm_prefetch(model=model, updates=args.reps or 3, transport=transport,
                                         paths=tuple(args.vllm_paths), timeout=args.timeout,
                                         pause_modes=tuple(args.serve_pause_modes))]
    console = Console(stderr=args.json, width=200)
    table = Table(title="vLLM: the engine's pause per update (medians), and tokens/s during a sync")
    for col in ("path", "model", "no prefetch: pause = sync s", "prefetch: sync s", "pause s",
                "apply s (serve: /update_weights)", "pause / apply", "tokens/s idle", "during sync", "during / idle"):
        table.add_column(col, justify="right")
    for r in rows:
        table.add_row(r["path"], r["model"], *_prefetch_cells(r))
    console.print(table)
    for r in rows:  # serve, each pause mode of the driver (--serve-pause-modes), side by side
        for mode, m in r.get("pause_modes", {}).items():
            console.print(f"serve, /pause?mode={mode}: clients' pause {m['pause_s']:.3f} s, /update_weights "
                          f"{m['update_s']:.3f} s (pause / it {m['pause_over_update']:.2f}), driver's pause "
                          f"{m['driver_pause_s']:.3f} s, {m['updates']} updates")
            if "engine_pause_s" in m:  # inside the engine (the worker's step trace)
                console.print(f"  engine: no step for {m['engine_pause_s']:.3f} s, apply {m['apply_s']:.3f} s "
                              f"(x{m['engine_pause_over_apply']:.2f}; before it {m['before_apply_s']:.3f} s, after "
                              f"{m['after_apply_s']:.3f} s), first step after {m['step_after_s']:.3f} s")
    if args.json:
        sys.stdout.flush()
        print(json.dumps({"rows": rows, "machine": machine()}), flush=True)
    return 1 if any("error" in r for r in rows) else 0


def _prefetch_cells(r: dict[str, Any]) -> list[str]:
    """A vllm-prefetch row's cells after path and model; a ``serve`` row's pause is the HTTP clients'
    gap in tokens, against the ``/update_weights`` route's time (what the engine spent applying)."""
    if "error" in r:
        return [f"[red]{r['error'][:100]}[/red]", *[""] * 7]
    serve = r["path"] == "serve"
    apply, ratio = (r["prefetch_update_s"], r["pause_over_update"]) if serve else (r["prefetch_apply_s"],
                                                                                   r["pause_over_apply"])
    return [f"{r['blocking_pause_s']:.3f}", f"{r['prefetch_sync_s']:.3f}", f"{r['prefetch_pause_s']:.3f}",
            f"{apply:.3f}", f"{ratio:.2f}", f"{r['idle_tokens_per_s']:.1f}", f"{r['during_tokens_per_s']:.1f}",
            f"{r['during_over_idle']:.2f}"]


def _fewer_bytes(args: argparse.Namespace) -> int:
    """``--suite fewer-bytes``: see :mod:`weightsync.apps.bench.fewer_bytes`."""
    from rich.console import Console
    from rich.table import Table

    from weightsync.apps.bench import machine
    from weightsync.apps.bench.fewer_bytes import run_fewer_bytes

    model = args.models[0] if args.models else "qwen3-0.2b"
    rows = run_fewer_bytes(model=model, versions=max(3, args.reps + 1), bucket_bytes=args.max_bucket_mb << 20,
                           timeout=args.timeout)
    console = Console(stderr=args.json, width=200)
    table = Table(title=f"{model}: 2 FSDP writers (bf16) -> 1 reader over torch/gloo, per version")
    for col in ("reader asks for", "MB on the wire", "x bf16 bytes", "sync s", "x bf16 time", "quantize s",
                "bitwise"):
        table.add_column(col, justify="right")
    for r in rows:
        if "error" in r:
            table.add_row(r["mode"], "", "", "", "", "", f"[red]{r['error'][:80]}[/red]")
            continue
        table.add_row(r["mode"], f"{r['nbytes'] / 1e6:.1f}", f"{r.get('bytes_vs_bf16', float('nan')):.3f}",
                      f"{r['seconds']:.3f}", f"{r.get('seconds_vs_bf16', float('nan')):.3f}",
                      f"{r['quantize_seconds']:.3f}", "yes" if r["verified"] else "[red]NO[/red]")
    console.print(table)
    if args.json:
        sys.stdout.flush()
        print(json.dumps({"rows": rows, "machine": machine()}), flush=True)
    return 0 if all(r.get("verified") for r in rows) else 1


def _delta(args: argparse.Namespace) -> int:
    """``--delta``: see :mod:`weightsync.apps.bench.delta_sync`."""
    from rich.console import Console
    from rich.table import Table

    from weightsync.apps.bench import machine
    from weightsync.apps.bench.delta_sync import delta_variants, run_delta

    models = args.models or ["qwen3-30m", "qwen3-0.2b"]
    carried, left_out = delta_variants()
    transports = args.delta_transports or [v.name for v in carried]
    console = Console(stderr=args.json, width=200)
    refused = [t for t in transports if t not in {v.name for v in carried}]
    if refused:
        console.print(f"[red]--delta-transports {', '.join(refused)}: "
                      f"{'; '.join(left_out.get(t, 'unknown transport') for t in refused)}[/red]")
        return 2
    for name, reason in left_out.items():
        console.print(f"left out: {name}: {reason}")
    rows, changed = run_delta(models=models, steps=max(3, args.delta_steps), lr=args.delta_lr, timeout=args.timeout,
                              links=args.link_gbit, transports=transports)
    for model, fractions in changed.items():
        listed = ", ".join(f"{c:.2%}" for c in fractions)
        console.print(f"{model}: bf16 elements changed per step (steps 2..): {listed}")
    table = Table(title="2 FSDP writers (bf16) -> 1 reader, median over versions 2..; transfer = "
                        "the reader's receive(), other = write() minus transfer")
    for col in ("model", "link", "transport", "mode", "MB on the wire", "x full bytes", "write() s", "x full",
                "transfer s", "x full", "other s", "bitwise"):
        table.add_column(col, justify="right")
    for r in rows:
        if "error" in r:
            table.add_row(r["model"], r["link"], r["transport"], r["mode"], "", "", "", "", "", "", "",
                          f"[red]{r['error'][:80]}[/red]")
            continue
        nan = float("nan")
        table.add_row(r["model"], r["link"], r["transport"], r["mode"], f"{r['nbytes'] / 1e6:.2f}",
                      f"{r.get('bytes_vs_full', nan):.3f}", f"{r['seconds']:.3f}",
                      f"{r.get('seconds_vs_full', nan):.2f}", f"{r['transfer_seconds']:.3f}",
                      f"{r.get('transfer_vs_full', nan):.2f}", f"{r['seconds'] - r['transfer_seconds']:.3f}",
                      "yes" if r["verified"] else "[red]NO[/red]")
    console.print(table)
    if args.json:
        sys.stdout.flush()
        print(json.dumps({"rows": rows, "changed": changed, "left_out": left_out, "machine": machine()}), flush=True)
    return 0 if all(r.get("verified") for r in rows) else 1


def _load(args: argparse.Namespace) -> int:
    """``--suite load``: see :mod:`weightsync.apps.bench.load`."""
    from rich.console import Console
    from rich.table import Table

    from weightsync.apps.bench import machine
    from weightsync.apps.bench.load import run_load

    result = run_load(readers=args.load_readers, versions=args.load_versions,
                      every=max(1, args.load_versions // 4), timeout=min(args.timeout, 300.0))
    console = Console(stderr=args.json, width=200)
    mb = 1 << 20
    p50, p99 = (result["write_seconds_p50"] or 0) * 1e3, (result["write_seconds_p99"] or 0) * 1e3
    table = Table(title=f"{result['readers']} readers x {result['versions']} versions (shm, staleness 0): "
                        f"write p50 {p50:.1f} ms, p99 {p99:.1f} ms")
    for col in ("after version", "writer RSS MB", "readers RSS MB (sum)", "/dev/shm MB"):
        table.add_column(col, justify="right")
    for row in result["writer"]:
        table.add_row(str(row["version"]), f"{row['rss'] / mb:.1f}",
                      f"{result['readers_rss'].get(row['version'], 0) / mb:.1f}", f"{row['shm'] / mb:.2f}")
    console.print(table)
    server = result["server"]
    if server:
        console.print(f"meta server RSS {server[0]['rss'] / mb:.1f} MB -> {server[-1]['rss'] / mb:.1f} MB over "
                      f"{len(server)} samples, /healthz {sorted({s['healthz'] for s in server})}; "
                      f"/dev/shm before {result['shm_before']} B, after {result['shm_after']} B; "
                      f"wrong tensors {result['wrong']}; failed processes {result['failed'] or 'none'}")
    if args.json:
        sys.stdout.flush()
        print(json.dumps({**result, "machine": machine()}), flush=True)
    return 0 if result["ok"] else 1
