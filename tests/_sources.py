"""Helpers of the training-source tests: forked gloo ranks, a tiny model, the checks every adapter meets.

``run_ranks(fn, world, *args)`` forks ``world`` processes from the test process, so the
frameworks the test module imported once (torch.distributed, transformers, deepspeed,
megatron) are not imported again per rank. Each rank joins a gloo group on a free port,
runs ``fn(rank, world, *args)`` and sends back its (picklable) result; the first failure
or a timeout kills every rank and fails the test with the rank's traceback.
"""

from __future__ import annotations

import datetime
import os
import pickle
import queue
import socket
import time
import traceback
import warnings
from collections.abc import Callable, Collection, Mapping
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _rank_main(fn: Callable[..., Any], rank: int, world: int, port: int, results: Any, args: tuple) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank),
                      WORLD_SIZE=str(world), LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(world))
    torch.set_num_threads(1)
    try:
        dist.init_process_group("gloo", rank=rank, world_size=world, timeout=datetime.timedelta(seconds=60))
        results.put((rank, None, pickle.dumps(fn(rank, world, *args))))
    except BaseException:
        results.put((rank, traceback.format_exc(), None))
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def run_ranks(fn: Callable[..., Any], world: int, *args: Any, timeout: float = 120.0,
              alongside: Callable[[], Any] | None = None) -> list[Any]:
    """Results of ``fn(rank, world, *args)`` on ``world`` forked gloo ranks, by rank.

    ``alongside`` runs in this process once the ranks are forked (a reader of what they write:
    no thread of it exists at the fork); its result is appended to the ranks'.
    """
    ctx = mp.get_context("fork")
    results = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=_rank_main, args=(fn, r, world, port, results, args), daemon=True)
             for r in range(world)]
    out: dict[int, Any] = {}
    deadline = time.monotonic() + timeout
    try:
        with warnings.catch_warnings():  # the parent's helper threads never touch torch
            warnings.simplefilter("ignore", DeprecationWarning)
            for p in procs:
                p.start()
        extra = []
        if alongside is not None:
            try:
                extra.append(alongside())
            except BaseException:  # a rank that failed first is the cause: report it
                while True:
                    try:
                        rank, error, _ = results.get(timeout=5)
                    except queue.Empty:
                        raise
                    if error is not None:
                        raise AssertionError(f"rank {rank} failed:\n{error}") from None
        while len(out) < world:
            try:
                rank, error, payload = results.get(timeout=max(0.1, deadline - time.monotonic()))
            except queue.Empty:
                raise TimeoutError(f"ranks {sorted(set(range(world)) - set(out))} did not finish in {timeout} s") from None
            if error is not None:
                raise AssertionError(f"rank {rank} failed:\n{error}")
            out[rank] = pickle.loads(payload)
        for p in procs:
            p.join(timeout=max(1.0, deadline - time.monotonic()))
    finally:
        for p in procs:
            if p.is_alive():
                p.kill()
                p.join(timeout=10)
        results.close()
    return [out[r] for r in range(world)] + extra


def check_source(source: Any, canonical: Mapping[str, torch.Tensor], live: Mapping[str, torch.Tensor],
                 staged: Collection[str] = ()) -> list:
    """The assertions every training source meets on one rank; returns its (name, box) list.

    * every region of ``source.layout()``, read from ``source.tensors()``, equals the box
      of the full canonical tensor, bit for bit;
    * ``tensors()`` are the live parameter storage (``live``: shard name -> the tensor the
      framework updates), not copies, contiguous, with the layout's shapes and dtypes; except the
      ``staged`` ones, which the source sends as a copy in another order (gpt-oss experts' fc1 in Megatron).
    """
    layout = source.layout()
    tensors = source.tensors()
    assert set(tensors) == {s.name for s in layout.shards} == set(live)
    held = []
    for shard in layout.shards:
        t = tensors[shard.name]
        assert (t.data_ptr() == live[shard.name].data_ptr()) != (shard.name in staged), \
            f"{shard.name} is {'not ' * (shard.name not in staged)}the live tensor"
        assert t.is_contiguous() and tuple(t.shape) == shard.shape, shard.name
        assert str(t.dtype) == f"torch.{shard.dtype}", shard.name
        flat = t.reshape(-1)
        for region in shard.regions:
            got = flat.as_strided(region.box.sizes, region.strides, flat.storage_offset() + region.offset)
            want = canonical[region.canonical][region.box.slices()]
            assert torch.equal(got, want), f"{shard.name}: {region.canonical} {region.box} differs"
            held.append((region.canonical, region.box))
    return held


def assert_covered(held_by_rank: list[list], shapes: Mapping[str, tuple[int, ...]]) -> None:
    """Every element of every canonical tensor is held by some rank."""
    count = {name: np.zeros(shape, dtype=np.int32) for name, shape in shapes.items()}
    for held in held_by_rank:
        for name, box in held:
            count[name][box.slices()] += 1
    missing = [name for name, c in count.items() if (c == 0).any()]
    assert not missing, f"no rank holds (all of) {missing[:5]}"


def hf_canonical(state: Mapping[str, torch.Tensor], spec: Any) -> dict[str, torch.Tensor]:
    """A transformers 5 state dict in checkpoint (canonical) form, written out by hand:
    ``experts.gate_up_proj [E, 2I, H]`` is ``[gate; up]`` along dim 1, ``experts.down_proj``
    the down stack (what transformers' checkpoint conversion merges)."""
    out = {}
    for name, t in state.items():
        if name.endswith("mlp.experts.gate_up_proj"):
            layer = int(name.split(".")[2])
            gate, up = t.chunk(2, dim=1)
            out[spec.name("expert_gate", layer)] = gate
            out[spec.name("expert_up", layer)] = up
        elif name.endswith("mlp.experts.down_proj"):
            out[spec.name("expert_down", int(name.split(".")[2]))] = t
        else:
            out[name] = t
    assert set(out) == set(spec.canonical_tensors()), set(out) ^ set(spec.canonical_tensors())
    return out


#: A tiny transformers Qwen3-MoE: layer 0 dense, layer 1 with 3 fused experts; odd vocabulary
#: and hidden sizes, so 2 ranks split them unevenly (and ZeRO-3 pads).
HF = {
    "architectures": ["Qwen3MoeForCausalLM"], "model_type": "qwen3_moe", "vocab_size": 101,
    "hidden_size": 31, "intermediate_size": 48, "moe_intermediate_size": 12, "num_hidden_layers": 2,
    "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 8, "num_experts": 3,
    "num_experts_per_tok": 2, "mlp_only_layers": [0], "decoder_sparse_step": 1,
    "tie_word_embeddings": False, "torch_dtype": "float32",
}


def tiny_model(config: dict) -> torch.nn.Module:
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    torch.manual_seed(0)  # the same weights on every rank
    fields = {k: v for k, v in config.items() if k not in ("architectures", "model_type")}
    return Qwen3MoeForCausalLM(Qwen3MoeConfig(**fields, experts_implementation="eager"))  # any hidden size


def module_with(shapes: dict) -> torch.nn.Module:
    """A plain module whose parameters have the given dotted names and shapes."""
    root = torch.nn.Module()
    for name, shape in shapes.items():
        *path, leaf = name.split(".")
        module = root
        for part in path:
            if not hasattr(module, part):
                module.add_module(part, torch.nn.Module())
            module = getattr(module, part)
        module.register_parameter(leaf, torch.nn.Parameter(torch.zeros(shape)))
    return root
