"""The verl actor's persistent copy of the model, taken within the device's free memory.

verl hands the actor a generator of full (gathered) tensors that it may free after each
yield, and weightsync's writer sends a version after all of them are staged, so actor
rank 0 keeps one copy of the model (on the trainer's GPU by default). That copy is taken
here, tensor by tensor, each allocation checked against the device's free memory
(:mod:`weightsync.ports.device`): a model that does not fit is refused with the figure and
the setting to change, never an out-of-memory error, and before the writer sends a byte.

The generator is walked to its end even then, since producing a tensor is collective over
the actor group (the other actor ranks are walking it too)::

    buffers = await copy_model(_aiter(weights), device="cuda")   # raises DeviceMemoryError
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable

import torch

from weightsync.ports import device as device_port

#: What to change when the copy does not fit (``engine_kwargs.weightsync`` of verl's config).
FIX = ("stage on the host instead: actor_rollout_ref.rollout.checkpoint_engine.engine_kwargs.weightsync.device=cpu "
       "(every worker of the job, actor and rollout, stages on one kind of device)")


async def copy_model(weights: AsyncIterator[tuple[str, torch.Tensor]], *, device: str,
                     keep: Callable[[str, torch.Tensor], bool] = lambda name, t: True) -> dict[str, torch.Tensor]:
    """A contiguous copy of every tensor ``weights`` yields that ``keep`` accepts, on ``device``
    (``keep`` sees every tensor, in order).

    Raises:
        DeviceMemoryError: the copy does not fit; the message gives the model's size (every
            tensor was walked), what was free when it stopped fitting, and :data:`FIX`.
    """
    port = device_port.current()
    buffers: dict[str, torch.Tensor] = {}
    total = 0
    failed: device_port.DeviceMemoryError | None = None
    async for name, t in weights:
        total += t.numel() * t.element_size()
        if failed is not None or not keep(name, t):
            continue  # keep walking: the other actor ranks produce these tensors with us
        try:
            buffers[name] = _copy(port, name, t, device)
        except device_port.DeviceMemoryError as exc:
            failed, buffers = exc, {}  # what was copied is freed now
    if failed is not None:
        free = port.free_bytes(device)
        raise device_port.DeviceMemoryError(
            f"the verl actor's copy of the model needs {device_port.gib(total)} on {device}, and only "
            f"{device_port.gib(free or 0)} of it is free: {FIX}") from failed
    return buffers


def _copy(port: device_port.DevicePort, name: str, t: torch.Tensor, device: str) -> torch.Tensor:
    """One tensor's copy on ``device``, allocated through the port (within its free memory)."""
    raw = device_port.allocate(port, t.numel() * t.element_size(), device, what=f"the actor's copy of {name}",
                               fix=FIX)
    copy = raw.view(t.dtype).view(t.shape)
    copy.copy_(t.detach())
    return copy
