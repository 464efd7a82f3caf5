"""The job spec: every setting of a sync job, defined once, with one wire form for the integrations.

:class:`SyncConfig` is what every writer and reader of a job passes. Its wire form is one flat
JSON/msgpack-safe mapping of every setting by name: SyncConfig's own, its
:class:`~weightsync.transport.TransportOptions`' and its :class:`~weightsync.plan.PlanOptions`'
(``TransportOptions.host`` is ``transport_host`` there, beside SyncConfig's ``host``)::

    wire = config.to_wire()             # {"num_writers": 2, ..., "max_bucket_bytes": 67108864, ...}
    config = SyncConfig.from_wire(wire, where="WeightSyncInitInfo")   # every field checked, by name

Integrations take the job's settings in this form, so that a setting added here reaches all of
them: vLLM's worker and trainer init infos, verl's ``engine_kwargs.weightsync``, TRL's
``TRLSyncSettings`` and Ray's attach. :func:`with_job_settings` gives an integration's
dataclass one field per setting; :func:`job_config` turns such an object back into a
``SyncConfig``.

Each setting has a scope (:data:`SCOPES`):

* ``match``: every rank of the job must pass the same value. Ranks compare these when they
  register (:meth:`SyncConfig.settings`), and a mismatch is an error naming the setting.
* ``local``: each rank's own choice, e.g. how long it waits or its lease.
* ``rank``: where this rank runs (its node name, the address peers reach it at). Such a setting
  never travels from one rank to another: the trainer does not send its own to vLLM's workers.
"""

from __future__ import annotations

import dataclasses
import functools
import inspect
import json
import math
import typing
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any, Literal, TypeVar

from weightsync.meta.config import config_address
from weightsync.plan import PlanOptions
from weightsync.ports.fleet.policy import Policy
from weightsync.session.combinations import refuse_combinations
from weightsync.transport import TransportOptions, available_transports

Scope = Literal["match", "local", "rank"]

#: The reader count an integration checks its settings with before it knows the job's: large, so
#: that a rule bound to the count (a quorum of K readers, NIXL's mode) is checked once it is known.
UNKNOWN_READERS = 1 << 16
#: Seats an elastic set of readers (``num_readers=None``) may use: reader ranks ``0..MAX_READER_SEATS-1``.
MAX_READER_SEATS = 4096

#: The scope of every setting, by wire name (module docstring). A setting without one is an
#: error at first use, so a new field cannot reach the wire unclassified.
SCOPES: Mapping[str, Scope] = {
    # SyncConfig
    "num_writers": "match", "num_readers": "match", "job": "match", "meta_address": "rank", "transport": "match",
    "staleness": "match", "timeout": "local", "lease_seconds": "local", "host": "rank",
    "layer_phases": "match", "integrity": "match", "completion": "match", "commit": "match",
    "peer_sources": "match", "peers_across_hosts": "match",
    # TransportOptions
    "max_bucket_bytes": "match", "direct_min_bytes": "match", "checksum": "match",
    "transport_host": "rank", "slots": "match", "file_dir": "local", "nixl_mode": "match",
    "shm_streaming": "match", "delta_anchor_every": "match",
    # PlanOptions
    "min_split_bytes": "match", "allow_unneeded_sources": "match",
}

#: Wire names of nested options' fields that would collide with SyncConfig's own.
_RENAMED = {("transport_options", "host"): "transport_host"}
_NESTED = {"transport_options": TransportOptions, "plan_options": PlanOptions}


@dataclass(frozen=True, slots=True)
class Setting:
    """One setting of the job spec: its wire name, where it lives, its type, default and scope."""

    name: str
    owner: str  # "" for SyncConfig's own fields, else the options field holding it
    attr: str
    kind: type  # int, float, bool or str
    default: Any  # dataclasses.MISSING when required
    scope: Scope
    choices: tuple[str, ...] = ()  # a Literal's values
    optional: bool = False  # None is a value of its own (``num_readers``: an elastic set of readers)

    @property
    def annotation(self) -> Any:
        kind = Literal[self.choices] if self.choices else self.kind  # type: ignore[valid-type]
        return kind | None if self.optional else kind

    def check(self, value: Any, where: str) -> Any:
        """``value`` as this setting's type, or a ValueError naming ``where.name``."""
        if value is None and self.optional:
            return None
        return check_value(value, self.kind, f"{where}.{self.name}", self.choices)


