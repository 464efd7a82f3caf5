"""``weightsync doctor --engines``: the vLLM workloads users run, each proven on a GPU.

Every case starts vLLM's GPU build with the ``"weightsync"`` worker backend (a reader in each of
vLLM's worker processes) on a checkpoint B, and a trainer (a thread of this process, on the
last GPU) syncs version 1 (weights A, which must change the greedy output) and version 2 (B,
which must restore it token for token) through vLLM's weight-transfer calls (``update_llm``):

* ``graphs``: CUDA graphs on (``enforce_eager=False``), bf16;
* ``utilization``: the same at vLLM's default ``gpu_memory_utilization=0.9``, whole-model staging
  (reserved before vLLM sizes its KV cache: figures ``kv_cache_blocks``, ``staging_bytes``);
* ``dp2``: ``data_parallel_size=2``, each replica a reader of its own;
* ``prefetch``: ``prefetch=True``; decode throughput while the next version arrives against
  without a transfer (``decode_ratio``: 1 means the transfer cost decode nothing);
* ``failure``: the trainer, a process of its own with layer phases, is SIGKILLed after the first
  phase of version 2 reached the engine: the update must fail and every reader report no valid
  version (never a mix), and the next full version must restore B.

Each case runs in a child process and prints one JSON line after :data:`PREFIX`:
``{"ok": ..., "detail": ..., "figures": {...}}``::

    python -m weightsync.integrations.vllm_workloads graphs
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

PREFIX = "WSVLLMWORKLOAD "
CASES = ("graphs", "utilization", "dp2", "prefetch", "failure")
#: GPUs a case needs (the trainer takes the last one, or shares the engine's)
GPUS_NEEDED = {"graphs": 1, "utilization": 1, "dp2": 2, "prefetch": 1, "failure": 1}


def engine_options(case: str) -> dict[str, Any]:
    """vLLM's ``LLM`` options for ``case`` (besides the model and the backend)."""
    if case not in CASES:
        raise ValueError(f"unknown vLLM workload {case!r}; known: {', '.join(CASES)}")
    options: dict[str, Any] = {"dtype": "bfloat16", "enforce_eager": False, "max_model_len": 512, "seed": 0,
                               "skip_tokenizer_init": True, "gpu_memory_utilization": 0.5,
                               "weight_transfer_config": {"backend": "weightsync"}}
    if case == "utilization":
        options["gpu_memory_utilization"] = 0.9
    if case == "dp2":
        options["data_parallel_size"] = 2
    return options


def init_info(case: str, server: Any, *, readers: int) -> dict[str, Any]:
    """The ``init_weight_transfer_engine`` info every replica gets (replica d is reader d)."""
    info: dict[str, Any] = {"meta_address": server.address, "meta_token": server.token, "job": "workload",
                            "rank": 0, "num_writers": 1, "num_readers": readers, "timeout": 300.0}
    if case == "prefetch":
        info["prefetch"] = True
    if case == "failure":
        info["layer_phases"], info["max_bucket_bytes"] = True, 1 << 20
    return info


def decode_ratio(during: float, idle: float) -> float:
    """Decode throughput while a version arrives, as a fraction of it without (0 when unknown)."""
    return during / idle if idle > 0 else 0.0


def _prompts(n: int) -> list[Any]:
    from vllm.inputs import TokensPrompt

    return [TokensPrompt(prompt_token_ids=[(7 * i + 3 * k) % 500 + 4 for i in range(32)]) for k in range(n)]


def _greedy(llm: Any) -> list[int]:
    from vllm import SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True, detokenize=False)
    return list(llm.generate(_prompts(1), params, use_tqdm=False)[0].outputs[0].token_ids)


def _decode_rate(llm: Any) -> float:
    """Generated tokens per second of a batch of 16 decodes."""
    from vllm import SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=128, ignore_eos=True, detokenize=False)
    t0 = time.perf_counter()
    outputs = llm.generate(_prompts(16), params, use_tqdm=False)
    return sum(len(o.outputs[0].token_ids) for o in outputs) / (time.perf_counter() - t0)


