"""The vLLM reader's extra memory during an update: whole-model staging against phases, on
CPU (the process's resident set) or on a GPU (device memory against weightsync's reserve).

Run by ``weightsync bench --suite vllm-memory`` and ``weightsync doctor``'s
``engine/vllm-memory`` (:mod:`weightsync.apps.bench.vllm_memory` starts this and a writer process):
an in-process vLLM engine is started on checkpoint B and generates greedily; a weightsync
reader then receives version 1 (other weights) and version 2 (B again) from the writer.
Greedy output after version 1 must differ and after version 2 equal the start, token for
token, so every figure belongs to an update that really happened.

* ``--device cpu``: the process's resident set before the update is the baseline; the peak
  above it while version 2 arrives and loads (the steady state: version 1 also forms the
  process group) is what staging and the reload cost.
* ``--device cuda``: vLLM sizes its KV cache from a real ``--gpu-memory-utilization``; the
  device memory torch has allocated once the engine is up is the baseline. weightsync's
  adapter then lays its staging out (the reserve: what it holds on the GPU beyond vLLM's
  own), and while version 2 arrives and loads, the peak allocated above the baseline
  (``torch.cuda.max_memory_allocated``) and the drop of the driver's free memory
  (``torch.cuda.mem_get_info``, sampled: CUDA IPC, NCCL and the driver allocate outside
  torch's allocator) are recorded. :func:`device_verdict` says whether they stay within
  the reserve plus :data:`SLACK_BYTES`.

    python -m weightsync.integrations.vllm_memory --checkpoint DIR --job J --bucket BYTES [--phases] \
        [--device cuda --gpu-memory-utilization 0.5]
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import sys
import threading
import time
from typing import Any

from weightsync.tools.rss import reset_peak_rss, status_bytes

PREFIX = "WSVLLMMEM "
#: vLLM's share of the GPU in ``--device cuda`` mode: real, and leaves room for staging and a writer
GPU_MEMORY_UTILIZATION = 0.5
#: What an update may take on the GPU beyond the reserve (staging) and the model's largest layer
#: (see :func:`allowed_extra`): torch's caching allocator rounds every block up (to 512 B) and
#: grows its pool in segments of 2 MiB, or 20 MiB for requests of 1-10 MB (c10's
#: CUDACachingAllocator, kSmallBuffer/kLargeBuffer), so a handful of transient tensors can
#: cost tens of MiB of segments; 64 MiB covers that and the driver's own bookkeeping when the
#: reader maps a writer's CUDA IPC memory. Anything near a model's size is a real cost not
#: reserved, which is what this check is for.
SLACK_BYTES = 64 << 20


def transport_for(device: str) -> str:
    """The transport both processes use: gloo on CPU (every byte the reader holds is its own:
    shared memory would add the writer's segment pages it maps to the resident set, though
    they are the writer's memory); on GPU, CUDA IPC, which needs only one GPU and no nccl4py
    (NCCL refuses a writer and a reader on one GPU)."""
    return "torch" if device == "cpu" else "shm"


def writer_device(device: str, gpus: int) -> str:
    """Where the writer holds its weights (a job's ranks use one kind of device): on CPU, CPU;
    on GPU, the second GPU when there is one, so the driver's free memory on the engine's GPU
    moves with the engine alone, else the engine's GPU (a trainer sharing it, as colocated
    jobs do: the driver figure then also holds the writer's transients)."""
    if device == "cpu":
        return "cpu"
    return "cuda:1" if gpus > 1 else "cuda:0"


def engine_options(device: str, gpu_memory_utilization: float | None) -> dict[str, Any]:
    """vLLM's ``LLM`` options for ``device``. On CPU the KV cache has a fixed size (64 MiB);
    on GPU it is sized by ``gpu_memory_utilization`` and nothing else, since vLLM 0.32's
    ``Worker.determine_available_memory`` lets ``kv_cache_memory_bytes`` override it."""
    common = {"dtype": "float32", "enforce_eager": True, "max_model_len": 128, "max_num_seqs": 1, "seed": 0,
              "skip_tokenizer_init": True}
    if device == "cpu":
        if gpu_memory_utilization is not None:
            raise ValueError("--gpu-memory-utilization is for --device cuda; on CPU the KV cache has a fixed size")
        return common | {"kv_cache_memory_bytes": 64 << 20}
    utilization = GPU_MEMORY_UTILIZATION if gpu_memory_utilization is None else gpu_memory_utilization
    if not 0.0 < utilization < 1.0:
        raise ValueError(f"--gpu-memory-utilization must be between 0 and 1 (exclusive), got {utilization}: the "
                         "rest of the GPU holds weightsync's staging")
    return common | {"gpu_memory_utilization": utilization}


def allowed_extra(reserve_bytes: int, largest_layer_bytes: int) -> int:
    """The most an update may add on the GPU above the post-init baseline: the reserve, one
    layer (vLLM's layerwise reload may hold one layer's tensors while it loads it) and
    :data:`SLACK_BYTES`."""
    return reserve_bytes + largest_layer_bytes + SLACK_BYTES


def device_verdict(figures: dict[str, Any], *, largest_layer_bytes: int) -> tuple[bool, str]:
    """Whether a ``--device cuda`` run passes, and the sentence that says why, with its figures.

    It passes when the update was real (greedy output changed with version 1, came back with
    version 2) and each figure stays within :func:`allowed_extra`: the peak torch allocated
    above the baseline during the steady-state update (version 2) and during the first (which
    also opens the writer's memory), and the drop of the driver's free memory during the
    steady-state update (during the first, a writer sharing the GPU may still be starting).
    """
    mib = 1 << 20
    limit = allowed_extra(figures["reserve_bytes"], largest_layer_bytes)
    said = (f"reserve {figures['reserve_bytes'] / mib:.1f} MiB (staging {figures['staging_bytes'] / mib:.1f} MiB), "
            f"peak extra during an update {figures['peak_extra_bytes'] / mib:.1f} MiB allocated "
            f"({figures['first_update_extra_bytes'] / mib:.1f} MiB during the first), "
            f"driver free memory down {figures['driver_extra_bytes'] / mib:.1f} MiB, limit {limit / mib:.1f} MiB "
            f"(reserve + largest layer {largest_layer_bytes / mib:.1f} MiB + slack {SLACK_BYTES / mib:.0f} MiB), "
            f"gpu_memory_utilization={figures['gpu_memory_utilization']}")
    if not (figures["changed"] and figures["restored"]):
        what = "did not change after version 1" if not figures["changed"] else "was not restored by version 2"
        return False, f"the update was not real: greedy output {what}; {said}"
    over = [what for what, key in (("allocated", "peak_extra_bytes"), ("first update", "first_update_extra_bytes"),
                                   ("driver", "driver_extra_bytes")) if figures[key] > limit]
    if over:
        return False, f"an update took more than the reserve ({' and '.join(over)} over the limit): {said}"
    return True, f"version 1 changed the output, version 2 restored it; {said}"


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


class _FreeSampler:
    """The least free memory the driver reports on ``device`` while the block runs (a thread
    polls ``torch.cuda.mem_get_info``: memory allocated outside torch has no peak counter)."""

    def __init__(self, device: Any) -> None:
        self.device, self.least = device, 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._poll, name="vllm-memory-sampler", daemon=True)

    def _poll(self) -> None:
        import torch

        while True:
            self.least = min(self.least, int(torch.cuda.mem_get_info(self.device)[0]))
            if self._stop.wait(0.002):
                return

    def __enter__(self) -> _FreeSampler:
        import torch

        self.least = int(torch.cuda.mem_get_info(self.device)[0])
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(10)


def _on_cpu(llm: Any, args: argparse.Namespace, sync: Any) -> dict[str, Any]:
    import torch

    from weightsync.engines.vllm import VLLMEngine
    from weightsync.roles.reader import WeightReader

    start = _greedy(llm)
    engine = VLLMEngine(llm)
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
    return {"peak_extra_bytes": steady, "first_update_extra_bytes": first, "staging_bytes": engine.staging_bytes,
            "seconds": seconds, "changed": other != start, "restored": restored == start,
            "torch_threads": torch.get_num_threads()}


def _on_gpu(llm: Any, args: argparse.Namespace, sync: Any) -> dict[str, Any]:
    import torch

    from weightsync.engines.vllm import VLLMEngine
    from weightsync.roles.reader import WeightReader

    start = _greedy(llm)
    device = torch.device("cuda", torch.cuda.current_device())
    gc.collect()
    torch.cuda.synchronize(device)
    baseline = torch.cuda.memory_allocated(device)  # the engine up: weights, KV cache, workspace
    engine = VLLMEngine(llm)
    # as the worker backend does at init_weight_transfer_engine: staging laid out before any update
    engine.lay_out(layer_phases=args.phases, budget_bytes=args.bucket)
    torch.cuda.synchronize(device)
    reserve = torch.cuda.memory_allocated(device) - baseline
    with WeightReader(engine, rank=0, config=sync) as reader:
        torch.cuda.reset_peak_memory_stats(device)
        reader.update(1)  # also opens the writer's CUDA IPC memory
        torch.cuda.synchronize(device)
        first = torch.cuda.max_memory_allocated(device) - baseline
        other = _greedy(llm)
        torch.cuda.synchronize(device)
        torch.cuda.reset_peak_memory_stats(device)
        t0 = time.perf_counter()
        with _FreeSampler(device) as sampler:
            free_before = sampler.least
            reader.update(2)  # steady state: what every later version costs
            torch.cuda.synchronize(device)
        seconds = time.perf_counter() - t0
        peak = torch.cuda.max_memory_allocated(device) - baseline
        restored = _greedy(llm)
    return {"reserve_bytes": reserve, "staging_bytes": engine.staging_bytes, "peak_extra_bytes": peak,
            "first_update_extra_bytes": first, "driver_extra_bytes": max(0, free_before - sampler.least),
            "gpu_memory_utilization": llm.llm_engine.vllm_config.cache_config.gpu_memory_utilization,
            "seconds": seconds, "changed": other != start, "restored": restored == start}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m weightsync.integrations.vllm_memory")
    parser.add_argument("--checkpoint", required=True)
    parser.add_argument("--job", required=True)
    parser.add_argument("--bucket", type=int, required=True)
    parser.add_argument("--phases", action="store_true")
    parser.add_argument("--timeout", type=float, default=300.0)
    parser.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    parser.add_argument("--gpu-memory-utilization", type=float, default=None)
    args = parser.parse_args(argv)
    try:
        options = engine_options(args.device, args.gpu_memory_utilization)
    except ValueError as exc:
        parser.error(str(exc))
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    from vllm import LLM

    from weightsync.session.sync_session import SyncConfig, TransportOptions

    llm = LLM(model=args.checkpoint, **options)
    sync = SyncConfig(num_writers=1, num_readers=1, job=args.job, timeout=args.timeout, layer_phases=args.phases,
                      transport=transport_for(args.device),
                      transport_options=TransportOptions(max_bucket_bytes=args.bucket))
    record = (_on_cpu if args.device == "cpu" else _on_gpu)(llm, args, sync)
    print(PREFIX + json.dumps(record), flush=True)
    llm.llm_engine.engine_core.shutdown()
    return 0


if __name__ == "__main__":
    sys.exit(main())
