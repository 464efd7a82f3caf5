"""Long-polls of the meta server: asyncio events keyed by exactly what each request waits for.

A request waits for a key ("3 writers and 2 readers registered", "a version newer than 7 in
epoch 2"); a change fires only the keys it satisfies, so a thousand ranks waiting on a barrier
are woken once, by the registration that completes it, not by every registration before it.
Nothing here sleeps or polls. The reducer says what changed (:mod:`weightsync.meta.reducer`
notices); :func:`notify` maps that to the keys to wake.

    watch = Watch()
    ready = await watch.wait("document", "job", "model/x", lambda: "model/x" in docs, timeout=5.0)
    notify(watch, data, DocumentChanged("job", "model/x"))     # from another task: wakes it
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Hashable
from typing import Any

from weightsync.meta.reducer import (
    CounterChanged,
    DocumentChanged,
    FleetChanged,
    MetaData,
    Notice,
    ReadersChanged,
    RosterGrew,
    VersionChanged,
)


class Watch:
    """Long-poll events grouped by (kind, job), then by what each waiter waits for."""

    def __init__(self) -> None:
        self._events: dict[tuple[str, str], dict[Hashable, list[Any]]] = {}
        self.closed = False

    @property
    def waiting(self) -> int:
        return sum(entry[1] for keys in self._events.values() for entry in keys.values())

    async def wait(self, kind: str, job: str, key: Hashable, ready: Callable[[], bool], timeout: float) -> bool:
        """Wait until ``ready()`` holds or ``timeout`` seconds pass; returns ``ready()``."""
        if ready() or timeout <= 0 or self.closed:
            return ready()
        keys = self._events.setdefault((kind, job), {})
        entry = keys.get(key)
        if entry is None:
            entry = keys[key] = [asyncio.Event(), 0]
        entry[1] += 1
        try:
            await asyncio.wait_for(entry[0].wait(), timeout)
        except asyncio.TimeoutError:
            pass
        finally:
            entry[1] -= 1
            if entry[1] == 0 and keys.get(key) is entry:
                del keys[key]
                if not keys:
                    self._events.pop((kind, job), None)
        return ready()

    def fire(self, kind: str, job: str, satisfied: Callable[[Any], bool]) -> None:
        """Wake the waiters of ``(kind, job)`` whose key ``satisfied(key)`` accepts."""
        keys = self._events.get((kind, job))
        if keys:
            for key in [k for k in keys if satisfied(k)]:
                keys.pop(key)[0].set()

    def close(self) -> None:
        """Wake everyone (server shutdown); later waits return at once."""
        self.closed = True
        for keys in self._events.values():
            for entry in keys.values():
                entry[0].set()
        self._events.clear()


def notify(watch: Watch, data: MetaData, notice: Notice) -> None:
    """Wake the long-polls a change satisfies (keys as :class:`~weightsync.meta.state.MetaState` waits)."""
    if isinstance(notice, RosterGrew):
        w, r = notice.writers, notice.readers
        watch.fire("registered", notice.job, lambda k: k[0] <= w and k[1] <= r)
    elif isinstance(notice, DocumentChanged):
        watch.fire("document", notice.job, lambda k: k == notice.key)
    elif isinstance(notice, CounterChanged):
        watch.fire("counter", notice.job, lambda k: k[0] == notice.name and notice.value >= k[1])
    elif isinstance(notice, VersionChanged):
        watch.fire("version", notice.job, lambda after: (notice.version, notice.epoch) > after)
    elif isinstance(notice, FleetChanged):
        watch.fire("fleet", notice.job, lambda after: notice.revision > after)
    elif isinstance(notice, ReadersChanged):
        job = data.jobs.get(notice.job)
        if job is not None:
            watch.fire("readers", notice.job, lambda k: job.readers_done(*k))
