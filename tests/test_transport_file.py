"""The file transport: what the multi-process contract does not reach."""

from __future__ import annotations

import os
import sys
import time

import pytest

sys.path.insert(0, os.path.dirname(__file__))

from fake_meta import FakeChannel
from weightsync.clock.deadline import Deadline
from weightsync.configs import load_spec
from weightsync.layout import parse_layout
from weightsync.plan import PlanOptions, build_local_plan
from weightsync.tools.torch_layout import allocate
from weightsync.transport import TransportContext, TransportError, TransportOptions, create_transport

pytestmark = pytest.mark.timeout(60)


def test_a_reader_asking_for_a_version_its_writer_already_pruned_fails_at_once_naming_the_newer_one(tmp_path):
    """Writers keep their last ``slots`` versions. A reader restarted beside a failed version took
    the newest published one (version 0) as its first, whose file writer 0 had pruned when it
    wrote version 2 (the failed version 1 took a slot): it waited for the file to appear until
    its 20 s timeout, and the writers waited for it as long (the file cell of the kill-both fault
    test, 3 runs in 5 under load). It now fails at its next look, naming the newer version, and
    its next update reads that one."""
    spec = load_spec("tiny-qwen3")
    writers = parse_layout("megatron:tp=1").all_rank_layouts(spec)
    readers = parse_layout("vllm:tp=1").all_rank_layouts(spec)
    options = TransportOptions(file_dir=str(tmp_path))
    plans = {role: build_local_plan(writers, readers, role=role, rank=0, options=PlanOptions(min_split_bytes=0))
             for role in ("writer", "reader")}
    writer = create_transport("file", TransportContext(channel=FakeChannel("writer", 0), num_writers=1,
                                                       num_readers=1, options=options))
    reader = create_transport("file", TransportContext(channel=FakeChannel("reader", 0), num_writers=1,
                                                       num_readers=1, options=options))
    try:
        writer.prepare(plans["writer"], allocate(writers[0]), epoch=0, deadline=Deadline.after(5))
        reader.prepare(plans["reader"], allocate(readers[0]), epoch=0, deadline=Deadline.after(5))
        for version in (0, 1, 2):
            writer.send(version, deadline=Deadline.after(5))
        assert not os.path.exists(tmp_path / "v0" / "writer-0.p0.safetensors")  # pruned: slots=2
        started = time.monotonic()
        with pytest.raises(TransportError, match=r"reader 0: writer 0's file for version 0 is gone from .*: it wrote "
                                                 "version 2 since and keeps only its last 2 versions, so version 0 "
                                                 "is superseded here"):
            reader.receive(0, deadline=Deadline.after(10.0))
        assert time.monotonic() - started < 1.5
        reader.receive(2, deadline=Deadline.after(5.0))  # the newer one reads as ever
    finally:
        reader.close()
        writer.close()
