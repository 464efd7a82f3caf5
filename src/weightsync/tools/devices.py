"""Every device decision weightsync makes, as small pure functions of strings.

No GPU is needed to test them, and none was available to the people who wrote them: each
rule below was read off the library it protects (torch's NCCL process group, CUDA IPC,
NIXL, SGLang) and is pinned by a CPU unit test with fake device indices
(``tests/test_devices.py``). Devices are strings (``"cpu"``, ``"cuda:3"``), so this module
imports no torch.

    device = tensors_device(str(t.device) for t in tensors.values())    # one device, or an error
    choice = choose_transport("auto", placements)                        # name + the reason
    check_serves("torch", serves_cpu=True, serves_cuda=True, device=device)
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from weightsync.plan.ops import Role
from weightsync.ports.device import gpu_identity, parse_device


def resolve_device(device: str, *, current_cuda_index: int | None) -> str:
    """A device with its index: ``"cuda"`` means this process's *current* CUDA device.

    torch allocates ``"cuda"`` on the current device, which is device 0 unless the process
    called ``torch.cuda.set_device``; publishing ``"cuda"`` would make every rank look like
    it sits on one GPU (and NIXL/IPC peers would address the wrong one).
    """
    kind, index = parse_device(device)
    if kind == "cpu" or index is not None:
        return device
    if current_cuda_index is None:
        raise ValueError("device 'cuda' was given but CUDA is not available in this process")
    return f"cuda:{current_cuda_index}"


def tensors_device(devices: Iterable[str], *, what: str = "tensors") -> str:
    """The one device all of a rank's tensors live on.

    Raises:
        ValueError: naming two devices that differ (a transport moves one device's memory),
            or when there are no tensors at all.
    """
    seen: list[str] = []
    for device in devices:
        if device not in seen:
            seen.append(device)
        if len(seen) > 1:
            raise ValueError(f"{what} live on several devices ({seen[0]} and {seen[1]}); a rank's weights must "
                             "live on one device: move them, or run one weightsync rank per device")
    if not seen:
        raise ValueError(f"no {what} were given")
    return seen[0]


def check_serves(transport: str, *, serves_cpu: bool, serves_cuda: bool, device: str, who: str = "") -> None:
    """Refuse tensors on a device the transport does not move (before any byte is touched).

    gloo copies raw memory with no device check, so GPU tensors handed to it would be read
    as host pointers; host shared memory cannot hold a CUDA allocation.
    """
    kind, _ = parse_device(device)
    if (kind == "cpu" and not serves_cpu) or (kind == "cuda" and not serves_cuda):
        served = " and ".join(k for k, ok in (("cpu", serves_cpu), ("cuda", serves_cuda)) if ok)
        raise ValueError(f"{who + ': ' if who else ''}transport {transport!r} moves {served} memory, but the "
                         f"tensors it was given live on {device}")


@dataclass(frozen=True, slots=True)
class RankPlacement:
    """Where one rank runs: its node (host name, or a Ray node id), its tensors' device, and
    that device's physical identity (a GPU's UUID, "" for host memory or when unknown).

    ``cuda:N`` means something only inside one process (``CUDA_VISIBLE_DEVICES`` renumbers
    GPUs per process, as Ray, vLLM and SGLang workers do), so ranks are compared by ``gpu``
    when they published it.
    """

    role: Role
    rank: int
    node: str
    device: str = "cpu"
    gpu: str = ""

    @property
    def who(self) -> str:
        return f"{self.role} {self.rank}"

    @property
    def gpu_key(self) -> tuple[str, str]:
        return (self.node, self.gpu) if self.gpu else (self.node, self.device)


@dataclass(frozen=True, slots=True)
class TransportChoice:
    name: str
    reason: str


def gpu_duplicates(placements: Sequence[RankPlacement]) -> list[tuple[RankPlacement, RankPlacement]]:
    """Pairs of ranks, of any roles, whose tensors live on one physical GPU.

    One NCCL communicator spans every writer and reader, and NCCL refuses two of its ranks on
    one GPU ("Duplicate GPU detected", keyed by PCI bus id): two engines sharing a GPU fail as
    surely as a trainer and an engine.
    """
    by_gpu: dict[tuple[str, str], list[RankPlacement]] = {}
    for p in placements:
        if parse_device(p.device)[0] == "cuda":
            by_gpu.setdefault(p.gpu_key, []).append(p)
    return [(a, b) for ranks in by_gpu.values() for i, a in enumerate(ranks) for b in ranks[i + 1:]]


def shared_gpus(placements: Sequence[RankPlacement]) -> list[tuple[RankPlacement, RankPlacement]]:
    """Pairs of one writer and one reader on one physical GPU (CUDA IPC is their only path)."""
    return [(a, b) if a.role == "writer" else (b, a) for a, b in gpu_duplicates(placements) if a.role != b.role]


def choose_transport(requested: str, placements: Sequence[RankPlacement], *,
                     unavailable: dict[str, str] | None = None) -> TransportChoice:
    """Resolve ``auto`` and refuse a transport that cannot work for these placements.

    * all ranks on one node: ``shm`` (POSIX shared memory on CPU, CUDA IPC on GPU), which is
      also the only transport for a trainer and an engine sharing one GPU;
    * ranks on several nodes with some writer and reader on one node: ``routed``
      (:mod:`weightsync.transport.routed.transport`), i.e. ``shm`` between each writer and reader on one
      node and ``torch`` between the others, decided per pair by :func:`same_node`;
    * otherwise ``torch`` (gloo on CPU, NCCL on GPU), unless two ranks share a GPU.

    Raises:
        ValueError: naming the ranks, when CPU and GPU ranks are mixed, when ``torch`` is
            asked for ranks sharing one GPU, or ``shm`` for ranks on several nodes.
    """
    unavailable = unavailable or {}
    kinds = {parse_device(p.device)[0] for p in placements}
    if len(kinds) > 1:
        cpu = next(p for p in placements if parse_device(p.device)[0] == "cpu")
        gpu = next(p for p in placements if parse_device(p.device)[0] == "cuda")
        raise ValueError(f"{cpu.who} holds its weights on cpu and {gpu.who} on {gpu.device}: every rank of a "
                         "job must use the same kind of device")
    nodes = {p.node for p in placements}
    same_gpu = gpu_duplicates(placements)
    if requested == "auto":
        if len(nodes) == 1 and "shm" not in unavailable:
            why = ("ranks share GPUs (NCCL refuses two ranks on one GPU): CUDA IPC" if same_gpu
                   else "all ranks on one node")
            return TransportChoice("shm", why)
        requested, reason = "torch", "ranks on several nodes"
        if "shm" not in unavailable and any(same_node(placements).values()):
            requested, reason = "routed", "ranks on several nodes: shm between same-node pairs, torch between nodes"
    else:
        reason = "requested"
    if requested in unavailable:
        raise ValueError(f"transport {requested!r} cannot be used: {unavailable[requested]}")
    if requested in ("torch", "routed") and same_gpu and "cuda" in kinds:
        a, b = same_gpu[0]
        where = f"GPU {a.gpu}" if a.gpu else a.device
        raise ValueError(f"{a.who} and {b.who} both use {where} on {a.node}, and NCCL refuses two ranks of one "
                         "communicator on one GPU: give each rank its own GPU, or use transport 'shm' (CUDA IPC) "
                         "or 'auto' when every rank runs on one node")
    if requested == "shm" and len(nodes) > 1:
        raise ValueError(f"transport 'shm' needs every rank on one node, but they run on {sorted(nodes)[:4]}: "
                         "use 'torch', 'nixl' or 'auto'")
    return TransportChoice(requested, reason)


def same_node(placements: Sequence[RankPlacement]) -> dict[tuple[int, int], bool]:
    """For every (writer rank, reader rank): whether the two run on one node.

    Nodes are compared by the name each rank published (``SyncConfig.host``: a host name, or
    a Ray node id, which tells apart two Ray nodes sharing one machine).
    """
    writers = {p.rank: p.node for p in placements if p.role == "writer"}
    readers = {p.rank: p.node for p in placements if p.role == "reader"}
    return {(w, r): wn == rn for w, wn in writers.items() for r, rn in readers.items()}


def torch_backend(device: str) -> str:
    """The torch.distributed backend for a device: NCCL moves CUDA memory, gloo host memory."""
    return "nccl" if parse_device(device)[0] == "cuda" else "gloo"


def visible_gpus() -> list[str]:
    """The identities of the GPUs this process sees, by local index."""
    import torch

    if not torch.cuda.is_available():
        return []
    return [gpu_identity(f"cuda:{i}") for i in range(torch.cuda.device_count())]


def ipc_attach_device(writer_device: str, writer_gpu: str = "", visible: Sequence[str] = ()) -> str:
    """The local device a CUDA IPC mapping of a writer's memory must be opened on: the
    writer's GPU, as this process numbers it.

    ``UntypedStorage._new_shared_cuda`` opens the handle on the device index it is given, and
    the index the writer recorded is the writer's own; under another ``CUDA_VISIBLE_DEVICES``
    it names another GPU (or none). With the writer's GPU identity the index is looked up
    among the GPUs this process sees; without it, the writer's index is all there is.

    Raises:
        ValueError: the writer's GPU is not visible here (naming it), or no index was given.
    """
    kind, index = parse_device(writer_device)
    if kind != "cuda" or index is None:
        raise ValueError(f"a CUDA IPC segment needs the writer's CUDA device with its index, got {writer_device!r}")
    if writer_gpu and visible:
        if writer_gpu not in visible:
            raise ValueError(f"the writer's GPU {writer_gpu} ({writer_device} in its process) is not one of the "
                             f"{len(visible)} GPUs this process sees: CUDA IPC needs both processes to see the GPU "
                             "(check CUDA_VISIBLE_DEVICES)")
        return f"cuda:{list(visible).index(writer_gpu)}"
    return writer_device


def nixl_device_id(device: str) -> int:
    """The NIXL device id of a memory region: its CUDA index for VRAM, 0 for host memory.

    NIXL matches a remote descriptor to the peer's registration by (address, device id), so
    a remote descriptor must carry the *peer's* index, published with its endpoint.
    """
    kind, index = parse_device(device)
    if kind == "cuda" and index is None:
        raise ValueError("a VRAM descriptor needs a CUDA device with its index")
    return index if index is not None else 0


def sglang_staging_device(requested: str | None, *, engine_gpus: Sequence[int], visible_gpus: int) -> str:
    """The GPU the SGLang ``distributed`` mode stages on: never one of the engine's TP GPUs.

    The staging side joins a NCCL group with the engine's TP ranks; NCCL refuses two ranks
    of that group on one GPU, so staging on, say, ``cuda:0`` while SGLang's TP rank 0 runs
    there fails at ``init_weights_update_group``.
    """
    taken = set(engine_gpus)
    if requested is not None:
        kind, index = parse_device(requested)
        if kind != "cuda" or index is None:
            raise ValueError(f"SGLang's distributed mode stages on a GPU given with its index, got {requested!r}")
        if index in taken:
            raise ValueError(f"staging device {requested} is one of the engine's TP GPUs {sorted(taken)}; NCCL "
                             "refuses two ranks of the update group on one GPU: pick another GPU, or use "
                             "mode='tensor' for an engine in this process")
        return requested
    free = [i for i in range(visible_gpus) if i not in taken]
    if not free:
        raise ValueError(f"SGLang's distributed mode needs a GPU outside the engine's TP GPUs {sorted(taken)}, and "
                         f"this process sees {visible_gpus}: give the reader its own GPU, or use mode='tensor'")
    return f"cuda:{free[0]}"
