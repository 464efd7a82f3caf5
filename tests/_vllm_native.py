"""Processes for tests/test_vllm_native.py: FSDP2 trainers on vLLM's native API, a vLLM server,
and the reference engines (one per checkpoint) the outputs are compared with.

    python tests/_vllm_native.py trainer --rank R --world 2 --checkpoint DIR --url URL --out DIR ...
    python tests/_vllm_native.py reference DIR [DIR ...]         # one JSON line of greedy tokens per DIR
    python tests/_vllm_native.py mp-engine --checkpoint DIR      # LLM with its engine core in a child process
    python tests/_vllm_native.py lora-trainer --rank R --world 2 --url URL ...   # TP ranks of a LoRA adapter
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from weightsync.apps.bench.vllm_prefetch_serve import free_port, vllm_serve

PROMPT = [5 + (7 * i) % 480 for i in range(40)]  # longer than one KV block (16 tokens on CPU)
NEW_TOKENS = 12
VLLM_ARGS = ["--dtype", "float32", "--enforce-eager", "--max-model-len", "256", "--max-num-seqs", "2",
             "--skip-tokenizer-init", "--kv-cache-memory-bytes", str(32 << 20), "--seed", "0"]


def run_to_end(procs: list[subprocess.Popen[str]], *, timeout: float, tail: int = 4000) -> list[str]:
    """Wait for every rank process (a rank still running at the end is killed) and check that each
    exited 0, showing the end of its stderr if not; their stdouts."""
    try:
        outputs = [p.communicate(timeout=timeout) for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.communicate()
    for p, (_, err) in zip(procs, outputs, strict=True):
        assert p.returncode == 0, err[-tail:]
    return [out for out, _ in outputs]


def vllm_server(model: Path, *, timeout: float = 240.0, extra: tuple[str, ...] = (),
                port: int | None = None) -> Any:
    """``vllm serve`` as a user starts it (the RL routes need VLLM_SERVER_DEV_MODE=1), with ``extra``
    arguments, on ``port`` (default: a free one)."""
    port = port or free_port()
    env = {**os.environ, "VLLM_SERVER_DEV_MODE": "1", "VLLM_HOST_IP": "127.0.0.1", "HF_HUB_OFFLINE": "1"}
    return vllm_serve(model, [*VLLM_ARGS, *extra], env=env, log=model.parent / f"server-{port}.log", timeout=timeout,
                      port=port)


def completion(url: str, model: str) -> tuple[list[int], str]:
    import httpx

    body = {"model": model, "prompt": PROMPT, "max_tokens": NEW_TOKENS, "temperature": 0, "return_token_ids": True,
            "ignore_eos": True}
    tokens = httpx.post(f"{url}/v1/completions", json=body, timeout=120).json()["choices"][0]["token_ids"]
    return tokens, httpx.get(f"{url}/weight_info", timeout=30).json()["weight_version"]


# -- trainers -----------------------------------------------------------------------------------

def trainer(args: argparse.Namespace) -> None:
    import torch
    import torch.distributed as dist
    from safetensors.torch import save_file
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from transformers import AutoModelForCausalLM
    from vllm.distributed.weight_transfer.base import ModuleSource
    from vllm.distributed.weight_transfer.clients import HTTPVLLMWeightSyncClient
    from vllm.distributed.weight_transfer.factory import WeightTransferTrainerFactory

    from weightsync.integrations.vllm_trainer import WeightSyncTrainerInitInfo

    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=args.rank, world_size=args.world)
    model = AutoModelForCausalLM.from_pretrained(args.checkpoint, dtype=torch.float32)
    mesh = init_device_mesh("cpu", (args.world,))
    for layer in model.model.layers:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    config = json.loads((Path(args.checkpoint) / "config.json").read_text())
    info = WeightSyncTrainerInitInfo(rank=args.rank, num_writers=args.world, num_readers=1, meta_address=args.meta,
                                     meta_token=args.token, job=args.job, model_config=config, timeout=120.0)
    # vLLM's own API, with the backend switched to "weightsync": nothing else is weightsync-specific.
    engine = WeightTransferTrainerFactory.trainer_init(info, client=HTTPVLLMWeightSyncClient(args.url),
                                                       source=ModuleSource(model))
    ids = torch.tensor([PROMPT])
    for version in range(1, args.versions + 1):
        if version > 1:  # version 1: the checkpoint as loaded; then one training step per version
            model(input_ids=ids, labels=ids).loss.backward()
            optimizer.step()
            optimizer.zero_grad()
        engine.send_weights()
        full = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
        if args.rank == 0:
            out = Path(args.out) / f"v{version}"
            out.mkdir(parents=True)
            (out / "config.json").write_text(json.dumps(config))
            save_file({k: v.contiguous() for k, v in full.items() if k != "lm_head.weight"
                       or not config.get("tie_word_embeddings")}, str(out / "model.safetensors"))
            tokens, weight_version = completion(args.url, args.model)
            print("RESULT " + json.dumps({"version": version, "tokens": tokens, "weight_version": weight_version}),
                  flush=True)
        dist.barrier()
    engine.shutdown()
    dist.destroy_process_group()


def lora_trainer(args: argparse.Namespace) -> None:
    """A tensor-parallel rank of a LoRA adapter (r=8, alpha=16) on vLLM's native API, version ``i``
    the adapter of ``seeds[i - 1]``. Each rank prints the bytes it sent per version; rank 0 also
    the server's greedy tokens after each version,
    for the synced adapter (``--served``), the base model and each of ``--compare`` (adapters
    the server loaded from disk)."""
    import torch
    from vllm.distributed.weight_transfer.clients import HTTPVLLMWeightSyncClient
    from vllm.distributed.weight_transfer.factory import WeightTransferTrainerFactory

    from weightsync.integrations.vllm_trainer import WeightSyncTrainerInitInfo
    from weightsync.layout import ModelSpec
    from weightsync.layout.lora import LoraSpec
    from weightsync.sources.lora import LoraSource
    from weightsync.tools.tiny import lora_weights
    from weightsync.tools.torch_layout import allocate, fill_from_canonical

    torch.set_num_threads(1)
    config = json.loads((Path(args.model) / "config.json").read_text())
    lora = LoraSpec(r=8, alpha=16)
    layout = lora.rank_layout(ModelSpec.from_hf_config(config), args.rank, tp=args.world, tp_rank=args.rank)
    live = {name.replace(".weight", ".default.weight"): t for name, t in allocate(layout).items()}  # a PeftModel's
    source = LoraSource(live, config, lora, tp=args.world, tp_rank=args.rank, rank=args.rank)
    info = WeightSyncTrainerInitInfo(rank=args.rank, num_writers=args.world, num_readers=1, meta_address=args.meta,
                                     meta_token=args.token, job=args.job, timeout=120.0, lora_id=args.lora_id)
    engine = WeightTransferTrainerFactory.trainer_init(info, client=HTTPVLLMWeightSyncClient(args.url),
                                                       source=source)
    names = [args.served, args.model, *args.compare.split(",")]
    if args.rank == 0:  # before the first version: the server's own adapter
        print("RESULT " + json.dumps({"version": 0, "tokens": {name: completion(args.url, name)[0]
                                                               for name in names}}), flush=True)
    for version, seed in enumerate(map(int, args.seeds.split(",")), start=1):
        fill_from_canonical(source.layout(), source.tensors(), lora_weights(config, lora, seed))
        engine.send_weights()
        result: dict[str, Any] = {"version": version, "nbytes": engine.last_result.nbytes}
        if args.rank == 0:
            tokens = {name: completion(args.url, name) for name in names}
            result.update(weight_version=tokens[args.served][1], tokens={name: t for name, (t, _) in tokens.items()})
        print("RESULT " + json.dumps(result), flush=True)
    engine.shutdown()


def pause_driver(args: argparse.Namespace) -> None:
    """An RL driver over HTTP (``vllm serve`` with the backend prefetching): the server's greedy
    tokens first, then per ``seed:mode`` of ``--plan`` one version (the canonical weights of that
    seed) prefetched since ``/start_weight_update`` and applied under the bench's driver sequence
    for that pause mode (``apply_prefetched``), then the server's greedy tokens, how many prompt
    tokens it took from its prefix cache, and its weight version."""
    from weightsync.apps.bench.vllm_prefetch_serve import _Routes, apply_prefetched
    from weightsync.meta.client import MetaClient
    from weightsync.roles.writer import WeightWriter
    from weightsync.session.config import SCOPES, SyncConfig
    from weightsync.tools.tiny import CanonicalSource, canonical_weights
    from weightsync.tools.torch_layout import fill_from_canonical

    config = json.loads((Path(args.model) / "config.json").read_text())
    source = CanonicalSource(config)
    sync = SyncConfig(num_writers=1, num_readers=1, job=args.job, timeout=120.0, staleness=1)
    routes = _Routes(args.url, 120.0)
    info = {k: v for k, v in sync.to_wire().items() if SCOPES[k] != "rank"}
    routes.post("/init_weight_transfer_engine", {"init_info": {**info, "rank": 0, "prefetch": True,
                                                               "meta_address": args.meta, "meta_token": args.token}})
    print("RESULT " + json.dumps({"version": 0, "tokens": completion(args.url, args.model)[0]}), flush=True)
    meta = MetaClient(args.meta, job=args.job, token=args.token)
    with WeightWriter(source, rank=0, config=sync, meta=meta) as writer:
        for version, step in enumerate(args.plan.split(","), start=1):
            seed, mode = step.split(":")
            routes.post("/start_weight_update")
            fill_from_canonical(source.layout(), source.tensors(), canonical_weights(config, int(seed)))
            writer.write(version)
            apply_prefetched(routes, version, mode)
            body = {"model": args.model, "prompt": PROMPT, "max_tokens": NEW_TOKENS, "temperature": 0,
                    "return_token_ids": True, "ignore_eos": True}
            out = routes.post("/v1/completions", body)  # the server runs with --enable-prompt-tokens-details
            print("RESULT " + json.dumps({
                "version": version, "mode": mode, "tokens": out["choices"][0]["token_ids"],
                "cached_tokens": out["usage"]["prompt_tokens_details"]["cached_tokens"],
                "weight_version": routes.http.get("/weight_info").json()["weight_version"]}), flush=True)
    routes.post("/shutdown_weight_transfer_engine")
    meta.close()


# -- reference engines --------------------------------------------------------------------------

def _engine(path: str, **kwargs: Any) -> Any:
    from vllm import LLM

    from vllm_in_process import before_engine_start

    before_engine_start()
    return LLM(model=path, dtype="float32", enforce_eager=True, max_model_len=256, max_num_seqs=2, seed=0,
               kv_cache_memory_bytes=32 << 20, skip_tokenizer_init=True, **kwargs)


def _greedy(llm: Any) -> list[int]:
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    params = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True, detokenize=False)
    return list(llm.generate([TokensPrompt(prompt_token_ids=PROMPT)], params, use_tqdm=False)[0].outputs[0].token_ids)


def reference(paths: list[str], tp: int = 1, states: bool = False) -> None:
    """Greedy tokens of a fresh engine per checkpoint, built as the test servers are (``tp`` > 1:
    its TP workers are processes of its own); with ``states``, each worker's state as digests."""
    from weightsync.engines.vllm_state import engine_states
    from weightsync.tools.engine_state import wire_digests

    parallel: dict[str, Any] = {"tensor_parallel_size": tp, "distributed_executor_backend": "mp"} if tp > 1 else {}
    for path in paths:
        llm = _engine(path, **parallel)
        row: dict[str, Any] = {"path": path, "tokens": _greedy(llm)}
        if states:
            row["states"] = [wire_digests(tensors) for _, tensors in engine_states(llm)]
        print("RESULT " + json.dumps(row), flush=True)
        llm.llm_engine.engine_core.shutdown()
        del llm


