"""The fleet-wide commit (``SyncConfig(commit="fleet")``, issue 37): engines switch to a version together.

Four readers, each a stand-in engine that stages like vLLM and serves only what its loader
copied (``apply``), and one writer, as threads over shared memory with a real meta server. What
each test checks is what an engine serves, bitwise, and when each engine switched:

* no engine applies a version before the last reader staged it (with ``commit="each"`` the
  first three would have applied it before the fourth even started);
* one reader that fails its stage aborts the version for all of them under ``all``: every
  engine keeps serving the version it had, and the write names every reader;
* under a quorum a slow reader does not hold the others, and catches up on the committed version;
* with ``staleness=1`` a reader that skipped a version for a newer one counts as staged for it.

The decision itself, :func:`~weightsync.job.fleet_commit.commit_verdict`, is checked case by case.
"""

from __future__ import annotations

import contextlib
import threading
import time

import pytest
import torch

from weightsync.clock.deadline import Deadline
from weightsync.engines.buffers import ShardedEngine
from weightsync.engines.staging import StagedWeights
from weightsync.job.fleet_commit import commit_verdict
from weightsync.layout import ModelSpec
from weightsync.meta import EmbeddedMetaServer, MetaClient
from weightsync.ports.fleet.policy import Policy
from weightsync.roles.reader import WeightReader
from weightsync.roles.writer import ReadersFailedError, WeightWriter
from weightsync.session.combinations import CombinationError
from weightsync.session.sync_session import SyncConfig, SyncError
from weightsync.tools.tiny import CanonicalSource, canonical_weights, checkpoint_tensors, tiny_config
from weightsync.tools.torch_layout import fill_from_canonical
from weightsync.transport import TransportOptions

CONFIG = {**tiny_config(), "torch_dtype": "float32"}
READERS = 4
WAIT = 60.0


class SwitchingEngine(StagedWeights):
    """Serves ``model``, which only its loader writes; records when each version was applied."""

    def __init__(self, rank: int, *, fail_stage_of: int | None = None) -> None:
        super().__init__(ModelSpec.from_hf_config(CONFIG), dtype=torch.float32, device="cpu", rank=rank)
        self.model: dict[str, torch.Tensor] = {}
        self.switched_at: dict[int, float] = {}
        self.fail_stage_of = fail_stage_of

    def receiving(self, version: int) -> None:
        if version == self.fail_stage_of:
            raise RuntimeError(f"staging buffer of version {version} is unusable (injected)")
        super().receiving(version)

    def apply(self, version: int) -> None:
        self.switched_at[version] = time.monotonic()
        super().apply(version)

    def _load_items(self, items: list[tuple[str, torch.Tensor]]) -> None:
        self.model.update({name: t.clone() for name, t in items})

    def serves(self, seed: int) -> bool:
        want = checkpoint_tensors(canonical_weights(CONFIG, seed))
        return set(self.model) == set(want) and all(torch.equal(self.model[n], t) for n, t in want.items())


def engines(**faults: int) -> list[SwitchingEngine]:
    out = []
    for rank in range(READERS):
        engine = SwitchingEngine(rank, fail_stage_of=faults.get(f"reader{rank}"))
        engine.update(checkpoint_tensors(canonical_weights(CONFIG, 0)), version=0)
        out.append(engine)
    return out


def config(**settings: object) -> SyncConfig:
    return SyncConfig(num_writers=1, num_readers=READERS, transport="shm", timeout=WAIT, commit="fleet",
                      **settings)  # type: ignore[arg-type]


