"""TRL's GRPOTrainer on weightsync's one-line switch (``weightsync.integrations.trl``).

Real GRPO runs of 2 optimizer steps: two data-parallel training processes (accelerate on CPU
runs DDP over gloo: its FSDP needs an accelerator) on a tiny Qwen3 built here, with a
tokenizer, prompts and a reward built here too. Server mode syncs a real ``vllm serve
--weight-transfer-config '{"backend": "weightsync"}'``; colocate mode the ``LLM`` TRL builds
inside each training process. After each step the engine's greedy tokens equal a fresh
engine's on the trainer's weights of that step; a colocated engine's worker also holds every
tensor, bitwise, that the fresh engine's worker of the same TP rank holds. Through the job, the two ranks each send a part
of the model, the parts making exactly one model: no rank sends (or gathers) the whole of it. A
colocated engine worker beside a DDP replica takes a local copy instead: 0 bytes.
"""

from __future__ import annotations

import contextlib
import importlib.util
import json
import os
import sys
from pathlib import Path

import pytest

import launcher

HERE = Path(__file__).resolve().parent
pytestmark = [
    pytest.mark.skipif(importlib.util.find_spec("vllm") is None, reason="vllm is not installed"),
    pytest.mark.skipif(importlib.util.find_spec("trl") is None, reason="trl is not installed (weightsync[trl])"),
    pytest.mark.slow,
    pytest.mark.xdist_group("trl"),
    pytest.mark.timeout(900),
]
STEPS = 2
#: TRL builds its colocated ``LLM`` without ``enforce_eager``: on CPU, vLLM then compiles the model with
#: inductor (a C++ build, 61 s against 23 s per engine here). ``VLLM_CPU_CI_ENV=1``, vLLM's own switch
#: for its CPU CI, keeps the dynamo trace (the weights stay inputs of a captured graph) and runs it
#: eagerly. The trainers' engines and the reference engines run the same way.
VLLM_CI = {"VLLM_CPU_CI_ENV": "1"}


def _mapped_shm() -> set[str]:
    """The /dev/shm files some live process maps now."""
    mapped: set[str] = set()
    for maps in Path("/proc").glob("[0-9]*/maps"):
        with contextlib.suppress(OSError):
            mapped.update(line.split(None, 5)[-1].strip() for line in maps.read_text().splitlines()
                          if "/dev/shm/" in line)
    return mapped


@pytest.fixture(autouse=True)
def _no_vllm_cpu_shm_left():
    """vLLM-CPU's TP workers share a file per TP group in /dev/shm (``<ident>-tp:0-[0-1]-cpushm_<rank>``)
    and leave it when their process ends without vLLM's own shutdown, as TRL's ranks and a stopped
    `vllm serve` do. Under TRL's colocated ``external_launcher`` the identifier is empty, so the
    name is the same in every run: the next TP 2 engine on the machine then fails to create it
    (``create shm in SHMManager failed. errno: 17``). After each test, the files of its engines
    that no live process maps are removed (a file another test's engine maps now is kept), and so
    are such files left before the test (by a run that was killed)."""
    _sweep_vllm_cpu_shm()
    yield
    _sweep_vllm_cpu_shm()


def _sweep_vllm_cpu_shm() -> None:
    mapped = _mapped_shm()
    for path in Path("/dev/shm").glob("*-cpushm_*"):
        if str(path) not in mapped:
            with contextlib.suppress(FileNotFoundError):
                path.unlink()


def _results(out: str) -> list[dict]:
    rows = [json.loads(line[len("RESULT "):]) for line in out.splitlines() if line.startswith("RESULT ")]
    return rows + [{**json.loads(line[len("LOGGED "):]), "logged": True} for line in out.splitlines()
                   if line.startswith("LOGGED ")]


