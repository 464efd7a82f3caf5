"""The fleet protocol simulated (tests/fleet_sim.py): writers, readers and a coordinator applying
the real ``decide``, on a clock the test moves, under random joins, leaves, deaths, restarts,
stopped members and coordinator restarts. The invariants are checked after every step
(:meth:`fleet_sim.Sim.check`) and at every ``write()`` return; each schedule ends with a quiet
phase in which every live reader must converge to the newest version.

Two drivers: seeded plain-random schedules (10 x 1,000, cheap enough for the fast tier), and a
hypothesis state machine whose failures shrink to a short schedule.
"""

from __future__ import annotations

import collections
import random

import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from budget import examples
from fleet_sim import CONVERGE_STEPS, STEP_DTS, InvariantError, ReaderProc, Sim, WriterProc, run_schedule
from weightsync.ports.fleet import JobShape, Policy

CHUNKS, PER_CHUNK = 10, examples(1_000)


@pytest.mark.parametrize("chunk", range(CHUNKS))
def test_random_schedules_keep_every_invariant_and_converge(chunk: int) -> None:
    for seed in range(chunk * PER_CHUNK, (chunk + 1) * PER_CHUNK):
        try:
            run_schedule(seed)
        except InvariantError as exc:
            raise AssertionError(f"schedule seed {seed} (replay: fleet_sim.run_schedule({seed})): {exc}") from None


def test_the_schedules_reach_every_outcome_and_fault() -> None:
    """The schedules are not vacuous: writes succeed and fail in every way, readers catch up."""
    kinds: collections.Counter[str] = collections.Counter()
    quiet_steps = []
    for seed in range(300):
        sim = run_schedule(seed)
        kinds.update(o.kind for o in sim.outcomes)
        quiet_steps.append(sim.quiet_steps)
    assert {"ok", "readers_failed", "not_met", "timeout", "refused"} <= set(kinds), kinds
    assert kinds["ok"] > kinds["timeout"]
    # one lease (3 s) for the dead to leave, one deadline (5 s) for a write in flight, one write
    # more: about 13 steps of 1 s; the bound leaves room
    assert max(quiet_steps) <= CONVERGE_STEPS


def test_the_simulator_catches_a_coordinator_that_completes_tries_too_early(monkeypatch) -> None:
    """A decide that counts one reader as enough under every policy makes a write() succeed
    without its policy: the simulator must say so."""
    monkeypatch.setattr(Policy, "needed", lambda self, readers: 1)
    with pytest.raises(InvariantError, match="does not meet policy"):
        for seed in range(300):
            run_schedule(seed)


# -- the same simulator, driven by hypothesis (failures shrink to a short schedule) --------------

class FleetMachine(RuleBasedStateMachine):
    sim: Sim

    @initialize(writers=st.integers(1, 2), readers=st.sampled_from([None, 1, 2, 3]),
                policy=st.sampled_from(["all", "quorum=1", "quorum=2", "fraction=0.5"]), rng=st.randoms())
    def start(self, writers: int, readers: int | None, policy: str, rng: random.Random) -> None:
        parsed = Policy.parse(policy, deadline=5.0)
        if readers is not None and parsed.kind == "quorum":
            readers = max(readers, parsed.count)
        self.sim = Sim(JobShape(writers, readers, parsed), rng)

    def _pick(self, role: str | None, index: int):
        running = self.sim.running(role)
        return running[index % len(running)] if running else None

    @rule(dt=st.sampled_from(STEP_DTS))
    def step(self, dt: float) -> None:
        self.sim.step(dt)

    @rule(index=st.integers(0, 7))
    def kill(self, index: int) -> None:
        if (p := self._pick(None, index)) is not None:
            self.sim.kill(p)

    @rule(index=st.integers(0, 7))
    def restart(self, index: int) -> None:
        dead = [p for p in self.sim.procs if not p.running and not p.left and not p.replaced]
        if dead:
            self.sim.restart(dead[index % len(dead)])

    @rule(index=st.integers(0, 7), seconds=st.sampled_from([0.5, 2.0, 4.0, 8.0]))
    def pause(self, index: int, seconds: float) -> None:
        if (p := self._pick(None, index)) is not None:
            self.sim.pause(p, seconds)

    @rule(index=st.integers(0, 7), role=st.sampled_from(["reader", "writer"]))
    def leave(self, index: int, role: str) -> None:
        if (p := self._pick(role, index)) is not None:
            self.sim.leave(p)

    @precondition(lambda self: self.sim.shape.readers is None)
    @rule()
    def join_reader(self) -> None:
        self.sim.spawn("reader", None)

    @rule(down=st.sampled_from([0.0, 1.0, 4.0]))
    def restart_coordinator(self, down: float) -> None:
        self.sim.coordinator.restart(down)

    @rule()
    def churn_stops(self) -> None:
        """The quiet phase: every live reader converges; then churn may start again."""
        self.sim.settle()
        self.sim.quiet = False

    @invariant()
    def roles_hold_their_kind(self) -> None:
        for p in self.sim.procs:
            assert isinstance(p, WriterProc if p.role == "writer" else ReaderProc)

    def teardown(self) -> None:
        if hasattr(self, "sim"):
            self.sim.settle()


FleetMachine.TestCase.settings = settings(max_examples=examples(30), stateful_step_count=25, deadline=None,
                                          suppress_health_check=[HealthCheck.too_slow])
test_fleet_machine = FleetMachine.TestCase

