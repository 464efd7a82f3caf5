"""The fault matrix: faults injected into real processes (transport x fault), run here and
nowhere else.

| fault | torch | shm | shm zero-copy | file | nixl pull | nixl push |
| --- | --- | --- | --- | --- | --- | --- |
| writer SIGKILL mid-send; both restart and write V again | yes | yes | heavy | yes | yes | yes |
| writer exits mid-send; only it restarts, both write V+1 | heavy, slow restart | yes | - | - | yes, slow restart | yes |
| writer exits, restarts at once for V+1; writer 0 is late | - | yes | - | - | - | - |
| reader SIGKILL as it receives V; restarted | yes | yes | heavy | yes | - | - |
| writer SIGKILL; only it rewrites V, the other writes V+1 | heavy | yes | - | yes | - | - |
| writer SIGSTOP (others fail in time); killed, restarted | yes | yes | heavy | yes | yes | yes |
| a writer and a reader SIGKILLed in V together; both restarted | yes | yes | yes | yes | yes | yes |
| writer SIGKILL after it joined V's epoch, before it connected | yes | yes | yes | yes | yes | yes |
| reader's engine poked between versions (delta) | yes | yes | heavy | yes | yes | yes |
| meta server killed and restarted (during, between) | shm (the coordinator's fault, not a transport's) |

plus routed in the poke row, the meta store's own faults (a flipped byte, a truncated or deleted
file, a full disk), and gloo's group faults one at a time. "heavy" cells run in
``make test-heavy``; each names, beside its mark, the default cell that checks the same
mechanism. A transport's own dead-peer unit cases live with the transport (the contract tier).

After each fault: every surviving reader ends on a complete version, bitwise; the job's next
version (or next attempt of the interrupted one) succeeds with the killed rank restarted; no
process is left and no ``/dev/shm/weightsync-*`` file leaks. Marked ``faults``; the run prints
the tally of injected and survived faults at its end (conftest.py).
"""

from __future__ import annotations

import json
import os
import signal
import time

import pytest

from fake_meta import FakeChannel
from meta_proc import MetaServerProcess
from test_sync_e2e import finish
from test_sync_e2e import launch as launch_rank
from weightsync.clock.deadline import Deadline
from weightsync.meta.client import EmbeddedMetaServer, MetaClient
from weightsync.transport import unavailable_reason

pytestmark = pytest.mark.faults

TIMEOUT = 20.0
#: Seconds from a rank's death to a survivor's failure that names it: the 3 s lease, a poll of
#: the leases, and slack for a loaded 2-core machine (issue 28 asks for 5 s; the timeout is 20 s)
DETECT = 8.0
#: What a call may take past its timeout (docs/faults.md, "A timeout that holds")
GRACE = 5.0
COMMON = {"source": "megatron:tp=2", "target": "vllm:tp=1,replicas=2", "num_writers": 2, "num_readers": 2,
          "config": "tiny-qwen3-moe", "timeout": TIMEOUT}


def shm_files() -> set[str]:
    return {n for n in os.listdir("/dev/shm") if n.startswith("weightsync")} if os.path.isdir("/dev/shm") else set()


#: pids of the rank processes the running test started (segment names carry their creator's pid)
LAUNCHED: set[int] = set()


def launch(*args, **kwargs):
    proc = launch_rank(*args, **kwargs)
    LAUNCHED.add(proc.pid)
    return proc


def creator(name: str) -> int | None:
    """The pid in a segment name (``weightsync-<pid>-...``, nixl's ``weightsync-<who>-e<n>-<pid>-...``)."""
    return next((int(part) for part in name.split("-")[1:] if part.isdigit()), None)


@pytest.fixture
def no_leaks():
    """No segment of this test's rank processes is left once they are gone (tests running beside
    this one under xdist have segments of their own, alive or about to be swept)."""
    LAUNCHED.clear()
    yield
    leaked = {n for n in shm_files() if creator(n) in LAUNCHED}
    assert leaked == set(), f"/dev/shm files leaked: {sorted(leaked)}"


#: every transport, with resharding (TP2 writers -> TP1 x 2 readers); shm both ways it exposes versions
TRANSPORTS = [
    pytest.param({"transport": "torch"}, id="torch"),
    pytest.param({"transport": "shm"}, id="shm-snapshot"),
    # shm with the trainer's parameters in /dev/shm: the contract tier covers it in the default run
    pytest.param({"transport": "shm", "shared_source": True}, id="shm-zero-copy", marks=pytest.mark.heavy),
    pytest.param({"transport": "file"}, id="file"),
]

def transport_name(options) -> str:
    name = options["transport"]
    if options.get("shared_source"):
        return f"{name} (zero-copy)"
    mode = options.get("transport_options", {}).get("nixl_mode")
    return f"{name} {mode}" if mode else name


@pytest.fixture
def tally(request):
    """Name the fault this test injects: conftest.py counts it (injected / survived / hangs) and
    prints the table at the end of the run, xdist workers included."""
    def record(fault: str, options) -> None:
        request.node.user_properties.append(("fault", f"{fault}|{transport_name(options)}"))

    return record


def skip_unavailable(options) -> None:
    if unavailable_reason(options["transport"]):
        pytest.skip(unavailable_reason(options["transport"]))


def died_at(stdout: str) -> float:
    """When the dying rank process emitted its last record (``died``), just before its fault."""
    return died_at_records([json.loads(line[7:]) for line in stdout.splitlines() if line.startswith("RESULT ")])


def died_at_records(records) -> float:
    return next(r["at"] for r in records if "died" in r)


def assert_noticed(records, death: float, dead: str | None, *, must_fail: bool = True) -> None:
    """The rank's first failure after ``death`` came within DETECT seconds and named ``dead``
    (with ``must_fail=False``, if it failed at all: one-sided writers need not wait for readers)."""
    failure = next((r for r in records if not r["ok"] and r["at"] > death), None)
    if failure is None and not must_fail:
        return
    assert failure is not None, records
    assert failure["at"] - death < DETECT and (dead is None or dead in failure["error"]), (failure["at"] - death,
                                                                                          failure)


def wait_for_lease(server, role: str, rank: int, pid: int) -> None:
    """Until process ``pid`` holds the lease of ``role`` ``rank`` (it joined the job)."""
    from weightsync.meta.client import open_meta

    deadline = Deadline.after(TIMEOUT * 4)
    with open_meta(server.address, token=server.token) as meta:
        while not any(row.role == role and row.rank == rank and row.pid == pid and row.alive
                      for row in meta.leases()):
            assert not deadline.expired, f"{role} {rank} (pid {pid}) did not join in time"
            time.sleep(0.2)


def assert_reader_ends_exact(out, rank, version):
    code, records, stderr = out[("reader", rank)]
    assert code == 0, stderr[-3000:]
    last = records[-1]
    assert last["ok"] and last["exact"] and last["version"] == version, (records, stderr[-3000:])
    for r in records[:-1]:
        assert r["ok"] or r["seconds"] < TIMEOUT + 10  # a failure ends within the timeout, never hangs


def test_a_restarted_rank_arriving_at_an_epoch_its_earlier_self_joined_fails_at_once():
    """The restarted torch reader of the SIGKILL case below came to the epoch its killed
    incarnation had joined: the arrival count was already full, and gloo's constructor then
    retried its pairs for 94 s under a 20 s timeout. The second arrival of a rank now fails at
    once, naming why, and the reader waits for the next epoch."""
    from weightsync.transport import TransportContext, TransportError, create_transport
    from weightsync.transport.endpoints import TorchArrival

    channel = FakeChannel("reader", 0)
    gloo = create_transport("torch", TransportContext(channel=channel, num_writers=1, num_readers=1, device="cpu"))
    channel.peer_publishes(0, "writer", 0, TorchArrival("w0"))  # writer 0 and the killed reader 0 formed
    channel.peer_publishes(0, "reader", 0, TorchArrival("killed"))  # the group of epoch 0
    started = time.monotonic()
    with pytest.raises(TransportError, match=r"reader 0: the process group of epoch 0 already counts an earlier "
                                             r"reader 0 \(process killed; .* takes part from the next epoch"):
        gloo._arrive(0, Deadline.after(TIMEOUT))
    assert time.monotonic() - started < 1.0


class _BrokenGroup:
    def send(self, *_):
        raise RuntimeError("Connection reset by peer")

    recv = send


class _Message:
    def describe(self) -> str:
        return "4096 bytes of w"


def test_a_send_posted_on_a_broken_group_past_the_deadline_fails_at_once():
    """A post that fails (the group broken by another lane) looked for a lease naming the dead
    rank for twice the ttl plus 1 s, whatever the deadline: writer 0's write() took 27.1 s
    under a 20 s timeout when only the killed writer restarted (the test below). The search now
    stays within the call's deadline."""
    import torch

    from weightsync.transport import TransportContext, TransportError, create_transport
    from weightsync.transport.base import TransferStats
    from weightsync.transport.torch.common import Pair
    from weightsync.transport.torch.gloo import _GlooLink, _LaneRun

    ctx = TransportContext(channel=FakeChannel("reader", 0, lease_seconds=3.0), num_writers=1, num_readers=1, device="cpu")
    gloo = create_transport("torch", ctx)
    run = _LaneRun(0, _BrokenGroup(), Deadline.after(0.0), TransferStats(1), [])
    link = _GlooLink(gloo, run, Pair(0, 0, []))  # type: ignore[arg-type]
    started = time.monotonic()
    with pytest.raises(TransportError, match=r"reader 0: transfer with writer 0 failed \(4096 bytes of w\): "
                                             "Connection reset by peer"):
        link.post("recv", torch.empty(1), _Message(), tag=0)  # type: ignore[arg-type]
    assert time.monotonic() - started < 1.0