def _trainers(tmp_path: Path, mode: str, url: str | None, server=None, extra: tuple[str, ...] = (),
              timeout: float = 600) -> list[dict]:
    """Two training ranks (the ``server`` context, if any, is entered while they start up)."""
    sys.path.insert(0, str(HERE))
    from _vllm_native import free_port, run_to_end

    env = {**os.environ, "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port()), "WORLD_SIZE": "2",
           "LOCAL_WORLD_SIZE": "2", "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1", "VLLM_CPU_KVCACHE_SPACE": "1",
           "VLLM_HOST_IP": "127.0.0.1", "VLLM_CPU_OMP_THREADS_BIND": "nobind", **VLLM_CI}
    cmd = [sys.executable, str(HERE / "_trl_grpo.py"), "train", "--model", str(tmp_path / "model"), "--out",
           str(tmp_path / "out"), "--mode", mode, "--steps", str(STEPS), *(["--url", url] if url else []), *extra]
    procs = [launcher.launch(cmd, env={**env, "RANK": str(r), "LOCAL_RANK": str(r)}, warm="vllm") for r in range(2)]
    with server if server is not None else contextlib.nullcontext():
        outputs = run_to_end(procs, timeout=timeout, tail=5000)
    return [r for out in outputs for r in _results(out)]


def _reference_rows(tmp_path: Path, script: str, command: str, extra: tuple[str, ...] = ()) -> dict[int, dict]:
    """What a fresh engine on each saved version of the trainer's weights gives, by version
    (``colocate-reference``: its tokens and each TP worker's state)."""
    paths = [str(tmp_path / "out" / f"v{v}") for v in range(1, STEPS + 1)]
    proc = launcher.run([sys.executable, str(HERE / script), command, *paths, *extra], timeout=600, warm="vllm",
                        env={**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1",
                             "VLLM_ENABLE_V1_MULTIPROCESSING": "0", "VLLM_CPU_OMP_THREADS_BIND": "nobind",
                             **VLLM_CI})  # in-process: no engine processes to start
    assert proc.returncode == 0, proc.stderr[-4000:]
    return {int(Path(r["path"]).name[1:]): r for r in _results(proc.stdout)}


def _check_served(results: list[dict], refs: dict[int, dict], *, tp: int, workers: int) -> None:
    """After every step the server generates what a fresh engine on the trainer's weights of that
    step generates, its version stamp is the step, and each of the ``workers`` workers its state
    route answers for (TP worker ``t`` of a replica is the ``t``-th) holds every tensor, bitwise,
    that the fresh engine's TP worker ``t`` holds; and training changed what the references generate."""
    from weightsync.tools.engine_state import compare_states, state_from_wire

    served = sorted((r for r in results if "tokens" in r), key=lambda r: r["version"])
    assert [r["version"] for r in served] == list(range(1, STEPS + 1))
    for r in served:
        reference = refs[r["version"]]
        assert r["weight_version"] == str(r["version"])  # the engine's stamp is the trainer's global step
        assert r["tokens"] == reference["tokens"], r  # the same weights as a fresh engine, token for token
        assert len(r["states"]) == workers and len(reference["states"]) == tp, (len(r["states"]), workers)
        for i, state in enumerate(r["states"]):
            report = compare_states(state_from_wire(state), state_from_wire(reference["states"][i % tp]))
            assert report.ok and report.compared, f"worker {i}, version {r['version']}: {report.describe()}"
    assert len({tuple(ref["tokens"]) for ref in refs.values()}) > 1  # training moved the weights, the server followed


def _check_colocated(results: list[dict], refs: dict[int, dict], tp: int) -> None:
    """After every step, each rank's engine generates what a fresh engine on the trainer's weights
    of that step generates, and every tensor its worker holds is bitwise the fresh engine's worker
    of the same TP rank's (one-worker engines: rank ``r``'s whole engine; TP 2: rank ``r`` hosts TP
    worker ``r``); and training changed what the references generate."""
    from weightsync.tools.engine_state import compare_states, state_from_wire

    rows = [r for r in results if "tokens" in r]
    assert sorted((r["rank"], r["version"]) for r in rows) == [(k, v) for k in (0, 1) for v in range(1, STEPS + 1)]
    for r in rows:
        reference = refs[r["version"]]
        assert r["tokens"] == reference["tokens"], r
        assert r["weight_version"] == str(r["version"])
        assert len(reference["states"]) == tp, len(reference["states"])
        report = compare_states(state_from_wire(r["state"]), state_from_wire(reference["states"][r["rank"] % tp]))
        assert report.ok and report.compared, f"rank {r['rank']}, version {r['version']}: {report.describe()}"
    assert len({tuple(ref["tokens"]) for ref in refs.values()}) > 1  # training moved the weights, the engines followed


