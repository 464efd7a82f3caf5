"""The completion policy of ``write`` (issue 36): ``all``, ``quorum=K``, ``fraction=F``.

The decision (:func:`weightsync.job.completion.judge`) is pure and tested case by case; the job
channel's wait is driven through a scripted coordinator, one report per call, so that no test
sleeps: each call of the fake answers the next step of the script (a reader applies, another
dies) and says whether the long-poll's condition held, as the meta server does.
"""

from __future__ import annotations

import pytest

from weightsync import SyncConfig
from weightsync.clock.deadline import Deadline
from weightsync.job.channel import JobChannel
from weightsync.job.completion import judge
from weightsync.ports.fleet.policy import Policy
from weightsync.ports.records import LeaseRow, ReaderReport
from weightsync.session.combinations import CombinationError


def report(**versions) -> ReaderReport:
    """Readers by rank (``r0=7``: applied 7; ``r1=("failed", 7, "why")``: failed 7; ``r2=None``)."""
    rows = []
    for name, value in versions.items():
        rank = int(name[1:])
        if isinstance(value, tuple):
            rows.append({"rank": rank, "version": None, "failed_version": value[1], "error": value[2]})
        else:
            rows.append({"rank": rank, "version": value, "failed_version": None, "error": None})
    return ReaderReport(None, tuple(rows))


QUORUM2 = Policy.parse("quorum=2", deadline=60.0)


def test_a_quorum_is_complete_once_enough_applied_and_names_who_missed():
    verdict = judge(QUORUM2, 7, readers=3, report=report(r0=7, r1=8, r2=6), dead={})
    assert verdict.state == "complete" and verdict.applied == (0, 1)
    assert verdict.missed == {2: "still applying"}
    assert "2 of the 2 reader(s) needed applied it; missed: reader 2: still applying" in verdict.summary()


def test_a_dead_reader_is_out_of_the_count_and_a_failing_one_too_until_the_quorum_is_impossible():
    dead = {2: "reader 2: lease expired"}
    waiting = judge(QUORUM2, 7, readers=3, report=report(r0=7, r1=6, r2=6), dead=dead)
    assert waiting.state == "waiting"  # reader 1 may still apply it
    failed = judge(QUORUM2, 7, readers=3, report=report(r0=7, r1=("failed", 7, "digest mismatch"), r2=6), dead=dead)
    assert failed.state == "failed"
    assert failed.missed == {1: "digest mismatch", 2: "died before it applied version 7: reader 2: lease expired"}


def test_a_reader_that_applied_counts_even_if_its_process_died_since():
    verdict = judge(QUORUM2, 7, readers=3, report=report(r0=7, r1=7, r2=5), dead={1: "expired"})
    assert verdict.state == "complete" and verdict.applied == (0, 1) and 1 not in verdict.missed


def test_at_the_deadline_an_unmet_policy_fails_naming_the_laggards():
    verdict = judge(QUORUM2, 7, readers=3, report=report(r0=7, r1=6, r2=6), dead={}, expired=True)
    assert verdict.state == "failed"
    assert verdict.missed == {1: "did not apply it by the deadline", 2: "did not apply it by the deadline"}


@pytest.mark.parametrize(("text", "readers", "needed"), [("fraction=0.5", 3, 2), ("fraction=0.25", 3, 1),
                                                         ("fraction=1", 4, 4), ("all", 3, 3), ("quorum=1", 5, 1)])
def test_the_readers_each_policy_needs(text, readers, needed):
    verdict = judge(Policy.parse(text, deadline=1.0), 3, readers=readers, report=report(), dead={})
    assert verdict.needed == needed and verdict.state == "waiting"


def test_a_policy_is_checked_where_the_config_is_written():
    assert SyncConfig(num_writers=1, num_readers=3, completion="quorum=2").policy == Policy("quorum", 2, deadline=300.0)
    with pytest.raises(ValueError, match=r"completion='quorum=4' needs 4 readers .* num_readers=3"):
        SyncConfig(num_writers=1, num_readers=3, completion="quorum=4")
    with pytest.raises(ValueError, match=r"completion: policy 'most' is not one of 'all', 'quorum=K'"):
        SyncConfig(num_writers=1, num_readers=3, completion="most")
    with pytest.raises(ValueError, match=r"WeightSyncInitInfo: completion: policy 'fraction=2'"):
        SyncConfig.from_wire({"num_writers": 1, "num_readers": 2, "completion": "fraction=2"},
                             where="WeightSyncInitInfo")


