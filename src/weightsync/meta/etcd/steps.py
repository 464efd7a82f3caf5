"""Operations of the etcd coordinator written once, as generators of *steps* (sans I/O), for
the sync client (:class:`~weightsync.meta.etcd.client.EtcdMetaClient`) and the asyncio one
(:class:`~weightsync.meta.etcd.async_client.AsyncEtcdMetaClient`) alike.

An operation yields a :class:`Txn` (one etcd transaction; the client adds the compare of its
pinned store instance) and receives its :class:`~weightsync.meta.etcd.ops.TxnAnswer`, or yields a
:class:`Watch` and receives the keys the first change put (empty: something else changed, or
the stream ended: read again) or None when the watch's time ran out. A client only drives the
steps, with blocking calls or with awaits, as :mod:`weightsync.meta.client_base` does for the
embedded server's two clients::

    table = client.run(barrier.join(keys, participant, writers=8, readers=2, timeout=60))   # sync
    table = await client.run(barrier.join(keys, participant, writers=8, readers=2, timeout=60))  # async

Registration and the barrier: :mod:`weightsync.meta.etcd.barrier`; here the steps themselves, the
watch-driven wait every other wait is made of (:func:`watched`), the store instance and documents.
"""

from __future__ import annotations

import secrets
import time
from collections.abc import Callable, Generator
from dataclasses import dataclass
from typing import Any, TypeAlias, TypeVar

from weightsync.clock.deadline import Deadline
from weightsync.meta import calls
from weightsync.meta.etcd import ops
from weightsync.meta.etcd.ops import Row, TxnAnswer
from weightsync.meta.etcd.schema import JobKeys
from weightsync.meta.records import check_document_key

T = TypeVar("T")
Request: TypeAlias = dict[str, Any]
#: a wait re-reads at least this often (a watch on a member that stopped answering ends no later)
PROGRESS_SECONDS = 5.0


@dataclass(frozen=True, slots=True)
class Txn:
    """Commit one transaction (see :func:`weightsync.meta.etcd.ops.put` and its siblings)."""

    compare: tuple[Request, ...]
    success: tuple[Request, ...]
    failure: tuple[Request, ...] = ()
    what: str = "read the job's state"


@dataclass(frozen=True, slots=True)
class Watch:
    """Wait up to ``seconds`` for a change of ``key`` (or, with ``prefix``, of a key under it)
    made after revision ``after``."""

    key: str
    after: int
    seconds: float
    prefix: bool = False


@dataclass(frozen=True, slots=True)
class Grant:
    """A new etcd lease of ``ttl`` whole seconds; answered with its id."""

    ttl: int


@dataclass(frozen=True, slots=True)
class KeepAlive:
    """Renew the etcd lease ``lease``; answered with its TTL, -1 if it expired (its keys are gone)."""

    lease: int


@dataclass(frozen=True, slots=True)
class Revoke:
    """Revoke the etcd lease ``lease`` this client no longer uses, if etcd answers within a couple
    of seconds (it expires on its own otherwise); answered with None."""

    lease: int


#: one step: a transaction, a watch, or one of the three lease calls
Step: TypeAlias = Txn | Watch | Grant | KeepAlive | Revoke
#: an operation: yields steps, is sent each one's answer (a Watch's: the keys its first change
#: put, or None when its time ran out; a lease call's: an int or None), returns its result
Steps: TypeAlias = Generator[Step, TxnAnswer | tuple[Row, ...] | int | None, T]


def commit(step: Txn) -> Steps[TxnAnswer]:
    answer = yield step
    assert isinstance(answer, TxnAnswer), f"a client answers a Txn with a TxnAnswer, got {answer!r}"
    return answer


def watch(step: Watch) -> Steps[tuple[Row, ...] | None]:
    woken = yield step
    assert woken is None or isinstance(woken, tuple), f"a client answers a Watch with rows or None, got {woken!r}"
    return woken


def lease_call(step: Grant | KeepAlive) -> Steps[int]:
    answer = yield step
    assert isinstance(answer, int), f"a client answers a lease call with an int, got {answer!r}"
    return answer


def revoke(lease: int) -> Steps[None]:
    yield Revoke(lease)


def read(*requests: Request) -> Steps[tuple[list[Request], int]]:
    """Several ranges read at one revision in one round trip: (their answers, the revision)."""
    answer = yield from commit(Txn((), requests))
    return answer.responses, answer.revision


def rows(*requests: Request) -> Steps[tuple[list[Row], int]]:
    answers, revision = yield from read(*requests)
    return [row for answer in answers for row in ops.rows_of(answer)], revision


def already(value: T) -> Steps[T]:
    """Steps that yield nothing and return ``value``: a read the sync client has done itself."""
    return value
    yield  # a generator, for `yield from`


def watched(key: str, read_: Callable[[], Steps[tuple[T, int]]], done: Callable[[T], bool], timeout: float, *,
            prefix: bool = False, progress: Callable[[T, float], None] | None = None) -> Steps[T]:
    """Read until ``done(value)`` or ``timeout`` seconds passed, watching ``key`` (with ``prefix``:
    every key under it) from the revision of each read; returns the last value read. Nothing
    polls: a wait wakes on a change, and at least every :data:`PROGRESS_SECONDS` to read again
    (and call ``progress(value, seconds_left)``)."""
    deadline = Deadline.after(max(0.0, timeout))
    said = time.monotonic()
    while True:
        value, revision = yield from read_()
        if done(value) or deadline.expired:
            return value
        if progress is not None and time.monotonic() - said >= PROGRESS_SECONDS:
            said = time.monotonic()
            progress(value, deadline.remaining(0.0))
        yield from watch(Watch(key, revision, min(deadline.remaining(0.0), PROGRESS_SECONDS), prefix))


# -- the store instance and documents -----------------------------------------------------------------

def pin_instance(keys: JobKeys) -> Steps[str]:
    """The store's instance (``<prefix>/instance``), created by the first client that asks."""
    created = secrets.token_hex(8).encode()
    answer = yield from commit(Txn((ops.unchanged(keys.instance, 0),), (ops.put(keys.instance, created),),
                                   (ops.read(keys.instance),), what="pin the store instance"))
    return created.decode() if answer.ok else ops.rows_of(answer.responses[0])[0].value.decode()


def put_document(keys: JobKeys, key: str, value: bytes) -> Steps[None]:
    """Store a job-level document under ``key``; overwrites."""
    calls.put_document(keys.job, key, value)  # checks the key and the value's type
    yield from commit(Txn((), (ops.put(keys.doc(key), bytes(value)),), what=f"store document {key}"))


def get_document(keys: JobKeys, key: str, wait: float) -> Steps[bytes | None]:
    """The document ``key``; with ``wait > 0``, watched for until it exists. None if absent."""
    doc = keys.doc(check_document_key(key))

    def read_() -> Steps[tuple[bytes | None, int]]:
        found, revision = yield from rows(ops.read(doc))
        return (found[0].value if found else None), revision
    return (yield from watched(doc, read_, lambda v: v is not None, wait))


def read_documents(keys: JobKeys, documents: list[str]) -> Steps[dict[str, bytes | None]]:
    """The documents named, read at one revision (None: absent)."""
    answers, _ = yield from read(*(ops.read(keys.doc(k)) for k in documents))
    found = {k: ops.rows_of(a) for k, a in zip(documents, answers, strict=True)}
    return {k: r[0].value if r else None for k, r in found.items()}