def _check_logged(results: list[dict]) -> None:
    """Every step's sync is among TRL's logged metrics, on every rank: its seconds, this rank's
    bytes (its share, as sent) and the version lag (0: TRL syncs before it generates)."""
    for rank in (0, 1):
        rows = next(r["rows"] for r in results if r.get("logged") and r["rank"] == rank)
        sent = [r["nbytes"] for r in results if r.get("rank") == rank and "version" in r]
        assert len(rows) == STEPS, rows
        assert [row["weightsync/bytes"] for row in rows] == sent
        assert all(row["weightsync/sync_seconds"] > 0 and row["weightsync/version_lag"] == 0 for row in rows), rows


def _check_shares(results: list[dict], dtype: str) -> None:
    """Each rank sent a part of the model, and the parts make exactly one model (in the engine's
    dtype): no rank sends the whole model, no byte goes twice."""
    import torch

    itemsize = getattr(torch, dtype).itemsize
    for version in range(1, STEPS + 1):
        ranks = {r["rank"]: r for r in results if r.get("version") == version}
        assert sorted(ranks) == [0, 1], results
        total = ranks[0]["model_numel"] * itemsize
        for r in ranks.values():
            assert r["held"] == r["model_bytes"], r  # DDP: a whole replica on each rank
            assert 0 < r["nbytes"] < total, r
        assert sum(r["nbytes"] for r in ranks.values()) == total, ranks


@pytest.mark.heavy  # 135 s in CI's conditions: `make test-heavy`; the TP 2 x DP 2 server test checks the same by default
def test_grpo_trainer_syncs_a_vllm_server_through_weightsync_without_a_gather(tmp_path):
    sys.path.insert(0, str(HERE))
    from _trl_grpo import write_model
    from _vllm_native import free_port, vllm_server

    write_model(tmp_path / "model")
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    server = vllm_server(tmp_path / "model", port=port, timeout=300,
                         extra=("--logprobs-mode", "processed_logprobs"))
    results = _trainers(tmp_path, "server", url, server)
    _check_shares(results, "float32")
    _check_logged(results)
    # the server's engine arguments
    _check_served(results, _reference_rows(tmp_path, "_vllm_native.py", "reference", ("--states",)), tp=1, workers=1)


# vllm serve with 2 replicas of 2 TP workers (4 worker processes): 90 s alone on the 2-core VM in wave 19
# (156 s in wave 18's slower conditions), in the default run since wave 19 (issue 41)
@pytest.mark.timeout(1200)
def test_grpo_trainer_syncs_a_tp2_dp2_vllm_server_each_worker_taking_only_its_slices(tmp_path, monkeypatch):
    """Server mode against ``vllm serve --tensor-parallel-size 2 --data-parallel-size 2`` (issue
    41): each of the server's four workers is a reader of its own (worker ``t`` of replica ``d`` is
    reader ``2d + t``) and receives only the slices it loads, from both training ranks; after every
    step the server generates what a fresh TP 2 engine on the trainer's saved weights generates, and
each worker of the replica its state route reads holds every tensor that the fresh engine's worker
of its TP rank holds."""
    sys.path.insert(0, str(HERE))
    from _trl_grpo import write_model
    from _vllm_native import free_port, vllm_server
    from weightsync.engines.vllm_layout import record_rank

    monkeypatch.setenv("VLLM_CPU_OMP_THREADS_BIND", "nobind")  # vLLM-CPU binds each worker to a NUMA node otherwise
    config = write_model(tmp_path / "model")
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    server = vllm_server(tmp_path / "model", port=port, timeout=600,
                         extra=("--logprobs-mode", "processed_logprobs", "--tensor-parallel-size", "2",
                                "--data-parallel-size", "2"))
    results = _trainers(tmp_path, "server", url, server, timeout=900)
    _check_logged(results)
    slices = sum(r.numel * 4 for t in (0, 1) for s in record_rank(config, tp=2, rank=t)  # float32
                 for r in {(reg.canonical, reg.box): reg for reg in s.regions}.values())
    for version in range(1, STEPS + 1):
        sent = [r["nbytes"] for r in results if r.get("version") == version]
        # over shared memory a writer packs each piece once, and the readers of both replicas that
        # load it copy it out: together the ranks pack at least one set of the TP 2 slices and at
        # most the two replicas' sets, and neither rank packs the whole model (no gather)
        model = next(r["model_bytes"] for r in results if r.get("version") == version)
        assert len(sent) == 2 and slices <= sum(sent) <= 2 * slices and all(0 < n < model for n in sent), sent
    refs = _reference_rows(tmp_path, "_vllm_native.py", "reference", ("--tp", "2", "--states"))
    # vLLM 0.32 runs a /collective_rpc on every data-parallel engine and answers with the first's:
    # the state read is replica 0's two workers
    _check_served(results, refs, tp=2, workers=2)