class Job:
    """A writer thread writing versions (version v holds seed v) and the test's readers."""

    def __init__(self, server: EmbeddedMetaServer | None, sync: SyncConfig, *, connect=None) -> None:
        self.server, self.sync = server, sync
        self._connect = connect  # another coordinator's client (an etcd cluster's), else the server's
        self.results: dict[int, object] = {}  # version -> WriteResult or the exception
        self.written: dict[int, threading.Event] = {}
        self.release = threading.Event()  # the writer stays up (its shared memory too) until the readers are done

    def meta(self) -> MetaClient:
        if self._connect is not None:
            return self._connect()
        assert self.server is not None
        return MetaClient(self.server.address, token=self.server.token)

    def write(self, versions: tuple[int, ...]) -> threading.Thread:
        self.written = {v: threading.Event() for v in versions}

        def run() -> None:
            source = CanonicalSource(CONFIG)
            with WeightWriter(source, rank=0, config=self.sync, meta=self.meta()) as writer:
                for version in versions:
                    fill_from_canonical(source.layout(), source.tensors(), canonical_weights(CONFIG, version))
                    try:
                        self.results[version] = writer.write(version)
                    except Exception as exc:  # checked by the test
                        self.results[version] = exc
                    self.written[version].set()
                self.release.wait(WAIT)

        thread = threading.Thread(target=run, daemon=True)
        thread.start()
        return thread


def run_readers(steps: list, timeout: float = 2 * WAIT) -> dict[int, object]:
    """Run ``steps[r]()`` on a thread per reader; each one's return value or exception."""
    out: dict[int, object] = {}

    def run(rank: int) -> None:
        try:
            out[rank] = steps[rank]()
        except Exception as exc:
            out[rank] = exc

    threads = [threading.Thread(target=run, args=(r,), daemon=True) for r in range(len(steps))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout)
    assert not any(t.is_alive() for t in threads), "a reader did not end"
    return out


def test_no_engine_switches_before_the_last_reader_staged_the_version():
    fleet = engines()
    staged_at: dict[int, float] = {}
    first_three = [threading.Event() for _ in range(3)]
    with EmbeddedMetaServer() as server, contextlib.ExitStack() as stack:
        job = Job(server, config())
        readers = [stack.enter_context(WeightReader(e, rank=r, config=job.sync, meta=job.meta()))
                   for r, e in enumerate(fleet)]
        writer = job.write((1, 2))

        def stage_then_apply(rank: int):
            def step():
                if rank == 3:  # the last reader joins, and receives once the others hold version 1 in staging
                    readers[rank].session.plan(Deadline.after(WAIT))
                    assert all(e.wait(WAIT) for e in first_three)
                received = readers[rank].receive(1, timeout=WAIT)
                staged_at[rank] = time.monotonic()
                if rank < 3:
                    first_three[rank].set()
                return readers[rank].apply(received)
            return step

        results = run_readers([stage_then_apply(r) for r in range(READERS)])
        assert all(not isinstance(r, Exception) for r in results.values()), results
        assert all(e.serves(1) and e.weight_version == 1 for e in fleet)
        switched = min(e.switched_at[1] for e in fleet)
        assert switched >= max(staged_at.values()), "an engine applied version 1 before every reader staged it"
        assert all("commit" in results[r].phases for r in range(READERS))  # each waited for the decision
        # version 2, read as a serving loop does
        results = run_readers([lambda r=r: readers[r].update(2, timeout=WAIT) for r in range(READERS)])
        assert all(e.serves(2) and e.weight_version == 2 for e in fleet), results
        job.release.set()
        writer.join(WAIT)
        assert not isinstance(job.results[1], Exception) and not isinstance(job.results[2], Exception), job.results


def test_a_failed_stage_aborts_the_version_for_every_engine_under_all():
    with EmbeddedMetaServer() as server:
        a_failed_stage_aborts_the_version(Job(server, config()))


def a_failed_stage_aborts_the_version(job: Job) -> None:
    """Reader 2's staging refuses version 1: no engine applies it, and version 2 reaches all of them
    (``tests/test_meta_etcd.py`` runs the same on an etcd cluster)."""
    fleet = engines(reader2=1)
    with contextlib.ExitStack() as stack:
        readers = [stack.enter_context(WeightReader(e, rank=r, config=job.sync, meta=job.meta()))
                   for r, e in enumerate(fleet)]
        writer = job.write((1, 2))
        results = run_readers([lambda r=r: readers[r].update(1, timeout=WAIT) for r in range(READERS)])
        assert all(isinstance(results[r], SyncError) for r in range(READERS)), results
        assert "unusable (injected)" in str(results[2])
        for r in (0, 1, 3):
            assert "not committed fleet-wide" in str(results[r]) and "reader(s) failed to stage it" in str(results[r])
        # no engine switched: each serves version 0, bitwise, as a valid version
        assert all(e.serves(0) and e.weight_version == 0 and e.invalid is None and 1 not in e.switched_at
                   for e in fleet)
        assert job.written[1].wait(WAIT)
        failed = job.results[1]
        assert isinstance(failed, ReadersFailedError) and sorted(failed.failed) == [0, 1, 2, 3], failed
        assert "not committed fleet-wide" in failed.failed[0]
        results = run_readers([lambda r=r: readers[r].update(2, timeout=WAIT) for r in range(READERS)])
        assert all(e.serves(2) and e.weight_version == 2 for e in fleet), results
        job.release.set()
        writer.join(WAIT)
        assert not isinstance(job.results[2], Exception), job.results[2]


