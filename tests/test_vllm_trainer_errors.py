"""The trainer side of vLLM's weight-transfer API surfaces the other side's error as itself,
within the job's timeout (issue 41).

No engine runs here: vLLM's workers are a client whose ``update_weights`` does what a worker's
reader does first (a call to the meta server), and the trainer rank is a real
:class:`~weightsync.integrations.vllm_trainer.WeightSyncTrainerEngine` with a real writer.
"""

from __future__ import annotations

import contextlib
import importlib.util
import socket
import threading
import time
from types import SimpleNamespace

import pytest

from weightsync.tools.tiny import CanonicalSource, tiny_config

pytestmark = pytest.mark.skipif(importlib.util.find_spec("vllm") is None, reason="vllm is not installed")


def _workers(update_weights):
    return SimpleNamespace(start_weight_update=lambda: None, update_weights=update_weights,
                           finish_weight_update=lambda weight_version=None: None, reset_prefix_cache=lambda: None,
                           init_weight_transfer_engine=lambda info: None)


def _trainer(address: str, token: str, client, timeout: float):
    from weightsync.integrations.vllm_trainer import WeightSyncTrainerEngine, WeightSyncTrainerInitInfo

    config = tiny_config()
    info = WeightSyncTrainerInitInfo(rank=0, meta_address=address, meta_token=token, model_config=config,
                                     timeout=timeout, job="errors")
    return WeightSyncTrainerEngine.trainer_init(info, client=client, source=CanonicalSource(config))


def test_a_worker_refused_by_the_meta_server_fails_send_weights_at_once_with_its_own_error():
    """The worker's ``PermissionError ... (401)`` was hidden behind the writer's barrier
    ``TimeoutError`` after the whole timeout."""
    from weightsync.meta.client import MetaClient
    from weightsync.meta.embedded import EmbeddedMetaServer

    server = EmbeddedMetaServer().start()

    def worker_with_a_wrong_token(info):
        with MetaClient(server.address, job="errors", token="w" * 32) as meta:
            meta.pin_instance()  # what a worker's reader asks first

    engine = _trainer(server.address, server.token, _workers(worker_with_a_wrong_token), timeout=4.0)
    try:
        start = time.monotonic()
        with pytest.raises(PermissionError, match=r"rejected the token \(401\)"):
            engine.send_weights()
        assert time.monotonic() - start < 2.0
    finally:
        unfinished = engine._unfinished_write
        if unfinished is not None:  # the writer gives up waiting for the reader at its timeout
            with contextlib.suppress(Exception):
                unfinished.result(timeout=10)
        engine.shutdown()
        server.stop()


def test_an_unreachable_meta_server_fails_send_weights_within_the_timeout():
    """It took the meta client's own 30 s (and 20 s in the issue) under ``timeout=3``."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        address = f"http://127.0.0.1:{sock.getsockname()[1]}"  # nothing listens there once closed
    stuck = threading.Event()
    engine = _trainer(address, "t" * 32, _workers(lambda info: stuck.wait(30)), timeout=3.0)
    try:
        start = time.monotonic()
        with pytest.raises(ConnectionError, match=rf"meta server {address} unreachable"):
            engine.send_weights()
        assert time.monotonic() - start < 3.0 + 2.0
    finally:
        stuck.set()
        engine.shutdown()
