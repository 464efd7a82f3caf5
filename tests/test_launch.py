"""Zero-config launch (issue 41): under torchrun a job finds its meta server with no
``WEIGHTSYNC_META_ADDR`` (rank 0 serves one and tells the others through torch's store), and a
multi-process job that has no store fails at once, naming the variable to set."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from weightsync.meta import connect
from weightsync.meta.launch import LaunchEnv

ROOT = Path(__file__).resolve().parent.parent

RANK_SCRIPT = """
import json, os, sys
from weightsync.meta import Participant, connect
if sys.argv[1] == "group":
    import torch.distributed as dist
    dist.init_process_group("gloo")
client, server = connect(job="zero", timeout=60)
rank = int(os.environ["RANK"])
client.register(Participant("writer", rank, "train", "h", {}, b""))
table = client.wait_table(writers=2, readers=0, timeout=60)
# one write(2) per line: the two ranks share torchrun's stdout (print may write the line and its
# newline apart, and the other rank's line then lands between them)
os.write(1, ("RESULT " + json.dumps({"rank": rank, "address": client.address, "started": server is not None,
                                     "writers": table.count("writer")}) + "\\n").encode())
if rank == 1:
    client.put_document("done", b"1")
else:  # rank 0's server outlives rank 1's calls
    assert client.get_document("done", wait=60) == b"1"
client.close()
if server is not None:
    server.stop()
"""


@pytest.mark.parametrize("store", ["agent", "group"])
def test_a_torchrun_job_without_a_meta_address_shares_rank_0s_server(tmp_path, store):
    """``agent``: torchrun's agent store, before any process group; ``group``: the default
    process group's store (accelerate and TRL initialise it first)."""
    script = tmp_path / "rank.py"
    script.write_text(RANK_SCRIPT)
    env = {k: v for k, v in os.environ.items() if not k.startswith(("WEIGHTSYNC_META", "MASTER_", "RANK", "WORLD_"))}
    env.update(PYTHONPATH=os.pathsep.join([str(ROOT / "src"), env.get("PYTHONPATH", "")]), OMP_NUM_THREADS="1")
    proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
                           str(script), store], capture_output=True, text=True, timeout=240, env=env, cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = sorted((json.loads(line[7:]) for line in proc.stdout.splitlines() if line.startswith("RESULT ")),
                  key=lambda r: r["rank"])
    assert [(r["rank"], r["started"], r["writers"]) for r in rows] == [(0, True, 2), (1, False, 2)]
    assert rows[0]["address"] == rows[1]["address"] and rows[0]["address"].startswith("http://127.0.0.1:")


def test_a_multi_process_job_without_a_store_or_an_address_fails_at_once_naming_the_variable(monkeypatch):
    for name in ("WEIGHTSYNC_META_ADDR", "TORCHELASTIC_USE_AGENT_STORE"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("RANK", "1")
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    start = time.monotonic()
    with pytest.raises(ValueError, match=r"rank 1 of a job of 2 processes \(WORLD_SIZE\) and no meta server is set: "
                                         r"set WEIGHTSYNC_META_ADDR"):
        connect(job="zero")
    assert time.monotonic() - start < 2.0


def test_the_launch_environment_is_read_once_into_a_dataclass():
    launch = LaunchEnv.from_env({"RANK": "3", "WORLD_SIZE": "8", "MASTER_ADDR": "10.0.0.1", "MASTER_PORT": "29500",
                                 "TORCHELASTIC_USE_AGENT_STORE": "True"})
    assert launch == LaunchEnv(rank=3, world_size=8, master_addr="10.0.0.1", master_port=29500, agent_store=True)
    assert launch.launched and not LaunchEnv.from_env({}).launched
