"""The fleet-wide commit (``SyncConfig(commit="fleet")``): every engine switches to a version together.

With ``commit="each"`` (the default) each reader applies a version as soon as its own bytes
arrived, so during a sync a fleet of engines serves a mix of versions for as long as the
slowest transfer takes. With ``commit="fleet"`` a version has two steps:

1. **Stage.** Each reader receives version V into staging (its engine keeps serving the
   version it had) and reports it staged (:meth:`FleetCommit.report_staged`), or reports that
   its stage failed.
2. **Commit.** Writer 0 decides once, for the whole fleet, from those reports and the
   readers' leases (:func:`commit_verdict`): *commit* once the job's completion policy is met
   by readers that staged V, *abort* once it no longer can be (under ``all``: one failed stage
   or one dead reader), or at the write's deadline. Readers wait for the decision
   (:meth:`FleetCommit.wait_commit`) and apply V on commit; on abort none applies it, each
   engine keeps the version it had, and the version fails for every reader with the reason.

The decision is one compare-and-set of a counter on the coordinator (0 undecided, 1 commit,
2 abort), so the first decision is the only one every reader sees, even when a newer version's
write or a restarted writer 0 decides concurrently. The reports are one counter per try of V,
staged readers in its low bits and failed ones above (:data:`FAILED_UNIT`), so that writer 0
long-polls one value and wakes at each report. Keys are per version *and* epoch: a version
written again after a failure is a new try, and stages of the old try do not count.

A reader that staged a newer version while an older one was still undecided (the writers ran
ahead, ``staleness > 0``) has *moved past* the older one: it counts as staged for it, so the
readers still on the older version are not held until its deadline.

A reader that staged V after V was committed applies it at once (it catches up; the switch
skew is the committed readers'), one that staged it after an abort does not apply it.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Literal

import msgpack

from weightsync.job.keys import commit_key, commit_why_key, stage_key, staged_key, version_epoch_key
from weightsync.job.parts import ChannelPart

if TYPE_CHECKING:
    from collections.abc import Iterable

    from weightsync.clock.deadline import Deadline
    from weightsync.ports.fleet.policy import Policy

logger = logging.getLogger("weightsync.job.channel")

#: a failed stage adds this to the try's report counter (a staged one adds 1): no fleet has a
#: million readers, so the two counts never mix
FAILED_UNIT = 1 << 20
UNDECIDED, COMMITTED, ABORTED = 0, 1, 2
Decision = Literal["commit", "abort"]


@dataclass(frozen=True)
class CommitVerdict:
    """Writer 0's decision on one try of a version, as every reader reads it."""

    decision: Decision
    why: str
    staged: int  # readers that had staged the version (or moved past it) when it was decided
    needed: int  # how many the policy needed

    def to_bytes(self) -> bytes:
        return msgpack.packb({"decision": self.decision, "why": self.why, "staged": self.staged,
                              "needed": self.needed}, use_bin_type=True)

    @staticmethod
    def from_bytes(blob: bytes | None, decision: Decision) -> CommitVerdict:
        """The verdict the coordinator's counter says was taken (``decision``), with its reasons
        from the document beside it when that is readable (a decision never depends on them)."""
        try:
            doc: Any = msgpack.unpackb(blob, raw=False) if blob else {}
        except (ValueError, msgpack.ExtraData, msgpack.FormatError, msgpack.StackError):
            doc = {}
        if not isinstance(doc, dict) or doc.get("decision") != decision:
            doc = {}
        why = doc.get("why")
        why = why if isinstance(why, str) else "no reason recorded"
        staged, needed = doc.get("staged"), doc.get("needed")
        return CommitVerdict(decision, why, staged if isinstance(staged, int) else -1,
                             needed if isinstance(needed, int) else -1)


def commit_verdict(policy: Policy, version: int, *, readers: int, staged: int, failed: int,
                   dead_unstaged: Mapping[int, str], expired: bool) -> CommitVerdict | None:
    """Writer 0's decision on ``version`` for reader ranks ``0..readers-1``, or None to wait on.

    ``staged``: readers that staged it (or moved past it); ``failed``: readers whose stage
    failed; ``dead_unstaged``: readers whose lease expired before they staged or failed it
    (rank -> how); ``expired``: the write's deadline came. Pure: every case is tested without
    processes or clocks.
    """
    needed = max(1, policy.needed(readers))
    if staged >= needed:
        return CommitVerdict("commit", f"{staged} of {readers} readers staged version {version} "
                             f"(the policy {policy.text!r} needs {needed})", staged, needed)
    out = failed + len(dead_unstaged)
    dead = "; ".join(f"reader {r} died before it staged it: {why}" for r, why in sorted(dead_unstaged.items()))
    if policy.kind == "all" and out:
        what = ", ".join(x for x in (f"{failed} reader(s) failed to stage it" if failed else "", dead) if x)
        return CommitVerdict("abort", f"version {version} cannot reach every reader: {what}", staged, needed)
    if readers - out < needed:
        return CommitVerdict("abort", f"too few readers are left to stage version {version}: {failed} failed, "
                             f"{len(dead_unstaged)} died ({dead or 'none'}); the policy {policy.text!r} needs {needed}",
                             staged, needed)
    if expired:
        return CommitVerdict("abort", f"only {staged} of {readers} readers staged version {version} by the "
                             f"deadline (the policy {policy.text!r} needs {needed})", staged, needed)
    return None


