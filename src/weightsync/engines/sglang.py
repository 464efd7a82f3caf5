"""SGLang as a weightsync reader: staged checkpoint tensors handed to SGLang's update APIs.

SGLang keeps its weights in its scheduler processes (one per TP rank) and takes updates as
Hugging Face names with full tensors, which every TP rank shards itself. The reader
receives a version into staging buffers (:mod:`weightsync.engines.staging`, on the GPU),
then hands them over through one of SGLang's two public APIs:

* ``mode="tensor"``: ``update_weights_from_tensor``, for an ``sglang.Engine`` in this
  process. The staged CUDA tensors reach the schedulers as CUDA IPC handles: no copy
  before SGLang's own loader runs.
* ``mode="distributed"``: ``update_weights_from_distributed``, for an ``sglang.Engine`` or
  a server (:class:`SGLangHTTP`). The reader joins a NCCL group with the engine's TP ranks
  (``init_weights_update_group``, once) and broadcasts the staged tensors while the engine
  receives them, in buckets of at most ``bucket_bytes`` (SGLang allocates a receive
  tensor for every name of a request on every TP rank).

    engine = sglang.Engine(model_path=path)
    adapter = SGLangEngine(engine, config)                 # config: the HF config dict
    with WeightReader(adapter, rank=0, config=sync) as reader:
        reader.update()

    server = SGLangHTTP("http://10.0.0.5:30000")
    adapter = SGLangEngine(server, config, mode="distributed", tp_size=4, master_address="10.0.0.7")

SGLang's KV cache is flushed by the update call itself (``flush_cache=True`` on the last
request). ``sglang`` is imported only here, lazily; needs a CUDA GPU.

A version touches SGLang only when its update call starts (nothing is received in place): a
transfer that fails leaves SGLang at its version; an update call that fails (SGLang refused it,
a bucket broke off) leaves it invalid, its weight version ``invalid:<version>`` where it can be
set, until a later version is loaded.
"""

from __future__ import annotations

import concurrent.futures
import logging
import socket
from collections.abc import Mapping, Sequence
from typing import Any, Literal

import torch

from weightsync.engines.staging import StagedWeights, invalid_stamp
from weightsync.layout import ModelSpec
from weightsync.tools.devices import resolve_device, sglang_staging_device
from weightsync.tools.torch_layout import dtype_name

logger = logging.getLogger(__name__)

Mode = Literal["tensor", "distributed"]


