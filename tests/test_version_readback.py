"""Version readback: which version an engine serves (since when, valid or not), which version
generated a request, and every member of a job with its version, state and lag.

No engine starts, and vLLM is not imported, here: the record and its wire form, the combination of
a vLLM engine's workers' answers, ``vllm serve``'s route and response header (the middleware in a
real Starlette app over a stand-in engine client), and ``weightsync status`` against a real meta
server. What needs vLLM's classes runs in the modules that import vLLM anyway: the version of an
output from vLLM's ``CompletionOutput`` spans and each driver's readback (tests/test_invalid_vllm.py),
the versioned identity of a LoRA adapter in vLLM's prefix-cache keys (tests/test_lora.py), SGLang's
answer on its stand-in engine (tests/test_engine_sglang.py).
"""

from __future__ import annotations

import json

import msgpack
import pytest

from weightsync.meta.members import members
from weightsync.ports.engine import ServingVersion
from weightsync.ports.records import LeaseRow

# -- the record -------------------------------------------------------------------------------------

def test_a_serving_version_crosses_json_and_msgpack_unchanged_and_bad_fields_are_named():
    answers = [ServingVersion(7, 1764390000.5, True), ServingVersion(None, None, True),
               ServingVersion(None, 12.0, False, "version 8 failed: connection broke", 8)]
    for answer in answers:
        assert ServingVersion.from_wire(json.loads(json.dumps(answer.to_wire()))) == answer
        assert ServingVersion.from_wire(msgpack.unpackb(msgpack.packb(answer.to_wire()))) == answer
    with pytest.raises(ValueError, match="field 'valid' must be bool, got None"):
        ServingVersion.from_wire({"version": 7, "since": 1.0})
    with pytest.raises(ValueError, match="field 'version' must be int or NoneType, got '7'"):
        ServingVersion.from_wire({"version": "7", "since": 1.0, "valid": True})
    with pytest.raises(ValueError, match="field 'version' must be int or NoneType, got True"):
        ServingVersion.from_wire({"version": True, "since": 1.0, "valid": True})
    with pytest.raises(ValueError, match="a mapping"):
        ServingVersion.from_wire([7, 1.0, True])


def test_an_engine_is_valid_at_a_version_only_when_every_worker_is():
    from weightsync.engines.vllm_version import engine_serving

    at7 = [ServingVersion(7, 10.0, True).to_wire(), ServingVersion(7, 11.5, True).to_wire()]
    assert engine_serving(at7) == ServingVersion(7, 11.5, True)  # since the last worker switched
    mid_update = [at7[0], ServingVersion(8, 12.0, True).to_wire()]
    assert engine_serving(mid_update) == ServingVersion(
        None, None, False, "its workers serve different versions [7, 8] (an update is under way)")
    broken = [at7[0], ServingVersion(None, 13.0, False, "version 8 failed: phase 3", 8).to_wire()]
    assert engine_serving(broken) == ServingVersion(None, 13.0, False, "version 8 failed: phase 3", 8)
    with pytest.raises(ValueError, match="no worker answered"):
        engine_serving([])


def test_an_engine_answers_from_its_validity():
    from weightsync.ports.engine import Validity

    class Engine:
        validity = Validity()
        weight_version = property(lambda self: self.validity.version)
        invalid = property(lambda self: self.validity.invalid)

    engine = Engine()
    assert ServingVersion.of(engine, since=None) == ServingVersion(None, None, True)  # type: ignore[arg-type]
    engine.validity.applied(3)
    assert ServingVersion.of(engine, since=5.0) == ServingVersion(3, 5.0, True)  # type: ignore[arg-type]
    engine.validity.touch(4)
    engine.validity.failed(4, RuntimeError("loader raised"))
    answer = ServingVersion.of(engine, since=5.0)  # type: ignore[arg-type]
    assert (answer.version, answer.valid, answer.failed, answer.reason) == (None, False, 4,
                                                                           "version 4 failed: loader raised")
    assert answer.since == engine.validity.invalid.since


# -- vllm serve: the route and the header --------------------------------------------------------------

class EngineClient:
    """What the middleware reads of vLLM's engine client: the weight-version label (a sequence of
    answers, one per read) and the workers' WORKER_VERSION answers."""

    def __init__(self, labels: list[str], workers: list[dict] | Exception) -> None:
        self.labels, self.workers, self.methods = labels, workers, []

    async def get_weight_version(self) -> str:
        return self.labels.pop(0) if len(self.labels) > 1 else self.labels[0]

    async def collective_rpc(self, method: str) -> list[dict]:
        self.methods.append(method)
        if isinstance(self.workers, Exception):
            raise self.workers
        return self.workers


def served(engine: EngineClient):
    from fastapi import FastAPI
    from fastapi.testclient import TestClient

    from weightsync.integrations.vllm_serve_version import WeightSyncVersionMiddleware

    app = FastAPI()
    app.state.engine_client = engine

    @app.post("/v1/completions")
    async def completions() -> dict:
        return {"choices": [{"text": "x"}]}

    @app.get("/health")
    async def health() -> dict:
        return {}

    app.add_middleware(WeightSyncVersionMiddleware)
    return TestClient(app)


def test_vllm_serve_answers_its_version_on_a_route_and_tags_each_completion():
    from weightsync.engines.vllm_version import WORKER_VERSION

    workers = [ServingVersion(7, 10.0, True).to_wire(), ServingVersion(7, 11.0, True).to_wire()]
    engine = EngineClient(["7"], workers)
    with served(engine) as client:
        answer = client.get("/weightsync/version")
        assert answer.status_code == 200 and engine.methods == [WORKER_VERSION]
        assert answer.json() == {**ServingVersion(7, 11.0, True).to_wire(), "label": "7", "workers": workers}
        response = client.post("/v1/completions", json={})
        assert response.json() == {"choices": [{"text": "x"}]}
        assert response.headers["x-weightsync-version"] == "7" and "x-weightsync-versions" not in response.headers
        assert "x-weightsync-version" not in client.get("/health").headers


