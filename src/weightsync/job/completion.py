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
from dataclasses import dataclass, field
from typing import Any, Literal

from weightsync.ports.fleet.policy import Policy
from weightsync.ports.records import ReaderReport

State = Literal["complete", "failed", "waiting"]


@dataclass(frozen=True, slots=True)
class Completion:
    """What became of one version under the job's completion policy, as a writer saw it.

    Attributes:
        version: the version waited for.
        policy: the policy's text (``all``, ``quorum=K``, ``fraction=F``).
        needed: readers that must apply it.
        applied: reader ranks that applied it (or newer).
        missed: reader ranks that did not, with why: the error one reported, how it died, or
            ``"still applying"`` (a live reader the quorum did not wait for).
        state: ``complete`` (the policy is met), ``failed`` (it can no longer be met, or the
            deadline came), ``waiting``.
    """

    version: int
    policy: str
    needed: int
    applied: tuple[int, ...]
    missed: Mapping[int, str] = field(default_factory=dict)
    state: State = "waiting"

    def to_wire(self) -> dict[str, Any]:
        return {"version": self.version, "policy": self.policy, "needed": self.needed, "applied": list(self.applied),
                "missed": {str(r): why for r, why in sorted(self.missed.items())}, "state": self.state}

    def summary(self) -> str:
        """One line naming who applied and who missed the version, and why."""
        missed = "; ".join(f"reader {r}: {why}" for r, why in sorted(self.missed.items())[:8])
        more = f" (+{len(self.missed) - 8} more)" if len(self.missed) > 8 else ""
        return (f"version {self.version} under completion={self.policy}: {len(self.applied)} of the {self.needed} "
                f"reader(s) needed applied it" + (f"; missed: {missed}{more}" if missed else ""))


def judge(policy: Policy, version: int, *, readers: int, report: ReaderReport, dead: Mapping[int, str],
          expired: bool = False) -> Completion:
    """The state of ``version`` for reader ranks ``0..readers-1`` under ``policy``.

    ``report`` is the coordinator's reader report, ``dead`` the readers whose lease expired
    (rank -> how), ``expired`` whether the writer's deadline came. A reader that applied the
    version (or a newer one) counts whatever else is said of it; a dead reader that did not is
    out of the count (its restart takes a later version).
    """
    applied = set(report.applied(version, readers))
    failed = {r: why for r, why in report.failed(version, readers).items() if r not in applied}
    out = dict(failed)
    out.update({r: f"died before it applied version {version}: {why}" for r, why in dead.items()
                if r < readers and r not in applied and r not in failed})
    pending = [r for r in range(readers) if r not in applied and r not in out]
    needed = max(1, policy.needed(readers))
    missed = {**out, **dict.fromkeys(pending, "still applying")}
    if len(applied) >= needed:
        state: State = "complete"
    elif len(applied) + len(pending) < needed or expired:
        state = "failed"
        if expired:
            missed.update(dict.fromkeys(pending, "did not apply it by the deadline"))
    else:
        state = "waiting"
    return Completion(version, policy.text, needed, tuple(sorted(applied)), dict(sorted(missed.items())), state)


__all__ = ["Completion", "State", "judge"]
