"""One job spec: every setting of ``SyncConfig`` reaches every integration, and is compared across
ranks where it must match.

The list below names every setting with its scope and two valid values. A setting added to
``SyncConfig``, ``TransportOptions`` or ``PlanOptions`` without an entry here fails the first
test; with one, the others check that it reaches vLLM's worker and trainer init infos (and from
the trainer to its workers), verl's ``engine_kwargs.weightsync``, TRL's settings and Ray's
attach, each a fresh integration object holding the value, never a default.
"""

from __future__ import annotations

import importlib.util
import json
import math
from types import SimpleNamespace

import pytest

from weightsync.job.channel import settings_difference
from weightsync.session.config import SyncConfig, job_settings

#: one xdist worker imports vLLM, TRL and Ray (docs/benchmarks.md, "make test-fast under 90 s")
pytestmark = pytest.mark.xdist_group("vllm-stack")

#: setting -> (scope, two valid values)
SETTINGS = {
    "num_writers": ("match", (2, 3)),
    "num_readers": ("match", (2, 3)),
    "job": ("match", ("rl", "rl-2")),
    "meta_address": ("rank", ("http://10.0.0.5:7000", "etcd://n1:2379,n2:2379,n3:2379")),
    "transport": ("match", ("torch", "shm")),
    "max_bucket_bytes": ("match", (1 << 20, 2 << 20)),
    "direct_min_bytes": ("match", (4096, 8192)),
    "checksum": ("match", (True, False)),
    "transport_host": ("rank", ("10.0.0.2", "10.0.0.3")),
    "slots": ("match", (3, 4)),
    "file_dir": ("local", ("/mnt/a", "/mnt/b")),
    "nixl_mode": ("match", ("pull", "push")),
    "shm_streaming": ("match", (True, False)),
    "delta_anchor_every": ("match", (4, 5)),
    "min_split_bytes": ("match", (4096, 8192)),
    "allow_unneeded_sources": ("match", (True, False)),
    "staleness": ("match", (1, 2)),
    "timeout": ("local", (12.5, 13.5)),
    "lease_seconds": ("local", (5.0, 6.0)),
    "host": ("rank", ("node-a", "node-b")),
    "layer_phases": ("match", (True, False)),
    "integrity": ("match", (True, False)),
    "completion": ("match", ("quorum=1", "fraction=0.5")),
    "commit": ("match", ("fleet", "each")),
    "peer_sources": ("match", (1, 0)),
    "peers_across_hosts": ("match", (True, False)),
}
CASES = [(name, value) for name, (_, values) in SETTINGS.items() for value in values]
#: what a setting needs beside it to be valid (weightsync/session/combinations.py): deltas are refused with
#: layer phases (on by default in vLLM's trainer and TRL), a transport's own option without it
NEEDS = {"delta_anchor_every": {"layer_phases": False}, "nixl_mode": {"transport": "nixl"},
         "file_dir": {"transport": "file"}, "completion": {"transport": "shm"}, "commit": {"layer_phases": False},
         "peers_across_hosts": {"peer_sources": 1}}


def with_needs(name, value, **base):
    return {**base, **NEEDS.get(name, {}), name: value}
BASE = {"num_writers": 4, "num_readers": 4}  # room for the ranks below
HAVE_VLLM = importlib.util.find_spec("vllm") is not None
needs_vllm = pytest.mark.skipif(not HAVE_VLLM, reason="vllm is not installed")


def test_every_setting_is_listed_here_with_its_scope():
    assert {s.name: s.scope for s in job_settings()} == {name: scope for name, (scope, _) in SETTINGS.items()}


@pytest.mark.parametrize(("name", "value"), CASES)
def test_the_wire_form_carries_the_setting_and_ranks_compare_it_where_it_must_match(name, value):
    config = SyncConfig.from_wire(with_needs(name, value, **BASE))
    wire = config.to_wire()
    assert wire[name] == value
    assert json.loads(json.dumps(wire)) == wire  # plain data
    assert SyncConfig.from_wire(wire) == config
    other = SyncConfig.from_wire(with_needs(name, SETTINGS[name][1][1 - SETTINGS[name][1].index(value)], **BASE))
    if SETTINGS[name][0] == "match":
        assert config.settings() != other.settings()
        assert f"{name}: " in settings_difference(config.settings(), other.settings())
    else:  # a rank's own choice, or where it runs: never compared
        assert config.settings() == other.settings()


