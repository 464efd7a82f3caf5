"""awex planner + awex p2p send/recv over gloo on CPU, TP2 (train) -> TP1 x 2 engines (infer).

4 OS processes, laid out the way awex lays them out:
  transfer ranks 0..1 = inference engines 0,1 (each its own default PG, world 1, like an SGLang TP1 engine)
  transfer ranks 2..3 = training TP ranks 0,1 (their own default PG, world 2, like Megatron TP2)
All four then join awex's separate "weights_exchange" group via awex.util.process_group.init_weights_update_group
(backend="gloo" instead of "nccl"), run awex's setup_batch_isend_irecv handshake, build their local plan with
awex's TransferPlanBuilder.build_local_transfer_plan, build p2p ops with awex's nccl_build_send_ops /
nccl_build_recv_ops, execute with awex's batch_send_recv (use_group=True, the default AWEX_USE_BATCH_SEND_RECV=1
path of NCCLWeightsWriter._write_weights / NCCLWorkerWeightsReader._update_weights), then copy back
non-contiguous views with NCCLWorkerWeightsReader._sync_non_contiguous_tensor_pairs. Every inference engine then
checks every parameter bitwise against the deterministic ground truth.

What is NOT awex code here: the tensors (random, deterministic) and the raw per-rank metadata (what awex's
McoreParamMetaResolver / InferParamMetaResolver would have gathered from Megatron / SGLang), which is fed
through awex's own ParamMetaResolver._build_params_meta + ShardingStrategy. The meta server is skipped (metas
are computed identically on every rank instead of exchanged through it).

Usage: python awex_p2p_bench.py [tiny|qwen3-mid|qwen3-0.6b] [iters] [bf16|fp32] [group|onebyone]
"""
import json
import os
import sys
import time

os.environ.setdefault("AWEX_MASTER_ADDR", "127.0.0.1")  # keep awex's get_ip_address() off the 8.8.8.8 probe
os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

TRAIN_TP, INFER_TP, ENGINES = 2, 1, 2
INFER_WORLD = INFER_TP * ENGINES
WORLD = INFER_WORLD + TRAIN_TP


def _free_port():
    import socket
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def worker(transfer_rank, ports, shape_name, iters, dtype_name, use_group, out_q):
    from types import SimpleNamespace

    import awex.logging as awex_logging
    from awex.reader.nccl_reader import NCCLWorkerWeightsReader
    from awex.transfer.nccl_comm import batch_send_recv, nccl_build_recv_ops, nccl_build_send_ops
    from awex.transfer.transfer_plan import TransferPlanBuilder, compute_transfer_plan_stats
    from awex.util.process_group import init_weights_update_group, setup_batch_isend_irecv
    from awex.writer.nccl_writer import NCCLWeightsWriter
    from awex_common import SHAPES, build_infer_meta, build_train_meta, full_tensor, hf_param_shapes, local_tensor
    awex_logging.setLevel("WARNING")  # awex's own logger (not stdlib logging)

    torch.set_num_threads(1)
    dtype = {"bf16": torch.bfloat16, "fp32": torch.float32}[dtype_name]
    is_train = transfer_rank >= INFER_WORLD
    shapes = hf_param_shapes(SHAPES[shape_name])

    # side-local default PG (awex asserts one exists before creating its exchange group)
    if is_train:
        tp_rank = transfer_rank - INFER_WORLD
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{ports['train']}", rank=tp_rank, world_size=TRAIN_TP)
    else:
        engine = transfer_rank // INFER_TP
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{ports['infer'][engine]}", rank=0, world_size=1)

    # local weights
    t = time.perf_counter()
    if is_train:
        params = {n: local_tensor(n, g, dtype, tp_rank, TRAIN_TP, "mcore") for n, g in shapes.items()}
    else:
        params = {n: torch.zeros(g, dtype=dtype) for n, g in shapes.items()}  # TP1: full tensors
    t_alloc = time.perf_counter() - t

    # metadata -> plan (awex code)
    t = time.perf_counter()
    train_meta = build_train_meta(shapes, dtype, TRAIN_TP)
    infer_meta = build_infer_meta(shapes, dtype, INFER_TP)
    t_meta = time.perf_counter() - t
    t = time.perf_counter()
    plan = TransferPlanBuilder(INFER_WORLD, TRAIN_TP, ENGINES).build_local_transfer_plan(
        infer_meta, train_meta, transfer_rank)
    t_plan = time.perf_counter() - t
    stats = compute_transfer_plan_stats(plan)

    # awex's exchange group over gloo + its handshake
    t = time.perf_counter()
    group = init_weights_update_group("127.0.0.1", ports["xchg"], transfer_rank, WORLD, "weights_exchange",
                                      backend="gloo", role="train" if is_train else "inference")
    setup_batch_isend_irecv(group, transfer_rank, WORLD)
    t_group = time.perf_counter() - t

    times = []
    for it in range(iters):
        if not is_train:
            for p in params.values():
                p.zero_()
        dist.barrier(group=group)
        t0 = time.perf_counter()
        # use_group=True mirrors AWEX_USE_BATCH_SEND_RECV=1 (default): batch_send_recv(use_group=True)
        # use_group=False mirrors AWEX_USE_BATCH_SEND_RECV=0: the writer's/reader's _send_recv_one_by_one
        # (called unbound with a stub `self`; they only read self.transfer_rank for logging).
        # NB: batch_send_recv(use_group=False) itself crashes on CPU (idx % num_streams with 0 streams).
        stub = SimpleNamespace(transfer_rank=transfer_rank)
        if is_train:
            ops, copy_ops, traj = nccl_build_send_ops(params, plan, group, -1, use_group)
            t1 = time.perf_counter()
            if use_group:
                batch_send_recv(send_ops=ops, recv_ops=[], blocking=True, use_group=True)
            else:
                NCCLWeightsWriter._send_recv_one_by_one(stub, ops, traj)
        else:
            ops, noncontig, traj = nccl_build_recv_ops(params, plan, group, use_group)
            t1 = time.perf_counter()
            if use_group:
                batch_send_recv(send_ops=[], recv_ops=ops, blocking=True, use_group=True)
                NCCLWorkerWeightsReader._sync_non_contiguous_tensor_pairs(noncontig)
            else:
                NCCLWorkerWeightsReader._send_recv_one_by_one(stub, ops, traj)
        t2 = time.perf_counter()
        dist.barrier(group=group)
        t3 = time.perf_counter()
        times.append({"build_ops_s": t1 - t0, "send_recv_s": t2 - t1, "to_barrier_s": t3 - t0})

    # bitwise verification on inference engines
    ok, bad = True, []
    t = time.perf_counter()
    if not is_train:
        for n, g in shapes.items():
            ref = full_tensor(n, g, dtype)
            if not torch.equal(params[n].view(torch.int16 if dtype == torch.bfloat16 else torch.int32),
                               ref.view(torch.int16 if dtype == torch.bfloat16 else torch.int32)):
                ok = False
                bad.append(n)
    t_verify = time.perf_counter() - t
    out_q.put({"rank": transfer_rank, "role": "train" if is_train else "infer", "ok": ok, "bad": bad[:5],
               "alloc_s": t_alloc, "meta_s": t_meta, "plan_s": t_plan, "group_init_s": t_group,
               "verify_s": t_verify, "plan_stats": stats["inter"], "iters": times})
    dist.barrier(group=group)
    dist.destroy_process_group()