def test_a_completion_that_spans_an_update_never_claims_one_version():
    engine = EngineClient(["7", "8"], [])  # the label read on arrival, then when the response starts
    with served(engine) as client:
        response = client.post("/v1/completions", json={})
    assert response.headers["x-weightsync-version"] == "mixed"
    assert response.headers["x-weightsync-versions"] == "7,8"


def test_a_completion_whose_version_cannot_be_read_is_served_and_claims_none():
    class Broken(EngineClient):
        async def get_weight_version(self) -> str:
            raise RuntimeError("engine core is gone")

    with served(Broken(["7"], [])) as client:
        response = client.post("/v1/completions", json={})
    assert response.status_code == 200 and response.headers["x-weightsync-version"] == "unknown"


def test_the_route_of_an_engine_without_the_weightsync_backend_says_how_to_start_it():
    engine = EngineClient(["default"], AttributeError("'Worker' object has no attribute 'weightsync_version'"))
    with served(engine) as client:
        answer = client.get("/weightsync/version")
    assert answer.status_code == 503
    assert "has no attribute 'weightsync_version'" in answer.json()["error"]
    assert "--weight-transfer-config '{\"backend\": \"weightsync\"}'" in answer.json()["error"]


# -- weightsync status -----------------------------------------------------------------------------------

def lease(role: str, rank: int, *, alive: bool = True, released: bool = False) -> LeaseRow:
    return LeaseRow(role, rank, "i", 41, "n9", 5.0, 0.1 if alive else 9.0, alive, released, "pid 41 on n9")


def test_each_member_gets_its_state_and_lag_from_the_job_status_and_leases():
    status = {
        "latest_version": {"version": 5, "fingerprint": "f", "published_at": 1.0, "epoch": 0},
        "participants": [{"role": "writer", "rank": 0, "host": "t0"}, {"role": "writer", "rank": 1, "host": "t1"},
                         *({"role": "reader", "rank": r, "host": f"r{r}"} for r in range(5))],
        "reader_state": [
            {"rank": 0, "state": "valid", "version": 5, "last_sync_at": 50.0},
            {"rank": 1, "state": "valid", "version": 3, "last_sync_at": 30.0},
            {"rank": 2, "state": "invalid", "version": None, "invalid_since": 40.0, "error": "phase 3"},
            {"rank": 3, "state": "none", "version": None},
            {"rank": 4, "state": "valid", "version": 5, "last_sync_at": 50.0},
        ],
    }
    rows = {(m.role, m.rank): m for m in members(status, [lease("writer", 1, alive=False), lease("reader", 4, alive=False,
                                                                                                 released=True)])}
    assert [(k, m.version, m.state, m.lag) for k, m in rows.items()] == [
        (("reader", 0), 5, "valid", 0), (("reader", 1), 3, "behind", 2), (("reader", 2), None, "invalid", None),
        (("reader", 3), None, "none", None), (("reader", 4), 5, "left", 0),
        (("writer", 0), 5, "valid", 0), (("writer", 1), 5, "dead", 0)]
    assert rows["reader", 2].since == 40.0 and rows["reader", 2].error == "phase 3"
    assert rows["reader", 1].since == 30.0 and rows["reader", 1].host == "r1"


def test_weightsync_status_lists_every_member_of_a_live_job(capsys):
    from weightsync.cli import main
    from weightsync.meta import EmbeddedMetaServer, MetaClient
    from weightsync.ports.records import Participant

    with EmbeddedMetaServer() as server, MetaClient(server.address, job="grpo", token=server.token) as meta:
        meta.register(Participant("writer", 0, host="trainer-0"))
        for rank in range(3):
            meta.register(Participant("reader", rank, host=f"rollout-{rank}"))
        for version in (1, 2):
            meta.publish_version(version, "fp", writer_rank=0, num_writers=1)
        meta.report_applied(0, 2)
        meta.report_applied(1, 1)
        meta.report_failed(2, 2, "injected: load_weights raised", invalid=True)
        assert main(["status", "--job", "grpo", "--meta", server.address, "--token", server.token, "--json"]) == 1
        listed = json.loads(capsys.readouterr().out)
        assert main(["status", "--job", "grpo", "--meta", server.address, "--token", server.token]) == 1
        table = capsys.readouterr().out
    assert [(m["role"], m["rank"], m["host"], m["version"], m["state"], m["lag"]) for m in listed["members"]] == [
        ("reader", 0, "rollout-0", 2, "valid", 0), ("reader", 1, "rollout-1", 1, "behind", 1),
        ("reader", 2, "rollout-2", None, "invalid", None), ("writer", 0, "trainer-0", 2, "valid", 0)]
    assert listed["members"][2]["error"] == "injected: load_weights raised"
    for text in ("rollout-1", "behind", "invalid", "trainer-0"):
        assert text in table


def test_weightsync_status_without_a_meta_server_says_where_to_name_one(monkeypatch, capsys):
    from weightsync.cli import main

    monkeypatch.delenv("WEIGHTSYNC_META_ADDR", raising=False)
    assert main(["status", "--job", "grpo"]) == 2
    assert "no meta server: pass --meta URL or set WEIGHTSYNC_META_ADDR" in capsys.readouterr().err
