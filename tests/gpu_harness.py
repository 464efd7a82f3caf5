"""Run a transport's writer and reader ranks in threads of this process, each as its own simulated
process of the CPU device model (``tests/device_model.py``), so that its GPU path runs on CPU.

    result = run_pair("shm", tmp_path, model=DeviceModel(), processes=("trainer", "engine"))
    assert result.errors == [] and result.bad == []

Every version a reader receives is compared byte for byte with the writers' values.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from fake_meta import DirectoryMeta
from weightsync.clock.deadline import Deadline
from weightsync.configs import load_spec
from weightsync.job.channel import JobChannel
from weightsync.layout import parse_layout
from weightsync.plan import build_local_plan, layer_phases, split_plan
from weightsync.plan.reference import cut_shards, empty_shards, random_canonical
from weightsync.ports import device as device_port
from weightsync.tools.torch_layout import TORCH_DTYPES
from weightsync.transport import TransportContext, TransportOptions, create_transport


def as_tensors(arrays: dict[str, Any], layout: Any) -> dict[str, torch.Tensor]:
    dtypes = {s.name: s.dtype for s in layout.shards}
    return {n: torch.from_numpy(a).view(TORCH_DTYPES[dtypes[n]]) for n, a in arrays.items()}


@dataclass
class PairResult:
    errors: list[BaseException] = field(default_factory=list)
    bad: list[tuple[int, int, str]] = field(default_factory=list)  # (reader, version, tensor)
    received: list[tuple[int, int]] = field(default_factory=list)  # (reader, version)
    used: list[int] = field(default_factory=list)  # the model's device memory in use after each version


def run_pair(transport: str, tmp_path: Any, *, model: Any, processes: tuple[str, str] | None = ("trainer", "engine"),
             source: str = "megatron:tp=1", target: str = "vllm:tp=1", config: str = "tiny-qwen3",
             versions: tuple[int, ...] = (1, 2), phase_bytes: int | None = None,
             options: TransportOptions | None = None, timeout: float = 20.0,
             reader_tensors: Callable[[Any], dict[str, torch.Tensor]] | None = None,
             before_receive: Callable[[int, int, dict[str, torch.Tensor]], None] | None = None,
             lockstep: bool = False, epoch_of: Callable[[int], int] = lambda version: 0,
             reattach: bool = False) -> PairResult:
    """One writer and the readers of ``target``, in threads; ``processes``: the simulated process of
    the writer and of every reader (None: all in this process, like an in-process trainer and engine).

    ``before_receive(version, phase, tensors)`` runs on the reader before each receive (to queue
    the engine's work on its tensors, say). ``lockstep``: every rank finishes phase ``p`` before
    any sends phase ``p + 1``, as when a rank's other route (the routed transport's NCCL) blocks
    per phase. ``epoch_of(version)``: the transport epoch each version runs in (every rank
    prepares again when it changes); ``reattach``: readers prepare again before every version
    within its epoch too (as when an engine's buffers moved).
    """
    spec = load_spec(config)
    writers = parse_layout(source).all_rank_layouts(spec)
    readers = parse_layout(target).all_rank_layouts(spec)
    canonical = writers[0].canonical
    names = layer_phases(canonical, budget_bytes=phase_bytes) if phase_bytes else None
    opts = options or TransportOptions(max_bucket_bytes=1 << 16, direct_min_bytes=1024)
    barrier = threading.Barrier(len(writers) + len(readers))
    result = PairResult()

    def ctx(role: str, rank: int) -> TransportContext:
        return TransportContext(channel=JobChannel(DirectoryMeta(str(tmp_path)), role=role, rank=rank),  # type: ignore[arg-type]
                                num_writers=len(writers), num_readers=len(readers), options=opts)

    def rank_main(role: str, rank: int) -> None:
        layout = (writers if role == "writer" else readers)[rank]
        plan = build_local_plan(writers, readers, role=role, rank=rank)
        phases = split_plan(plan, names) if names else None
        if role == "writer":
            tensors = as_tensors(cut_shards(layout, random_canonical(canonical, seed=0)), layout)
        else:
            tensors = reader_tensors(layout) if reader_tensors else as_tensors(empty_shards(layout), layout)
        t = create_transport(transport, ctx(role, rank))
        epoch = epoch_of(versions[0])
        try:
            t.prepare(plan, tensors, epoch=epoch, deadline=Deadline.after(timeout), phases=phases)
            for v in versions:
                if epoch_of(v) != epoch or (reattach and role == "reader" and v != versions[0]):
                    epoch = epoch_of(v)
                    t.prepare(plan, tensors, epoch=epoch, deadline=Deadline.after(timeout), phases=phases)
                values = random_canonical(canonical, seed=v)
                if role == "writer":
                    for name, src in as_tensors(cut_shards(layout, values), layout).items():
                        tensors[name].copy_(src)
                    for p in range(len(phases or [plan])):
                        t.send(v, deadline=Deadline.after(timeout), phase=p)
                        if lockstep:
                            barrier.wait(timeout)
                else:
                    for p in range(len(phases or [plan])):
                        if before_receive is not None:
                            before_receive(v, p, tensors)
                        t.receive(v, deadline=Deadline.after(timeout), phase=p)
                        if lockstep:
                            barrier.wait(timeout)
                    device_port.current().synchronize("cpu")
                    want = as_tensors(cut_shards(layout, values), layout)
                    result.received.append((rank, v))
                    result.bad += [(rank, v, n) for n, x in tensors.items()
                                   if not torch.equal(x.view(torch.uint8), want[n].to(x.dtype).view(torch.uint8))]
                barrier.wait(timeout)
                if role == "writer" and rank == 0:
                    result.used.append(model.used)
        except BaseException as exc:
            result.errors.append(exc)
            barrier.abort()
        finally:
            t.close()

    def run(role: str, rank: int) -> None:
        if processes is None:
            rank_main(role, rank)
            return
        with model.as_process(processes[0] if role == "writer" else f"{processes[1]}{rank}"):
            rank_main(role, rank)

    with device_port.use(model):
        threads = [threading.Thread(target=run, args=("writer", r)) for r in range(len(writers))]
        threads += [threading.Thread(target=run, args=("reader", r)) for r in range(len(readers))]
        for th in threads:
            th.start()
        for th in threads:
            th.join(4 * timeout)
        assert not any(th.is_alive() for th in threads), "a rank did not finish"
    return result

