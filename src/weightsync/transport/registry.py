"""The transports a job may name: an open registry.

Every transport, built in or not, is an entry here: its name, the class (or, for a transport
with modes, the class of each mode and how a job's mode is chosen), why it cannot run on this
machine or for this job, and the transports its bytes also travel over (``routed``: ``shm`` and
``torch``), whose own rules then apply too.

A third party adds one without touching weightsync, either in code::

    from weightsync.transport.registry import register_transport
    register_transport("mine", "my_pkg.transport:MyTransport")   # a class, or "module:Class"

or by declaring it in its package's metadata, found when a job first names it::

    [project.entry-points."weightsync.transports"]
    mine = "my_pkg.transport:MyTransport"

A class is loaded only when a job uses it (importing weightsync imports no transport). The
class must provide :class:`weightsync.transport.base.Transport` (its capabilities are class
attributes, which :func:`create_transport <weightsync.transport.create_transport>` reads).
"""

from __future__ import annotations

import functools
import importlib
import importlib.metadata
import logging
import threading
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from weightsync.transport.base import TransportContext

logger = logging.getLogger(__name__)

#: the entry-point group third-party packages declare their transports in
ENTRY_POINT_GROUP = "weightsync.transports"

#: a class, or where to import it from: ``"module:Class"``
ClassRef = str | type


def _never(*_: Any) -> str | None:
    return None


def _no_check(ctx: TransportContext) -> None:
    return None


@dataclass(frozen=True)
class TransportEntry:
    """One transport: what the registry knows of it.

    Attributes:
        name: what jobs call it (``SyncConfig.transport``).
        classes: the class of each mode; a transport without modes has one, under ``""``.
        mode: which mode a job uses (from its context: device, options, rank counts); None
            when there is one mode.
        missing: why it cannot run on this machine (a package or device absent), or None.
        refuses: why it cannot run for this job (its context), or None.
        routes: the transports that also carry its bytes, whose rules it must meet as well.
        check_delta: raises ValueError, naming why, when it cannot honour this job's
            ``delta_anchor_every`` beyond what its classes' ``carries_deltas`` say.
    """

    name: str
    classes: Mapping[str, ClassRef]
    mode: Callable[[TransportContext], str] | None = None
    missing: Callable[[], str | None] = _never
    refuses: Callable[[TransportContext], str | None] = _never
    routes: tuple[str, ...] = ()
    check_delta: Callable[[TransportContext], None] = _no_check
    _loaded: dict[str, type] = field(default_factory=dict, compare=False, repr=False)

    def mode_for(self, ctx: TransportContext) -> str:
        if self.mode is None:
            return ""
        mode = self.mode(ctx)
        if mode not in self.classes:
            raise ValueError(f"transport {self.name!r} chose mode {mode!r}, which it has no class for "
                             f"(its modes: {sorted(self.classes)})")
        return mode

    def path(self, ctx: TransportContext) -> str:
        """``module:Class`` of the class this job uses."""
        ref = self.classes[self.mode_for(ctx)]
        return ref if isinstance(ref, str) else f"{ref.__module__}:{ref.__qualname__}"

    def cls(self, ctx: TransportContext) -> Any:
        """The class this job uses, imported on first use."""
        mode = self.mode_for(ctx)
        if mode not in self._loaded:
            ref = self.classes[mode]
            self._loaded[mode] = _load(ref, what=f"transport {self.name!r}") if isinstance(ref, str) else ref
        return self._loaded[mode]


def _load(ref: str, *, what: str) -> type:
    module, sep, name = ref.partition(":")
    if not sep or not module or not name:
        raise ValueError(f"{what}: {ref!r} is not 'module:Class'")
    try:
        found = getattr(importlib.import_module(module), name)
    except (ImportError, AttributeError) as exc:
        raise ValueError(f"{what}: cannot import {ref!r}: {exc}") from exc
    if not isinstance(found, type):
        raise ValueError(f"{what}: {ref!r} is a {type(found).__name__}, not a class")
    return found


_REGISTRY: dict[str, TransportEntry] = {}
_LOCK = threading.Lock()


def register_transport(name: str, classes: ClassRef | Mapping[str, ClassRef], *,
                       mode: Callable[[TransportContext], str] | None = None,
                       missing: Callable[[], str | None] = _never,
                       refuses: Callable[[TransportContext], str | None] = _never,
                       routes: tuple[str, ...] = (), check_delta: Callable[[TransportContext], None] = _no_check,
                       replace: bool = False) -> TransportEntry:
    """Make transport ``name`` available to jobs (see the module docstring).

    ``classes`` is one class (or ``"module:Class"``), or, with ``mode``, a class per mode.

    Raises:
        ValueError: the name is empty or ``"auto"``, already registered (without ``replace``),
            or modes and ``mode`` are not given together.
    """
    if not name or name == "auto":
        raise ValueError(f"a transport cannot be named {name!r}")
    table = dict(classes) if isinstance(classes, Mapping) else {"": classes}
    if (mode is None) != (set(table) == {""}):
        raise ValueError(f"transport {name!r}: give a class per mode together with `mode`, or one class without it")
    entry = TransportEntry(name, table, mode, missing, refuses, tuple(routes), check_delta)
    with _LOCK:
        if name in _REGISTRY and not replace:
            raise ValueError(f"transport {name!r} is already registered ({_REGISTRY[name].classes}); "
                             "pass replace=True to replace it")
        _REGISTRY[name] = entry
    return entry


def unregister_transport(name: str) -> None:
    """Forget transport ``name`` (a test's, or one a package replaces)."""
    with _LOCK:
        _REGISTRY.pop(name, None)


@functools.cache
def _read_entry_points() -> None:
    """Register the transports installed packages declare (once, when a name is first not known)."""
    for point in importlib.metadata.entry_points(group=ENTRY_POINT_GROUP):
        if point.name in _REGISTRY:
            logger.warning("transport %r declared by %s is already registered; keeping the registered one",
                           point.name, point.value)
            continue
        register_transport(point.name, point.value)


def transport_entry(name: str) -> TransportEntry:
    """The entry of transport ``name``.

    Raises:
        ValueError: no transport of that name is registered (naming the ones that are).
    """
    if name not in _REGISTRY:
        _read_entry_points()
    try:
        return _REGISTRY[name]
    except KeyError:
        raise ValueError(f"unknown transport {name!r}; known: {registered_transports()}") from None


def registered_transports() -> list[str]:
    return sorted(_REGISTRY)
