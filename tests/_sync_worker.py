"""One rank of an end-to-end sync scenario (WeightWriter/WeightReader + real meta server).

Run as a subprocess: ``python tests/_sync_worker.py '<json>'``; prints one JSON line per
version. The meta server address comes from WEIGHTSYNC_META_ADDR / _TOKEN.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import sys
import threading
import time

import torch

from weightsync.apps.demo import canonical_values
from weightsync.clock.deadline import Deadline
from weightsync.configs import load_spec
from weightsync.engines.buffers import ShardedEngine
from weightsync.plan import PlanOptions
from weightsync.roles.reader import WeightReader
from weightsync.roles.writer import WeightWriter
from weightsync.session.sync_session import SyncConfig, SyncError
from weightsync.sources.module import ShardedSource
from weightsync.tools.torch_layout import TORCH_DTYPES, allocate, fill_from_canonical, strided_view
from weightsync.transport import TransportOptions
from weightsync.transport.shm.files import share_tensors


def emit(**record):
    """One result line; ``at`` (wall clock) lets a test time how soon others noticed a fault here."""
    print("RESULT " + json.dumps({**record, "at": time.time()}), flush=True)


#: held by the first thread that dies: lanes of one transfer may reach die() together
_DYING = threading.Lock()


def die(how: str) -> None:
    """End this process abruptly: exit code 3, SIGKILL or SIGSTOP (frozen until killed)."""
    if not _DYING.acquire(blocking=False):
        time.sleep(3600)  # another thread of this process is dying: one record, one fault
    emit(died=how)
    if how == "exit":
        os._exit(3)
    os.kill(os.getpid(), getattr(signal, how))
    if how == "SIGSTOP":
        # The stop is pending until a thread of this process enters the kernel: sleep, or this
        # thread may reach os._exit first and the "frozen" writer would simply exit. The test
        # kills it; never continued before that.
        time.sleep(3600)
        os._exit(3)


def die_mid_transfer(writer: WeightWriter, how: str = "exit") -> None:
    """Make this writer's process die part-way through its next send."""
    assert writer.session.planned is not None
    transport = writer.session.planned.transport
    if hasattr(transport, "_post"):  # two-sided: after a couple of messages are on the wire
        original = transport._post
        count = {"n": 0}

        def post(*a, **kw):
            count["n"] += 1
            if count["n"] > 2:
                die(how)
            return original(*a, **kw)

        transport._post = post
    else:  # one-sided: during the copy, before the version is published
        transport.send = lambda *a, **kw: die(how)


def wait_for_go(flag_dir: str, timeout: float, name: str = "go") -> None:
    """Touch ``flag_dir/held``, then wait for ``flag_dir/<name>``: the test injects its fault between."""
    open(os.path.join(flag_dir, "held"), "w").close()
    deadline = Deadline.after(timeout)
    while not os.path.exists(os.path.join(flag_dir, name)):
        if deadline.expired:
            raise TimeoutError(f"no go in {flag_dir} within {timeout} s")
        time.sleep(0.02)


def hold_before_send(writer: WeightWriter, version: int, flag_dir: str, timeout: float) -> None:
    """Pause this writer in ``version`` just before it sends (its epoch decided, the version
    maybe published): a fault injected then lands during the version."""
    assert writer.session.planned is not None
    transport = writer.session.planned.transport
    original = transport.send

    def send(v, *a, **kw):
        if v == version:
            wait_for_go(flag_dir, timeout)
        return original(v, *a, **kw)

    transport.send = send


def die_receiving(reader: WeightReader, version: int, how: str) -> None:
    """Make this reader's process die as it starts receiving ``version`` (writers are sending)."""
    assert reader.session.planned is not None
    transport = reader.session.planned.transport
    original = transport.receive

    def receive(v, *a, **kw):
        if v >= version:
            die(how)
        return original(v, *a, **kw)

    transport.receive = receive


