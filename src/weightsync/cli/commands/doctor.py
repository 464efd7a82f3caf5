"""``weightsync doctor``: check what works on this machine (see :mod:`weightsync.apps.doctor`).

    weightsync doctor                 # every check the hardware allows; GPU checks say why they skip
    weightsync doctor --engines       # also update a live vLLM / SGLang engine
    weightsync doctor --json
    weightsync doctor --report doctor.json   # versions, GPU topology, results: attach it to a bug report
"""

from __future__ import annotations

import argparse
import json
import sys


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--engines", action="store_true",
                   help="also update a live vLLM / SGLang engine when installed (starts an engine: a minute or more)")
    p.add_argument("--only", default="", help="comma-separated check-name prefixes, e.g. cpu,gpu/nccl")
    p.add_argument("--timeout", type=float, default=120.0, help="seconds allowed for each check")
    p.add_argument("--json", action="store_true", help="end with one JSON object on the last line of stdout")
    p.add_argument("--report", metavar="FILE", default="",
                   help="write the report (versions, GPU topology, every check's result, timing or skip reason) "
                        "as one JSON file to attach to a bug report")


def run(args: argparse.Namespace) -> int:
    from rich.console import Console
    from rich.table import Table

    from weightsync.apps.doctor import DoctorOptions, run_checks

    console = Console(stderr=args.json, width=160)
    only = tuple(x.strip() for x in args.only.split(",") if x.strip())
    colours = {"passed": "green", "failed": "red", "skipped": "yellow"}

    def progress(check) -> None:  # type: ignore[no-untyped-def]
        console.print(f"[{colours[check.status]}]{check.status:>7}[/] {check.name} ({check.seconds:.1f}s)")

    report = run_checks(DoctorOptions(engines=args.engines, timeout=args.timeout, only=only), on_check=progress)
    env = report.environment
    gpus = f"{env.gpus} GPU(s): {', '.join(env.gpu_names)}" if env.gpus else "no GPU"
    table = Table(title=f"weightsync doctor: torch {env.torch} (CUDA {env.cuda_build or 'none'}), {gpus}")
    for col in ("check", "result", "GB/s", "seconds", "detail"):
        table.add_column(col, justify="left" if col in ("check", "detail") else "right")
    for c in report.checks:
        table.add_row(c.name, f"[{colours[c.status]}]{c.status}[/]", "" if c.gbps is None else f"{c.gbps:.2f}",
                      f"{c.seconds:.1f}", c.detail)
    console.print(table)
    if args.report:
        with open(args.report, "w") as f:
            json.dump(report.to_dict(), f, indent=1)
        console.print(f"report written to {args.report}")
    if args.json:
        sys.stdout.flush()
        print(json.dumps(report.to_dict()), flush=True)
    return 0 if report.ok else 1
