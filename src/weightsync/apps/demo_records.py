"""What the demo's workers report (one JSON line per step: :class:`WriterStep`,
:class:`ReaderStep`, and with ``kill_reader`` :class:`ReaderKilled` / :class:`WriterFailed`),
and what :func:`weightsync.apps.demo.run_demo` returns (:class:`DemoResult`).
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True, kw_only=True)
class WriterStep:
    """One ``write`` of one writer process."""

    rank: int
    version: int
    nbytes: int
    phases: dict[str, float]
    train_seconds: float
    #: device memory torch's allocator holds for this process after the write (GPU writers)
    device_bytes: int = 0


@dataclass(frozen=True, kw_only=True)
class ReaderStep:
    """One ``update`` of one reader process, and what checking its weights found."""

    rank: int
    version: int
    nbytes: int
    phases: dict[str, float]
    gbps: float
    verified: bool  # every tensor bitwise equal to the checkpoint of this version
    mismatches: list[str]  # the first tensors that differ
    in_place: bool  # every buffer kept its storage
    num_phases: int = 1  # phases the version moved in (``layer_phases``: several)

    @property
    def transfer_seconds(self) -> float:
        return sum(v for k, v in self.phases.items() if k.startswith("receive."))


@dataclass(frozen=True, kw_only=True)
class ReaderKilled:
    """The reader of ``DemoSpec.kill_reader``, as it SIGKILLs itself (``at``: ``time.time()``)."""

    rank: int
    version: int
    at: float


@dataclass(frozen=True, kw_only=True)
class WriterFailed:
    """A writer's ``write`` that raised (with ``DemoSpec.kill_reader``): the error its caller saw."""

    rank: int
    version: int
    error: str
    at: float


#: With ``kill_reader``: at most this many seconds from the reader's death to each writer's error.
FAULT_SECONDS = 10.0


@dataclass(frozen=True, kw_only=True)
class DemoResult:
    """What :func:`run_demo` saw: every worker's steps, the failures, and whether all checks passed."""

    ok: bool
    writers: list[WriterStep]
    readers: list[ReaderStep]
    failures: list[str]
    size: str
    source: str
    target: str
    parameters: int
    #: with ``kill_reader``: the death, and each writer's error
    killed: list[ReaderKilled] = field(default_factory=list)
    writer_errors: list[WriterFailed] = field(default_factory=list)


_RECORDS: dict[str, type] = {"writer": WriterStep, "reader": ReaderStep, "writer-failed": WriterFailed,
                             "reader-killed": ReaderKilled}
Record = WriterStep | ReaderStep | WriterFailed | ReaderKilled