def test_under_a_quorum_a_slow_reader_holds_no_one_and_catches_up_on_the_committed_version():
    fleet = engines()
    with EmbeddedMetaServer() as server, contextlib.ExitStack() as stack:
        job = Job(server, config(completion="quorum=3"))
        readers = [stack.enter_context(WeightReader(e, rank=r, config=job.sync, meta=job.meta()))
                   for r, e in enumerate(fleet)]
        writer = job.write((1,))

        def slow() -> object:
            readers[3].session.plan(Deadline.after(WAIT))  # it joined the job, then lags
            assert job.written[1].wait(WAIT)
            return readers[3].update(1, timeout=WAIT)

        steps = [lambda r=r: readers[r].update(1, timeout=WAIT) for r in range(3)] + [slow]
        results = run_readers(steps)
        assert all(not isinstance(r, Exception) for r in results.values()), results
        written = job.results[1]
        assert not isinstance(written, Exception), written
        assert written.completion.applied == (0, 1, 2) and 3 in written.completion.missed
        assert all(e.serves(1) and e.weight_version == 1 for e in fleet)  # reader 3 caught up
        assert fleet[3].switched_at[1] > max(e.switched_at[1] for e in fleet[:3])
        job.release.set()
        writer.join(WAIT)


def test_a_reader_that_skipped_a_version_for_a_newer_one_holds_no_one_on_the_skipped_version():
    """``staleness=1``: the writer goes on to version 2 while the fleet stages version 1. Reader 3
    was busy and takes version 2 first: it has moved past version 1, so it counts as staged for
    version 1, and the other three switch to version 1 at once instead of waiting for reader 3
    until version 1's deadline. Then all four serve version 2, bitwise."""
    fleet = engines()
    with EmbeddedMetaServer() as server, contextlib.ExitStack() as stack:
        job = Job(server, config(staleness=1, transport_options=TransportOptions(slots=2)))  # v2 beside v1
        readers = [stack.enter_context(WeightReader(e, rank=r, config=job.sync, meta=job.meta()))
                   for r, e in enumerate(fleet)]
        writer = job.write((1, 2))
        started = time.monotonic()
        took: dict[int, float] = {}

        def serving(rank: int) -> object:  # as a serving loop: version 1, then version 2
            readers[rank].update(1, timeout=WAIT)
            took[rank] = time.monotonic() - started
            assert fleet[rank].serves(1) and fleet[rank].weight_version == 1
            return readers[rank].update(2, timeout=WAIT)

        def busy() -> object:
            readers[3].session.plan(Deadline.after(WAIT))  # it joined the job, then was busy serving
            return readers[3].update(2, timeout=WAIT)  # waits for a version newer than 1

        results = run_readers([lambda r=r: serving(r) for r in range(3)] + [busy])
        assert all(not isinstance(r, Exception) for r in results.values()), results
        assert all(1 in fleet[r].switched_at for r in range(3)) and 1 not in fleet[3].switched_at
        # the skip counted: version 1 was not held until its deadline (WAIT, 60 s)
        assert max(took.values()) < WAIT / 4, took
        assert all(e.serves(2) and e.weight_version == 2 for e in fleet), results
        job.release.set()
        writer.join(WAIT)
        assert job.written[1].is_set() and job.written[2].is_set()
        assert not isinstance(job.results[2], Exception), job.results[2]