def test_breaking_a_gloo_group_goes_past_the_pairs_of_dead_ranks():
    """gloo closes every pair of a group when a receive *times out*; on the pair of a rank that
    died the receive fails at once instead, and the other pairs stayed open (a writer's send to a
    live reader then waited its whole timeout, 1 run in 4 of the SIGKILL case below)."""
    from weightsync.transport.torch.gloo import break_group

    tried = []

    class _Work:
        def __init__(self, rank):
            self.rank = rank

        def wait(self, timeout):
            raise RuntimeError("Timed out waiting 1ms for recv operation to complete")

    class _Group:
        def recv(self, tensors, rank, tag):
            tried.append(rank)
            if rank == 1:  # the dead writer's pair
                raise RuntimeError("Connection reset by peer")
            return _Work(rank)

    break_group(_Group(), [1, 2, 3])
    assert tried[:2] == [1, 2]  # past the dead rank's pair, to one whose receive times out


def test_a_gloo_send_cut_off_mid_write_fails_the_write_within_seconds_of_the_death():
    """gloo fails the pending operations of a pair it closes, except a send whose bytes are
    partly written: that wait ran to its timeout (writer 0's write() took its whole 20 s, 1 run
    in 6 of the SIGKILL case below) however the group was broken. Here reader 0 takes part of a
    64 MiB message and gives up (it breaks its group); writer 0's guard then sees it dead and the
    write fails within seconds, naming it. The reader's memory stays as it was when it gave up."""
    import datetime
    import threading

    import torch
    import torch.distributed as dist

    from weightsync.transport import TransportContext, TransportError, create_transport
    from weightsync.transport.torch.common import Pair
    from weightsync.transport.torch.gloo import _GlooLink, break_group

    store, groups = dist.HashStore(), {}

    def form(rank: int) -> None:
        groups[rank] = dist.ProcessGroupGloo(dist.PrefixStore("cut", store), rank, 2, datetime.timedelta(seconds=10))

    formers = [threading.Thread(target=form, args=(rank,)) for rank in range(2)]
    for thread in formers:
        thread.start()
    for thread in formers:
        thread.join(timeout=TIMEOUT)
    channel = FakeChannel("writer", 0, lease_seconds=3.0)  # reader 0 dies when the test says so
    gloo = create_transport("torch", TransportContext(channel=channel, num_writers=1, num_readers=1))
    gloo._pg = groups[0]
    source, dest = torch.ones(64 << 20, dtype=torch.uint8), torch.zeros(64 << 20, dtype=torch.uint8)
    posted, gave_up = threading.Event(), {}

    def move(pair, run):
        link = _GlooLink(gloo, run, pair)
        sent = link.post("send", source, _Message(), tag=0)  # type: ignore[arg-type]
        posted.set()
        link.wait(sent)

    def reader_gives_up() -> None:
        posted.wait(TIMEOUT)
        groups[1].recv([dest], 0, 0)  # the writer starts writing...
        break_group(groups[1], [0])  # ...and the reader gives up (its pair closes) mid-message
        gave_up["dest"] = dest.clone()
        channel.dead[0] = "its lease expired"

    reader = threading.Thread(target=reader_gives_up)
    reader.start()
    started = time.monotonic()
    try:
        with pytest.raises(TransportError, match=r"writer 0: reader 0 died while this rank waited for version 1: "
                                                 "its lease expired"):
            gloo._run_pairs(1, Deadline.after(8.0), move, [Pair(0, 1, [])])
        elapsed = time.monotonic() - started
    finally:
        reader.join(timeout=TIMEOUT)
        for thread in threading.enumerate():  # a lane left behind ends at its deadline
            if thread.name.startswith("weightsync-torch"):
                thread.join(timeout=TIMEOUT)
    assert elapsed < 4.0, f"the write failed {elapsed:.1f} s after it started, 8 s its timeout"
    assert torch.equal(dest, gave_up["dest"])


def test_a_gloo_group_whose_peer_died_before_connecting_fails_to_form_within_seconds_of_the_death():
    """gloo's constructor cannot be interrupted: a rank that arrived at the epoch's store and then
    died before connecting cost its peers the whole timeout there, and under load far more (a
    group took 100 s to form under a 20 s timeout, "Connect timeout"). Reader 0 arrives (the
    store counts it) and never connects; its lease expires 0.5 s in: writer 0's formation fails
    within about a second of that, naming it, and the constructor it left behind ends alone."""
    import threading

    import torch.distributed as dist

    from weightsync.clock.deadline import Deadline
    from weightsync.transport import TransportContext, TransportError, create_transport

    store = dist.PrefixStore("formation", dist.HashStore())
    channel = FakeChannel("writer", 0, lease_seconds=3.0)  # reader 0 dies when the test says so
    gloo = create_transport("torch", TransportContext(channel=channel, num_writers=1, num_readers=1))
    gloo._store_for = lambda epoch, deadline: store  # both ranks arrived (the store's count is not what is tested)
    gloo._holders = {}

    def reader_dies() -> None:
        time.sleep(0.5)
        channel.dead[0] = "its lease expired"

    dying = threading.Thread(target=reader_dies)
    dying.start()
    started = time.monotonic()
    try:
        with pytest.raises(TransportError, match=r"writer 0: reader 0 died while this rank waited for the process "
                                                 "group of epoch 3 to form: its lease expired"):
            gloo._form_group(3, Deadline.after(5.0))
        elapsed = time.monotonic() - started
    finally:
        dying.join(timeout=TIMEOUT)
        for thread in threading.enumerate():  # the constructor left behind ends at its own timeout
            if thread.name.startswith("weightsync-gloo-form"):
                thread.join(timeout=TIMEOUT)
    assert elapsed < 3.0, f"the group failed to form {elapsed:.1f} s after it started, 5 s its timeout"


def test_a_dead_writer_or_reader_is_named_at_once_whether_it_arrived_or_not_and_a_seated_restart_is_waited_for():
    """A writer that died before it arrived at an epoch's store was waited for until the deadline,
    since its restart might come (issue 36: a dead writer named only at the 15 s timeout on torch).
    It is named within about a second now: it is out of the epoch (its seat there is closed, so its
    restart joins a later epoch), unless a restart took the seat first, which is waited for. A
    reader dead before it arrived, or after, is named within about a second too."""
    import threading

    from weightsync.clock.deadline import Deadline
    from weightsync.transport import TransportContext, TransportError, create_transport
    from weightsync.transport.endpoints import TorchArrival

    channel = FakeChannel("reader", 0, lease_seconds=3.0)
    gloo = create_transport("torch", TransportContext(channel=channel, num_writers=1, num_readers=1))
    channel.dead[0] = "its lease expired"  # writer 0 is dead and has not arrived
    started = time.monotonic()
    with pytest.raises(TransportError, match="reader 0: writer 0 died while this rank waited for every rank to join "
                                             r"the process group of epoch 2: it has no live process \(its lease "
                                             r"expired\) and never joined epoch 2"):
        gloo._arrive(2, Deadline.after(10.0))
    assert time.monotonic() - started < 2.0

    channel = FakeChannel("reader", 0, lease_seconds=3.0)
    channel.dead[0] = "its lease expired"
    gloo = create_transport("torch", TransportContext(channel=channel, num_writers=1, num_readers=1))
    channel.seated.add(0)  # its restart took its seat in the epoch before anyone closed it

    def restart_arrives() -> None:
        time.sleep(1.5)
        channel.dead.clear()  # its restart holds the rank
        channel.peer_publishes(2, "writer", 0, TorchArrival("restart"))

    restart = threading.Thread(target=restart_arrives)
    restart.start()
    try:
        gloo._arrive(2, Deadline.after(10.0))  # waits for the restart instead of failing
    finally:
        restart.join(timeout=TIMEOUT)

    channel = FakeChannel("writer", 0, lease_seconds=3.0)
    for epoch, arrived in ((3, False), (4, True)):  # reader 0 dead before it arrived, and after
        gloo = create_transport("torch", TransportContext(channel=channel, num_writers=1, num_readers=2))
        if arrived:  # reader 0 arrives, then dies (reader 1 is on its way)
            channel.peer_publishes(epoch, "reader", 0, TorchArrival("r0"))
        channel.dead[0] = "its lease expired"
        started = time.monotonic()
        with pytest.raises(TransportError, match="writer 0: reader 0 died while this rank waited for every rank to "
                                                 f"join the process group of epoch {epoch}: its lease expired"):
            gloo._arrive(epoch, Deadline.after(10.0))
        assert time.monotonic() - started < 2.0, arrived


class _LeftEpoch(FakeChannel):
    """Writer 0 is alive but left epoch 2 (it saw it fail after writer 0 decided the retry there)."""

    def writers_out_of_epoch(self, epoch, ranks) -> dict[int, str]:
        return {0: "its process (pid 7 on vm) left epoch 2: it takes part only in later epochs"} if 0 in ranks else {}


def test_a_writer_that_left_the_epoch_is_named_at_the_rendezvous_though_alive():
    """The epoch race of the torch reader-restart case (1 run in 4 of the suite, `make test-heavy`
    until wave 23): a live writer that left the epoch was waited for at its rendezvous until the
    deadline, since only dead peers were looked for there. It is named at the next look."""
    from weightsync.clock.deadline import Deadline
    from weightsync.transport import TransportContext, TransportError, create_transport

    channel = _LeftEpoch("reader", 0, lease_seconds=3.0)
    gloo = create_transport("torch", TransportContext(channel=channel, num_writers=1, num_readers=1))
    started = time.monotonic()
    with pytest.raises(TransportError, match="reader 0: writer 0 will not come to the process group of epoch 2: its "
                                             r"process .* left epoch 2"):
        gloo._arrive(2, Deadline.after(10.0))
    assert time.monotonic() - started < 2.0


class _StaleLeases(FakeChannel):
    """Leases as the job channel caches them: an answer up to a quarter second old says reader 0's
    old process expired; a fresh one (``max_age=0``) that its restart holds the rank."""

    def dead_peers(self, role, ranks, *, max_age=0.25, known=None, departed=True) -> dict[int, str]:
        stale = {0: "pid 1 on vm, last heartbeat 3.1 s ago: its lease expired"} if max_age > 0 else {}
        return {r: why for r, why in stale.items() if r in set(ranks) and role == "reader"}


