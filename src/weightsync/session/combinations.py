"""Which settings combine: every pair that does not is refused at init, naming both settings.

A setting that a job cannot honour with another must never be dropped silently (a delta
"accepted" and full versions sent anyway, a checksum never computed, a NIXL mode on a job
without NIXL). The rules live here, in one place, and
docs/fewer-bytes.md's combination table lists each with its message;
``tests/test_combinations.py`` walks that table. :class:`~weightsync.session.config.SyncConfig`
checks them when it is built (so a wrong init info fails where the user wrote it), and the
session checks them again once ``transport="auto"`` has picked a transport::

    refuse_combinations(config.to_wire(), transport=config.transport)   # SyncConfig.__post_init__
    refuse_combinations(config.to_wire(), transport=choice.name, why=choice.reason)   # once chosen

A rule that a later change makes work is deleted here, with its row in the table.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

#: Every transport carries deltas: torch and routed run the delta exchange per pair
#: (transport/delta/pairs.py), shm and NIXL pull writers publish each version's changes
#: (transport/delta/published.py), NIXL push writers WRITE them into each reader's inbox
#: (transport/nixl/push_changes.py), file writers a change file next to each version
#: (transport/file/changes.py), and NCCL runs the per-pair exchange on GPU memory
#: (transport/torch/nccl_delta.py). On other GPU memory (CUDA IPC, NIXL VRAM) the transport refuses
#: them when it is created.
#: Transports whose writers send to every reader (torch's pairs, routed's torch part; NIXL in push
#: mode): a reader cannot join a running job. Those in a process group (torch, routed) also fail
#: every send for one dead reader, so a completion policy other than ``all`` cannot hold there; a
#: NIXL push writer goes on without a reader that dies under one (transport/nixl/push.py).
TWO_SIDED = frozenset({"torch", "routed"})
#: Transports that checksum every message with ``checksum=True``.
CHECKSUM_TRANSPORTS = frozenset({"torch"})
#: Transport options that only one kind of transport reads: (setting, its no-op value, the
#: transports that read it, whether ``auto`` may choose one of them).
ONLY_FOR = (("nixl_mode", "auto", frozenset({"nixl"}), False),
            ("file_dir", "", frozenset({"file"}), False),
            ("shm_streaming", True, frozenset({"shm", "routed"}), True))


class CombinationError(ValueError):
    """Two settings of a job that do not work together; the message names both and the way out."""


def refusal(settings: Mapping[str, Any], *, transport: str, why: str = "") -> str | None:
    """Why a job of these settings (``SyncConfig``'s wire form) cannot run over ``transport``
    (``"auto"``: not chosen yet), or None. ``why`` is the reason ``auto`` picked ``transport``.
    """
    picked = f"transport='auto' chose {transport!r} ({why})" if why else f"transport={transport!r}"
    chosen = transport != "auto"
    if settings["commit"] == "fleet" and settings["layer_phases"]:
        return ("commit='fleet' with layer_phases=True: an engine loads each phase into the weights it serves as "
                "the phase arrives, so no version could wait staged for the fleet's commit. Set layer_phases=False "
                "(whole-model staging), or commit='each'")
    completion = settings["completion"]
    if settings["num_readers"] is None:
        if settings["commit"] == "fleet":
            return ("num_readers=None (an elastic set of readers) with commit='fleet': the fleet's commit is decided "
                    "for a fixed set of readers. Use commit='each', or a fixed num_readers")
        if chosen and _two_sided(settings, transport):
            return (f"num_readers=None (an elastic set of readers) with {picked}: its writers connect to every "
                    "reader themselves, so a reader could not join or leave a running job. Use a one-sided "
                    "transport (shm, file, or nixl with nixl_mode='pull'), or a fixed num_readers")
    if completion != "all" and chosen and transport in TWO_SIDED:
        return (f"completion={completion!r} with {picked}: its writers send to every reader themselves, in one "
                "process group, so a dead reader fails every write whatever the policy. Use shm, file or nixl, or "
                "completion='all'")
    if settings["checksum"] and chosen and transport not in CHECKSUM_TRANSPORTS:
        return (f"checksum=True with {picked}: only the {_names(CHECKSUM_TRANSPORTS)} transport checksums its "
                f"messages, so nothing would be checked. Set transport='torch', or checksum=False")
    for name, no_op, readers, auto_may_choose in ONLY_FOR:
        value = settings[name]
        if value == no_op or transport in readers or (not chosen and auto_may_choose):
            continue
        where = picked if chosen else f"transport='auto' (which never chooses {_names(readers)})"
        return (f"{name}={value!r} with {where}: {name} applies to the {_names(readers)} transport only and would "
                f"be ignored. Set transport={sorted(readers)[0]!r}, or leave {name}={no_op!r}")
    return None


def _two_sided(settings: Mapping[str, Any], transport: str) -> bool:
    """Whether a writer of ``transport`` sends to each reader itself (so waits on every one of them)."""
    if transport == "nixl":
        from weightsync.transport.nixl.common import resolve_mode

        return resolve_mode(settings["nixl_mode"], num_writers=settings["num_writers"],
                            num_readers=settings["num_readers"], delta=settings["delta_anchor_every"] > 0) == "push"
    return transport in TWO_SIDED


def _names(transports: frozenset[str]) -> str:
    return " and ".join(sorted(transports))


def refuse_combinations(settings: Mapping[str, Any], *, transport: str, why: str = "") -> None:
    """Raise :class:`CombinationError` when :func:`refusal` finds one."""
    message = refusal(settings, transport=transport, why=why)
    if message is not None:
        raise CombinationError(message)


__all__ = ["CHECKSUM_TRANSPORTS", "ONLY_FOR", "TWO_SIDED", "CombinationError", "refusal",
           "refuse_combinations"]
