"""Which settings combine: every pair that does not is refused at init, naming both settings.

A setting that a job cannot honour with another must never be dropped silently (a delta
"accepted" and full versions sent anyway). The rules live here, in one place, and
docs/fewer-bytes.md's combination table lists each with its message;
``tests/test_combinations.py`` walks that table. :class:`~weightsync.sync_config.SyncConfig`
checks them when it is built (so a wrong init info fails where the user wrote it), and the
session checks them again once ``transport="auto"`` has picked a transport::

    refuse_combinations(config.to_wire(), transport=config.transport)   # SyncConfig.__post_init__
    refuse_combinations(config.to_wire(), transport=choice.name, why=choice.reason)   # once chosen

A rule that a later change makes work is deleted here, with its row in the table.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

#: Transports whose writer and reader run the delta exchange (transport/delta.py).
DELTA_TRANSPORTS = frozenset({"torch"})


class CombinationError(ValueError):
    """Two settings of a job that do not work together; the message names both and the way out."""


def refusal(settings: Mapping[str, Any], *, transport: str, why: str = "") -> str | None:
    """Why a job of these settings (``SyncConfig``'s wire form) cannot run over ``transport``
    (``"auto"``: not chosen yet), or None. ``why`` is the reason ``auto`` picked ``transport``.
    """
    delta = settings["delta_anchor_every"]
    if not delta:
        return None
    if settings["layer_phases"]:
        return (f"delta_anchor_every={delta} with layer_phases=True: a version moved in phases of layers is always "
                "sent in full, so the deltas would never be used. Set layer_phases=False to move deltas (the engine "
                "then stages the whole model), or delta_anchor_every=0")
    if transport != "auto" and transport not in DELTA_TRANSPORTS:
        picked = f"transport='auto' chose {transport!r} ({why})" if why else f"transport={transport!r}"
        return (f"delta_anchor_every={delta} with {picked}: deltas run on the {' and '.join(sorted(DELTA_TRANSPORTS))} "
                f"transport only, and {transport!r} would send every version in full. Set "
                "transport='torch', or delta_anchor_every=0")
    return None


def refuse_combinations(settings: Mapping[str, Any], *, transport: str, why: str = "") -> None:
    """Raise :class:`CombinationError` when :func:`refusal` finds one."""
    message = refusal(settings, transport=transport, why=why)
    if message is not None:
        raise CombinationError(message)


__all__ = ["DELTA_TRANSPORTS", "CombinationError", "refusal", "refuse_combinations"]