def test_a_restart_that_registered_and_arrived_since_the_leases_were_read_is_not_its_dead_predecessor():
    """Writer 1 was SIGKILLed in version 1; its restart registered and arrived at the store of the
    epoch that rewrites it within the quarter second for which a reader's lease answers are cached.
    The reader saw writer 1 arrived (fresh) and dead (the cached lease of the killed process),
    failed the group's formation naming the dead process, and every other rank then timed out
    forming it: the version was never written again (2 runs in 3 of the torch SIGKILL case once
    processes started faster). The arrivals are now confirmed against fresh leases. Here from
    writer 0's side, with reader 0 restarted."""
    import threading

    from weightsync.clock.deadline import Deadline
    from weightsync.transport import TransportContext, create_transport
    from weightsync.transport.endpoints import TorchArrival

    channel = _StaleLeases("writer", 0, lease_seconds=3.0)
    gloo = create_transport("torch", TransportContext(channel=channel, num_writers=1, num_readers=2))
    channel.peer_publishes(3, "reader", 0, TorchArrival("restart"))  # reader 0's restart arrived; reader 1 is on
    # its way

    def reader_1_arrives() -> None:
        time.sleep(1.5)  # past three looks at the leases
        channel.peer_publishes(3, "reader", 1, TorchArrival("r1"))

    late = threading.Thread(target=reader_1_arrives)
    late.start()
    try:
        gloo._arrive(3, Deadline.after(10.0))  # the group forms
    finally:
        late.join(timeout=TIMEOUT)


#: both NIXL modes too (this case is the one every transport runs: the others have their own rows)
NIXL = [pytest.param({"transport": "nixl", "transport_options": {"nixl_mode": "pull"}}, id="nixl-pull"),
        pytest.param({"transport": "nixl", "transport_options": {"nixl_mode": "push"}}, id="nixl-push")]


@pytest.mark.parametrize("options", TRANSPORTS + NIXL)
def test_writer_sigkilled_mid_transfer_restarts_and_writes_the_version_again(options, no_leaks, tally):
    skip_unavailable(options)
    tally("writer SIGKILL mid-send; both writers restart and write V again", options)
    common = {**COMMON, **options}
    with EmbeddedMetaServer() as server:
        procs = {("writer", 0): launch(server, "writer", 0, versions=[0, 1], **common),
                 ("writer", 1): launch(server, "writer", 1, versions=[0, 1], die_at=1, die_how="SIGKILL", **common)}
        procs |= {("reader", r): launch(server, "reader", r, until=1, **common) for r in range(2)}
        first = {rank: procs.pop(("writer", rank)) for rank in range(2)}
        died = finish({1: first[1]}, TIMEOUT * 4)[1]
        survived = finish({0: first[0]}, TIMEOUT * 4)[0]
        assert died[0] == -signal.SIGKILL
        assert survived[0] == 0, (survived[0], json.dumps(survived[1]), survived[2][-3000:])
        assert_noticed(survived[1], died_at_records(died[1]), "writer 1")
        for rank in range(2):
            procs[("writer", rank)] = launch(server, "writer", rank, versions=[1], **common)
        out = finish(procs, TIMEOUT * 8)
    for rank in range(2):
        assert_reader_ends_exact(out, rank, 1)
        code, records, stderr = out[("writer", rank)]
        assert code == 0 and records[-1]["ok"], (records, stderr[-3000:])


@pytest.mark.parametrize(("transport", "options"), [
    # over gloo, writer 0 can take past two timeouts to fail version 1 under CI's load (the gloo
    # overrun of test_faults.py's _GLOO_FORMATION_OVERRUN): `make test-heavy`; the restarted writer's
    # wait for writer 0 is checked below on shm, and this case runs by default with a slow restart
    pytest.param("torch", {}, id="torch", marks=pytest.mark.heavy),
    # torch, writer 1's restart coming up only after writer 0 reached version 2's rendezvous:
    # writer 0 waits there for it (it gave version 2 up at once, since writer 1's lease had
    # expired, and the restart then waited for a version 2 no one wrote; 1 run in 4 under load)
    pytest.param("torch", {"start_delay": 6.0}, id="torch-slow-restart"),
    pytest.param("shm", {}, id="shm"),
    pytest.param("nixl", {"nixl_mode": "pull"}, id="nixl-pull"),
    # pull, writer 1's restart coming up only after writer 0 started version 2: writer 0 waits for
    # it (it had given version 2 up at once and closed its memory, which the restart's part then
    # completed, and readers failed: "remote agent ... was disconnected", seen in CI)
    pytest.param("nixl", {"nixl_mode": "pull", "start_delay": 6.0}, id="nixl-pull-slow-restart"),
    # push: writer 0's WRITEs of version 1 land, and its wait for readers ends when they report
    # failing version 1 (a failed reader is done with that version)
    pytest.param("nixl", {"nixl_mode": "push"}, id="nixl-push"),
])
def test_writer_killed_mid_transfer_then_only_it_restarts_and_the_next_version_succeeds(transport, options, no_leaks,
                                                                                        tally):
    if unavailable_reason(transport):
        pytest.skip(unavailable_reason(transport))
    tally("writer exits mid-send; only it restarts, and both write V+1", {"transport": transport, "transport_options": options})
    timeout = 20.0  # generous: the restarted writer must import torch on a loaded 2-core machine
    options = dict(options)
    start_delay = options.pop("start_delay", 0.0)
    common = {"source": "megatron:tp=2", "target": "vllm:tp=1,replicas=2", "num_writers": 2, "num_readers": 2,
              "transport": transport, "config": "tiny-qwen3-moe", "timeout": timeout,
              "transport_options": options}
    with EmbeddedMetaServer() as server:
        procs = {("writer", 0): launch(server, "writer", 0, versions=[0, 1, 2], **common),
                 ("writer", 1): launch(server, "writer", 1, versions=[0, 1], die_at=1, **common)}
        # each reader updates until it holds version 2 (three updates, or two when nixl pull skips 1)
        procs |= {("reader", r): launch(server, "reader", r, until=2, **common) for r in range(2)}
        first = procs.pop(("writer", 1))
        first.wait(timeout * 4)
        assert first.returncode == 3  # died part-way through version 1
        procs[("writer", 1)] = launch(server, "writer", 1, versions=[2], start_delay=start_delay, **common)  # restarted
        out = finish(procs, timeout * 6)
    for rank in range(2):
        code, records, stderr = out[("reader", rank)]
        assert code == 0, stderr[-3000:]
        if options.get("nixl_mode") == "pull" and records[1]["ok"]:
            # nixl pull: version 1 was never published (writer 1 died before it published), and
            # when the restarted writer 1 comes back within the reader's timeout, the reader's
            # next update takes version 2, the newest, without a failure on the way
            ok0, ok2 = records
            assert ok0["ok"] and ok0["exact"] and ok0["version"] == 0
            assert ok2["ok"] and ok2["exact"] and ok2["version"] == 2, (out, stderr[-3000:])
            continue
        ok0, failed, ok2 = records
        assert ok0["ok"] and ok0["exact"] and ok0["version"] == 0
        assert not failed["ok"]
        assert failed["seconds"] < timeout + 5
        if transport in ("torch", "shm") or options.get("nixl_mode") == "push":
            # torch and nixl push: bytes were arriving; shm: writers publish before packing and
            # readers copy while they pack. Either way the engine knows it is not at a valid version,
            assert failed["weight_version"] is None
            assert failed["reported"] is None  # and the meta server was told so
        elif failed["weight_version"] is None:
            # nixl pull, on a loaded machine: writer 0 learns of writer 1's death within seconds and
            # moves on to version 2 beside the restarted writer 1; a reader that began pulling an
            # attempt that then failed says its engine holds no valid version, as above
            assert failed["reported"] is None, failed
        else:  # nixl pull: version 1 was never published, so nothing was touched
            assert failed["weight_version"] == 0 and failed["reported"] == 0, failed
            assert "no version newer than 0" in failed["error"]
        assert ok2["ok"] and ok2["exact"] and ok2["version"] == 2, (out, stderr[-3000:])
    code, records, stderr = out[("writer", 1)]
    assert code == 0 and records[-1]["ok"], stderr[-3000:]


def test_a_restarted_writer_waits_for_writer_0_to_be_done_with_the_version_its_predecessor_died_in(tmp_path, no_leaks,
                                                                                                  tally):
    """Writer 1 dies in version 1 and restarts at once to write version 2; writer 0 reaches
    version 2 only after more than one timeout (here it is held; in CI, failing version 1 on
    its transport's timeout did it). The restarted writer waits for it, as it would for a slow
    trainer step, and version 2 completes everywhere. (Before a restarted writer's first write
    waited one more timeout for writer 0, it failed: "writer 0 did not start version 2 in epoch 0
    or later in time", as CI saw in the torch case of the test above.)"""
    tally("writer exits mid-send, restarts at once for V+1; writer 0 is late", {"transport": "shm"})
    timeout = 6.0
    flags = tmp_path / "flags"
    flags.mkdir()
    common = {"source": "megatron:tp=2", "target": "vllm:tp=1,replicas=2", "num_writers": 2, "num_readers": 2,
              "transport": "shm", "config": "tiny-qwen3-moe", "timeout": timeout}
    with EmbeddedMetaServer() as server:
        procs = {("writer", 0): launch(server, "writer", 0, versions=[0, 1, 2], pause_before=2, flag_dir=str(flags),
                                       **common)}
        procs |= {("reader", r): launch(server, "reader", r, versions=[0, 1, 2], **{**common, "timeout": 60.0})
                  for r in range(2)}
        first = launch(server, "writer", 1, versions=[0, 1], die_at=1, **common)
        first.wait(timeout * 8)
        assert first.returncode == 3  # died part-way through version 1
        procs[("writer", 1)] = launch(server, "writer", 1, versions=[2], **common)
        deadline = Deadline.after(timeout * 8)
        while not (flags / "held").exists():  # writer 0 failed version 1 and holds before version 2
            assert not deadline.expired, "writer 0 never reached version 2"
            time.sleep(0.1)
        time.sleep(timeout * 1.5)  # more than the restarted writer's own timeout
        (flags / "go").touch()
        out = finish(procs, timeout * 10)
    code, records, stderr = out[("writer", 1)]
    assert code == 0 and [(r["version"], r["ok"]) for r in records] == [(2, True)], (records, stderr[-3000:])
    for rank in range(2):
        code, records, stderr = out[("reader", rank)]
        assert code == 0 and records[-1]["version"] == 2 and records[-1]["ok"] and records[-1]["exact"], (
            records, stderr[-3000:])