def main():
    shape_name = sys.argv[1] if len(sys.argv) > 1 else "tiny"
    iters = int(sys.argv[2]) if len(sys.argv) > 2 else 3
    dtype_name = sys.argv[3] if len(sys.argv) > 3 else "bf16"
    use_group = (sys.argv[4] if len(sys.argv) > 4 else "group") == "group"
    ports = {"train": _free_port(), "infer": [_free_port() for _ in range(ENGINES)], "xchg": _free_port()}
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    procs = [ctx.Process(target=worker, args=(r, ports, shape_name, iters, dtype_name, use_group, q))
             for r in range(WORLD)]
    t = time.perf_counter()
    for p in procs:
        p.start()
    import queue
    res = []
    while len(res) < len(procs):  # don't hang forever if a rank crashed
        try:
            res.append(q.get(timeout=5))
        except queue.Empty:
            if any(p.exitcode not in (None, 0) for p in procs):
                for p in procs:
                    if p.is_alive():
                        p.kill()
                sys.exit(f"a rank crashed: exitcodes={[p.exitcode for p in procs]}")
    for p in procs:
        p.join()
    wall = time.perf_counter() - t
    res.sort(key=lambda r: r["rank"])
    from awex_common import SHAPES, hf_param_shapes, nbytes_of
    model_bytes = nbytes_of(hf_param_shapes(SHAPES[shape_name]), {"bf16": torch.bfloat16, "fp32": torch.float32}[dtype_name])
    moved = model_bytes * ENGINES
    print(json.dumps({"shape": shape_name, "dtype": dtype_name, "batch_isend_irecv": use_group,
                      "layout": f"train TP{TRAIN_TP} -> infer TP{INFER_TP} x {ENGINES} engines",
                      "model_bytes": model_bytes, "bytes_moved_total": moved, "wall_s": wall,
                      "exitcodes": [p.exitcode for p in procs]}, indent=None))
    iters_by_rank = {r["rank"]: r.pop("iters") for r in res}
    for r in res:
        print(json.dumps(r))
        for i, x in enumerate(iters_by_rank[r["rank"]]):
            print(f"   rank {r['rank']} iter {i}: " + " ".join(f"{k}={v:.4f}" for k, v in x.items()))
    # transfer phase per iteration = slowest rank, from the pre-transfer barrier to its post-transfer barrier
    for i in range(iters):
        ph = max(iters_by_rank[r][i]["to_barrier_s"] for r in iters_by_rank)
        print(f"iter {i}: transfer_phase_s={ph:.4f} GB/s(total moved)={moved / ph / 1e9:.3f}")
    all_ok = all(r["ok"] for r in res)
    print("ALL_BITWISE_EQUAL" if all_ok else "MISMATCH")


if __name__ == "__main__":
    main()