def check_value(value: Any, kind: type, what: str, choices: tuple[str, ...] = ()) -> Any:
    """``value`` as ``kind`` (int, float, bool or str; a float finite), or a ValueError naming ``what``.

    Wire input is strict: a number in a string, a bool for an int and ``inf``/``nan`` are refused.
    """
    got = f"got {value!r} ({type(value).__name__})"
    if kind is bool:
        if not isinstance(value, bool):
            raise ValueError(f"{what} must be true or false, {got}")
        return value
    if kind is int:
        if isinstance(value, bool) or not isinstance(value, int):
            raise ValueError(f"{what} must be an integer, {got}")
        return value
    if kind is float:
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise ValueError(f"{what} must be a number, {got}")
        if not math.isfinite(value):
            raise ValueError(f"{what} must be a finite number, {got}")
        return float(value)
    if not isinstance(value, str):
        raise ValueError(f"{what} must be a string, {got}")
    if choices and value not in choices:
        raise ValueError(f"{what} must be one of {list(choices)}, got {value!r}")
    return value


@dataclass(frozen=True, kw_only=True)
class SyncConfig:
    """Job-wide settings; every writer and reader passes the same ones (see :data:`SCOPES`).

    Attributes:
        num_writers / num_readers: participants the job waits for before planning.
            ``num_readers=None``: an elastic set of readers (:mod:`weightsync.session.elastic`):
            readers join and leave while the job runs, each on a seat (its rank, any of
            ``0..MAX_READER_SEATS-1``), and the writers plan each version for the readers that
            had joined, and not left, when it started; ``completion`` counts those.
        job: the job's name on the meta server.
        meta_address: the job's coordinator, as this rank reaches it: a meta server
            (``http://host:port``) or an etcd cluster (``etcd://host1:2379,host2:2379,...``,
            :mod:`weightsync.meta.etcd.address`). "" takes ``WEIGHTSYNC_META_ADDR``, else an
            embedded server. A ``rank`` setting: each rank may reach it by another name, and the
            integrations give their workers their own. The meta server's token stays out of the
            config (``WEIGHTSYNC_META_TOKEN``, or an integration's ``meta_token``), as does an etcd
            password (``WEIGHTSYNC_ETCD_PASSWORD``): a config is logged and sent to every rank.
        transport: ``auto`` (shared memory on one host, torch p2p across hosts), or a name.
        staleness: how many versions training may run ahead of the slowest reader; 0 means
            synchronous (``write`` returns when every reader applied the version).
        timeout: default bound, in seconds, on every blocking step.
        lease_seconds: a rank that sends no heartbeat (a background thread renews its lease on
            the meta server every quarter of this) for this long is dead: peers waiting on it
            fail at once, naming it, and a restarted process may take its rank over.
        host: this rank's node name (default: the host name); ranks on one node share memory.
        layer_phases: move each version in phases of whole layers, each at most
            ``transport_options.max_bucket_bytes`` (:mod:`weightsync.plan.phases`), so that an
            engine running its own loader (vLLM) stages one phase at a time instead of a
            whole-model copy.
        integrity: writers digest every piece they send and readers check what landed in their
            memory before the engine applies it (:mod:`weightsync.transport.digests`); a
            mismatch fails the version on that reader, naming the tensor, writer and bytes.
        completion: when a version is complete, so that ``write`` returns
            (:mod:`weightsync.job.completion`): ``"all"`` (every reader applied it; a reader that
            failed it or died fails the write), ``"quorum=K"`` (K readers applied it) or
            ``"fraction=F"`` (that share of the readers did). Under a quorum or a fraction a dead
            or failing reader misses the version and catches up later, and never fails ``write``
            while the policy can still be met; it needs shm, file or NIXL (a push writer goes on
            without a reader that dies): torch and routed send in one process group, which any
            dead reader breaks.
        commit: when a reader's engine switches to a version (:mod:`weightsync.job.fleet_commit`):
            ``"each"`` as soon as its own bytes arrived, so a fleet serves a mix of versions while
            a sync runs; ``"fleet"``: every reader stages the version first, writer 0 commits it
            once the completion policy is met by readers that staged it, and the engines apply
            it together (an abort leaves every engine on the version it had). It needs engines
            that receive into staging (vLLM with ``in_place=False``, SGLang, or an
            :class:`~weightsync.roles.inflight.InflightReader`), and whole versions (not
            ``layer_phases``, whose phases are loaded as they arrive).
        peer_sources: readers at seats ``0..K-1`` keep a copy of the newest version they applied
            in shared memory, and a reader that holds no version (an engine that joins, or one
            replacing a dead engine) takes its first version from those on its host instead of
            from the writers (:mod:`weightsync.roles.peer_copies`). 0: none (every reader reads
            the writers). Each such reader keeps one copy of its shard in ``/dev/shm``; with
            ``integrity`` the writers' digests go with it and a joiner checks what it copied.
        peers_across_hosts: the readers keeping copies (``peer_sources``) also serve readers on
            other hosts, over NIXL, and a reader that holds no version and finds no peer on its
            host reads from them (a replacement engine on a new node has no peer beside it).
            Needs ``peer_sources`` > 0 and NIXL (``pip install 'weightsync[nixl]'``); each
            keeping reader then runs one NIXL agent.
    """

    num_writers: int
    num_readers: int | None
    job: str = "default"
    meta_address: str = ""
    transport: str = "auto"
    transport_options: TransportOptions = field(default_factory=TransportOptions)
    plan_options: PlanOptions = field(default_factory=PlanOptions)
    staleness: int = 0
    timeout: float = 300.0
    lease_seconds: float = 3.0
    host: str = ""
    layer_phases: bool = False
    integrity: bool = False
    completion: str = "all"
    commit: Literal["each", "fleet"] = "each"
    peer_sources: int = 0
    peers_across_hosts: bool = False

    def __post_init__(self) -> None:
        for setting in job_settings():
            if not setting.owner:
                object.__setattr__(self, setting.attr, setting.check(getattr(self, setting.attr), "SyncConfig"))
        for name, cls in _NESTED.items():
            options = getattr(self, name)
            if not isinstance(options, cls):
                raise ValueError(f"SyncConfig.{name} must be a {cls.__name__}, got {type(options).__name__}")
        if self.num_writers < 1 or (self.num_readers is not None and self.num_readers < 1):
            raise ValueError(f"num_writers and num_readers must be >= 1 (a job needs a writer and a reader; "
                             f"num_readers=None: an elastic set of readers), got num_writers={self.num_writers}, "
                             f"num_readers={self.num_readers}")
        if not self.job:
            raise ValueError("job must be a non-empty job name")
        object.__setattr__(self, "meta_address", config_address(self.meta_address, "meta_address"))
        if self.staleness < 0:
            raise ValueError(f"staleness must be >= 0, got {self.staleness}")
        if not 0 <= self.peer_sources <= self.reader_seats:
            raise ValueError(f"peer_sources must be in 0..{self.reader_seats} (the job's reader seats: readers at "
                             f"seats below it keep a copy for readers that join), got {self.peer_sources}")
        if self.peers_across_hosts and not self.peer_sources:
            raise ValueError("peers_across_hosts=True with peer_sources=0: no reader keeps a copy to serve across "
                             "hosts. Set peer_sources=K (readers at seats below K keep one), or "
                             "peers_across_hosts=False")
        if self.peers_across_hosts and "nixl" not in available_transports():
            raise ValueError("peers_across_hosts=True serves peer copies over NIXL, which is not installed here "
                             "(pip install 'weightsync[nixl]'), or set peers_across_hosts=False")
        if self.timeout <= 0:
            raise ValueError(f"timeout must be positive, got {self.timeout}")
        if not 0.1 <= self.lease_seconds <= 3600:
            raise ValueError(f"lease_seconds must be in [0.1, 3600], got {self.lease_seconds}")
        policy = self.policy  # a malformed text is refused here, naming the forms accepted
        if policy.kind == "quorum" and self.num_readers is not None and policy.count > self.num_readers:
            raise ValueError(f"completion={self.completion!r} needs {policy.count} readers to apply each version, but "
                             f"the job has num_readers={self.num_readers}: use quorum=K with K <= {self.num_readers}")
        refuse_combinations(self.to_wire(), transport=self.transport)  # "auto" is checked once it has chosen
        if self.transport_options.slots <= self.staleness:
            # One-sided transports keep a version slot per version a reader may lag behind.
            object.__setattr__(self, "transport_options",
                               dataclasses.replace(self.transport_options, slots=self.staleness + 1))

    @property
    def reader_seats(self) -> int:
        """How many reader ranks the job may have: ``num_readers``, or an elastic set's seats."""
        return MAX_READER_SEATS if self.num_readers is None else self.num_readers

    @property
    def policy(self) -> Policy:
        """The completion policy (``completion``), with the write's ``timeout`` as its deadline."""
        try:
            return Policy.parse(self.completion, deadline=self.timeout)
        except ValueError as exc:
            raise ValueError(f"completion: {exc}") from None

    def settings(self) -> str:
        """What every rank of a job must agree on (the ``match`` settings), as ranks compare it
        when they register: a JSON object, so that a mismatch names the setting."""
        wire = self.to_wire()
        return json.dumps({s.name: wire[s.name] for s in job_settings() if s.scope == "match"},
                          separators=(",", ":"))

    def to_wire(self) -> dict[str, Any]:
        """Every setting by wire name: plain ints, floats, bools and strings (module docstring)."""
        return {s.name: getattr(getattr(self, s.owner) if s.owner else self, s.attr) for s in job_settings()}

    @classmethod
    def from_wire(cls, wire: Mapping[str, Any], *, where: str = "SyncConfig") -> SyncConfig:
        """The config a wire form describes; settings left out take their defaults.

        Raises:
            ValueError: naming ``where.<setting>`` for an unknown, missing or malformed setting,
                or one out of its range.
        """
        if not isinstance(wire, Mapping):
            raise ValueError(f"{where} must be a mapping of settings, got {type(wire).__name__}")
        settings = {s.name: s for s in job_settings()}
        unknown = sorted(str(k) for k in wire if k not in settings)
        if unknown:
            raise ValueError(f"{where} has unknown settings {unknown}; known: {sorted(settings)}")
        own: dict[str, Any] = {}
        nested: dict[str, dict[str, Any]] = {name: {} for name in _NESTED}
        for name, setting in settings.items():
            if name not in wire:
                if setting.default is dataclasses.MISSING:
                    raise ValueError(f"{where}.{name} is required")
                continue
            value = setting.check(wire[name], where)
            (nested[setting.owner] if setting.owner else own)[setting.attr] = value
        try:
            options = {name: cls_(**nested[name]) for name, cls_ in _NESTED.items()}
            return cls(**own, **options)
        except ValueError as exc:  # a range check of the dataclasses: it names the setting
            raise ValueError(f"{where}: {exc}") from exc