#: The torch cell ran only in `make test-heavy` until wave 23: after a try failed, writer 0 could decide
#: the retry's epoch while writer 1 then moved past that epoch (it saw it fail too); writer 1 waited for a
#: later decision and writer 0 for writer 1 at the epoch's rendezvous, both until their timeouts (1 run in 4
#: of the suite over gloo). Writer 1 now leaves its seat in the epochs below its new floor, the rendezvous
#: names it at once ("its process left epoch E"), and writer 0's retry joins it in the next epoch
#: (`test_a_writer_that_left_the_epoch_is_named_at_the_rendezvous_though_alive`).
@pytest.mark.parametrize("options", TRANSPORTS)
def test_reader_sigkilled_mid_transfer_the_other_carries_on_and_the_restarted_one_catches_up(options, no_leaks,
                                                                                              tally, tmp_path):
    skip_unavailable(options)
    tally("reader SIGKILL as it receives V; restarted", options)
    common = {**COMMON, **options}
    flags = tmp_path / "flags"
    flags.mkdir()
    with EmbeddedMetaServer() as server:
        # retries: version 1 fails when the dead reader's lease expires; the retry fails too if
        # the restarted reader joins while it is in flight (the writers' connections do not include
        # it), which a loaded machine makes likely; the trainer writes it again, as after any failure.
        # The writers fail version 1 within seconds of the death, so they hold version 2 until
        # the restarted reader joined (a trainer's next step takes longer than a restart).
        procs = {("writer", r): launch(server, "writer", r, versions=[0, 1, 2], retries=2, pause_before=2,
                                       flag_dir=str(flags), **common)
                 for r in range(2)}
        procs[("reader", 0)] = launch(server, "reader", 0, until=2, **common)
        dying = launch(server, "reader", 1, until=2, die_at=1, die_how="SIGKILL", **common)
        stdout, _ = dying.communicate(timeout=TIMEOUT * 4)
        assert dying.returncode == -signal.SIGKILL
        procs[("reader", 1)] = launch(server, "reader", 1, until=2, **common)
        wait_for_lease(server, "reader", 1, procs[("reader", 1)].pid)
        (flags / "go").touch()
        out = finish(procs, TIMEOUT * 8)
    for rank in range(2):
        assert_reader_ends_exact(out, rank, 2)
        code, records, stderr = out[("writer", rank)]
        assert code == 0 and records[-1]["version"] == 2 and records[-1]["ok"], (records, stderr[-3000:])
        # in time, naming it, even when the restarted reader took its lease over before anyone
        # saw it expire (gloo: the pair that broke is often another's, see GlooTransport._blame)
        assert_noticed(records, died_at(stdout), "reader 1", must_fail=False)


KILLED_TOGETHER = [pytest.param({"transport": "torch"}, id="torch"),
                   pytest.param({"transport": "shm"}, id="shm-snapshot"),
                   pytest.param({"transport": "shm", "shared_source": True}, id="shm-zero-copy"),
                   pytest.param({"transport": "file"}, id="file"),
                   pytest.param({"transport": "nixl", "transport_options": {"nixl_mode": "pull"}}, id="nixl-pull"),
                   pytest.param({"transport": "nixl", "transport_options": {"nixl_mode": "push"}}, id="nixl-push")]


@pytest.mark.parametrize("options", KILLED_TOGETHER)
def test_a_writer_and_a_reader_killed_together_and_restarted_together_recover_by_themselves(options, no_leaks,
                                                                                            tally):
    """Issue 36's probe: writer 1 and reader 1 are SIGKILLed in version 1 together, and both come
    back together; readers call ``update()`` as a serving loop does, and writer 0 goes on training.
    On torch this never recovered (the readers' updates took the version that had failed in an
    earlier epoch, its rendezvous refusing connections, and the writers timed out with "only 3 of
    4 ranks joined"): every reader must end on the last version, bitwise, with no help. On shared
    memory the restarted reader took version 1 from the segment of the dead writer 1 and waited
    there until its timeout (it watched writer 1's lease, which the restart holds: alive), and
    writer 0 waited as long for it: a segment names the process that made it now."""
    skip_unavailable(options)
    tally("a writer and a reader SIGKILLed in V together; both restarted together", options)
    common = {**COMMON, **options}
    with EmbeddedMetaServer() as server:
        # writer 0's trainer retries version 1 while the restarted rank resumes at version 2: until
        # wave 23 they waited for each other until their timeouts (63 s on torch); writer 0 now gives
        # version 1 up (superseded) and its next write joins version 2
        procs = {("writer", 0): launch(server, "writer", 0, versions=[0, 1, 2, 3], retries={"1": 2}, **common),
                 ("reader", 0): launch(server, "reader", 0, until=3, **common)}
        # where writers publish after they write (file, NIXL pull), a writer that dies in V never
        # published it and no reader receives it: the test kills the reader as the writer dies
        receives = options["transport"] in ("torch", "shm") or options.get("transport_options", {}).get(
            "nixl_mode") == "push"
        reader_fault = {"die_at": 1, "die_how": "SIGKILL"} if receives else {}
        dying = [launch(server, "writer", 1, versions=[0, 1], die_at=1, die_how="SIGKILL", **common),
                 launch(server, "reader", 1, until=3, **reader_fault, **common)]
        if not receives:
            dying[0].communicate(timeout=TIMEOUT * 4)
            dying[1].send_signal(signal.SIGKILL)
        for proc in dying:  # the writer may see the reader's death first, fail version 1 and exit
            proc.communicate(timeout=TIMEOUT * 4)
        assert dying[1].returncode == -signal.SIGKILL and dying[0].returncode in (0, -signal.SIGKILL), [
            p.returncode for p in dying]
        restarted = time.time()
        procs[("writer", 1)] = launch(server, "writer", 1, versions=[2, 3], **common)
        procs[("reader", 1)] = launch(server, "reader", 1, until=3, **common)
        out = finish(procs, TIMEOUT * 10)
    for rank in range(2):
        assert_reader_ends_exact(out, rank, 3)
        code, records, stderr = out[("writer", rank)]
        assert code == 0 and records[-1]["version"] == 3 and records[-1]["ok"], (records, stderr[-3000:])
    # by themselves: no update or write waited for a timeout on the way (they recover within a
    # lease or two of the restart, not after one)
    ends = [r["at"] for _, records, _ in out.values() for r in records if r.get("version") == 3 and r["ok"]]
    slow = [(who, round(r["at"] - restarted, 2), r.get("version"), r.get("error", "")[:400])
            for who, (_, records, _) in sorted(out.items()) for r in records if r.get("seconds", 0) > DETECT]
    assert max(ends) - restarted < TIMEOUT, (max(ends) - restarted, slow)


@pytest.mark.parametrize("options", KILLED_TOGETHER)
def test_a_writer_killed_after_it_joined_an_epoch_but_before_it_connected_is_named_within_a_lease(options, no_leaks,
                                                                                                   tally):
    """Issue 36's probe saw a dead writer named only at the timeout on torch (15 s, one of two kills)
    and NIXL: the torch rendezvous and the endpoint waits waited for a dead writer that had not
    arrived, in case its restart came to the epoch. Writer 1 is SIGKILLed after it joined version
    0's epoch, before its transport connected there; its restart comes at once. Every rank's
    failure of version 0 now names writer 1 within a lease or two of its death (the epoch is not
    the restart's: its predecessor took the seat), and version 0, written again, reaches every
    reader with the restart."""
    skip_unavailable(options)
    tally("a writer SIGKILLed after it joined V's epoch, before it connected; restarted", options)
    common = {**COMMON, **options}
    with EmbeddedMetaServer() as server:
        # writer 0 writes version 0 again where its write failed (two-sided), else goes on to version 1
        # (one-sided: its part was out, the readers failed it); the restart resumes at version 0, and
        # gives it up at once when writer 0 went on
        procs = {("writer", 0): launch(server, "writer", 0, versions=[0, 1], retries=2, **common)}
        procs |= {("reader", r): launch(server, "reader", r, until=1, **common) for r in range(2)}
        dying = launch(server, "writer", 1, versions=[0], die_connecting=0, **common)
        stdout, _ = dying.communicate(timeout=TIMEOUT * 4)
        assert dying.returncode == -signal.SIGKILL, dying.returncode
        death = died_at(stdout)
        procs[("writer", 1)] = launch(server, "writer", 1, versions=[0, 1], **common)
        out = finish(procs, TIMEOUT * 8)
    for rank in range(2):
        code, records, stderr = out[("writer", rank)]
        assert code == 0 and records[-1]["version"] == 1 and records[-1]["ok"], (records, stderr[-3000:])
        assert_reader_ends_exact(out, rank, 1)
        # a reader names writer 1, or writer 0's rendezvous that closed when writer 0 gave the epoch up
        assert_noticed(out[("reader", rank)][1], death, None, must_fail=False)
    # writer 0 names writer 1, or (NIXL push, shm zero-copy) the readers that gave the version up for it
    assert_noticed(out[("writer", 0)][1], death, None)
    assert any("writer 1" in r.get("error", "") for _, records, _ in out.values() for r in records), out
    ends = [r["at"] for _, records, _ in out.values() for r in records if r.get("version") == 1 and r["ok"]]
    assert max(ends) - death < TIMEOUT, max(ends) - death  # no call waited for its timeout on the way


