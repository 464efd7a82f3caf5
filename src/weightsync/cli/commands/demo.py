"""``weightsync demo``: 2 training processes -> 2 inference processes, printed as a table.

The demo itself (the parent, the workers and its typed result) is :mod:`weightsync.apps.demo`.
"""

from __future__ import annotations

import argparse

from weightsync.apps.demo import SIZES, DemoResult, run_demo


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--size", choices=sorted(SIZES), default="small", help="model size (default small, ~58M params)")
    p.add_argument("--source", default="megatron:tp=2", help="training layout (default megatron:tp=2)")
    p.add_argument("--target", default="vllm:tp=1,replicas=2", help="inference layout (default vllm:tp=1,replicas=2)")
    p.add_argument("--steps", type=int, default=3, help="training steps, one sync after each")
    p.add_argument("--transport", default="auto", help="auto | torch | shm | file | nixl")
    p.add_argument("--max-bucket-mb", type=int, default=32, help="staging memory bound per process")
    p.add_argument("--timeout", type=float, default=120.0, help="seconds allowed for each sync")


def run(args: argparse.Namespace) -> int:
    result = run_demo(size=args.size, source=args.source, target=args.target, steps=args.steps,
                      transport=args.transport, max_bucket_bytes=args.max_bucket_mb << 20, timeout=args.timeout)
    print_result(result)
    return 0 if result.ok else 1


def print_result(result: DemoResult) -> None:
    from rich.console import Console
    from rich.table import Table

    console = Console()
    table = Table(title=f"weightsync demo: {result.source} -> {result.target} "
                        f"({result.parameters / 1e6:.1f}M parameters)")
    for col in ("version", "reader", "MB", "wait s", "transfer s", "apply s", "GB/s", "bitwise", "in place"):
        table.add_column(col, justify="right")
    for r in sorted(result.readers, key=lambda r: (r.version, r.rank)):
        ph = r.phases
        table.add_row(str(r.version), str(r.rank), f"{r.nbytes / 1e6:.1f}", f"{ph.get('wait', 0):.3f}",
                      f"{r.transfer_seconds:.3f}", f"{ph.get('apply', 0):.4f}", f"{r.gbps:.2f}",
                      "yes" if r.verified else "NO", "yes" if r.in_place else "NO")
    console.print(table)
    if result.writers:
        phases: dict[str, float] = {}
        for w in result.writers:
            for k, v in w.phases.items():
                phases[k] = phases.get(k, 0.0) + v / len(result.writers)
        console.print("writer phases (mean seconds per write): "
                      + ", ".join(f"{k} {v:.3f}" for k, v in sorted(phases.items())))
    for failure in result.failures:
        console.print(f"[red]FAILED[/red] {failure}")
    console.print("[green]demo OK: every version arrived bitwise-equal, in place[/green]" if result.ok
                  else "[red]demo FAILED[/red]")