def mp_engine(checkpoint: str, versions: list[str]) -> None:
    """An LLM whose engine core runs in a child process, updated by one trainer rank in this
    process through vLLM's API (``LLMClient``); prints greedy tokens per version."""
    from vllm.distributed.weight_transfer.factory import WeightTransferTrainerFactory

    from weightsync.integrations.vllm_trainer import LLMClient, WeightSyncTrainerInitInfo
    from weightsync.sources.module import ShardedSource
    from weightsync.tools.tiny import canonical_weights
    from weightsync.tools.torch_layout import fill_from_canonical

    config = json.loads((Path(checkpoint) / "config.json").read_text())
    llm = _engine(checkpoint, weight_transfer_config={"backend": "weightsync"})
    source = ShardedSource("hf", config, 0)
    engine = WeightTransferTrainerFactory.trainer_init(WeightSyncTrainerInitInfo(rank=0, model_config=config),
                                                       client=LLMClient(llm), source=source)
    print("RESULT " + json.dumps({"version": 0, "tokens": _greedy(llm)}), flush=True)
    for version, seed in enumerate(map(int, versions), start=1):
        fill_from_canonical(source.layout(), source.tensors(), canonical_weights(config, seed))
        if version == len(versions) > 1:  # the last by a second trainer, once the first shut down
            t0 = time.monotonic()
            engine.shutdown()  # the trainer first: its workers, then its writer, then its meta server
            print("RESULT " + json.dumps({"trainer_first_seconds": time.monotonic() - t0}), flush=True)
            engine = WeightTransferTrainerFactory.trainer_init(
                WeightSyncTrainerInitInfo(rank=0, model_config=config), client=LLMClient(llm), source=source)
        engine.send_weights(version)
        print("RESULT " + json.dumps({"version": version, "tokens": _greedy(llm),
                                      "weight_version": llm.get_weight_version()}), flush=True)
    t0 = time.monotonic()
    llm.llm_engine.engine_core.shutdown()  # now the engine (its workers) first, then the trainer
    t1 = time.monotonic()
    engine.shutdown()
    print("RESULT " + json.dumps({"engine_seconds": t1 - t0, "trainer_seconds": time.monotonic() - t1}), flush=True)