#: one-sided transports, where a dead reader is no part of a writer's send (file runs in `make
#: test-heavy`: the same completion wait over another transport's slots)
QUORUM_TRANSPORTS = [pytest.param({"transport": "shm"}, id="shm"),
                     pytest.param({"transport": "file"}, id="file", marks=pytest.mark.heavy),
                     pytest.param({"transport": "nixl", "transport_options": {"nixl_mode": "pull"}}, id="nixl-pull",
                                  marks=pytest.mark.heavy)]
#: a quorum over a fixed set of readers also holds where a writer WRITEs to every reader: it goes
#: on without the one that died (an elastic set takes the one-sided transports only)
FIXED_QUORUM_TRANSPORTS = [*QUORUM_TRANSPORTS, pytest.param({"transport": "nixl", "transport_options": {
    "nixl_mode": "push"}}, id="nixl-push")]


@pytest.mark.parametrize("options", FIXED_QUORUM_TRANSPORTS)
def test_under_a_quorum_a_killed_reader_fails_no_write_and_its_restart_catches_up(options, no_leaks, tally,
                                                                                 tmp_path):
    """Issue 36's completion policy: 3 readers, ``completion="quorum=2"``. Reader 2 is SIGKILLed
    as it receives version 1; versions 1 and 2 complete with readers 0 and 1 (each write says
    reader 2 missed them), and a restart of reader 2 catches up to version 3 bitwise. Under
    ``completion="all"`` the writers' ``write(1)`` fails with ReadersFailedError."""
    skip_unavailable(options)
    tally("reader SIGKILL under completion='quorum=2' of 3 readers: no write fails", options)
    common = {**COMMON, **options, "num_readers": 3, "target": "vllm:tp=1,replicas=3", "completion": "quorum=2"}
    flags = tmp_path / "flags"
    flags.mkdir()
    with EmbeddedMetaServer() as server:
        # the writers stay up after version 3 (a trainer goes on): reader 2's restart gets it whenever it comes
        writers = {("writer", r): launch(server, "writer", r, versions=[0, 1, 2, 3], pause_before=3, stay_until="done",
                                         flag_dir=str(flags), **common) for r in range(2)}
        procs = {("reader", r): launch(server, "reader", r, until=3, **common) for r in range(2)}
        dying = launch(server, "reader", 2, until=3, die_at=1, die_how="SIGKILL", **common)
        dying.communicate(timeout=TIMEOUT * 4)
        assert dying.returncode == -signal.SIGKILL
        deadline = Deadline.after(TIMEOUT * 4)
        with MetaClient(server.address, token=server.token) as meta:
            while not all((meta.reader_versions().get(r) or -1) >= 2 for r in range(2)):
                assert not deadline.expired, meta.reader_versions()
                time.sleep(0.2)
        procs[("reader", 2)] = launch(server, "reader", 2, until=3, **common)
        wait_for_lease(server, "reader", 2, procs[("reader", 2)].pid)
        (flags / "go").touch()
        out = finish(procs, TIMEOUT * 8)
        (flags / "done").touch()
        out |= finish(writers, TIMEOUT)
        with MetaClient(server.address, token=server.token) as meta:
            status = meta.status()
    for rank in range(3):
        assert_reader_ends_exact(out, rank, 3)
    # the status page's record: reader 2 missed versions 1 and 2, and its restart caught up
    shown = {c["version"]: c for c in status["completions"]}
    assert shown.keys() == {0, 1, 2, 3} and all(c["state"] == "complete" for c in shown.values()), shown
    assert [shown[v]["caught_up"] for v in (1, 2)] == [[2], [2]], shown
    for rank in range(2):
        code, records, stderr = out[("writer", rank)]
        assert code == 0 and [r["version"] for r in records] == [0, 1, 2, 3], (records, stderr[-3000:])
        assert all(r["ok"] for r in records), records
        for r in records[1:3]:  # written while reader 2 was dead
            completion = r["completion"]
            assert completion["state"] == "complete" and completion["applied"] == [0, 1], r
            # named dead once its lease expired (3 s), until then still applying as far as anyone knows
            assert list(completion["missed"]) == ["2"], r
            assert r["seconds"] < DETECT, r  # no wait for the dead reader


def churn(options, flags, *, writers: int, readers: int, versions: int, quorum: int, every: float,
          seed: int, coordinator: str | None = None, elastic: bool = False) -> None:
    """Issue 36's churn: ``writers`` writers write ``versions`` versions, a training step apart, under
    ``quorum=K`` of ``readers`` reader processes; every ``every`` seconds a random reader is
    SIGKILLed and a new process takes its rank at once (seeded). Every version completes; every
    version a reader reports holds bitwise; every reader ends on the last version; the status
    record shows each version complete. ``coordinator``: an etcd address (else an embedded meta
    server, whose status page is checked too). ``elastic``: ``num_readers=None``, and each
    ``every`` seconds either a random reader is SIGKILLed for good (while more than ``K + 1`` are
    up) or a new engine joins on the lowest free seat: the fleet shrinks and grows."""
    import contextlib
    import random
    import types

    from weightsync.meta.client import open_meta

    rng = random.Random(seed)
    last = versions - 1
    common = {**COMMON, **options, "source": f"megatron:tp={writers}", "num_writers": writers,
              "num_readers": None if elastic else readers, "completion": f"quorum={quorum}",
              "target": f"vllm:tp=1,replicas={4096 if elastic else readers}",
              **({"tries": 2 * versions} if elastic else {})}
    ended: list[tuple[int, object]] = []  # (rank, process) of every reader killed
    joined: set[int] = set()  # seats an engine joined while versions flowed (elastic)
    with contextlib.ExitStack() as stack:
        server = (stack.enter_context(EmbeddedMetaServer()) if coordinator is None
                  else types.SimpleNamespace(address=coordinator, token=""))
        # the writer stays up after its last version (a trainer goes on): readers started late get it
        trainers = {("writer", w): launch(server, "writer", w, versions=list(range(versions)), step_seconds=0.25,
                                          stay_until="done", flag_dir=str(flags), **common) for w in range(writers)}
        live = {r: launch(server, "reader", r, until=last, **common) for r in range(readers)}
        wait_for_lease(server, "reader", readers - 1, live[readers - 1].pid)
        deadline = Deadline.after(TIMEOUT * 8)
        with open_meta(server.address, token=server.token) as meta:
            while getattr(meta.latest_version(), "version", -1) < last:
                assert all(p.poll() is None for p in trainers.values()) and not deadline.expired, \
                    "the writers did not write every version"
                time.sleep(every)
                if elastic and (len(live) > quorum + 1 and rng.random() < 0.5):  # one leaves, for good
                    rank = rng.choice(sorted(live))
                    live[rank].kill()
                    ended.append((rank, live.pop(rank)))
                elif elastic:  # a new engine joins
                    rank = min(set(range(len(live) + 1)) - set(live))
                    live[rank] = launch(server, "reader", rank, until=last, **common)
                    joined.add(rank)
                else:
                    rank = rng.randrange(readers)
                    if live[rank].poll() is None:
                        live[rank].kill()
                        ended.append((rank, live[rank]))
                        live[rank] = launch(server, "reader", rank, until=last, **common)
            out = finish({("reader", r): p for r, p in live.items()}, TIMEOUT * 4)
            (flags / "done").touch()
            out |= finish(trainers, TIMEOUT)
            killed = finish({("killed", i): p for i, (_, p) in enumerate(ended)}, TIMEOUT)
            status = meta.status() if coordinator is None else {"completions": []}
    for w in range(writers):
        code, records, stderr = out[("writer", w)]
        assert code == 0 and [r["version"] for r in records] == list(range(versions)), (records, stderr[-3000:])
        assert all(r["ok"] and r["completion"]["state"] == "complete" for r in records), records
    for key in out:
        if key[0] == "reader":
            assert_reader_ends_exact(out, key[1], last)
    # every reader, killed or not, reported only versions it held bitwise
    wrong = [(key, r) for key, (_, records, _) in [*killed.items(), *out.items()] for r in records
             if r.get("role") == "reader" and r["ok"] and not r["exact"]]
    assert len(ended) >= 3 and wrong == [], (len(ended), wrong)
    assert not elastic or len(joined) >= 3, joined
    assert all(c["state"] == "complete" for c in status["completions"]), status["completions"]


#: issue 36's size (16 readers, 100 versions, 1-2 writers): on shm in the default run (56 s here
#: alone, wave 24; until then a 1 x 4 case of 16 versions stood in for it), on file in `make test-heavy`
CHURN = [pytest.param({"transport": "shm"}, 2, 16, 100, 10, id="shm-2x16"),
         pytest.param({"transport": "file"}, 1, 16, 100, 10, id="file-1x16", marks=pytest.mark.heavy)]


@pytest.mark.parametrize(("options", "writers", "readers", "versions", "quorum"), CHURN)
def test_churn_readers_killed_and_replaced_at_random_under_a_quorum_every_version_completes(
        options, writers, readers, versions, quorum, no_leaks, tally, tmp_path):
    skip_unavailable(options)
    tally(f"churn: a random reader of {readers} SIGKILLed and replaced every 1.5 s, quorum={quorum}", options)
    churn(options, tmp_path, writers=writers, readers=readers, versions=versions, quorum=quorum, every=1.5, seed=36)


#: an elastic fleet that shrinks and grows, at issue 36's size: 16 engines at start (59 s here alone)
ELASTIC_CHURN = [pytest.param({"transport": "shm"}, 2, 16, 100, 8, id="shm-2x16")]