@pytest.mark.heavy  # 130 s: the TP 2 colocate test's `local` case checks the same (0 bytes, tokens, metrics) with TP
def test_grpo_trainer_colocated_engines_take_a_local_copy_of_their_ranks_replica(tmp_path):
    """DDP ranks (accelerate on CPU), each with a one-worker engine in its process: each engine
    loads its own rank's replica (the local copy, issue 41): no byte crosses a process, and after
    every step each engine generates what a fresh engine on the trainer's weights generates."""
    sys.path.insert(0, str(HERE))
    from _trl_grpo import write_model

    write_model(tmp_path / "model")
    results = _trainers(tmp_path, "colocate", None)
    dtypes = {r["dtype"] for r in results if "dtype" in r}
    assert len(dtypes) == 1, dtypes
    for version in range(1, STEPS + 1):
        ranks = [r for r in results if r.get("version") == version]
        assert len(ranks) == 2 and all(r["held"] == r["model_bytes"] and r["nbytes"] == 0 for r in ranks), ranks
    _check_logged(results)
    # the references are built with the arguments TRL builds its LLM with
    _check_colocated(results, _reference_rows(tmp_path, "_trl_grpo.py", "colocate-reference"), tp=1)


@pytest.mark.parametrize("path", ["local", pytest.param("job", marks=pytest.mark.heavy)])  # job: 130 s more
def test_grpo_trainer_colocated_tp2_engine_generates_as_a_fresh_tp2_engine(tmp_path, path):
    """``vllm_tensor_parallel_size=2``: TRL's two ranks host the two TP workers of one engine
    (``external_launcher``), and the engine generates what a fresh TP 2 engine on the trainer's
    weights generates after every step. ``local``: DDP ranks each hold the whole model, so each
    worker loads its slices from its own rank's replica through vLLM's loader (0 bytes sent).
    ``job``: a transport named in the settings keeps the job's path, where each worker's reader
    receives only the slices it loads, from both ranks (each rank sends a part, no gather)."""
    sys.path.insert(0, str(HERE))
    from _trl_grpo import write_model
    from weightsync.engines.vllm_layout import record_rank

    config = write_model(tmp_path / "model")
    results = _trainers(tmp_path, "colocate", None, extra=("--tp", "2", "--transport", "auto" if path == "local" else "shm"),
                        timeout=1000)
    _check_logged(results)
    dtype = {r["dtype"] for r in results if "dtype" in r}.pop()
    import torch

    itemsize = getattr(torch, dtype).itemsize
    slices = sum(r.numel * itemsize for t in (0, 1) for s in record_rank(config, tp=2, rank=t)
                 for r in {(reg.canonical, reg.box): reg for reg in s.regions}.values())
    for version in range(1, STEPS + 1):
        ranks = [r for r in results if r.get("version") == version]
        sent = [r["nbytes"] for r in ranks]
        assert len(sent) == 2 and all(r["held"] == r["model_bytes"] for r in ranks), ranks
        if path == "local":
            assert sent == [0, 0], sent
        else:
            assert all(0 < n < slices for n in sent), sent
    _check_colocated(results, _reference_rows(tmp_path, "_trl_grpo.py", "colocate-reference", ("--tp", "2")), tp=2)