@functools.cache
def job_settings() -> tuple[Setting, ...]:
    """Every setting of the job spec, in SyncConfig's field order (nested options in place)."""
    out: list[Setting] = []
    for f, kind in _fields(SyncConfig):
        if f.name in _NESTED:
            for g, inner in _fields(_NESTED[f.name]):
                out.append(_setting(_RENAMED.get((f.name, g.name), g.name), f.name, g, inner))
        else:
            out.append(_setting(f.name, "", f, kind))
    missing = [s.name for s in out if s.name not in SCOPES]
    if missing or len({s.name for s in out}) != len(out):
        raise RuntimeError(f"the job spec's settings {missing or out} need a scope in SCOPES and a unique wire name")
    return tuple(out)


def _fields(cls: type) -> list[tuple[dataclasses.Field[Any], Any]]:
    hints = typing.get_type_hints(cls)
    return [(f, hints[f.name]) for f in dataclasses.fields(cls)]


def _setting(name: str, owner: str, f: dataclasses.Field[Any], hint: Any) -> Setting:
    choices: tuple[str, ...] = ()
    args = typing.get_args(hint)
    optional = type(None) in args and len(args) == 2
    if optional:
        hint = next(a for a in args if a is not type(None))
    if typing.get_origin(hint) is Literal:
        choices, hint = tuple(typing.get_args(hint)), str
    if hint not in (int, float, bool, str):
        raise RuntimeError(f"job setting {name} has type {hint}: the wire form carries int, float, bool and str")
    default = f.default if f.default_factory is dataclasses.MISSING else f.default_factory()
    return Setting(name, owner, f.name, hint, default, SCOPES.get(name, "match"), choices, optional)