@pytest.mark.parametrize(("options", "writers", "readers", "versions", "quorum"), ELASTIC_CHURN)
def test_an_elastic_fleet_that_shrinks_and_grows_at_random_completes_every_version_under_a_quorum(
        options, writers, readers, versions, quorum, no_leaks, tally, tmp_path):
    """Readers die for good and new engines join at random (seeded) while versions flow: writer 0
    drops each dead reader from the next version's plan, each new one takes the newest version
    at once and follows; every version completes and every reader ends on the last, bitwise."""
    skip_unavailable(options)
    tally(f"elastic churn: of {readers} engines at start, one dies or one joins every second, quorum={quorum}",
          options)
    churn(options, tmp_path, writers=writers, readers=readers, versions=versions, quorum=quorum, every=1.0, seed=18,
          elastic=True)


def _wait_past(meta, version: int, procs) -> int:
    """Until the job's newest version is past ``version`` (every process in ``procs`` still up); returns it."""
    deadline = Deadline.after(TIMEOUT * 4)
    while (latest := getattr(meta.latest_version(), "version", -1)) <= version:
        assert all(p.poll() is None for p in procs) and not deadline.expired, f"version {version + 1} never came"
        time.sleep(0.1)
    return latest


@pytest.mark.parametrize("options", QUORUM_TRANSPORTS)  # an elastic set takes a quorum: the one-sided transports
def test_elastic_readers_join_and_leave_while_versions_flow_and_every_write_completes(options, no_leaks, tally,
                                                                                      tmp_path):
    skip_unavailable(options)
    tally("elastic readers: one dies, two join on new seats, quorum=1", options)
    elastic(options, tmp_path)


def elastic(options, flags, *, coordinator: str | None = None) -> None:
    """``num_readers=None`` (issue 36's elastic readers) under ``quorum=1``: readers 0 and 1 start
    with the writer; reader 0 is SIGKILLed (it leaves by dying) and reader 2 joins on a new seat
    while versions flow. The writer then pauses between two versions (a long training step), and
    reader 3 joins: it takes the newest version at once, before any other is written. Every write
    completes; a joining reader's first version is received in full and bitwise; every live reader
    ends on the last version, bitwise; the dead seat never fails a write. ``coordinator``: an
    etcd address (else an embedded meta server)."""
    import contextlib
    import types

    from weightsync.meta.client import open_meta

    versions, pause = 40, 12  # the writer waits before version 12 until the test says go
    last = versions - 1
    # each seat a replica, laid out as the vLLM backend lays out an elastic set's workers (one per seat)
    common = {**COMMON, **options, "source": "megatron:tp=1", "num_writers": 1, "num_readers": None,
              "target": "vllm:tp=1,replicas=4096", "completion": "quorum=1",
              "tries": 2 * versions}  # updates a reader makes at most: one per version, and room for failures
    with contextlib.ExitStack() as stack:
        server = (stack.enter_context(EmbeddedMetaServer()) if coordinator is None
                  else types.SimpleNamespace(address=coordinator, token=""))
        meta = stack.enter_context(open_meta(server.address, token=server.token))
        writer = launch(server, "writer", 0, versions=list(range(versions)), step_seconds=0.3, stay_until="done",
                        pause_before=pause, flag_dir=str(flags), **common)
        live = {r: launch(server, "reader", r, until=last, **common) for r in (0, 1)}
        _wait_past(meta, 2, [writer, *live.values()])
        dead = live.pop(0)
        dead.kill()
        killed = finish({("killed", 0): dead}, TIMEOUT)
        joined = _wait_past(meta, -1, [writer])  # the newest version as reader 2 starts
        live[2] = launch(server, "reader", 2, until=last, **common)
        _wait_past(meta, pause - 2, [writer, *live.values()])
        deadline = Deadline.after(TIMEOUT * 4)
        while not (flags / "held").exists():  # the writer is between versions pause - 1 and pause
            assert writer.poll() is None and not deadline.expired, "the writer never paused"
            time.sleep(0.05)
        live[3] = launch(server, "reader", 3, until=last, **common)
        while meta.reader_versions().get(3) != pause - 1:  # the newest version, with no newer one coming
            assert live[3].poll() is None and not deadline.expired, "reader 3 did not take the newest version"
            time.sleep(0.1)
        (flags / "go").touch()
        out = finish({("reader", r): p for r, p in live.items()}, TIMEOUT * 8)
        (flags / "done").touch()
        out |= finish({("writer", 0): writer}, TIMEOUT)
    code, records, stderr = out[("writer", 0)]
    assert code == 0 and [r["version"] for r in records] == list(range(versions)), (records, stderr[-3000:])
    assert all(r["ok"] and r["completion"]["state"] == "complete" for r in records), records
    for rank in (1, 2, 3):
        assert_reader_ends_exact(out, rank, last)
    firsts = {rank: next(r for r in out[("reader", rank)][1] if r["ok"]) for rank in (2, 3)}
    assert firsts[2]["version"] >= joined and firsts[3]["version"] == pause - 1, firsts
    assert all(r["bytes"] == r["needed"] > 0 for r in firsts.values()), firsts  # in full
    wrong = [(key, r) for key, (_, recs, _) in [*killed.items(), *out.items()] for r in recs
             if r.get("role") == "reader" and r["ok"] and not r["exact"]]
    assert wrong == [], wrong


#: what an elastic set runs with beside its joins and leaves: deltas (weights moving ~2% per
#: version), in-band integrity and layer phases together, or nothing more
_FEATURES = {"sparse": True, "integrity": True, "layer_phases": True, "transport_options": {"delta_anchor_every": 100}}
ELASTIC_CASES = [pytest.param(p.values[0], features, id=f"{p.id}-{name}",
                              marks=[*p.marks, *([pytest.mark.heavy] if name == "plain" else [])])
                 for p in QUORUM_TRANSPORTS for name, features in (("delta-integrity-phases", _FEATURES), ("plain", {}))]


# `make test-heavy` runs the plain case and file and NIXL pull; the default run the one over shm with every feature
@pytest.mark.parametrize(("options", "features"), ELASTIC_CASES)
def test_under_all_readers_that_leave_die_or_stall_are_planned_no_more_and_the_stalled_one_joins_again(
        options, features, no_leaks, tally, tmp_path):
    """``num_readers=None`` with ``completion="all"``: a reader that left (cleanly, or by dying,
    or stalled past its lease) is dropped from the next version's plan by writer 0, so ``all``
    counts the readers that are there. Reader 1 leaves cleanly after version 3: no write fails
    for it. Reader 0 is SIGKILLed: at most the version it died in fails, naming it, within the
    timeout. Reader 3 joins. Reader 2 is SIGSTOPped until three more versions came out without
    it, then continues: it finds itself dropped, joins again and ends on the last version. Every
    live reader ends bitwise on the last version, every call within its timeout."""
    import signal

    from weightsync.meta.client import open_meta

    skip_unavailable(options)
    tally("elastic readers under all: one leaves, one dies, one stalls past its lease", options)
    versions = 36
    last = versions - 1
    common = {**COMMON, **options, **features, "source": "megatron:tp=1", "num_writers": 1, "num_readers": None,
              "target": "vllm:tp=1,replicas=4096", "completion": "all", "tries": 2 * versions,
              "transport_options": {**options.get("transport_options", {}), **features.get("transport_options", {})}}
    with EmbeddedMetaServer() as server, open_meta(server.address, token=server.token) as meta:
        writer = launch(server, "writer", 0, versions=list(range(versions)), step_seconds=0.3, stay_until="done",
                        flag_dir=str(tmp_path), **common)
        live = {r: launch(server, "reader", r, until=last, **common) for r in (0, 2)}
        out = finish({("reader", 1): launch(server, "reader", 1, until=3, **common)}, TIMEOUT * 4)  # it leaves
        _wait_past(meta, 6, [writer, *live.values()])
        dead = live.pop(0)
        dead.kill()
        killed = finish({("killed", 0): dead}, TIMEOUT)
        live[3] = launch(server, "reader", 3, until=last, **common)
        stalled = _wait_past(meta, 14, [writer, *live.values()])
        os.kill(live[2].pid, signal.SIGSTOP)
        try:
            _wait_past(meta, stalled + 3, [writer, live[3]])  # written without it: it was dropped
        finally:
            os.kill(live[2].pid, signal.SIGCONT)
        out |= finish({("reader", r): p for r, p in live.items()}, TIMEOUT * 8)
        (tmp_path / "done").touch()
        out |= finish({("writer", 0): writer}, TIMEOUT)
    code, records, stderr = out[("writer", 0)]
    assert code == 0 and sorted({r["version"] for r in records}) == list(range(versions)), (records, stderr[-3000:])
    failed = [r for r in records if not r["ok"]]
    assert {r["version"] for r in records if r["version"] <= 6} <= {r["version"] for r in records if r["ok"]}, failed
    assert len(failed) <= 2 and all("reader 0" in r["error"] or "reader 2" in r["error"] for r in failed), failed
    assert_calls_end_in_time({**out, **killed})
    assert [r["version"] for r in out[("reader", 1)][1] if r["ok"]][-1] == 3
    for rank in (2, 3):
        assert_reader_ends_exact(out, rank, last)
    wrong = [(key, r) for key, (_, recs, _) in [*killed.items(), *out.items()] for r in recs
             if r.get("role") == "reader" and r["ok"] and not r["exact"]]
    assert wrong == [], wrong


def assert_calls_end_in_time(out) -> None:
    """Every write() and update() of every rank ended within its timeout plus the documented
    grace (docs/faults.md), whatever the recovery flow made it wait for."""
    late = [(role, rank, r["version"], round(r["seconds"], 1), r.get("error", "")[:300])
            for (role, rank), (_, records, _) in out.items() for r in records
            if "seconds" in r and r["seconds"] > TIMEOUT + GRACE]
    assert late == [], late


#: two-sided (torch) and both one-sided paths (shm's polls; file's directory): the recovery flows
#: differ by those, not by shm's zero-copy mode (CI time)
RESTART_TRANSPORTS = [p for p in TRANSPORTS if p.id != "shm-zero-copy"]  # (its marks dropped with it)