def reader_versions(worker: Any) -> int | None:
    """In each vLLM worker (``collective_rpc``): the version its weightsync reader holds (None: none valid)."""
    engine = worker.weight_transfer_engine
    return None if engine.reader is None else engine.reader.version


def _trainer(config: dict[str, Any], server: Any, versions: list[tuple[int, Any]], *, device: str, readers: int,
             errors: list[BaseException]) -> threading.Thread:
    """A trainer thread writing ``versions`` ((version, canonical weights)) from ``device``."""
    def train() -> None:
        try:
            from weightsync.meta.client import MetaClient
            from weightsync.roles.writer import WeightWriter
            from weightsync.session.sync_session import SyncConfig
            from weightsync.tools.tiny import CanonicalSource
            from weightsync.tools.torch_layout import fill_from_canonical

            sync = SyncConfig(num_writers=1, num_readers=readers, job="workload", timeout=300.0)
            source = CanonicalSource(config, device=device)
            with WeightWriter(source, rank=0, config=sync,
                              meta=MetaClient(server.address, job="workload", token=server.token)) as writer:
                for version, values in versions:
                    fill_from_canonical(source.layout(), source.tensors(), values)
                    writer.write(version)
        except BaseException as exc:  # reported by the case
            errors.append(exc)
    thread = threading.Thread(target=train, name="workload-trainer", daemon=True)
    thread.start()
    return thread


def run_case(case: str) -> dict[str, Any]:
    """Run ``case`` (module docstring) and return its verdict and figures."""
    import torch
    from vllm import LLM

    from weightsync.engines.vllm import update_llm
    from weightsync.integrations.selfcheck import verdict
    from weightsync.meta import EmbeddedMetaServer
    from weightsync.tools.tiny import canonical_weights, tiny_config, write_checkpoint

    readers = 2 if case == "dp2" else 1
    trainer_device = f"cuda:{torch.cuda.device_count() - 1}"
    config = {**tiny_config(), "torch_dtype": "bfloat16"}
    figures: dict[str, float] = {}
    with tempfile.TemporaryDirectory(prefix="weightsync-workload-") as tmp, EmbeddedMetaServer() as server:
        b = write_checkpoint(Path(tmp) / "B", config, seed=2)
        llm = LLM(model=str(Path(tmp) / "B"), **engine_options(case))
        ref_b = _greedy(llm)
        llm.init_weight_transfer_engine({"init_info": init_info(case, server, readers=readers)})
        if case == "failure":
            return _failure(llm, config, server, ref_b, tmp)
        errors: list[BaseException] = []
        trainer = _trainer(config, server, [(1, canonical_weights(config, seed=1)), (2, b)], device=trainer_device,
                           readers=readers, errors=errors)
        if case == "prefetch":
            figures["decode_tokens_per_s_idle"] = _decode_rate(llm)
            llm.start_weight_update()  # the receive starts in each worker, in the background
            figures["decode_tokens_per_s_during_sync"] = _decode_rate(llm)
            figures["decode_ratio"] = decode_ratio(figures["decode_tokens_per_s_during_sync"],
                                                   figures["decode_tokens_per_s_idle"])
        outputs = []
        for version in (1, 2):
            t0 = time.perf_counter()
            update_llm(llm, version, timeout=300.0)
            figures[f"update_{version}_seconds"] = time.perf_counter() - t0
            outputs.append(_greedy(llm))
        trainer.join(300)
        if errors:
            raise errors[0]
        cache = llm.llm_engine.vllm_config.cache_config
        figures.update(gpu_memory_utilization=cache.gpu_memory_utilization,
                       kv_cache_blocks=float(cache.num_gpu_blocks or 0), readers=float(readers))
        ok, detail = verdict(outputs[0], outputs[1], ref_b, where=f"{case}: ")
        return {"ok": ok, "detail": detail, "figures": figures}


