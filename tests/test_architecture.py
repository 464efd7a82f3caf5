"""The one-way dependency rule of docs/architecture.md, enforced on the source tree."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

SRC = Path(__file__).resolve().parents[1] / "src" / "weightsync"

#: Packages the pure core (layout/, plan/) must never import.
CORE_FORBIDDEN = (
    "torch", "weightsync.transport", "weightsync.engines", "weightsync.sources", "weightsync.meta",
    "weightsync.writer", "weightsync.reader", "vllm", "sglang", "megatron", "deepspeed", "nixl",
    "nixl_cu12", "transformers", "fastapi", "uvicorn", "httpx",
)
#: Engine / framework packages only their own adapter module may import.
ADAPTER_ONLY = {
    "vllm": ("engines/vllm", "sources/vllm", "integrations/trl"), "sglang": "engines/sglang",
    "transformers": ("engines/hf", "sources/"), "trl": "integrations/trl",
    "megatron": "sources/megatron", "deepspeed": "sources/deepspeed",
    "nixl": "transport/nixl", "nixl_cu12": "transport/nixl",
    "ray": ("ray/", "sources/vllm"), "verl": "integrations/verl",  # weightsync.ray, and the vLLM trainer source driving vLLM's Ray workers
}


def imports_of(path: Path) -> set[str]:
    tree = ast.parse(path.read_text())
    names: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names.add(node.module)
    return names


def _matches(name: str, prefix: str) -> bool:
    return name == prefix or name.startswith(prefix + ".")


@pytest.mark.parametrize("package", ["layout", "plan"])
def test_core_imports_nothing_outside_the_core(package):
    offenders = []
    for path in sorted((SRC / package).rglob("*.py")):
        for name in imports_of(path):
            if any(_matches(name, bad) for bad in CORE_FORBIDDEN):
                offenders.append(f"{path.relative_to(SRC)} imports {name}")
    assert not offenders, "core must stay pure:\n" + "\n".join(offenders)


def test_engines_are_imported_only_inside_their_adapter():
    offenders = []
    for path in sorted(SRC.rglob("*.py")):
        rel = path.relative_to(SRC).as_posix()
        for name in imports_of(path):
            for pkg, home in ADAPTER_ONLY.items():
                homes = home if isinstance(home, tuple) else (home,)
                if _matches(name, pkg) and not any(rel.startswith(h) for h in homes):
                    offenders.append(f"{rel} imports {name}")
    assert not offenders, "\n".join(offenders)


#: Adapters never reach across: a source is not an engine, and neither moves bytes itself.
ADAPTER_FORBIDDEN = {
    "sources": ("weightsync.engines", "weightsync.transport"),
    "engines": ("weightsync.sources", "weightsync.transport"),
}


@pytest.mark.parametrize("package", sorted(ADAPTER_FORBIDDEN))
def test_sources_and_engines_import_neither_each_other_nor_a_transport(package):
    offenders = []
    for path in sorted((SRC / package).rglob("*.py")):
        for name in imports_of(path):
            if any(_matches(name, bad) for bad in ADAPTER_FORBIDDEN[package]):
                offenders.append(f"{path.relative_to(SRC)} imports {name}")
    assert not offenders, "\n".join(offenders)


#: Meta-server calls that carry the job protocol; only the job channel (and the meta package
#: itself) may make them, so that every key and message of the protocol lives in one module.
PROTOCOL_CALLS = {"put_document", "get_document", "publish_version", "wait_version", "report_applied",
                  "report_failed", "wait_readers", "wait_registered", "latest_version", "wait_reader_report",
                  "compare_and_set", "counter", "acquire_lease", "leases", "pin_instance"}


def test_only_the_job_channel_speaks_the_protocol():
    offenders = []
    for path in sorted(SRC.rglob("*.py")):
        rel = path.relative_to(SRC).as_posix()
        if rel == "job.py" or rel.startswith("meta/"):
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
                    and node.func.attr in PROTOCOL_CALLS and not _is_channel(node.func.value)):
                offenders.append(f"{rel}:{node.lineno} calls .{node.func.attr}()")
    assert not offenders, "go through weightsync.job.JobChannel:\n" + "\n".join(offenders)


def _is_channel(value: ast.expr) -> bool:
    """``channel.x()``, ``self.channel.x()``, ``ctx.job.x()``, ``session.channel.x()``..."""
    name = value.attr if isinstance(value, ast.Attribute) else value.id if isinstance(value, ast.Name) else ""
    return name in ("channel", "job")


def test_engine_adapters_are_lazy_attributes_of_the_engines_package():
    """``from weightsync.engines import VLLMEngine`` works (docs), importing vLLM only then."""
    code = ("import sys, weightsync.engines as e; assert 'vllm' not in sys.modules; "
            "from weightsync.engines import VLLMEngine, update_llm; "
            "assert VLLMEngine.__module__ == 'weightsync.engines.vllm' and callable(update_llm)")
    subprocess.run([sys.executable, "-c", code], check=True, timeout=300)