T = TypeVar("T")


def with_job_settings(*, exclude: Iterable[str] = (), defaults: Mapping[str, Any] | None = None
                      ) -> Callable[[type[T]], type[T]]:
    """Give a class one field per job setting, before ``@dataclass`` makes them fields.

    Put it under the ``@dataclass`` decorator. ``exclude`` names settings the integration
    fills itself (it passes them to :func:`job_config`); ``defaults`` overrides defaults.
    The class records the names it took in ``__job_settings__``.

    Raises:
        TypeError: the class already declares a field of that name (one definition only).
    """
    skip, overrides = set(exclude), dict(defaults or {})
    unknown = (skip | set(overrides)) - set(SCOPES)
    if unknown:
        raise TypeError(f"with_job_settings names settings the job spec does not have: {sorted(unknown)}")

    def add(cls: type[T]) -> type[T]:
        annotations = dict(inspect.get_annotations(cls))
        names = []
        for setting in job_settings():
            if setting.name in skip:
                continue
            if setting.name in annotations:
                raise TypeError(f"{cls.__name__}.{setting.name} is a job setting: leave it to with_job_settings")
            annotations[setting.name] = setting.annotation
            default = overrides.get(setting.name, setting.default)
            if default is not dataclasses.MISSING:
                setattr(cls, setting.name, default)
            names.append(setting.name)
        cls.__annotations__ = annotations
        cls.__job_settings__ = tuple(names)  # type: ignore[attr-defined]
        return cls

    return add