@needs_vllm
@pytest.mark.parametrize(("name", "value"), CASES)
def test_vllm_init_infos_carry_the_setting_from_trainer_to_worker(name, value):
    from weightsync.integrations.vllm_backend import WeightSyncInitInfo
    from weightsync.integrations.vllm_trainer import WeightSyncTrainerInitInfo

    worker = WeightSyncInitInfo.from_wire(with_needs(name, value, **BASE))
    assert worker.sync_config().to_wire()[name] == value
    trainer = WeightSyncTrainerInitInfo(rank=0, **with_needs(name, value, **BASE))
    assert trainer.sync_config().to_wire()[name] == value
    sent = trainer.worker_init_info("http://meta:1", "token")
    assert json.loads(json.dumps(sent)) == sent
    received = WeightSyncInitInfo.from_wire(sent).sync_config().to_wire()[name]
    # where the trainer runs is not where the worker runs: the worker keeps its own, and the
    # coordinator is the one the trainer tells its workers of
    own = {**SyncConfig(num_writers=1, num_readers=1).to_wire(), "meta_address": "http://meta:1"}
    assert received == (own[name] if SETTINGS[name][0] == "rank" else value)


#: settings an integration fills itself: verl and TRL size the job from their own topology and
#: place each rank on its own node
FILLED = {"verl": {"num_writers", "num_readers", "host", "transport_host"},
          "trl": {"num_writers", "num_readers", "host", "transport_host"}}


@pytest.mark.parametrize(("name", "value"), CASES)
def test_verl_engine_kwargs_carry_the_setting(name, value):
    from weightsync.integrations.verl_settings import VerlSyncSettings

    if name in FILLED["verl"]:
        with pytest.raises(ValueError, match=rf"engine_kwargs.weightsync has unknown fields \['{name}'\]"):
            VerlSyncSettings.from_engine_kwargs({name: value})
        return
    settings = VerlSyncSettings.from_engine_kwargs(with_needs(name, value))
    assert settings.sync_config(num_readers=4).to_wire()[name] == value


@pytest.mark.parametrize(("name", "value"), CASES)
def test_trl_settings_carry_the_setting_in_both_modes(name, value):
    from weightsync.integrations.trl_sync import TRLSyncSettings

    if name in FILLED["trl"]:
        with pytest.raises(TypeError, match=name):
            TRLSyncSettings(**{name: value})
        return
    settings = TRLSyncSettings(**with_needs(name, value))
    assert settings.sync_config(num_writers=4, num_readers=4).to_wire()[name] == value  # colocate
    if HAVE_VLLM:  # server mode: through vLLM's trainer init info
        # the main process shares the coordinator it found (the settings' own when they name one)
        address = value if name == "meta_address" else "http://meta:1"
        info = settings.trainer_init_info(rank=0, world=4, meta_address=address, meta_token="t", model_config=None)
        assert info.sync_config().to_wire()[name] == value


@pytest.mark.parametrize(("name", "value"), CASES)
def test_ray_attach_carries_the_setting_and_places_the_rank(name, value, monkeypatch):
    pytest.importorskip("ray")
    from weightsync.integrations.ray import actors

    monkeypatch.setattr(actors, "node_identity", lambda: ("label:slot-1", "10.9.9.9"))
    sent = SyncConfig.from_wire(with_needs(name, value, **BASE)).to_wire()  # what attach_* sends each actor
    placed = actors.placed_config(SyncConfig.from_wire(json.loads(json.dumps(sent)), where="attach_writers"))
    wire = placed.to_wire()
    assert (wire["host"], wire["transport_host"]) == ("label:slot-1", "10.9.9.9")  # the actor's own node
    if name not in ("host", "transport_host"):
        assert wire[name] == value


# -- bad input is refused at once, naming the field (issue 28 section 4) ------------------------------

BAD = [({"num_writers": "2"}, r"num_writers must be an integer, got '2' \(str\)"),
       ({"max_bucket_bytes": "1024"}, r"max_bucket_bytes must be an integer, got '1024'"),
       ({"timeout": math.inf}, r"timeout must be a finite number, got inf"),
       ({"timeout": math.nan}, r"timeout must be a finite number, got nan"),
       ({"timeout": "30"}, r"timeout must be a number, got '30'"),
       ({"layer_phases": 1}, r"layer_phases must be true or false, got 1"),
       ({"delta_anchor_every": -1}, r"delta_anchor_every must be >= 0"),
       ({"nixl_mode": "both"}, r"nixl_mode must be one of \['auto', 'pull', 'push'\]"),
       ({"meta_address": "meta-server"}, r"meta_address: meta server address must be 'http://host:port'"),
       ({"timout": 30.0}, r"has unknown \w+ \['timout'\]")]