#: torch runs in `make test-heavy` (40-50 s here, up to 150 s in CI), strictly: the shm and file cells
#: check the same recovery flow by default. (It was a non-strict xfail while a later epoch's gloo group
#: could take ~100 s to form under a 20 s timeout; formation is bounded by the deadline since
#: test_a_gloo_group_whose_peer_died_before_connecting_fails_to_form_within_seconds_of_the_death, and the
#: case passed 3 runs in 3 at load average 9.)
RESTART_CASES = [pytest.param(*p.values, id=p.id, marks=pytest.mark.heavy) if p.id == "torch" else p
                 for p in RESTART_TRANSPORTS]


@pytest.mark.parametrize("options", RESTART_CASES)
def test_only_the_killed_writer_restarts_and_rewrites_its_version_while_the_other_moved_on(options, no_leaks, tally,
                                                                                           tmp_path):
    """Writer 1 is SIGKILLed in version 1; writer 0 fails it and goes on to version 2 while the
    restarted writer 1 writes version 1 again (the trainer of that rank retries its step). The
    two disagree until writer 1 gives version 1 up: every call in between ends within its
    timeout plus the grace (on 3ee4748 a write() took 96.5 s under a 20 s timeout), and the
    job then carries on, bitwise. Writer 1 gives version 1 up within seconds of writer 0's
    decision of version 2 (writer 0 never starts version 1 again; it waited for its timeout
    before), so the job does not stall for a timeout (issue 36)."""
    skip_unavailable(options)
    tally("writer SIGKILL mid-send; only it restarts and writes V again, the other writes V+1", options)
    common = {**COMMON, **options}
    flags = tmp_path / "flags"
    flags.mkdir()
    with EmbeddedMetaServer() as server:
        # writer 0 does not write version 1 again (it goes on, as a trainer whose step failed
        # might); writer 1 gives version 1 up once writer 0 decided version 2, and joins it
        procs = {("writer", 0): launch(server, "writer", 0, versions=[0, 1, 2, 3], retries={"3": 2}, pause_before=2,
                                       flag_dir=str(flags), **common)}
        dying = launch(server, "writer", 1, versions=[0, 1], die_at=1, die_how="SIGKILL", **common)
        procs |= {("reader", r): launch(server, "reader", r, until=3, **common) for r in range(2)}
        stdout, _ = dying.communicate(timeout=TIMEOUT * 4)
        assert dying.returncode == -signal.SIGKILL
        procs[("writer", 1)] = launch(server, "writer", 1, versions=[1, 2, 3], retries={"3": 2}, **common)
        wait_for_lease(server, "writer", 1, procs[("writer", 1)].pid)
        (flags / "go").touch()  # writer 0 moves on to version 2 while writer 1 writes version 1 again
        out = finish(procs, TIMEOUT * 10)
    assert_calls_end_in_time(out)
    for rank in range(2):
        assert_reader_ends_exact(out, rank, 3)
        code, records, stderr = out[("writer", rank)]
        assert code == 0 and records[-1]["version"] == 3 and records[-1]["ok"], (records, stderr[-3000:])
    assert_noticed(out[("writer", 0)][1], died_at(stdout), "writer 1")
    given_up = out[("writer", 1)][1][0]
    assert given_up["version"] == 1 and not given_up["ok"] and given_up["seconds"] < DETECT, given_up
    assert "writer 0 writes version 2 now, so version 1 is superseded" in given_up["error"], given_up


@pytest.mark.parametrize("options", TRANSPORTS + NIXL)  # NIXL: issue 36 saw a SIGSTOP named only at the timeout
def test_writer_sigstopped_others_fail_in_time_then_a_restart_completes_the_version(options, no_leaks, tally):
    skip_unavailable(options)
    tally("writer SIGSTOP mid-send (others fail in time); killed, both writers restart", options)
    common = {**COMMON, **options}
    with EmbeddedMetaServer() as server:
        procs = {("writer", 0): launch(server, "writer", 0, versions=[0, 1], **common)}
        stopped = launch(server, "writer", 1, versions=[0, 1], die_at=1, die_how="SIGSTOP", **common)
        procs |= {("reader", r): launch(server, "reader", r, until=1, **common) for r in range(2)}
        try:
            code, records, _ = finish({"w0": procs.pop(("writer", 0))}, TIMEOUT * 4)["w0"]
            assert code == 0 and not records[-1]["ok"] and records[-1]["seconds"] < TIMEOUT + 10, records
        finally:
            stopped.kill()  # frozen: the operator (or torchrun) kills it
            stdout, _ = stopped.communicate(timeout=TIMEOUT)
        assert_noticed(records, died_at(stdout), "writer 1")
        for rank in range(2):
            procs[("writer", rank)] = launch(server, "writer", rank, versions=[1], **common)
        out = finish(procs, TIMEOUT * 8)
    for rank in range(2):
        assert_reader_ends_exact(out, rank, 1)


# -- a reader's version is true of its memory (issue 28 section 1) ---------------------------------------------------

#: what each poke does to reader 0 between two versions (tests/_sync_worker.py: poke)
POKES = {"rollback": "engine version rolled back (a manual update to an older version)",
         "none": "engine version set to None (a manual update failed half-way)",
         "reset": "destination reset in place (load_state_dict of version 0), version unchanged",
         "flip": "one bit flipped in the destination, version unchanged",
         "scratch": "a destination tensor reused as scratch, version unchanged"}
#: delta on every transport it reaches (full versions at 0 and every 100th); NCCL refuses it
#: (tests/test_transport_delta.py)
DELTA = {"delta_anchor_every": 100}
DELTA_TRANSPORTS = [
    pytest.param({"transport": "torch"}, id="torch"),
    pytest.param({"transport": "shm"}, id="shm-snapshot"),
    pytest.param({"transport": "shm", "shared_source": True}, id="shm-zero-copy", marks=pytest.mark.heavy),
    pytest.param({"transport": "routed", "hosts": {"writer": ["a", "a"], "reader": ["a", "b"]}}, id="routed"),
    pytest.param({"transport": "nixl"}, id="nixl-pull"),  # nixl_mode 'auto' picks pull with deltas
    pytest.param({"transport": "nixl", "transport_options": {"nixl_mode": "push"}}, id="nixl-push"),
    pytest.param({"transport": "file"}, id="file"),
]


def run_poked(options, pokes: dict[int, str], versions: int, *, delta: bool):
    """2 writers -> 2 readers, weights changing ~2% per version; reader 0 is poked before the
    versions in ``pokes``, reader 1 is not. Returns every rank's records."""
    options = dict(options)
    hosts = options.pop("hosts", {})
    common = {**COMMON, **options, "sparse": True, "versions": list(range(versions))}
    if delta:
        common["transport_options"] = {**options.get("transport_options", {}), **DELTA}
    with EmbeddedMetaServer() as server:
        procs = {(role, r): launch(server, role, r, **common, host=hosts.get(role, ["", ""])[r],
                                   **({"pokes": {str(v): how for v, how in pokes.items()}} if (role, r) == (
                                       "reader", 0) else {}))
                 for role in ("writer", "reader") for r in range(2)}
        out = finish(procs, TIMEOUT * (versions + 4))
    for (role, rank), (code, records, stderr) in out.items():
        assert code == 0, f"{role} {rank}:\n{stderr[-3000:]}"
        assert [r["version"] for r in records] == list(range(versions)), (role, rank, records, stderr[-3000:])
        failed = [r for r in records if not r["ok"]]
        assert not failed, (role, rank, json.dumps(failed), stderr[-3000:])  # whole: pytest's repr cuts errors off
        if role == "reader":
            assert all(r["exact"] for r in records), (rank, [(r["version"], r["exact"]) for r in records])
    return {key: records for key, (_, records, _) in out.items()}


def assert_deltas(records, versions, *, at_most: float = 0.25):
    """Every version after the first put at most ``at_most`` of the full bytes on the wire."""
    for r in records:
        if r["version"] in versions:
            assert 0 < r["bytes"] <= at_most * r["needed"], (r["version"], r["bytes"], r["needed"])


@pytest.mark.parametrize("how", ["rollback", "none"])
def test_engine_version_moved_outside_the_reader_the_job_carries_on_bitwise(how, no_leaks, tally):
    """torch without deltas: the reader took the old version number again and received the next
    version's bytes under it; every write() failed after that (on 3ee4748)."""
    tally(f"{POKES[how]}; no delta", {"transport": "torch"})
    run_poked({"transport": "torch"}, {2: how}, 4, delta=False)


@pytest.mark.parametrize("how", list(POKES))
def test_delta_reader_that_cannot_vouch_for_its_base_gets_the_version_in_full(how, no_leaks, tally):
    """torch (gloo) with deltas: after each poke reader 0 is exact (on 3ee4748 the delta went onto
    the changed memory, or the job stalled), and deltas resume the version after."""
    tally(f"{POKES[how]}; delta", {"transport": "torch"})
    out = run_poked({"transport": "torch"}, {2: how}, 4, delta=True)
    assert_deltas(out[("reader", 1)], {1, 2, 3})
    assert_deltas(out[("reader", 0)], {1, 3})
    poked, clean = out[("reader", 0)][2], out[("reader", 1)][2]
    assert poked["bytes"] > clean["bytes"], (poked, clean)  # the pairs it could not vouch for came in full


@pytest.mark.parametrize("options", DELTA_TRANSPORTS)
def test_delta_on_every_transport_survives_every_poke_bitwise(options, no_leaks, tally):
    """Every poke in turn on reader 0; reader 1 keeps receiving deltas (on 3ee4748 only torch had them)."""
    skip_unavailable(options)
    tally("every poke in turn (rollback, None, reset, flip, scratch); delta", options)
    out = run_poked(options, {2: "rollback", 3: "none", 4: "reset", 5: "flip", 6: "scratch"}, 8, delta=True)
    assert_deltas(out[("reader", 1)], set(range(1, 8)))
    assert_deltas(out[("reader", 0)], {1, 7})