class FleetCommit(ChannelPart):
    """The fleet-commit part of :class:`~weightsync.job.channel.JobChannel` (which sets these attributes)."""

    # -- readers ------------------------------------------------------------------------------
    def report_staged(self, version: int, epoch: int, *, moved_past: Iterable[int] = ()) -> None:
        """This reader holds ``version`` (published in ``epoch``) in staging, checked. It has also
        moved past the versions ``moved_past`` (older ones it skipped): their undecided tries
        count it as staged."""
        for older in moved_past:
            decided = int(self.meta.counter(version_epoch_key(older)))  # its epoch + 1 (0: never started)
            if decided and int(self.meta.counter(commit_key(older, decided - 1))) == UNDECIDED:
                self._count(older, decided - 1, 1, "moved past")
        self._count(version, epoch, 1, "staged")

    def report_stage_failed(self, version: int, epoch: int, why: str) -> None:
        """This reader could not stage ``version``: writer 0 decides without waiting for it."""
        self._count(version, epoch, FAILED_UNIT, f"failed: {why[:500]}")

    def _count(self, version: int, epoch: int, unit: int, what: str) -> None:
        """Add this reader's report to the try's counter, once per reader and try."""
        mark = stage_key(version, epoch, self.rank)
        if self.meta.get_document(mark) is not None:
            return  # already counted (a retried report)
        self.meta.put_document(mark, what.encode())
        key = staged_key(version, epoch)
        held = 0  # a guess: a failed compare-and-set answers the value it found
        while True:
            done, held = self.meta.compare_and_set(key, expected=held, value=held + unit)
            if done:
                return
            held = int(held)

    def wait_commit(self, version: int, epoch: int, *, deadline: Deadline) -> CommitVerdict:
        """Writer 0's decision on ``version``, waiting for it in slices of a lease so that a writer 0
        that died before deciding is noticed within one lease (the version is then aborted here:
        no engine applies a version whose fleet-wide fate nobody will decide)."""
        key = commit_key(version, epoch)
        while True:
            step = deadline.remaining(0.0) if self.lease_seconds <= 0 else min(deadline.remaining(0.0),
                                                                                self.lease_seconds)
            held = int(self.meta.counter(key, at_least=COMMITTED, wait=step))
            if held == COMMITTED:  # the reasons are read only when they are shown (an abort)
                return CommitVerdict("commit", "committed", -1, -1)
            if held != UNDECIDED:
                reasons = self.meta.get_document(commit_why_key(version, epoch, "abort"))
                return CommitVerdict.from_bytes(reasons, "abort")
            dead = self.dead_peers("writer", [0], max_age=0.0)
            if dead:
                why = f"writer 0 died before it decided the fleet commit of version {version}: {dead[0]}"
            elif deadline.expired:
                why = f"no fleet-wide decision on version {version} came within the deadline"
            else:
                continue
            return CommitVerdict("abort", why, -1, -1)

    # -- writer 0 -----------------------------------------------------------------------------
    def decide_commit(self, policy: Policy, version: int, epoch: int, *, readers: int,
                      deadline: Deadline) -> CommitVerdict:
        """Writer 0: decide ``version``'s fleet commit (:func:`commit_verdict`) once the readers'
        reports allow it, and record it; returns the decision the fleet sees (another decider's,
        if one got there first)."""
        key = staged_key(version, epoch)
        seen = -1
        since_leases = time.monotonic()
        while True:
            step = deadline.remaining(0.0) if self.lease_seconds <= 0 else min(deadline.remaining(0.0),
                                                                                self.lease_seconds)
            value = int(self.meta.counter(key, at_least=seen + 1, wait=step))
            staged, failed = value % FAILED_UNIT, value // FAILED_UNIT
            dead: dict[int, str] = {}
            if value == seen or time.monotonic() - since_leases >= self.lease_seconds:  # a quiet slice: who died?
                since_leases = time.monotonic()
                dead = {r: why for r, why in self.dead_peers("reader", range(readers), max_age=0.0).items()
                        if self.meta.get_document(stage_key(version, epoch, r)) is None}
            seen = value
            verdict = commit_verdict(policy, version, readers=readers, staged=staged, failed=failed,
                                     dead_unstaged=dead, expired=deadline.expired)
            if verdict is not None:
                return self.record_commit(version, epoch, verdict)

    def record_commit(self, version: int, epoch: int, verdict: CommitVerdict) -> CommitVerdict:
        """Record ``verdict`` unless the try was decided already; the decision that stands."""
        if verdict.decision == "abort":  # the reasons readers show; a commit needs none
            self.meta.put_document(commit_why_key(version, epoch, verdict.decision), verdict.to_bytes())
        value = COMMITTED if verdict.decision == "commit" else ABORTED
        done, held = self.meta.compare_and_set(commit_key(version, epoch), expected=UNDECIDED, value=value)
        if done:
            logger.info("%s: fleet commit of version %d: %s (%s)", self.who, version, verdict.decision, verdict.why)
            return verdict
        if held == COMMITTED:
            return CommitVerdict("commit", "committed by another decision", -1, -1)
        return CommitVerdict.from_bytes(self.meta.get_document(commit_why_key(version, epoch, "abort")), "abort")


__all__ = ["ABORTED", "COMMITTED", "FAILED_UNIT", "UNDECIDED", "CommitVerdict", "FleetCommit", "commit_verdict"]
