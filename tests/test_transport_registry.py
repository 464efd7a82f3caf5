"""The open transport registry: a transport weightsync does not ship, registered in code or
declared by an installed package, is chosen by name like a built-in one and moves a real job."""

from __future__ import annotations

import os
import sys

import pytest

from fake_meta import FakeChannel
from test_sync_e2e import assert_all_exact, finish, launch
from weightsync.meta.client import EmbeddedMetaServer
from weightsync.transport import TransportContext, TransportOptions, create_transport, unavailable_reason
from weightsync.transport.registry import _read_entry_points, register_transport, transport_entry, unregister_transport
from weightsync.transport.shm.transport import SharedMemoryTransport

PLUGIN = '''
from weightsync.transport.shm.transport import SharedMemoryTransport


class MirrorTransport(SharedMemoryTransport):
    """A third party's transport: shared memory under another name."""

    name = "mirror"
'''


def _install_plugin(root) -> str:
    """A package declaring transport "mirror" in its metadata, as pip would install it."""
    (root / "ws_mirror.py").write_text(PLUGIN)
    info = root / "ws_mirror-1.0.dist-info"
    info.mkdir()
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: ws-mirror\nVersion: 1.0\n")
    (info / "entry_points.txt").write_text("[weightsync.transports]\nmirror = ws_mirror:MirrorTransport\n")
    return str(root)


def _ctx(**options) -> TransportContext:
    return TransportContext(channel=FakeChannel(), num_writers=1, num_readers=1, options=TransportOptions(**options))


def test_a_transport_registered_in_code_is_created_by_name_and_a_second_registration_is_refused():
    class Mine(SharedMemoryTransport):
        name = "mine"

    register_transport("mine", Mine)
    try:
        assert unavailable_reason("mine") is None
        assert isinstance(create_transport("mine", _ctx()), Mine)
        with pytest.raises(ValueError, match=r"transport 'mine' is already registered .* pass replace=True"):
            register_transport("mine", "somewhere:Else")
        register_transport("mine", Mine, missing=lambda: "its card is not plugged in", replace=True)
        with pytest.raises(ValueError, match="transport 'mine' cannot be used: its card is not plugged in"):
            create_transport("mine", _ctx())
    finally:
        unregister_transport("mine")
    with pytest.raises(ValueError, match=r"unknown transport 'mine'; known: \['file', 'nixl', 'routed', 'shm', "
                                         r"'torch'"):
        create_transport("mine", _ctx())


def test_registration_errors_name_what_is_wrong():
    with pytest.raises(ValueError, match="a transport cannot be named 'auto'"):
        register_transport("auto", SharedMemoryTransport)
    with pytest.raises(ValueError, match="give a class per mode together with `mode`"):
        register_transport("moded", {"a": SharedMemoryTransport, "b": SharedMemoryTransport})
    register_transport("broken", "weightsync.transport.shm.transport:NoSuchClass")
    try:
        with pytest.raises(ValueError, match=r"transport 'broken': cannot import "
                                             r"'weightsync.transport.shm.transport:NoSuchClass'"):
            create_transport("broken", _ctx())
    finally:
        unregister_transport("broken")


def test_a_mode_is_picked_per_job_and_deltas_are_refused_where_the_picked_class_would_ignore_them():
    class Full(SharedMemoryTransport):
        name, carries_deltas = "two-modes", False

    class Delta(SharedMemoryTransport):
        name = "two-modes"

    register_transport("two-modes", {"full": Full, "delta": Delta},
                       mode=lambda ctx: "delta" if ctx.num_readers > 1 else "full")
    try:
        many = TransportContext(channel=FakeChannel(), num_writers=1, num_readers=2,
                                options=TransportOptions(delta_anchor_every=2))
        assert isinstance(create_transport("two-modes", many), Delta)
        with pytest.raises(ValueError, match=r"writer 0: delta_anchor_every=2 is not supported by the two-modes "
                                             r"transport \(Full, on cpu\): it would send every version in full"):
            create_transport("two-modes", _ctx(delta_anchor_every=2))
    finally:
        unregister_transport("two-modes")


def test_a_transport_an_installed_package_declares_moves_a_real_job_bitwise(tmp_path, monkeypatch):
    """Writers and readers in processes of their own find "mirror" through the package's entry
    point, and the job's versions arrive bitwise in place."""
    plugin = _install_plugin(tmp_path)
    monkeypatch.syspath_prepend(plugin)
    _read_entry_points.cache_clear()
    try:
        assert transport_entry("mirror").path(_ctx()) == "ws_mirror:MirrorTransport"
    finally:
        unregister_transport("mirror")
        _read_entry_points.cache_clear()
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([plugin, *filter(None, [os.environ.get("PYTHONPATH")])]))
    common = {"source": "fsdp:dp=1", "target": "vllm:tp=2", "num_writers": 1, "num_readers": 2,
              "transport": "mirror", "versions": [0, 1], "config": "tiny-qwen3-moe", "timeout": 30.0}
    with EmbeddedMetaServer() as server:
        procs = {("writer", 0): launch(server, "writer", 0, **common)}
        procs |= {("reader", r): launch(server, "reader", r, **common) for r in range(2)}
        out = finish(procs, 120)
    assert_all_exact(out, [0, 1])
    assert sys.modules.get("ws_mirror") is None  # this process only read the metadata
