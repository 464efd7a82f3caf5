"""One rank of a transport contract scenario, run as a subprocess (JSON in, JSON out).

    python tests/_transport_worker.py '{"transport": "shm", "role": "writer", "rank": 0, ...}'
"""

from __future__ import annotations

import json
import os
import sys
import time

sys.path.insert(0, os.path.dirname(__file__))

import torch

from fake_meta import DirectoryMeta
from weightsync.clock.deadline import Deadline
from weightsync.configs import load_spec
from weightsync.job.channel import JobChannel
from weightsync.layout import parse_layout
from weightsync.layout.lora import LoraSpec
from weightsync.plan import PlanOptions, build_local_plan
from weightsync.tools.devices import RankPlacement
from weightsync.tools.processes import process_alive
from weightsync.tools.torch_layout import TORCH_DTYPES, allocate, fill_from_canonical
from weightsync.transport import TransportContext, TransportOptions, create_transport
from weightsync.transport.shm.files import share_tensors


def values_for(canonical, version, dtype):
    out = {}
    for i, (name, t) in enumerate(canonical.items()):
        g = torch.Generator().manual_seed(7919 * version + i)
        out[name] = torch.randn(t.shape, generator=g).to(TORCH_DTYPES[dtype])
    return out


def sparse_values_for(canonical, version, dtype):
    """Version 0's values with ~2% of the elements moved per later version (what training does)."""
    out = values_for(canonical, 0, dtype)
    for step in range(1, version + 1):
        for i, t in enumerate(out.values()):
            g = torch.Generator().manual_seed(104729 * step + i)
            flat = t.view(-1)
            idx = torch.randint(0, flat.numel(), (max(1, flat.numel() // 50),), generator=g)
            flat[idx] += 0.25
    return out


def wait_published(meta: DirectoryMeta, version: int, writer: int, deadline: Deadline) -> None:
    """Until ``writer`` published ``version``; a writer whose process is gone is named at once, as a
    rank's expired lease names it in a job (this harness has no meta server, and one machine)."""
    while meta.get_document(f"sent/{version}/{writer}", wait=min(0.25, deadline.remaining(0.0))) is None:
        pid = meta.get_document(f"pid/writer/{writer}")
        if pid is not None and not process_alive(int(pid)):
            raise TimeoutError(f"writer {writer} died before it published version {version} (pid {int(pid)})")
        if deadline.expired:
            raise TimeoutError(f"writer {writer} never published version {version}")

def main() -> None:
    args = json.loads(sys.argv[1])
    torch.set_num_threads(1)
    spec = load_spec(args["config"])
    if "lora" in args:  # a LoRA adapter: fp32 TP slices on the writers, whole bf16 adapters on the readers
        lora = LoraSpec(r=args["lora"]["r"], alpha=args["lora"]["alpha"])
        tp = args["lora"]["tp"]
        writers = [lora.rank_layout(spec, w, tp=tp, tp_rank=w, dtype="float32") for w in range(tp)]
        readers = [lora.rank_layout(spec, r, dtype="bfloat16") for r in range(args["lora"]["readers"])]
    else:
        writers = parse_layout(args["source"]).all_rank_layouts(spec)
        readers = parse_layout(args["target"]).all_rank_layouts(spec)
    canonical = writers[0].canonical
    role, rank = args["role"], args["rank"]
    mine = (writers if role == "writer" else readers)[rank]
    values = sparse_values_for if args.get("sparse_steps") else values_for
    plan = build_local_plan(writers, readers, role=role, rank=rank, options=PlanOptions(min_split_bytes=0))
    # "cuda": every process on one GPU (CUDA IPC); "cuda-per-rank": one GPU per process (NCCL).
    device = args.get("device", "cpu")
    if device == "cuda-per-rank":
        device = f"cuda:{rank if role == 'writer' else len(writers) + rank}"
    tensors = allocate(mine, device=device)
    shares = []
    if role == "writer" and args.get("shared_sources"):  # the trainer's weights live in /dev/shm
        shares.append(share_tensors(tensors))
        tensors = shares[0].tensors
    pointers = {n: t.data_ptr() for n, t in tensors.items()}
    meta = DirectoryMeta(args["meta_dir"])
    meta.put_document(f"pid/{role}/{rank}", str(os.getpid()).encode())  # the harness's liveness (one machine)
    opts = TransportOptions(max_bucket_bytes=args.get("bucket", 1 << 16), direct_min_bytes=1024,
                            checksum=args.get("checksum", False), **args.get("options", {}))
    nodes = args.get("nodes", {})  # role -> each rank's node (the routed transport splits pairs by it)
    placements = tuple(RankPlacement(r, i, node) for r, names in nodes.items() for i, node in enumerate(names))
    ctx = TransportContext(channel=JobChannel(meta, role=role, rank=rank), num_writers=len(writers),
                           num_readers=len(readers), device=str(torch.device(device)) if device != "cuda" else
                           f"cuda:{torch.cuda.current_device()}", options=opts, placements=placements)
    transport = create_transport(args["transport"], ctx)
    timeout = args.get("timeout", 30.0)
    t0 = time.monotonic()
    try:
        transport.prepare(plan, tensors, epoch=0, deadline=Deadline.after(timeout))
    except Exception as exc:  # WeightReader reports a failed prepare like a failed receive
        transport.close()
        if role == "writer":
            raise
        print(json.dumps({"error": type(exc).__name__, "message": str(exc), "seconds": time.monotonic() - t0}),
              flush=True)
        return
    results = []
    try:
        for version in range(args["versions"]):
            if role == "writer":
                if args.get("die_at") == version and rank == args.get("die_rank", 0):
                    os._exit(3)  # a peer dying mid-sync
                if version in args.get("moved_at", {}).get(str(rank), []):  # the trainer's weights move
                    tensors = allocate(mine, device=device)  # new storage, same shapes (param.data = ...)
                    if args.get("moved_shared"):  # to new /dev/shm files (zero-copy stays possible)
                        shares.append(share_tensors(tensors))
                        tensors = shares[-1].tensors
                    transport.prepare(plan, tensors, epoch=0, deadline=Deadline.after(timeout))  # what SyncSession.arm does
                fill_from_canonical(mine, tensors, values(canonical, version, args["source_dtype"]))
                # (routed: its shm part keeps version slots too; WeightWriter's staleness wait guards them)
                if (transport.one_sided or transport.name == "routed") and version >= 1:
                    for r in range(len(readers)):  # do not overwrite a slot still being read
                        assert meta.get_document(f"done/{version - 1}/{r}", wait=timeout) is not None
                # what WeightWriter does: publish first when receive() itself waits for the data
                early = transport.publishes_before_send
                if early:
                    meta.put_document(f"sent/{version}/{rank}", b"1")
                stats = transport.send(version, deadline=Deadline.after(timeout))
                if not early:
                    meta.put_document(f"sent/{version}/{rank}", b"1")
                results.append({"version": version, "peak_extra_bytes": stats.peak_extra_bytes})
            else:
                if version in args.get("new_memory_at", {}).get(str(rank), []):  # a restarted/staging reader
                    tensors = allocate(mine, device=device)  # fresh (zeroed) memory
                    pointers = {n: t.data_ptr() for n, t in tensors.items()}
                    transport.prepare(plan, tensors, epoch=0, deadline=Deadline.after(timeout))
                t0 = time.monotonic()
                try:
                    if transport.one_sided:  # what WeightReader does: wait for the publication
                        for w in range(len(writers)):
                            wait_published(meta, version, w, Deadline.after(timeout))
                    stats = transport.receive(version, deadline=Deadline.after(timeout))
                except Exception as exc:  # report what the user would see
                    print(json.dumps({"error": type(exc).__name__, "message": str(exc),
                                      "seconds": time.monotonic() - t0}), flush=True)
                    # what WeightReader does: a reader that failed a version is done with it, so a
                    # one-sided writer stops keeping that version's memory for it
                    for v in range(version, args["versions"]):
                        meta.put_document(f"done/{v}/{rank}", b"1")
                    return
                expected = values(canonical, version, args["source_dtype"])
                expected = {n: v.to(TORCH_DTYPES[args["target_dtype"]]) for n, v in expected.items()}
                want = allocate(mine, device=device)
                fill_from_canonical(mine, want, expected)
                exact = all(torch.equal(tensors[n], want[n]) for n in tensors)
                meta.put_document(f"done/{version}/{rank}", b"1")
                results.append({"version": version, "exact": exact, "bytes": stats.nbytes,
                                "peak_extra_bytes": stats.peak_extra_bytes,
                                "needed": plan.total_bytes,
                                "in_place": all(t.data_ptr() == pointers[n] for n, t in tensors.items())})
        if role == "writer" and transport.one_sided:
            for r in range(len(readers)):  # keep the exposed data until every reader is done
                meta.get_document(f"done/{args['versions'] - 1}/{r}", wait=timeout)
        print(json.dumps({"results": results}), flush=True)
    except Exception:
        # a writer whose version failed (another writer died) stays up until the readers are done
        # with it, as a trainer that goes on would: its leaving would be a second fault, and the
        # readers could name it instead of the writer that died (NIXL push readers READ every
        # writer's ready word: CI saw one name writer 0, gone, before it saw writer 1 dead)
        if role == "writer":
            for r in range(len(readers)):
                meta.get_document(f"done/{args['versions'] - 1}/{r}", wait=timeout)
        raise
    finally:
        transport.close()
        for shared in shares:
            shared.close()


if __name__ == "__main__":
    main()