class _Client:
    """vLLM's four control-plane calls and the prefix-cache reset, doing nothing."""

    def __init__(self):
        self.init_info = None

    def init_weight_transfer_engine(self, init_info):
        self.init_info = init_info

    def start_weight_update(self):
        pass

    def update_weights(self, update_info):
        pass

    def finish_weight_update(self, weight_version=None):
        pass

    def reset_prefix_cache(self):
        pass


@needs_vllm
@pytest.mark.timeout(60)
@pytest.mark.parametrize(("bad", "message"), BAD[:-1])  # a misspelt keyword is Python's TypeError, as it should be
def test_a_bad_trainer_init_info_is_refused_naming_the_field(bad, message):
    """On 3ee4748: TypeError for the strings; inf passed init and then hung (or OverflowError) in
    send_weights; nan passed init and every wait failed at once."""
    from vllm.distributed.weight_transfer.factory import WeightTransferTrainerFactory

    from weightsync.integrations.vllm_trainer import WeightSyncTrainerInitInfo
    from weightsync.sources.module import ShardedSource
    from weightsync.tools.tiny import tiny_config

    config = tiny_config()
    with pytest.raises(ValueError, match=r"WeightSyncTrainerInitInfo\W*" + message):
        engine = WeightTransferTrainerFactory.trainer_init(
            WeightSyncTrainerInitInfo(rank=0, model_config=config, **bad), client=_Client(),
            source=ShardedSource("hf", config, 0))
        try:
            engine.send_weights()
        finally:
            engine.shutdown()


@needs_vllm
@pytest.mark.parametrize(("bad", "message"), BAD)
def test_a_bad_worker_init_info_is_refused_naming_the_field(bad, message, monkeypatch):
    """What vLLM's worker does with ``init_weight_transfer_engine``'s dict, the model stubbed out.
    On 3ee4748: TypeError for the strings; inf and nan accepted."""
    import torch

    from weightsync.engines.buffers import ShardedEngine
    from weightsync.integrations import vllm_backend
    from weightsync.tools.tiny import tiny_config

    monkeypatch.setattr(vllm_backend, "_WorkerEngine", lambda *args, **kwargs: ShardedEngine("hf", tiny_config(), 0))
    engine = vllm_backend.WeightSyncTransferEngine(
        SimpleNamespace(backend="weightsync"), SimpleNamespace(parallel_config=None, model_config=None),
        torch.device("cpu"), None)
    init = {"num_writers": 1, "num_readers": 1, "meta_address": "http://127.0.0.1:9", "meta_token": "token-12345678", **bad}
    try:
        with pytest.raises(ValueError, match=r"WeightSyncInitInfo\W*" + message):
            engine.init_transfer_engine(engine.parse_init_info(init))
    finally:
        engine.shutdown()


@needs_vllm
def test_worker_init_info_rank_and_adapter_are_checked():
    from weightsync.integrations.vllm_backend import WeightSyncInitInfo

    with pytest.raises(ValueError, match=r"WeightSyncInitInfo.rank must be in \[0, 2\) \(the reader seats\), got 2"):
        WeightSyncInitInfo.from_wire({"num_writers": 1, "num_readers": 2, "rank": 2})
    with pytest.raises(ValueError, match=r"WeightSyncInitInfo.num_readers is required"):
        WeightSyncInitInfo.from_wire({"num_writers": 1})
    with pytest.raises(ValueError, match=r"WeightSyncInitInfo.lora is not a plain LoRA adapter config: KeyError\('r'\)"):
        WeightSyncInitInfo.from_wire({"num_writers": 1, "num_readers": 1, "lora": {"lora_alpha": 16}})
    with pytest.raises(ValueError, match=r"WeightSyncInitInfo: drafter=True with lora: adapter versions"):
        WeightSyncInitInfo.from_wire({"num_writers": 1, "num_readers": 1, "drafter": True,
                                      "lora": {"r": 4, "lora_alpha": 8, "target_modules": ["q_proj"]}})
    with pytest.raises(ValueError, match=r"WeightSyncInitInfo.drafter"):
        WeightSyncInitInfo.from_wire({"num_writers": 1, "num_readers": 1, "drafter": "yes"})