def _failure(llm: Any, config: dict[str, Any], server: Any, ref_b: list[int], tmp: str) -> dict[str, Any]:
    """The trainer process dies after the first phase of version 2: the update fails, no reader
    holds a valid version, and version 3 (B, from a new trainer) restores the output."""
    from weightsync.engines.vllm import update_llm

    def trainer(*versions: str) -> subprocess.Popen[str]:
        return subprocess.Popen([sys.executable, "-m", "weightsync.integrations.vllm_workloads", "trainer", tmp,
                                 server.address, server.token, *versions], text=True)

    first = trainer("1:1", "2:2:die")  # version 2 (B) is cut short: its first phase arrives, the rest never
    update_llm(llm, 1, timeout=300.0)
    changed = _greedy(llm) != ref_b
    t0 = time.perf_counter()
    try:
        update_llm(llm, 2, timeout=60.0)
        failed = ""
    except Exception as exc:  # what the driver sees: the workers' error
        failed = f"{type(exc).__name__}: {exc}"[:300]
    figures = {"failure_seconds": time.perf_counter() - t0}
    first.wait(60)
    valid = llm.collective_rpc(reader_versions)
    second = trainer("3:2")
    update_llm(llm, 3, timeout=300.0)
    restored = _greedy(llm) == ref_b
    second.wait(60)
    ok = changed and bool(failed) and all(v is None for v in valid) and restored
    detail = (f"failure: version 2 {'failed (' + failed + ')' if failed else 'did not fail'} with the trainer killed "
              f"mid-version; readers then held {valid} (None: no valid version); version 3 "
              f"{'restored' if restored else 'did not restore'} the output")
    return {"ok": ok, "detail": detail, "figures": figures}


def _trainer_main(tmp: str, address: str, token: str, versions: list[str]) -> int:
    """A trainer process (``failure``): ``version:seed[:die]`` each; ``die``: SIGKILL itself once
    the first phase of that version is sent."""
    import torch

    from weightsync.meta.client import MetaClient
    from weightsync.roles.writer import WeightWriter
    from weightsync.session.sync_session import SyncConfig, TransportOptions
    from weightsync.tools.tiny import CanonicalSource, canonical_weights
    from weightsync.tools.torch_layout import fill_from_canonical

    config = json.loads((Path(tmp) / "B" / "config.json").read_text())
    sync = SyncConfig(num_writers=1, num_readers=1, job="workload", timeout=300.0, layer_phases=True,
                      transport_options=TransportOptions(max_bucket_bytes=1 << 20))
    source = CanonicalSource(config, device=f"cuda:{torch.cuda.device_count() - 1}")
    with WeightWriter(source, rank=0, config=sync, meta=MetaClient(address, job="workload", token=token)) as writer:
        for spec in versions:
            version, seed, *die = spec.split(":")
            fill_from_canonical(source.layout(), source.tensors(), canonical_weights(config, seed=int(seed)))
            if die:
                _die_after_first_phase(writer)
            writer.write(int(version))
    return 0


def _die_after_first_phase(writer: Any) -> None:
    transport = writer.session.planned.transport
    send: Callable[..., Any] = transport.send

    def dying(version: int, *args: Any, phase: int = 0, **kwargs: Any) -> Any:
        if phase >= 1:
            os.kill(os.getpid(), signal.SIGKILL)
        return send(version, *args, phase=phase, **kwargs)
    transport.send = dying


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m weightsync.integrations.vllm_workloads")
    parser.add_argument("case", choices=[*CASES, "trainer"])
    parser.add_argument("rest", nargs="*")
    args = parser.parse_args(argv)
    if args.case == "trainer":
        tmp, address, token, *versions = args.rest
        return _trainer_main(tmp, address, token, versions)
    try:
        out = run_case(args.case)
    except Exception as exc:  # the doctor shows it as the check's failure
        out = {"ok": False, "detail": f"{args.case}: {type(exc).__name__}: {exc}"[:500], "figures": {}}
    print(PREFIX + json.dumps(out), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
