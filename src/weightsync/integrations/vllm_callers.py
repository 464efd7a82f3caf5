"""vLLM objects a worker-side backend finds up its call stack, where vLLM 0.32 hands it no
reference: the worker creating it (:func:`_creator`), the worker hosting it
(:func:`_hosting_worker`), and the engine core whose ``collective_rpc`` runs it
(:func:`_calling_engine_core`). Each returns None when the stack does not hold one.
"""

from __future__ import annotations

import sys
from types import FrameType
from typing import Any

import torch


def _creator(model: torch.nn.Module) -> Any:
    """The vLLM worker creating this backend for ``model``; None if not found.

    vLLM gives a weight-transfer engine its drafter only inside a draft session, which its
    trainer-side client protocol (``VLLMWeightSyncClient``: four calls) cannot open. The worker
    builds the engine in ``Worker.load_model`` (vLLM 0.32, ``WeightTransferEngineFactory.create_engine``)
    once its model runner holds the drafter: the caller whose ``get_model()`` is ``model`` is that
    worker, its ``get_draft_model()`` the drafter vLLM's draft session would hand over, and its
    model runner the holder of the KV caches (which the engine-state oracle leaves out).
    """
    frame: FrameType | None = sys._getframe(1)
    for _ in range(12):
        if frame is None:
            break
        owner = frame.f_locals.get("self")
        get_model, get_draft = getattr(owner, "get_model", None), getattr(owner, "get_draft_model", None)
        if callable(get_model) and callable(get_draft):
            try:
                if get_model() is model:
                    return owner
            except Exception:  # another object with these names: keep looking
                pass
        frame = frame.f_back
    return None


def _hosting_worker(start: FrameType | None, engine: Any) -> Any:
    """The vLLM worker whose ``weight_transfer_engine`` is ``engine``: a caller of its
    ``init_transfer_engine`` (vLLM 0.32: ``Worker.init_weight_transfer_engine``); None if not found."""
    frame = start
    for _ in range(6):
        if frame is None:
            break
        owner = frame.f_locals.get("self")
        if getattr(owner, "weight_transfer_engine", None) is engine:
            return owner
        frame = frame.f_back
    return None


def _calling_engine_core(start: FrameType | None) -> Any:
    """vLLM's engine core whose call (a ``collective_rpc``) runs this worker code; None if none.

    The core holds the weight version stamped on every output (vLLM 0.32: ``EngineCore``, with
    ``set_weight_version``), and a worker has no reference to it. An engine of one worker runs
    it in the core's own process (vLLM's ``uni`` executor: an ``LLM`` in or out of process, ``vllm
    serve`` with TP=PP=DP=1), so the core is a caller on this thread's stack. Executors that run
    workers in their own processes (``mp``, ``ray``) leave it unreachable.
    """
    frame = start
    for _ in range(16):
        if frame is None:
            break
        owner = frame.f_locals.get("self")
        if all(callable(getattr(owner, name, None)) for name in ("set_weight_version", "get_weight_version",
                                                                 "collective_rpc")):
            return owner
        frame = frame.f_back
    return None
