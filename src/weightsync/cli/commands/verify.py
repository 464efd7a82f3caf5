"""``weightsync verify``: compare weights with a checkpoint, tensor by tensor, read-only.

    # an engine's per-rank dumps (rank-0.safetensors, ...) in a layout, against a checkpoint
    weightsync verify --checkpoint ckpt/ --weights dumps/ --layout vllm:tp=2 --config ckpt/
    # two checkpoints with canonical names
    weightsync verify --checkpoint ckpt/ --weights other_ckpt/
"""

from __future__ import annotations

import argparse
import os
import sys

from safetensors.torch import load_file

from weightsync.configs import load_spec
from weightsync.layout import parse_layout
from weightsync.tools.verify import checkpoint_index, merge_reports, verify_rank


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--checkpoint", required=True, help="reference checkpoint directory (*.safetensors)")
    p.add_argument("--weights", required=True,
                   help="weights to check: per-rank dumps (rank-<r>.safetensors, with --layout) or a checkpoint")
    p.add_argument("--layout", help="layout of the per-rank dumps, e.g. vllm:tp=2 (omit for a checkpoint)")
    p.add_argument("--config", help="HF config.json (file, directory or bundled name); default: --checkpoint")
    p.add_argument("--atol", type=float, default=0.0, help="absolute tolerance (default 0: bitwise)")
    p.add_argument("--json", action="store_true", help="print the full JSON report")


def run(args: argparse.Namespace) -> int:
    spec = load_spec(args.config or args.checkpoint)
    index = checkpoint_index(args.checkpoint)
    reports = []
    if args.layout:
        kind = parse_layout(args.layout)
        kind.validate(spec)
        for rank in range(kind.world_size):
            path = os.path.join(args.weights, f"rank-{rank}.safetensors")
            if not os.path.exists(path):
                raise ValueError(f"{path} does not exist: --weights must hold one dump per rank of {args.layout}")
            reports.append(verify_rank(kind.rank_layout(spec, rank), load_file(path), args.checkpoint,
                                       atol=args.atol, index=index))
    else:
        layout = parse_layout("hf").rank_layout(spec, 0)
        tensors = {}
        for file in sorted({e.file for e in checkpoint_index(args.weights).values()}):
            tensors.update(load_file(file))
        reports.append(verify_rank(layout, tensors, args.checkpoint, atol=args.atol, index=index))
    report = merge_reports(reports)
    if args.json:
        print(report.to_json())
    else:
        summary = report.summary()
        print(f"{'OK' if report.ok else 'MISMATCH'}: {summary['tensors']} tensors checked, "
              f"statuses {summary['statuses']}, {summary['missing']} missing, max |diff| {summary['max_abs_diff']:g}")
        for t in [t for t in report.tensors.values() if t.status != "ok"][:20]:
            print(f"  {t.status}: {t.name} {t.detail or f'{t.differing_elements} elements differ'}", file=sys.stderr)
    return 0 if report.ok else 1