def test_readers_abort_within_one_lease_when_writer_0_dies_before_it_decides(monkeypatch):
    """Writer 0's process "dies" as it would decide (its heartbeat stops, nothing is decided): the
    readers, which staged the version, give it up within about one lease, naming writer 0, and
    every engine keeps serving version 0."""
    from weightsync.job.channel import JobChannel

    def die(channel, *args, **kwargs):
        channel.stop_heartbeat(release=False)  # its lease now runs out, as a killed process's does
        died.append(time.monotonic())

    died: list[float] = []
    monkeypatch.setattr(JobChannel, "decide_commit", die)
    fleet = engines()
    with EmbeddedMetaServer() as server, contextlib.ExitStack() as stack:
        job = Job(server, config(lease_seconds=0.5))
        readers = [stack.enter_context(WeightReader(e, rank=r, config=job.sync, meta=job.meta()))
                   for r, e in enumerate(fleet)]
        job.write((1,))
        gave_up: dict[int, float] = {}

        def read(rank: int) -> object:
            try:
                return readers[rank].update(1, timeout=WAIT)
            finally:
                gave_up[rank] = time.monotonic()

        results = run_readers([lambda r=r: read(r) for r in range(READERS)])
        assert died
        for r in range(READERS):
            assert isinstance(results[r], SyncError) and "writer 0 died before it decided" in str(results[r])
        assert all(e.serves(0) and e.weight_version == 0 and e.invalid is None for e in fleet)
        # named within a lease or two (0.5 s each) of the death, not at the 60 s deadline
        assert max(gave_up.values()) - died[0] < 5.0
        job.release.set()


def test_an_engine_that_receives_into_its_live_weights_is_refused():
    engine = ShardedEngine("hf", tiny_config(), 0)
    with pytest.raises(ValueError, match=r"commit='fleet' needs an engine that receives into staging only.*"
                                         r"ShardedEngine receives into its live weights"):
        WeightReader(engine, rank=0, config=SyncConfig(num_writers=1, num_readers=1, commit="fleet"))


def test_layer_phases_are_refused_with_the_fleet_commit():
    with pytest.raises(CombinationError, match="commit='fleet' with layer_phases=True"):
        SyncConfig(num_writers=1, num_readers=1, commit="fleet", layer_phases=True)
    with pytest.raises(ValueError, match=r"commit must be one of \['each', 'fleet'\], got 'all'"):
        SyncConfig.from_wire({"num_writers": 1, "num_readers": 1, "commit": "all"})


ALL, QUORUM = Policy.parse("all", deadline=1.0), Policy.parse("quorum=2", deadline=1.0)


@pytest.mark.parametrize(("policy", "reports", "decision", "words"), [
    (ALL, {"staged": 4, "failed": 0, "dead_unstaged": {}, "expired": False}, "commit", "4 of 4 readers staged"),
    (ALL, {"staged": 3, "failed": 0, "dead_unstaged": {}, "expired": False}, None, ""),
    (ALL, {"staged": 3, "failed": 1, "dead_unstaged": {}, "expired": False}, "abort", "1 reader(s) failed to stage it"),
    (ALL, {"staged": 3, "failed": 0, "dead_unstaged": {2: "lease expired"}, "expired": False}, "abort",
     "reader 2 died before it staged it: lease expired"),
    (ALL, {"staged": 1, "failed": 0, "dead_unstaged": {}, "expired": True}, "abort", "only 1 of 4 readers staged"),
    (QUORUM, {"staged": 2, "failed": 2, "dead_unstaged": {}, "expired": False}, "commit", "needs 2"),
    (QUORUM, {"staged": 1, "failed": 1, "dead_unstaged": {3: "gone"}, "expired": False}, None, ""),
    (QUORUM, {"staged": 1, "failed": 2, "dead_unstaged": {3: "gone"}, "expired": False}, "abort",
     "too few readers are left"),
    (QUORUM, {"staged": 1, "failed": 0, "dead_unstaged": {}, "expired": True}, "abort", "by the deadline"),
])
def test_the_commit_verdict(policy, reports, decision, words):
    verdict = commit_verdict(policy, 7, readers=4, **reports)
    if decision is None:
        assert verdict is None
        return
    assert verdict is not None and verdict.decision == decision and words in verdict.why, verdict
    assert verdict.needed == (4 if policy is ALL else 2)
