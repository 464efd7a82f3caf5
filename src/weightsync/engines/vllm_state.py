"""What a vLLM engine serves, against a fresh engine on given weights: the oracle of a weight update.

A weight update is right when the engine holds exactly what a fresh engine started on the
same weights holds. This module reads both and names every tensor that differs:

* the *state* of an engine is every tensor its worker's model and MTP drafter reach
  (:func:`weightsync.tools.engine_state.tensor_state`: parameters, buffers, module attributes,
  tensors inside quant configs and closures), plus one *probe* per linear layer: what the
  layer's quant method computes on a fixed input (``<module>.<probe>``). vLLM's CPU build
  keeps linear weights inside oneDNN handles that no walk can read (the parameter itself is
  emptied), so a layer's output is the one way to compare its packed weights;
* the live engine is read where it runs: an ``LLM`` in this process by reference
  (:func:`engine_state`), any other engine through the ``"weightsync"`` backend's query on its
  workers (``collective_rpc("weight_transfer_engine", args=("engine_state",))``, the same for an
  ``LLM`` whose engine core is a child process and for ``vllm serve``'s dev route
  ``/collective_rpc``), as per-tensor digests;
* the fresh engine is started on the given checkpoint with the live engine's settings (dtype,
  MTP drafting) in a child process (:func:`fresh_state`), since one process holds one vLLM
  engine at a time.

    report = verify_engine(llm_or_url, "/ckpt/step-1200")   # a StateReport
    assert report.ok, report.describe()
    weightsync verify --engine http://rollout:8000 --checkpoint /ckpt/step-1200

``vllm`` is imported lazily, inside functions.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import urllib.error
import urllib.request
from collections.abc import Mapping
from dataclasses import asdict, dataclass
from typing import Any

import torch

from weightsync.engines.vllm import draft_model, runs_mtp
from weightsync.tools.engine_state import (
    StateReport,
    TensorDigest,
    compare_states,
    digest_state,
    state_from_wire,
    state_to_wire,
    tensor_state,
)

#: The query the ``"weightsync"`` backend answers on its workers (see :func:`backend_query`).
STATE_QUERY = "engine_state"
#: Rows of the fixed input each linear layer is probed with.
PROBE_ROWS = 3
_PREFIX = "WSENGINESTATE "


@dataclass(frozen=True, slots=True)
class EngineSettings:
    """What a fresh engine must share with the live one for their states to be comparable."""

    dtype: str
    mtp_tokens: int = 0  # MTP speculative tokens (0: the engine does not draft with MTP)
    #: what sizes the buffers some layers allocate for a batch
    max_model_len: int = 256
    max_num_seqs: int = 1
    #: the attention backends the live engine was started with, by name ("": vLLM chose), the
    #: target's and the MTP drafter's (vLLM chooses the drafter's apart). They decide which copies
    #: of the weights the engine keeps (AMX MLA packs ``W_UK`` in bf16 where the reference CPU
    #: MLA keeps it as loaded), so the fresh engine must be asked for the same
    attention_backend: str = ""
    mtp_attention_backend: str = ""

    @classmethod
    def of(cls, vllm_config: Any) -> EngineSettings:
        spec = vllm_config.speculative_config
        tokens = int(getattr(spec, "num_speculative_tokens", 0) or 0) if runs_mtp(vllm_config) else 0
        target = getattr(getattr(vllm_config, "attention_config", None), "backend", None)
        return cls(str(vllm_config.model_config.dtype).removeprefix("torch."), tokens,
                   int(vllm_config.model_config.max_model_len), int(vllm_config.scheduler_config.max_num_seqs),
                   _backend_name(target), _backend_name(getattr(spec, "attention_backend", None)) if tokens else "")

    def llm_kwargs(self) -> dict[str, Any]:
        out: dict[str, Any] = {"dtype": self.dtype, "max_model_len": self.max_model_len,
                               "max_num_seqs": self.max_num_seqs}
        if self.mtp_tokens:
            out["speculative_config"] = {"method": "mtp", "num_speculative_tokens": self.mtp_tokens}
            if self.mtp_attention_backend:
                out["speculative_config"]["attention_backend"] = self.mtp_attention_backend
        if self.attention_backend:
            out["attention_config"] = {"backend": self.attention_backend}
        return out


def _backend_name(backend: Any) -> str:
    """An attention backend as ``LLM`` options name it: its enum member's name ("" for vLLM's choice)."""
    return "" if backend is None else str(getattr(backend, "name", backend))


# -- worker side ---------------------------------------------------------------------------------------

def model_state(model: torch.nn.Module, drafter: torch.nn.Module | None = None, *, probes: bool = True,
                runtime: list[torch.Tensor] | tuple[torch.Tensor, ...] = ()) -> dict[str, torch.Tensor]:
    """The state of a vLLM model (and its MTP drafter, under ``drafter.``), by reference.

    ``runtime``: tensors the engine computes while it serves, not weights (the model runner's KV
    caches, which vLLM binds to every attention layer): tensors on their memory are left out.
    """
    roots = {"": model} if drafter is None else {"": model, "drafter": drafter}
    skip = {_storage(t) for t in runtime if isinstance(t, torch.Tensor)} - {None}
    state = {n: t for n, t in tensor_state(roots).items() if _storage(t) not in skip}
    if probes:
        for prefix, root in roots.items():
            state.update(linear_probes(root, prefix))
    return state


def linear_probes(model: torch.nn.Module, prefix: str = "") -> dict[str, torch.Tensor]:
    """Each linear layer's output on a fixed input (``<module>.<probe>``), from its own quant method.

    Layers whose ``quant_method.apply(layer, x)`` computes ``x @ W.T`` (vLLM's linear and
    embedding methods) are probed with ``PROBE_ROWS`` rows drawn from a fixed seed, in the
    layer's activation dtype: equal packed weights give equal outputs, bitwise. A layer whose
    weight the attention backend emptied after packing it elsewhere (AMX MLA's ``kv_b_proj``:
    ``W_UK`` and ``W_UV`` live on in the backend's packed copies, which the walk compares) is not
    probed: it computes nothing any more.
    """
    from vllm.model_executor.layers.linear import LinearMethodBase
    from vllm.model_executor.layers.vocab_parallel_embedding import UnquantizedEmbeddingMethod

    out: dict[str, torch.Tensor] = {}
    seen: set[int] = set()
    for path, module in model.named_modules():
        method = getattr(module, "quant_method", None)
        width = getattr(module, "input_size_per_partition", None) or getattr(module, "embedding_dim", None)
        if not isinstance(method, (LinearMethodBase, UnquantizedEmbeddingMethod)) or not width or id(module) in seen:
            continue
        weight = getattr(module, "weight", None)
        if isinstance(weight, torch.Tensor) and weight.numel() == 0:
            continue
        seen.add(id(module))
        dtype = getattr(module, "params_dtype", None) or torch.get_default_dtype()
        device = next((t.device for t in module.parameters()), torch.device("cpu"))
        gen = torch.Generator().manual_seed(int(width))
        x = torch.randn(PROBE_ROWS, int(width), generator=gen).to(dtype=dtype, device=device)
        with torch.no_grad():
            out[".".join(p for p in (prefix, path, "<probe>") if p)] = method.apply(module, x).detach().clone()
    return out


def _storage(t: torch.Tensor) -> int | None:
    return None if t.is_meta else int(t.untyped_storage().data_ptr())


def kv_caches(worker_or_runner: Any) -> list[torch.Tensor]:
    """A vLLM worker's KV caches (vLLM 0.32: ``model_runner.kv_caches``): runtime state, not weights."""
    runner = getattr(worker_or_runner, "model_runner", worker_or_runner)
    return [t for t in getattr(runner, "kv_caches", None) or () if isinstance(t, torch.Tensor)]


def worker_model_state(worker: Any, *, probes: bool = True) -> dict[str, torch.Tensor]:
    """The state of a vLLM worker's model and drafter, by reference (run it in the worker)."""
    runner = worker.model_runner
    return model_state(runner.get_model(), draft_model(runner), probes=probes, runtime=kv_caches(runner))


def backend_query(model: torch.nn.Module, drafter: torch.nn.Module | None, vllm_config: Any, query: str, *,
                  runtime: list[torch.Tensor] | tuple[torch.Tensor, ...] = ()) -> dict[str, Any]:
    """What the ``"weightsync"`` backend answers to ``query`` (a name) on its worker: JSON-able.

    ``engine_state``: ``{"settings": EngineSettings, "tensors": {name: [shape, dtype, digest]}}``;
    ``runtime``: the worker's KV caches (see :func:`model_state`).
    """
    if query != STATE_QUERY:
        raise ValueError(f"the weightsync backend answers the query {STATE_QUERY!r}, not {query!r}")
    return _digests(model_state(model, drafter, runtime=runtime), vllm_config)


def _digests(state: Mapping[str, torch.Tensor], vllm_config: Any) -> dict[str, Any]:
    """A worker's settings and state as digests: what crosses to a reader in another process."""
    return {"settings": asdict(EngineSettings.of(vllm_config)), "tensors": state_to_wire(digest_state(state))}


def _in_process_state(worker: Any) -> dict[str, Any]:
    state = {n: t.detach().clone() for n, t in worker_model_state(worker).items()}
    return {"settings": asdict(EngineSettings.of(worker.vllm_config)), "tensors": state}


def _worker_digests(worker: Any) -> dict[str, Any]:
    """A worker's state as digests, for a worker of an ``LLM`` in this process that runs in a process
    of its own (TP workers): no tensor leaves the worker."""
    return _digests(worker_model_state(worker), worker.vllm_config)


# -- reading engines ----------------------------------------------------------------------------------

LiveState = tuple[EngineSettings, Mapping[str, "torch.Tensor | TensorDigest"]]


def engine_state(live: Any, *, timeout: float = 300.0) -> LiveState:
    """The settings and state of a live engine of one worker: an ``LLM`` or the URL of ``vllm serve``.

    An ``LLM`` whose engine core runs in this process is read by reference (copies of its
    tensors); any other engine through the ``"weightsync"`` backend on its workers, as digests
    (``vllm serve`` needs ``VLLM_SERVER_DEV_MODE=1`` for its ``/collective_rpc`` route).

    Raises:
        ValueError: the engine cannot be read (no weightsync backend), or it has several workers
            (:func:`engine_states` reads those).
    """
    states = engine_states(live, timeout=timeout)
    if len(states) != 1:
        raise ValueError(f"expected one worker's state, got {len(states)}: engine_state reads engines of one worker "
                         "(TP=PP=1); engine_states reads each worker of a sharded one")
    return states[0]


def engine_states(live: Any, *, timeout: float = 300.0) -> list[LiveState]:
    """Each worker's settings and state, in the order vLLM lists its workers (their ranks): what a
    sharded engine holds is compared worker by worker with a fresh engine of the same parallelism.

    An ``LLM`` whose engine core runs in this process answers for the workers it drives: a
    worker in this process by reference, workers in processes of their own (its TP workers) as
    digests; an ``LLM`` that is one rank of an ``external_launcher`` job answers for its own
    worker. Any other engine answers through the ``"weightsync"`` backend, as :func:`engine_state`.
    """
    if isinstance(live, str):
        answers = _post(live.rstrip("/") + "/collective_rpc",
                        {"method": "weight_transfer_engine", "args": [STATE_QUERY]}, timeout)["results"]
    elif type(live.llm_engine.engine_core).__name__ == "InprocClient":
        parallel = live.llm_engine.vllm_config.parallel_config
        here = parallel.world_size == 1 or parallel.distributed_executor_backend == "external_launcher"
        answers = live.collective_rpc(_in_process_state if here else _worker_digests)
    else:
        answers = live.collective_rpc("weight_transfer_engine", args=(STATE_QUERY,))
    if not answers or not all(isinstance(a, Mapping) for a in answers):
        raise ValueError(f"expected each worker's state, got {answers!r:.200}")
    states: list[LiveState] = []
    for answer in answers:
        tensors = answer["tensors"]
        if tensors and not isinstance(next(iter(tensors.values())), torch.Tensor):
            tensors = state_from_wire(tensors)
        states.append((EngineSettings(**answer["settings"]), tensors))
    return states


def _post(url: str, body: Mapping[str, Any], timeout: float) -> Any:
    request = urllib.request.Request(url, data=json.dumps(body).encode(), method="POST",
                                     headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=timeout) as answer:
            return json.loads(answer.read())
    except urllib.error.HTTPError as exc:
        detail = exc.read().decode(errors="replace")[:500]
        if exc.code == 404:
            raise ValueError(f"{url}: no such route; start vllm serve with VLLM_SERVER_DEV_MODE=1 (its dev routes) "
                             "and --weight-transfer-config '{\"backend\": \"weightsync\"}'") from exc
        raise ValueError(f"{url} answered {exc.code}: {detail}") from exc


def fresh_state(checkpoint: str | os.PathLike[str], settings: EngineSettings, *, in_process: bool = False,
                timeout: float = 600.0) -> dict[str, TensorDigest] | dict[str, torch.Tensor]:
    """The state of a fresh engine started on ``checkpoint`` with ``settings``.

    By default the engine runs in a child process (``python -m weightsync.engines.vllm_state``),
    which prints the state's digests: a process holds one vLLM engine at a time. ``in_process``
    starts it here instead and returns its tensors (no other engine may live in this process).
    """
    if in_process:
        return _fresh_here(os.fspath(checkpoint), settings)[1]
    cmd = [sys.executable, "-m", "weightsync.engines.vllm_state", os.fspath(checkpoint), json.dumps(asdict(settings))]
    env = {**os.environ, "VLLM_ENABLE_V1_MULTIPROCESSING": "0", "HF_HUB_OFFLINE": "1",
           "VLLM_HOST_IP": os.environ.get("VLLM_HOST_IP", "127.0.0.1")}
    proc = subprocess.run(cmd, env=env, text=True, capture_output=True, timeout=timeout, check=False)
    lines = [line[len(_PREFIX):] for line in proc.stdout.splitlines() if line.startswith(_PREFIX)]
    if proc.returncode != 0 or not lines:
        tail = " | ".join(proc.stderr.strip().splitlines()[-4:])
        raise RuntimeError(f"the fresh engine on {checkpoint} failed (exit {proc.returncode}): {tail}"[:1500])
    return state_from_wire(json.loads(lines[-1]))


def _fresh_here(checkpoint: str, settings: EngineSettings) -> tuple[EngineSettings, dict[str, torch.Tensor]]:
    from vllm import LLM

    from weightsync.engines.process_state import preserved_process_state

    with preserved_process_state():
        os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
        llm = LLM(model=checkpoint, enforce_eager=True, seed=0, kv_cache_memory_bytes=32 << 20,
                  skip_tokenizer_init=True, **settings.llm_kwargs())
        try:
            got, state = engine_state(llm)
        finally:
            llm.llm_engine.engine_core.shutdown()
    return got, dict(state)  # type: ignore[arg-type]


def verify_engine(live: Any, checkpoint: str | os.PathLike[str], *, timeout: float = 600.0) -> StateReport:
    """Compare a live engine (an ``LLM`` or a ``vllm serve`` URL) with a fresh engine on ``checkpoint``.

    Returns:
        A :class:`~weightsync.tools.engine_state.StateReport` naming every tensor that differs.
    """
    settings, state = engine_state(live, timeout=timeout)
    return compare_states(state, fresh_state(checkpoint, settings, timeout=timeout))


def _main(argv: list[str]) -> int:
    """A fresh engine's state, printed as one JSON line after ``_PREFIX`` (what :func:`fresh_state` runs)."""
    checkpoint, settings = argv[0], EngineSettings(**json.loads(argv[1]))
    _, state = _fresh_here(checkpoint, settings)
    print(_PREFIX + json.dumps(state_to_wire(digest_state(state))), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(_main(sys.argv[1:]))


__all__ = ["STATE_QUERY", "EngineSettings", "backend_query", "engine_state", "fresh_state", "linear_probes",
           "model_state", "verify_engine"]
