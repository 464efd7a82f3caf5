"""The test launcher's warm processes (tests/launcher.py): a child forked from one is the process a
fresh interpreter would have been, as far as what the warm process imported is concerned."""

from __future__ import annotations

import os
import sys

import pytest

import launcher

#: prints what a child sees: its parent (the warm process), what huggingface_hub read at import,
#: and two variables the import does not read
CHILD = ("import os, huggingface_hub.constants as c; "
         "print(os.getppid(), c.HF_HUB_OFFLINE, os.environ['OMP_NUM_THREADS'], os.environ['MASTER_PORT'])")


@pytest.fixture
def hub_warm(monkeypatch: pytest.MonkeyPatch):
    """A warm process kind that imports huggingface_hub's constants (which read ``HF_HUB_OFFLINE``
    at import), as the ``vllm`` kind imports vLLM, at a fraction of the cost."""
    monkeypatch.setitem(launcher.WARM, "hub", ("huggingface_hub.constants",))
    monkeypatch.setitem(launcher._zygotes, "hub", [])
    yield launcher._zygotes["hub"]
    for zygote in launcher._zygotes["hub"]:
        zygote.close()


def _child(env: dict[str, str]) -> list[str]:
    proc = launcher.run([sys.executable, "-c", CHILD], env=env, timeout=120, warm="hub")
    assert proc.returncode == 0, proc.stderr[-2000:]
    return proc.stdout.split()


def test_a_warm_process_serves_only_the_children_that_agree_with_what_its_imports_read(hub_warm):
    base = {**os.environ, "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1", "MASTER_PORT": "1"}
    first = _child(base)
    # a port and a thread count are not read at import (each child applies its thread count)
    second = _child({**base, "MASTER_PORT": "2", "OMP_NUM_THREADS": "2"})
    online = _child({**base, "HF_HUB_OFFLINE": "0"})
    assert first == [first[0], "True", "1", "1"]
    assert second == [first[0], "True", "2", "2"]  # the same warm process
    assert online[1:] == ["False", "1", "1"] and online[0] != first[0]  # one of its own, which read "0"
    assert [z.proc.pid for z in hub_warm] == [int(first[0]), int(online[0])]
    assert "HF_HUB_OFFLINE" in hub_warm[0].read and "MASTER_PORT" not in hub_warm[0].read


def test_an_unknown_warm_process_is_refused_by_name():
    with pytest.raises(ValueError, match="no warm process 'jax'"):
        launcher.launch([sys.executable, "-c", "pass"], warm="jax")