@pytest.mark.parametrize("when", ["between", "during"])
@pytest.mark.parametrize("durable", [True, False], ids=["state-dir", "no-state-dir"])
def test_meta_server_killed_and_restarted_the_job_carries_on(tmp_path, durable, when, no_leaks, tally):
    """With ``--state-dir`` the restarted server has everything; without, clients see that it
    lost its state (a new server instance), fail the version in flight naming that, and register
    again. Either way the next versions succeed. Writer 0 pauses (after version 0, or inside
    version 1 just before it sends) while the server is killed and restarted."""
    common = {**COMMON, "transport": "shm"}
    tally(f"meta server SIGKILL + restart {when} versions, " + ("with" if durable else "without") + " --state-dir",
          common)
    flags = tmp_path / "flags"
    flags.mkdir()
    pause = {"pause_before": 1} if when == "between" else {"hold_at": 1}
    args = ("--state-dir", str(tmp_path / "state")) if durable else ()
    with MetaServerProcess(tmp_path, *args) as server:
        procs = {("writer", r): launch(server, "writer", r, versions=[0, 1, 2], retries=1, flag_dir=str(flags),
                                       **(pause if r == 0 else {}), **common) for r in range(2)}
        procs |= {("reader", r): launch(server, "reader", r, until=2, **common) for r in range(2)}
        try:
            deadline = Deadline.after(TIMEOUT * 3)
            while not (flags / "held").exists():
                assert not deadline.expired, "writer 0 did not reach the fault point in time"
                time.sleep(0.02)  # a bounded poll for the worker's flag file
            server.kill()
            server.start()  # same port
            (flags / "go").touch()
            out = finish(procs, TIMEOUT * 8)
        finally:
            for p in procs.values():
                if p.poll() is None:
                    p.kill()
                    p.wait(10)
    for rank in range(2):
        assert_reader_ends_exact(out, rank, 2)
        code, records, stderr = out[("writer", rank)]
        assert code == 0 and records[-1]["version"] == 2 and records[-1]["ok"], (records, stderr[-3000:])


# -- the meta server's store: a full disk and damaged files --------------------------------------------------------

META_STORE = {"transport": "- (meta server)"}
DOCUMENT = b"an acknowledged document " * 3


def acknowledge(client) -> None:
    """Changes the server answered: two ranks, versions 1..4, the epoch counter at 5, a document, a reader."""
    from weightsync.meta import Participant

    client.register(Participant("writer", 0, "train", "h0", {"device": "cpu"}, b"writer layout"))
    client.register(Participant("reader", 0, "rollout", "h1", {"device": "cpu"}, b"reader layout"))
    for epoch in range(5):
        assert client.compare_and_set("epoch", expected=epoch, value=epoch + 1) == (True, epoch + 1)
    client.put_document("model/x", DOCUMENT)
    for version in range(1, 5):
        assert client.publish_version(version, "fp", writer_rank=0, num_writers=1) is not None
    client.report_applied(0, 4, nbytes=8, seconds=0.1)


def assert_acknowledged(client, epoch: int = 5) -> None:
    """Every acknowledged change is there, and no counter went backwards."""
    assert len(client.participants()) == 2
    assert client.counter("epoch") == epoch
    assert client.get_document("model/x") == DOCUMENT
    latest = client.latest_version()
    assert latest is not None and latest.version == 4
    assert client.reader_versions() == {0: 4}


def state_files(state) -> dict[str, int]:
    return {p.name: p.stat().st_size for p in state.iterdir() if p.is_file() and p.name not in ("lock", "token")}


def refused_or_intact(tmp_path, server, state) -> str:
    """Start the server on its damaged state: it either refuses, saying what is damaged and how to
    recover, or serves every acknowledged change. Returns which."""
    from weightsync.meta import MetaClient

    try:
        server.start()
    except RuntimeError as exc:
        message = (tmp_path / "server.log").read_text()
        assert str(state) in message and ("restore" in message.lower() or "move" in message), str(exc)[-2000:]
        assert "Traceback" not in message, message[-3000:]
        return "refused"
    with server, MetaClient(server.address, job="j", token=server.token, timeout=10) as client:
        assert_acknowledged(client)
    return "intact"


def populated(tmp_path, *, crash: bool):
    """A durable server that acknowledged :func:`acknowledge`'s changes, then stopped (SIGTERM) or crashed (SIGKILL)."""
    from weightsync.meta import MetaClient

    state = tmp_path / "state"
    server = MetaServerProcess(tmp_path, "--state-dir", str(state))
    with server, MetaClient(server.address, job="j", token=server.token, timeout=10) as client:
        acknowledge(client)
        if crash:
            server.kill()
    return server, state


def test_meta_store_a_flipped_byte_in_an_acknowledged_value_is_refused(tmp_path, tally):
    """A one-byte flip inside a stored value used to be replayed as if it had been written."""
    tally("meta store: a flipped byte inside an acknowledged record", META_STORE)
    server, state = populated(tmp_path, crash=False)
    hits = [(name, data.index(DOCUMENT)) for name in state_files(state)
            if DOCUMENT in (data := (state / name).read_bytes())]
    assert hits, state_files(state)
    for name, at in hits:
        data = bytearray((state / name).read_bytes())
        data[at + 5] ^= 0x01
        (state / name).write_bytes(bytes(data))
    assert refused_or_intact(tmp_path, server, state) == "refused"


def test_meta_store_a_truncated_file_after_a_crash_is_refused_or_loses_nothing(tmp_path, tally):
    """The file the last acknowledged changes went to loses its tail after a crash: a truncated
    journal used to be taken for a torn write, dropping acknowledged records."""
    tally("meta store: SIGKILL, then the newest state file loses its last 100 bytes", META_STORE)
    server, state = populated(tmp_path, crash=True)
    files = {n: s for n, s in state_files(state).items() if s > 256}
    newest = max(files, key=lambda n: (state / n).stat().st_mtime_ns)
    with open(state / newest, "r+b") as f:
        f.truncate(files[newest] - 100)
    refused_or_intact(tmp_path, server, state)


def test_meta_store_a_deleted_file_is_refused(tmp_path, tally):
    """The largest state file deleted after a clean stop: the server used to start empty, and an
    older state came back at the next restart."""
    tally("meta store: the largest state file deleted after a clean stop", META_STORE)
    server, state = populated(tmp_path, crash=False)
    files = state_files(state)
    (state / max(files, key=files.__getitem__)).unlink()
    assert refused_or_intact(tmp_path, server, state) == "refused"


def _tmpfs_namespace(mountpoint, size: str):
    """A process holding a private mount namespace with a ``size`` tmpfs on ``mountpoint`` (and the
    nsenter prefix that runs a command in it), or None where this machine cannot make one."""
    import shutil
    import subprocess

    if shutil.which("unshare") is None or shutil.which("nsenter") is None:
        return None
    user = [] if os.geteuid() == 0 else ["--user", "--map-root-user"]
    holder = subprocess.Popen(["unshare", *user, "--mount", "--propagation", "private", "sh", "-c",
                               f"mount -t tmpfs -o size={size} tmpfs {mountpoint} && echo ready && exec sleep 300"],
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    assert holder.stdout is not None
    if holder.stdout.readline().strip() != "ready":
        holder.kill()
        holder.communicate(timeout=10)
        return None
    enter = ["nsenter", f"--target={holder.pid}", "--mount", *(["--user", "--preserve-credentials"] if user else [])]
    if subprocess.run([*enter, "true"], capture_output=True, timeout=30).returncode != 0:
        holder.kill()
        holder.communicate(timeout=10)
        return None
    return holder, enter


def test_meta_store_full_disk_answers_503_changes_nothing_and_a_retry_succeeds_once(tmp_path, tally):
    """On a full tmpfs a change is refused with 503 and not applied; once space returns the same
    request succeeds exactly once, and a restart has every acknowledged change, counters never
    going back. (It used to be applied in memory with the 503, and partially written.)"""
    import httpx

    from weightsync.meta import MetaClient

    tally("meta store: disk full (tmpfs), then space returns", META_STORE)
    fs = tmp_path / "fs"
    fs.mkdir()
    made = _tmpfs_namespace(fs, "4m")
    if made is None:
        pytest.skip("no private mount namespace with a tmpfs here (unshare/nsenter); "
                    "tests/test_meta_store.py injects ENOSPC instead")
    holder, enter = made
    outside = f"/proc/{holder.pid}/root{fs}"  # the namespace's tmpfs, seen from here
    server = MetaServerProcess(tmp_path, "--state-dir", str(fs / "state"), prefix=enter)
    try:
        with server, MetaClient(server.address, job="j", token=server.token, timeout=10) as client:
            acknowledge(client)
            with open(f"{outside}/filler", "wb") as filler:
                try:
                    while True:
                        filler.write(b"\0" * (64 << 10))
                        filler.flush()
                except OSError:
                    pass  # the tmpfs is full
            http = httpx.Client(base_url=server.address, headers={"Authorization": f"Bearer {server.token}"},
                                timeout=10)
            cas = ("/v1/jobs/j/counters/epoch", {"json": {"expected": 5, "value": 6}})
            refused = [http.put("/v1/jobs/j/documents/during", content=b"x" * 20000), http.post(cas[0], **cas[1])]
            assert [r.status_code for r in refused] == [503, 503], [r.text for r in refused]
            assert client.get_document("during") is None and client.counter("epoch") == 5  # changed nothing
            assert "full" in refused[1].json()["detail"], refused[1].text
            assert http.get("/healthz").status_code == 503
            os.unlink(f"{outside}/filler")  # space returns
            assert http.post(cas[0], **cas[1]).json() == {"swapped": True, "value": 6}
            assert http.post(cas[0], **cas[1]).json() == {"swapped": False, "value": 6}  # exactly once
            assert http.put("/v1/jobs/j/documents/during", content=b"x" * 20000).status_code == 200
            assert http.get("/healthz").text == "ok"
            http.close()
        with server.start(), MetaClient(server.address, job="j", token=server.token, timeout=10) as client:
            assert_acknowledged(client, epoch=6)
            assert client.get_document("during") == b"x" * 20000
    finally:
        server.stop()
        holder.kill()
        holder.communicate(timeout=10)