@needs_vllm
def test_model_config_may_be_a_transformers_config_object():
    """On 3ee4748 an HF config object raised AttributeError (``config.get``) at trainer_init."""
    import torch
    from transformers import Qwen3Config, Qwen3ForCausalLM
    from vllm.distributed.weight_transfer.base import ModuleSource
    from vllm.distributed.weight_transfer.factory import WeightTransferTrainerFactory

    from weightsync.integrations.vllm_trainer import WeightSyncTrainerInitInfo
    from weightsync.tools.tiny import tiny_config

    hf_config = Qwen3Config(**tiny_config())
    torch.manual_seed(0)
    model = Qwen3ForCausalLM(hf_config)
    client = _Client()
    engine = WeightTransferTrainerFactory.trainer_init(WeightSyncTrainerInitInfo(rank=0, model_config=hf_config),
                                                       client=client, source=ModuleSource(model))
    try:
        layout = engine.writer.source.layout()
        assert {s.name for s in layout.shards} == set(dict(model.named_parameters()))
        assert client.init_info["num_writers"] == 1 and client.init_info["layer_phases"] is True
    finally:
        engine.shutdown()
    with pytest.raises(ValueError, match=r"model_config must be the model's Hugging Face config, a dict or a "
                                         r"transformers config object \(PretrainedConfig\), got int"):
        WeightSyncTrainerInitInfo(rank=0, model_config=3)


# -- where the coordinator is: SyncConfig.meta_address (issue 38) ---------------------------------------

def test_meta_address_is_normalized_and_an_etcd_password_in_it_is_refused():
    assert SyncConfig(num_writers=1, num_readers=1, meta_address="10.0.0.5:7000").meta_address == "http://10.0.0.5:7000"
    assert SyncConfig(num_writers=1, num_readers=1).meta_address == ""  # WEIGHTSYNC_META_ADDR, else embedded
    with pytest.raises(ValueError, match=r"meta_address carries an etcd password \(user:password@\).*"
                                         r"etcd://user@host:port,\.\.\. and the password in WEIGHTSYNC_ETCD_PASSWORD"):
        SyncConfig(num_writers=1, num_readers=1, meta_address="etcd://ws:secret@n1:2379,n2:2379")
    with pytest.raises(ValueError, match=r"meta_address: .*etcd://host1:2379"):
        SyncConfig(num_writers=1, num_readers=1, meta_address="etcd://n1:x")


def test_a_role_given_a_client_of_another_coordinator_than_its_config_names_is_refused():
    from weightsync.meta.client import MetaClient
    from weightsync.roles.writer import WeightWriter
    from weightsync.sources.module import ShardedSource
    from weightsync.tools.tiny import tiny_config

    config = SyncConfig(num_writers=1, num_readers=1, meta_address="127.0.0.1:9")
    source = ShardedSource("hf", tiny_config(), 0)
    other = MetaClient("http://127.0.0.1:10", job="default", token="token-12345678")
    try:
        with pytest.raises(ValueError, match=r"SyncConfig.meta_address is 'http://127.0.0.1:9' but the meta client "
                                             r"passed is for 'http://127.0.0.1:10'"):
            WeightWriter(source, rank=0, config=config, meta=other)
    finally:
        other.close()
    from weightsync.meta.client import job_meta

    same = MetaClient("http://127.0.0.1:9/", job="default", token="token-12345678")
    try:
        assert job_meta(config.meta_address, job="default", given=same) is same
    finally:
        same.close()


def test_ray_attach_takes_the_coordinator_from_the_config_or_meta_and_refuses_two():
    pytest.importorskip("ray")
    from weightsync.integrations.ray.actors import connection
    from weightsync.integrations.ray.meta import MetaConnection

    etcd = SyncConfig(num_writers=1, num_readers=1, meta_address="etcd://n1:2379,n2:2379")
    assert connection(etcd, None) == MetaConnection("etcd://n1:2379,n2:2379", "")
    assert connection(etcd, MetaConnection("etcd://n1:2379,n2:2379/weightsync", "")).address.startswith("etcd://")
    with pytest.raises(ValueError, match=r"no coordinator for the actors: pass meta=meta_server\(\)"):
        connection(SyncConfig(num_writers=1, num_readers=1), None)
    with pytest.raises(ValueError, match=r"SyncConfig.meta_address is 'etcd://n1:2379,n2:2379' but meta= is "
                                         r"'http://10.0.0.1:7000'"):
        connection(etcd, MetaConnection("http://10.0.0.1:7000", "token-12345678"))


def test_verl_refuses_a_ray_actor_name_beside_a_coordinator_address():
    from weightsync.integrations.verl_settings import VerlSyncSettings

    with pytest.raises(ValueError, match=r"engine_kwargs.weightsync.meta_name='mine' with meta_address="
                                         r"'etcd://n1:2379': .*give one of the two"):
        VerlSyncSettings.from_engine_kwargs({"meta_name": "mine", "meta_address": "etcd://n1:2379"})
    assert VerlSyncSettings.from_engine_kwargs({"meta_address": "etcd://n1:2379"}).sync_config(
        num_readers=2).meta_address == "etcd://n1:2379"
