"""vLLM's expert placement (EPLB) as plain data for the core: ``EplbState`` -> :class:`Placement`.

vLLM 0.32 keeps one ``EplbModelState`` per model in ``EplbState.model_states`` (keyed by the
model config's hash; the target model, and an MTP drafter's MoE part when EPLB covers it), each
with ``physical_to_logical_map`` ``[moe_layers, physical]`` on the worker's device. This module
reads them on the worker, where the state lives, and hands the core a
:class:`~weightsync.layout.eplb.Placement` (numpy, no torch): the drafter's rows follow the
target's, as its MoE layers follow the target's layers. ``vllm`` is never imported here: the
state objects are the worker's own.

    placement = placement_of(worker.model_runner.eplb_state, vllm_config)
    digest = register(placement)      # the reader's layout: f"vllm:tp=..,ep=..,eplb={digest}"

A placement, and a reader's layout with it, changes whenever vLLM rebalances: a reader reads it
before each version (:meth:`weightsync.roles.reader.WeightReader.update` re-registers a layout that
changed, and the job re-plans it).
"""

from __future__ import annotations

from typing import Any

import numpy as np

from weightsync.layout.eplb import Placement


def _state(eplb_state: Any, model_config: Any) -> Any:
    key = model_config.compute_hash()
    found = eplb_state.model_states.get(key)
    if found is None:
        raise ValueError(f"vLLM's EPLB state has no model {getattr(model_config, 'model', key)!r} "
                         f"(it balances {sorted(eplb_state.model_states)})")
    return found


def placement_of(eplb_state: Any, vllm_config: Any) -> Placement:
    """The current placement of a worker's ``EplbState`` (vLLM 0.32): the target model's maps,
    then the MTP drafter's when EPLB balances it too.

    Raises:
        ValueError: the state does not hold the target model.
    """
    target = _state(eplb_state, vllm_config.model_config)
    maps = [np.asarray(target.physical_to_logical_map.cpu(), dtype=np.int64)]
    spec = getattr(vllm_config, "speculative_config", None)
    draft = getattr(spec, "draft_model_config", None) if spec is not None else None
    if draft is not None and draft.compute_hash() in eplb_state.model_states:
        drafter = eplb_state.model_states[draft.compute_hash()]
        maps.append(np.asarray(drafter.physical_to_logical_map.cpu(), dtype=np.int64))
    return Placement(int(target.model.num_logical_experts), np.concatenate(maps, axis=0))


def placement_of_worker(worker: Any) -> Placement | None:
    """The placement of a vLLM worker's model runner (None: EPLB is off)."""
    runner = getattr(worker, "model_runner", worker)
    state = getattr(runner, "eplb_state", None)
    if state is None:
        return None
    return placement_of(state, runner.vllm_config)


__all__ = ["placement_of", "placement_of_worker"]
