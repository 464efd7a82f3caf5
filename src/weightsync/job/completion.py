"""When a version is complete: the job's completion policy applied to what its readers reported.

A writer's ``write(V)`` (with ``staleness=0``; ``V - staleness`` otherwise) returns once the
readers' reports meet the job's policy (``SyncConfig.completion``):

* ``all``: every reader applied it (a reader that failed it or died fails the write, naming it);
* ``quorum=K``: ``K`` readers applied it;
* ``fraction=F``: ``ceil(F * readers)`` of them did (at least one).

Under a quorum or a fraction, a reader that failed the version, died, or is still applying it
when the quorum is met has *missed* it: it catches up on a later version (one-sided transports
keep the newest versions in slots), and a dead reader's restart takes the newest one. The write
fails only once the policy can no longer be met (too few readers left that may still apply it),
or at its deadline.

:func:`judge` is the decision, a pure function of the readers' report and who is dead, so that
every case is tested without processes or clocks (``tests/test_completion.py``); the job
channel's wait (:meth:`weightsync.job.channel.JobChannel.wait_completion`) feeds it.

    verdict = judge(Policy.parse("quorum=2", deadline=60.0), 7, readers=3, report=report, dead={2: "lease expired"})
    verdict.state   # "complete": readers 0 and 1 applied version 7; reader 2 missed it
"""

from __future__ import annotations

from collections.abc import Mapping
from collections.abc import Set as AbstractSet

from weightsync.ports.fleet.policy import Completion, CompletionState, Policy
from weightsync.ports.records import ReaderReport


def judge(policy: Policy, version: int, *, readers: int, report: ReaderReport, dead: Mapping[int, str],
          expired: bool = False, absent: AbstractSet[int] = frozenset()) -> Completion:
    """The state of ``version`` for reader ranks ``0..readers-1`` but ``absent`` under ``policy``.

    ``report`` is the coordinator's reader report, ``dead`` the readers whose lease expired
    (rank -> how), ``expired`` whether the writer's deadline came, ``absent`` the seats of an
    elastic set that the version's plan has no reader for (never joined, or left): they are not
    counted, whatever the report says of them. A reader that applied the version (or a newer
    one) counts whatever else is said of it; a dead reader that did not is out of the count (its
    restart takes a later version).
    """
    seats = [r for r in range(readers) if r not in absent]
    applied = set(report.applied(version, readers)) - absent
    failed = {r: why for r, why in report.failed(version, readers).items() if r not in applied and r not in absent}
    out = dict(failed)
    out.update({r: f"died before it applied version {version}: {why}" for r, why in dead.items()
                if r < readers and r not in absent and r not in applied and r not in failed})
    pending = [r for r in seats if r not in applied and r not in out]
    needed = max(1, policy.needed(len(seats)))
    missed = {**out, **dict.fromkeys(pending, "still applying")}
    if len(applied) >= needed:
        state: CompletionState = "complete"
    elif len(applied) + len(pending) < needed or expired:
        state = "failed"
        if expired:
            missed.update(dict.fromkeys(pending, "did not apply it by the deadline"))
    else:
        state = "waiting"
    return Completion(version, policy.text, needed, tuple(sorted(applied)), dict(sorted(missed.items())), state)


__all__ = ["Completion", "judge"]