class SGLangEngine(StagedWeights):
    """An SGLang engine (``sglang.Engine`` or :class:`SGLangHTTP`) as an :class:`InferenceEngine`.

    Args:
        engine: the SGLang engine; ``mode="tensor"`` needs an in-process ``sglang.Engine``.
        config: the model's Hugging Face config (dict) or its :class:`ModelSpec`.
        dtype / device: of the staging buffers (the engine's dtype; a GPU of this process).
            ``mode="distributed"``: never one of the engine's TP GPUs (NCCL refuses two ranks
            of the update group on one GPU); by default the first GPU outside them.
        tp_size: the engine's tensor-parallel size (``mode="distributed"``: the group's size).
        engine_gpus: the GPU indices of the engine's TP ranks on this host (default: read from
            an in-process engine's ``server_args``, else ``0..tp_size-1``, SGLang's default);
            empty for an engine on another host.
        master_address: an address of this host the engine's TP ranks can reach.
        bucket_bytes: bound on one ``update_weights_from_distributed`` request.
        timeout: seconds to wait for SGLang on each call.
    """

    def __init__(self, engine: Any, config: Mapping[str, Any] | ModelSpec, *, mode: Mode = "tensor", rank: int = 0,
                 replicas: int | None = None, dtype: torch.dtype = torch.bfloat16, device: str | None = None,
                 tp_size: int = 1, master_address: str = "127.0.0.1", group_name: str = "weightsync",
                 bucket_bytes: int = 1 << 30, timeout: float = 600.0,
                 engine_gpus: Sequence[int] | None = None) -> None:
        if mode not in ("tensor", "distributed"):
            raise ValueError(f"mode must be 'tensor' or 'distributed', got {mode!r}")
        if bucket_bytes <= 0 or tp_size < 1:
            raise ValueError(f"bucket_bytes and tp_size must be positive, got {bucket_bytes} and {tp_size}")
        spec = config if isinstance(config, ModelSpec) else ModelSpec.from_hf_config(config)
        if mode == "distributed":
            gpus = list(engine_gpus) if engine_gpus is not None else _engine_gpus(engine, tp_size)
            device = sglang_staging_device(device, engine_gpus=gpus, visible_gpus=torch.cuda.device_count())
        else:
            current = torch.cuda.current_device() if torch.cuda.is_available() else None
            device = resolve_device(device or "cuda", current_cuda_index=current)
        super().__init__(spec, dtype=dtype, device=device, rank=rank, replicas=replicas)
        self.engine = engine
        self.mode = mode
        self.tp_size = tp_size
        self.master_address = master_address
        self.group_name = group_name
        self.bucket_bytes = bucket_bytes
        self.timeout = timeout
        self._group: Any = None
        # staged now: a model that does not fit next to SGLang is refused here, with its figure
        self.lay_out()
        self._pool = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="weightsync-sglang")

    #: SGLang takes a version in one update call (its cache is flushed with it): whole-model staging.
    loads_in_phases = False

    def _load_items(self, items: list[tuple[str, torch.Tensor]]) -> None:
        if self.mode == "tensor":
            _check(self.engine.update_weights_from_tensor(named_tensors=items, flush_cache=True), "update")
        else:
            self._broadcast(items)

    def _end(self, version: int, *, failed: bool = False) -> None:
        # Not every SGLang release can set the version through its Python Engine; servers can.
        set_version = getattr(self.engine, "update_weight_version", None)
        if set_version is not None and not failed:
            set_version(str(version))

    def _invalidate(self, version: int) -> None:
        # SGLang loaded part of the version (or a bucket of it): its outputs say so from now on.
        set_version = getattr(self.engine, "update_weight_version", None)
        if set_version is not None:
            set_version(invalid_stamp(version))

    # -- mode="distributed" ---------------------------------------------------------------------
    def _broadcast(self, items: list[tuple[str, torch.Tensor]]) -> None:
        group = self._ensure_group()
        buckets: list[list[tuple[str, torch.Tensor]]] = [[]]
        size = 0
        for name, tensor in items:
            nbytes = tensor.numel() * tensor.element_size()
            if buckets[-1] and size + nbytes > self.bucket_bytes:
                buckets.append([])
                size = 0
            buckets[-1].append((name, tensor))
            size += nbytes
        for i, bucket in enumerate(buckets):
            request = self._pool.submit(
                self.engine.update_weights_from_distributed, names=[n for n, _ in bucket],
                dtypes=[dtype_name(t.dtype) for _, t in bucket], shapes=[list(t.shape) for _, t in bucket],
                group_name=self.group_name, flush_cache=i == len(buckets) - 1)
            for _, tensor in bucket:  # SGLang posts one receive per name, in request order
                torch.distributed.broadcast(tensor, src=0, group=group)
            _check(request.result(timeout=self.timeout), "update")

    def _ensure_group(self) -> Any:
        if self._group is None:
            from sglang.srt.utils import init_custom_process_group

            with socket.socket() as sock:
                sock.bind((self.master_address, 0))
                port = sock.getsockname()[1]
            # Both sides block in the rendezvous: the engine joins from the pool thread.
            joined = self._pool.submit(self.engine.init_weights_update_group, master_address=self.master_address,
                                       master_port=port, rank_offset=1, world_size=self.tp_size + 1,
                                       group_name=self.group_name, backend="nccl")
            self._group = init_custom_process_group(backend="nccl", init_method=f"tcp://{self.master_address}:{port}",
                                                    world_size=self.tp_size + 1, rank=0, group_name=self.group_name)
            _check(joined.result(timeout=self.timeout), "init_weights_update_group")
        return self._group

    def close(self) -> None:
        try:
            if self._group is not None:
                group, self._group = self._group, None
                _check(self.engine.destroy_weights_update_group(group_name=self.group_name),
                       "destroy_weights_update_group")
                torch.distributed.destroy_process_group(group)
        finally:
            self._pool.shutdown(wait=False)

    def __enter__(self) -> SGLangEngine:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()


def _engine_gpus(engine: Any, tp_size: int) -> list[int]:
    """The GPUs of an SGLang engine's TP ranks: ``base_gpu_id + i * gpu_id_step`` (its defaults 0 and 1)."""
    args = getattr(engine, "server_args", None)
    base = int(getattr(args, "base_gpu_id", 0) or 0)
    step = int(getattr(args, "gpu_id_step", 1) or 1)
    return [base + i * step for i in range(tp_size)]


def _check(result: Any, what: str) -> None:
    """SGLang answers ``(success, message)`` (Engine) or ``{"success": ..., "message": ...}`` (HTTP)."""
    if isinstance(result, Mapping):
        success, message = result.get("success", False), result.get("message", "")
    elif isinstance(result, tuple) and len(result) >= 2:
        success, message = result[0], result[1]
    else:
        return  # releases that answer nothing raise on failure instead
    if not success:
        raise RuntimeError(f"SGLang {what} failed: {message}")


class SGLangHTTP:
    """An SGLang server's weight-update routes, with ``sglang.Engine``'s method names."""

    def __init__(self, url: str, *, api_key: str | None = None, timeout: float = 600.0) -> None:
        import httpx

        headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self._client = httpx.Client(base_url=url.rstrip("/"), headers=headers, timeout=timeout)

    def _post(self, route: str, payload: Mapping[str, Any]) -> dict[str, Any]:
        response = self._client.post(route, json=dict(payload))
        body = response.json() if response.content else {}
        if response.status_code >= 400 and "success" not in body:
            body = {"success": False, "message": f"HTTP {response.status_code}: {response.text[:500]}"}
        return body if isinstance(body, dict) else {"success": True, "message": str(body)}

    def init_weights_update_group(self, **request: Any) -> dict[str, Any]:
        return self._post("/init_weights_update_group", request)

    def destroy_weights_update_group(self, **request: Any) -> dict[str, Any]:
        return self._post("/destroy_weights_update_group", request)

    def update_weights_from_distributed(self, **request: Any) -> dict[str, Any]:
        return self._post("/update_weights_from_distributed", request)

    def update_weight_version(self, new_version: str) -> None:
        _check(self._post("/update_weight_version", {"new_version": new_version}), "update_weight_version")

    def close(self) -> None:
        self._client.close()