def mp_engine_delta(checkpoint: str, seed: int) -> None:
    """Deltas into an LLM whose engine core runs in a child process, over the torch transport:
    version 1 is the checkpoint's weights (canonical weights of ``seed``) with every 50th element
    of every tensor moved (the first version: sent in full), version 2 the checkpoint's weights
    again (a delta: only those elements). Prints greedy tokens and bytes sent per version."""
    from vllm.distributed.weight_transfer.factory import WeightTransferTrainerFactory

    from weightsync.integrations.vllm_trainer import LLMClient, WeightSyncTrainerInitInfo
    from weightsync.sources.module import ShardedSource
    from weightsync.tools.tiny import canonical_weights
    from weightsync.tools.torch_layout import fill_from_canonical

    config = json.loads((Path(checkpoint) / "config.json").read_text())
    llm = _engine(checkpoint, weight_transfer_config={"backend": "weightsync"})
    source = ShardedSource("hf", config, 0)
    info = WeightSyncTrainerInitInfo(rank=0, model_config=config, transport="torch", layer_phases=False,
                                     delta_anchor_every=8)
    engine = WeightTransferTrainerFactory.trainer_init(info, client=LLMClient(llm), source=source)
    print("RESULT " + json.dumps({"version": 0, "tokens": _greedy(llm)}), flush=True)
    exact = canonical_weights(config, seed)
    moved = {name: t.clone() for name, t in exact.items()}
    for t in moved.values():
        t.view(-1)[::50] += 0.25
    for version, weights in ((1, moved), (2, exact)):
        fill_from_canonical(source.layout(), source.tensors(), weights)
        engine.send_weights()
        print("RESULT " + json.dumps({"version": version, "tokens": _greedy(llm), "nbytes": engine.last_result.nbytes,
                                      "weight_version": llm.get_weight_version()}), flush=True)
    engine.shutdown()
    llm.llm_engine.engine_core.shutdown()