def digest_bytes(reader: WeightReader) -> int:
    """The bytes of the digests that travel with each version (SyncConfig.integrity)."""
    digests = reader.session.planned.digests
    return digests.nbytes if digests is not None else 0


def sparse_values(config, version: int):
    """Version 0's weights with ~2% of the elements moved per later version (what training does)."""
    out = canonical_values(config, 0)
    for step in range(1, version + 1):
        for i, t in enumerate(out.values()):
            flat = t.view(-1)
            g = torch.Generator().manual_seed(104729 * step + i)
            flat[torch.randint(0, flat.numel(), (max(1, flat.numel() // 50),), generator=g)] += 0.25
    return out


def poke(engine: ShardedEngine, how: str, version: int, values) -> None:
    """Change the engine outside its reader, before the update that takes ``version`` (issue 28):

    * ``rollback``: a manual update to an older version (its weights, and its number);
    * ``none``: a manual update that failed half-way (half a tensor written, the version None);
    * ``reset``: every tensor reset in place to version 0 (``copy_`` / ``load_state_dict``), the
      version unchanged;
    * ``flip``: one bit flipped in one element;
    * ``scratch``: one tensor used as scratch space (random values), the version unchanged.
    """
    layout = engine.layout()
    biggest = max(engine.tensors, key=lambda n: engine.tensors[n].numel())
    target = engine.tensors[biggest]
    if how == "rollback":
        fill_from_canonical(layout, engine.tensors, values(version - 2))
        engine.apply(version - 2)
    elif how == "none":
        engine.receiving(version - 1)  # a manual update writes into the live weights...
        target.view(-1)[: target.numel() // 2] = 0
        engine.abort(version - 1, RuntimeError("manual update failed"))  # ...and fails: invalid
    elif how == "reset":
        fill_from_canonical(layout, engine.tensors, values(0))
    elif how == "flip":
        target.view(-1).view(torch.uint8)[target.numel()] ^= 4  # a bit in the middle of the tensor
    elif how == "scratch":  # every byte the sync owns in it (padding rows are no one's)
        shard = next(s for s in layout.shards if s.name == biggest)
        for region in shard.regions:
            view = strided_view(target.view(-1), region.box.sizes, region.strides, region.offset)
            view.copy_(torch.randn(view.shape) * 100)
    else:
        raise ValueError(f"unknown poke {how!r}")


def reported(reader: WeightReader, rank: int) -> int | str | None:
    """What the meta server says this reader applied (or why it cannot say)."""
    try:
        return reader.meta.reader_versions().get(rank)
    except Exception as exc:  # e.g. a meta server that restarted without its state
        return f"unknown: {type(exc).__name__}"


def main() -> None:
    args = json.loads(sys.argv[1])
    torch.set_num_threads(1)
    spec = load_spec(args["config"])
    config = spec.to_hf_config()
    sync = SyncConfig(num_writers=args["num_writers"], num_readers=args["num_readers"], host=args.get("host", ""),
                      transport=args.get("transport", "auto"), timeout=args.get("timeout", 60.0),
                      integrity=args.get("integrity", False), completion=args.get("completion", "all"),
                      layer_phases=args.get("layer_phases", False),
                      plan_options=PlanOptions(min_split_bytes=args.get("min_split_bytes", 1 << 20)),
                      transport_options=TransportOptions(max_bucket_bytes=args.get("bucket", 1 << 16),
                                                         direct_min_bytes=1024,
                                                         **args.get("transport_options", {})))
    role, rank = args["role"], args["rank"]
    values = (lambda v: sparse_values(config, v)) if args.get("sparse") else (lambda v: canonical_values(config, v))
    if role == "writer":
        time.sleep(args.get("start_delay", 0.0))  # a restart that comes up slowly
        source = ShardedSource(args["source"], config, rank)
        shared = None
        if args.get("shared_source"):  # parameters in /dev/shm: the shm transport goes zero-copy
            shared = share_tensors(source.tensors())
            source = ShardedSource(args["source"], config, rank, tensors=shared.tensors)
        with contextlib.ExitStack() as stack, WeightWriter(source, rank=rank, config=sync) as writer:
            if shared is not None:
                stack.callback(shared.close)
            for version in args["versions"]:
                time.sleep(args.get("step_seconds", 0.0))  # a training step
                fill_from_canonical(source.layout(), source.tensors(), values(version))
                if args.get("pause_before") == version:  # the previous version is done: between versions
                    wait_for_go(args["flag_dir"], sync.timeout * 4)
                if args.get("hold_at") == version:
                    writer.session.plan(Deadline.after(sync.timeout))
                    hold_before_send(writer, version, args["flag_dir"], sync.timeout * 4)
                if args.get("die_at") == version:
                    writer.session.plan(Deadline.after(sync.timeout))
                    die_mid_transfer(writer, args.get("die_how", "exit"))
                if args.get("die_connecting") == version:  # it joined the version's epoch, then died
                    writer.session.plan(Deadline.after(sync.timeout))  # before its transport connected there
                    how = args.get("die_how", "SIGKILL")
                    writer.session.arm = lambda *_, **__: die(how)  # type: ignore[method-assign]
                retries = args.get("retries", 0)  # a number, or {version: number}
                retries = retries.get(str(version), 0) if isinstance(retries, dict) else retries
                for _ in range(1 + retries):  # a trainer may write a failed version again
                    t0 = time.monotonic()
                    try:
                        result = writer.write(version)
                        completion = result.completion
                        emit(role=role, rank=rank, version=version, ok=True, bytes=result.nbytes,
                             seconds=time.monotonic() - t0,
                             **({} if completion is None else {"completion": completion.to_wire()}))
                        break
                    except SyncError as exc:
                        emit(role=role, rank=rank, version=version, ok=False, error=str(exc),
                             seconds=time.monotonic() - t0)
                        if writer.version is not None and writer.version >= version:
                            break  # the version is out (its readers failed it): go on with the next
            if args.get("stay_until"):  # a trainer that goes on training: its last version stays out
                wait_for_go(args["flag_dir"], sync.timeout * 8, name=args["stay_until"])
        return
    engine = ShardedEngine(args["target"], config, rank)
    pointers = {n: t.data_ptr() for n, t in engine.tensors.items()}
    layout = engine.layout()
    with WeightReader(engine, rank=rank, config=sync) as reader:
        # with "until": update until that version is applied (a few failures or timeouts on the way:
        # restarted writers start a fresh interpreter, slow on a loaded 2-core machine)
        versions = args["versions"] if "until" not in args else range(args.get("tries", args["until"] + 6))
        for version in versions:
            if "until" in args and engine.weight_version == args["until"]:
                break
            if args.get("die_at") is not None and reader.session.planned is None:
                reader.session.plan(Deadline.after(sync.timeout))
                die_receiving(reader, args["die_at"], args.get("die_how", "exit"))
            if (how := args.get("pokes", {}).get(str(version))) is not None:
                poke(engine, how, version, values)
            t0 = time.monotonic()
            try:
                result = reader.update(timeout=args.get("timeout", 60.0))
            except (SyncError, TimeoutError, ValueError) as exc:
                emit(role=role, rank=rank, version=version, ok=False, error=f"{type(exc).__name__}: {exc}",
                     seconds=time.monotonic() - t0, weight_version=engine.weight_version,
                     reported=reported(reader, rank))
                continue
            want = allocate(layout)
            fill_from_canonical(layout, want, {n: v.to(TORCH_DTYPES[spec.dtype])
                                               for n, v in values(result.version).items()})
            exact = all(torch.equal(engine.tensors[n], want[n]) for n in want)
            emit(role=role, rank=rank, version=result.version, ok=True, exact=exact, bytes=result.nbytes,
                 needed=reader.session.planned.plan.total_bytes + digest_bytes(reader),
                 in_place=all(t.data_ptr() == pointers[n] for n, t in engine.tensors.items()))


if __name__ == "__main__":
    main()
