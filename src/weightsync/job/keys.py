"""Every meta-server document key of the job protocol: the one place that builds one.

Only the job channel (:mod:`weightsync.job.channel` and its parts) calls these; a key is
``<kind>/<scope...>``, and a comment beside each says what its document holds.
"""

from __future__ import annotations

from weightsync.plan.ops import Role
from weightsync.ports.fleet.policy import COMPLETIONS_KEY


def epoch_key() -> str:
    return "epoch"


def version_epoch_key(version: int) -> str:
    return f"versions/{version}/epoch"  # a counter: the epoch writer 0 decided for the version, + 1


def writing_key(rank: int) -> str:
    # "<incarnation> <version>": the version writer ``rank``'s process writes now (writer 0: decided an epoch
    # for last; the others: wait for writer 0 to start, or take part in)
    return f"versions/writing/writer{rank}"


def seat_key(epoch: int, rank: int) -> str:
    # a counter: writer ``rank``'s seat in the epoch: 0 open, 1 closed (it had no live process before it
    # joined a try there), 2 left (it saw the epoch fail, or restarted), else the mark of the process that
    # joined a try there (``epochs.seat_mark``)
    return f"seats/{epoch}/writer{rank}"


def layouts_key() -> str:
    return "layouts"  # a counter: the job's layout generation, one step per layout a rank changed while running


def layout_key(generation: int) -> str:
    return f"layouts/{generation}"  # msgpack [role, rank, layout blob]: whose layout generation N changed, to what


def version_layouts_key(version: int, epoch: int) -> str:
    return f"versions/{version}/layouts/{epoch}"  # the layout generation writer 0 planned the try with (absent: 0)


def staged_key(version: int, epoch: int) -> str:
    # a counter: readers that staged the try of the version in this epoch, plus FAILED_UNIT per failed stage
    return f"versions/{version}/staged/{epoch}"


def stage_key(version: int, epoch: int, rank: int) -> str:
    return f"versions/{version}/staged/{epoch}/reader{rank}"  # "staged", "moved past" or "failed: <why>"


def commit_key(version: int, epoch: int) -> str:
    return f"versions/{version}/commit/{epoch}"  # a counter: the fleet commit's decision (0 undecided, 1, 2)


def commit_why_key(version: int, epoch: int, decision: str) -> str:
    return f"versions/{version}/commit/{epoch}/{decision}"  # msgpack CommitVerdict: why it was aborted


def last_joined_key(rank: int) -> str:
    # "<incarnation> <epoch>": the newest epoch writer ``rank``'s process joined a try in (it joins
    # before it connects, so no connection of a later epoch includes that process)
    return f"joins/writer{rank}"


def model_key(digest: str) -> str:
    return f"models/{digest}"


def tensor_table_key() -> str:
    return "tensor-table"


def peer_copy_key(seat: int) -> str:
    return f"peers/reader{seat}"  # msgpack PeerCopy: the version reader ``seat`` keeps a copy of, and where


def endpoint_key(transport: str, epoch: int, role: Role, rank: int) -> str:
    return f"transport/{transport}/{epoch}/{role}{rank}"


def store_index_key(version: int, writer: int) -> str:
    return f"tensorstore/{version}/writer{writer}"


def tile_maxima_key(version: int, writer: int) -> str:
    return f"quant/{version}/writer{writer}"


def completions_key() -> str:
    """The newest versions' completions under the job's policy, as writer 0 saw them (a msgpack
    list; the meta server's status page and /metrics read it)."""
    return COMPLETIONS_KEY