def main() -> int:
    parser = argparse.ArgumentParser()
    sub = parser.add_subparsers(dest="cmd", required=True)
    t = sub.add_parser("trainer")
    for name in ("checkpoint", "url", "out", "meta", "token", "job", "model"):
        t.add_argument(f"--{name}", required=True)
    t.add_argument("--rank", type=int, required=True)
    t.add_argument("--world", type=int, default=2)
    t.add_argument("--versions", type=int, default=2)
    r = sub.add_parser("reference")
    r.add_argument("paths", nargs="+")
    r.add_argument("--tp", type=int, default=1)
    r.add_argument("--states", action="store_true", help="each worker's state too, as digests")
    m = sub.add_parser("mp-engine")
    m.add_argument("--checkpoint", required=True)
    m.add_argument("--seeds", required=True)
    d = sub.add_parser("mp-engine-delta")
    d.add_argument("--checkpoint", required=True)
    d.add_argument("--seed", type=int, required=True)
    lt = sub.add_parser("lora-trainer")
    for name in ("url", "meta", "token", "job", "model", "served", "compare", "seeds"):
        lt.add_argument(f"--{name}", required=True)
    lt.add_argument("--rank", type=int, required=True)
    lt.add_argument("--world", type=int, default=2)
    lt.add_argument("--lora-id", type=int, default=1)
    pd = sub.add_parser("pause-driver")
    for name in ("url", "meta", "token", "job", "model", "plan"):
        pd.add_argument(f"--{name}", required=True)
    args = parser.parse_args()
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("VLLM_HOST_IP", "127.0.0.1")
    if args.cmd == "trainer":
        trainer(args)
    elif args.cmd == "lora-trainer":
        lora_trainer(args)
    elif args.cmd == "pause-driver":
        pause_driver(args)
    elif args.cmd == "reference":
        reference(args.paths, args.tp, args.states)
    elif args.cmd == "mp-engine-delta":
        mp_engine_delta(args.checkpoint, args.seed)
    else:
        mp_engine(args.checkpoint, args.seeds.split(","))
    return 0


if __name__ == "__main__":
    sys.exit(main())
