"""``weightsync demo``: the end-to-end sync demo on the embedded defaults (see weightsync.demo)."""

from __future__ import annotations

import argparse

from weightsync.demo import SIZES, run_demo


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
    return 0 if result["ok"] else 1