def test_nixl_takes_a_quorum_in_either_mode_and_torch_and_routed_are_refused_naming_the_process_group():
    """NIXL push took no quorum until wave 25 (a push writer waited on every reader); it goes
    on without a dead reader now (tests/test_transport_nixl.py). torch and routed writers send in
    one process group, which a dead reader breaks for every pair."""
    from weightsync import TransportOptions

    SyncConfig(num_writers=1, num_readers=3, transport="nixl", completion="quorum=2")  # auto: pull for 3 from 1
    SyncConfig(num_writers=2, num_readers=2, transport="nixl", completion="quorum=1")  # auto: push
    for mode in ("pull", "push"):
        SyncConfig(num_writers=2, num_readers=2, transport="nixl", completion="quorum=1",
                   transport_options=TransportOptions(nixl_mode=mode))
    for transport in ("torch", "routed"):
        with pytest.raises(CombinationError, match=rf"completion='quorum=1' with transport='{transport}': its "
                                                   "writers send to every reader themselves, in one process group"):
            SyncConfig(num_writers=2, num_readers=2, transport=transport, completion="quorum=1")


class ScriptedMeta:
    """A coordinator whose reader reports and leases follow a script, one step per long-poll."""

    def __init__(self, steps: list[tuple[ReaderReport, set[int]]]) -> None:
        self.steps, self.calls = list(steps), []
        self.now, self.dead = steps[0]

    def wait_reader_report(self, *, min_version, readers, timeout, settled=None, applied=0):
        self.calls.append((readers, settled, applied))
        if readers == 0:  # a read, not a wait
            return self.now
        if self.steps:
            self.now, self.dead = self.steps.pop(0)
        if self.now.enough(min_version, readers, settled=settled, applied=applied):
            return self.now
        raise TimeoutError("the long-poll's slice ran out")

    def reader_versions(self):
        return self.now.versions

    def leases(self):
        return [LeaseRow("reader", r, f"inc{r}", 10 + r, "h", 3.0, 0.1, alive=r not in self.dead, released=False,
                         detail=f"reader {r}: lease expired") for r in range(3)]


def channel(meta) -> JobChannel:
    chan = JobChannel(meta, role="writer", rank=0)
    chan.lease_seconds = 3.0
    return chan


def test_a_quorum_write_returns_as_soon_as_k_applied_without_waiting_for_the_dead_one():
    meta = ScriptedMeta([(report(r0=6, r1=6, r2=5), set()), (report(r0=7, r1=6, r2=5), {2}),
                         (report(r0=7, r1=7, r2=5), {2})])
    verdict = channel(meta).wait_completion(QUORUM2, min_version=7, readers=3, deadline=Deadline.after(30))
    assert verdict.state == "complete" and verdict.applied == (0, 1)
    assert verdict.missed == {2: "died before it applied version 7: reader 2: lease expired"}
    # the long-poll asked for a quorum of 2, and after reader 2's death for the two others only
    assert meta.calls[0] == (3, 3, 2) and (3, 2, 2) in meta.calls


def test_a_quorum_that_became_impossible_fails_within_the_lease_that_showed_it():
    meta = ScriptedMeta([(report(r0=6, r1=6, r2=5), set()),
                         (report(r0=7, r1=("failed", 7, "out of memory"), r2=5), {2})])
    verdict = channel(meta).wait_completion(QUORUM2, min_version=7, readers=3, deadline=Deadline.after(30))
    assert verdict.state == "failed" and verdict.applied == (0,)
    assert verdict.missed == {1: "out of memory", 2: "died before it applied version 7: reader 2: lease expired"}


def test_the_all_policy_wait_stops_waiting_for_a_dead_reader_once_the_live_ones_are_done():
    """Under ``all`` the writer's wait names a dead reader as failed, but only once the live
    readers are done: a slot-reuse wait must not return while a live reader reads the slot."""
    meta = ScriptedMeta([(report(r0=7, r1=6, r2=5), {2}), (report(r0=7, r1=6, r2=5), {2}),
                         (report(r0=7, r1=7, r2=5), {2})])
    failed = channel(meta).wait_readers(min_version=7, readers=3, deadline=Deadline.after(30))
    assert failed == {2: "died before it applied version 7: reader 2: lease expired"}
    assert meta.calls[-1] == (3, 2, 0)  # the last wait was for the two live readers


def test_a_dead_readers_restart_that_applied_does_not_stand_in_for_a_live_reader_still_reading():
    """Reader 2 died, and its restart applied the version while reader 1 is still reading the slot:
    the wait goes on until reader 1 is done (the server's count alone was met by reader 2)."""
    meta = ScriptedMeta([(report(r0=7, r1=6, r2=5), {2}), (report(r0=7, r1=6, r2=7), set()),
                         (report(r0=7, r1=7, r2=7), set())])
    assert channel(meta).wait_readers(min_version=7, readers=3, deadline=Deadline.after(30)) == {}
    assert meta.steps == [] and meta.calls[-1] == (3, None, 0)