def job_wire(obj: Any) -> dict[str, Any]:
    """The job settings an object of a :func:`with_job_settings` class holds, by wire name."""
    return {name: getattr(obj, name) for name in type(obj).__job_settings__}


def from_fields(cls: type[T], fields: Mapping[str, Any], where: str, *, required: Iterable[str] = ()) -> T:
    """``cls(**fields)`` for a dataclass of :func:`with_job_settings`, with an unknown or missing
    field named (``where.<field>``) instead of Python's ``TypeError``."""
    if not isinstance(fields, Mapping):
        raise ValueError(f"{where} must be a mapping of fields, got {type(fields).__name__}")
    known = {f.name for f in dataclasses.fields(cls)}  # type: ignore[arg-type]
    unknown = sorted(str(k) for k in fields if k not in known)
    if unknown:
        raise ValueError(f"{where} has unknown fields {unknown}; known: {sorted(known)}")
    for name in required:
        if name not in fields:
            raise ValueError(f"{where}.{name} is required")
    return cls(**fields)


def job_config(obj: Any, where: str, **fixed: Any) -> SyncConfig:
    """The SyncConfig of an object of a :func:`with_job_settings` class, with ``fixed`` settings
    (those the integration fills itself) on top; errors name ``where.<setting>``."""
    return SyncConfig.from_wire({**job_wire(obj), **fixed}, where=where)


__all__ = ["SCOPES", "UNKNOWN_READERS", "Scope", "Setting", "SyncConfig", "check_value", "from_fields", "job_config",
           "job_settings", "job_wire", "with_job_settings"]
