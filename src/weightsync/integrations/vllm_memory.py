"""The vLLM reader's extra memory during an update: whole-model staging against phases.

Run by ``weightsync bench --suite vllm-memory`` (:mod:`weightsync.bench.vllm_memory`), one
process per (model, mode): an in-process vLLM engine is started on checkpoint B and
generates greedily; the process's resident set is then the baseline, its peak counter is
reset, and a weightsync reader receives version 1 (other weights) and version 2 (B again)
from a writer process. The peak above the baseline while version 2 arrives and loads (the
steady state; version 1 also forms the process group) is what staging and the reload cost;
greedy output after version 1 must differ and after version 2 equal the start, token for
token (so the figure belongs to an update that really happened).

    python -m weightsync.integrations.vllm_memory --checkpoint DIR --job J --bucket BYTES [--phases]
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import sys
import time

from weightsync.rss import reset_peak_rss, status_bytes

PREFIX = "WSVLLMMEM "


def _reset_peak() -> None:
    """Reset the kernel's peak resident-set counter (VmHWM) to the current resident set."""
    if not reset_peak_rss():
        raise OSError("cannot reset the peak resident set (/proc/self/clear_refs): the figure would be wrong")


def _greedy(llm: object) -> list[int]:
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True, detokenize=False)
    prompt = TokensPrompt(prompt_token_ids=[(7 * i + 3) % 500 + 4 for i in range(24)])
    return list(llm.generate([prompt], params, use_tqdm=False)[0].outputs[0].token_ids)  # type: ignore[attr-defined]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m weightsync.integrations.vllm_memory")
    parser.add_argument("--checkpoint", required=True)
    parser.add_argument("--job", required=True)
    parser.add_argument("--bucket", type=int, required=True)
    parser.add_argument("--phases", action="store_true")
    parser.add_argument("--timeout", type=float, default=300.0)
    args = parser.parse_args(argv)
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    import torch
    from vllm import LLM

    from weightsync.engines.vllm import VLLMEngine
    from weightsync.reader import WeightReader
    from weightsync.session import SyncConfig, TransportOptions

    llm = LLM(model=args.checkpoint, dtype="float32", enforce_eager=True, max_model_len=128, max_num_seqs=1, seed=0,
              kv_cache_memory_bytes=64 << 20, skip_tokenizer_init=True)
    start = _greedy(llm)
    engine = VLLMEngine(llm)
    # torch (gloo): every byte the reader holds is its own (shared memory would add the writer's
    # segment pages it maps to the resident set, though they are the writer's memory).
    sync = SyncConfig(num_writers=1, num_readers=1, job=args.job, timeout=args.timeout, layer_phases=args.phases,
                      transport="torch", transport_options=TransportOptions(max_bucket_bytes=args.bucket))
    gc.collect()
    baseline = status_bytes("VmRSS")
    _reset_peak()
    with WeightReader(engine, rank=0, config=sync) as reader:
        reader.update(1)  # the first update also forms the process group and lays out staging
        first = status_bytes("VmHWM") - baseline
        other = _greedy(llm)
        _reset_peak()
        t0 = time.perf_counter()
        reader.update(2)  # steady state: what every later version costs
        seconds = time.perf_counter() - t0
        steady = status_bytes("VmHWM") - baseline
        restored = _greedy(llm)
    record = {"peak_extra_bytes": steady, "first_update_extra_bytes": first, "staging_bytes": engine.staging_bytes,
              "seconds": seconds, "changed": other != start, "restored": restored == start,
              "torch_threads": torch.get_num_threads()}
    print(PREFIX + json.dumps(record), flush=True)
    llm.llm_engine.engine_core.shutdown()
    return 0


if __name__ == "__main__":
    sys.exit(main())
