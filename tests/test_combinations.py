"""The combination table (docs/fewer-bytes.md, "What combines"), walked entry by entry.

Every entry says "works" (naming the tests that prove it: each must exist), "refused" (the
message a user gets: reproduced here from the settings the row and column name), "untested"
or "n/a". A refusal reaches the user at init: where the settings are written (SyncConfig, the
vLLM trainer init info), or, for ``transport="auto"``, when the job plans, before any byte
moves (on 3ee4748 each of these was accepted and every version sent in full).
"""

from __future__ import annotations

import ast
import re
import threading
from functools import cache
from pathlib import Path

import pytest

from weightsync import SyncConfig, TransportOptions
from weightsync.session.combinations import CombinationError

ROOT = Path(__file__).resolve().parents[1]
DOC = ROOT / "docs" / "fewer-bytes.md"
#: the settings (wire form) a feature of the tables stands for (FP8 and LoRA are layouts, not settings)
SETTINGS = {"delta": {"delta_anchor_every": 4}, "layer phases": {"layer_phases": True},
            "fleet commit": {"commit": "fleet"}}
ENTRY = re.compile(r"^(works|refused|untested|n/a)\b")


def tables() -> dict[str, list[dict[str, str]]]:
    """Each table of the "What combines" section, by its heading: one dict per row, by column."""
    section = DOC.read_text().split("## What combines", 1)[1]
    out: dict[str, list[dict[str, str]]] = {}
    for block in section.split("### ")[1:]:
        title, *lines = block.splitlines()
        rows = [[c.strip() for c in ln.strip().strip("|").split("|")] for ln in lines if ln.startswith("|")]
        header, body = rows[0], rows[2:]
        out[title.strip()] = [dict(zip(header, row, strict=True)) for row in body]
    return out


def cells() -> list[tuple[str, str, str, str]]:
    """(table, row, column, entry) of every non-empty entry."""
    return [(title, next(iter(row.values())), column, entry) for title, rows in tables().items() for row in rows
            for column, entry in list(row.items())[1:] if entry]


def test_the_section_has_the_four_tables_with_every_feature():
    found = tables()
    assert set(found) == {"Transport x feature", "Engine x feature", "Feature x feature", "Transport x option"}
    features = ["delta", "FP8", "LoRA", "layer phases"]
    assert list(found["Transport x feature"][0])[1:] == features
    assert list(found["Engine x feature"][0])[1:] == features
    transports = [re.match(r"`(\w+)`", row["transport"]).group(1) for row in found["Transport x feature"]]
    assert transports == ["torch", "shm", "nixl", "file", "routed", "auto"]
    assert list(found["Transport x option"][0])[1:] == transports
    options = [row["option"].strip("`").split("=")[0] for row in found["Transport x option"]]
    assert options == ["checksum", "nixl_mode", "file_dir", "shm_streaming", "completion"]


@pytest.mark.parametrize(("table", "row", "column", "entry"), cells())
def test_every_entry_says_works_refused_untested_or_na(table, row, column, entry):
    assert ENTRY.match(entry) or entry.startswith("as the transport it picks"), entry


def _tests_named(entry: str) -> list[str]:
    """``path::name[param]`` references of an entry; a bare ``[param]`` repeats the one before."""
    refs, last = [], ""
    for ref in re.findall(r"`([^`]+)`", entry):
        if ref.startswith("[") and last:
            refs.append(last.split("[", maxsplit=1)[0] + ref)
        elif "::" in ref:
            refs.append(ref)
            last = ref
    return refs


@cache
def _test_functions(path: str) -> tuple[set[str], str]:
    source = (ROOT / path).read_text()
    names = set()
    for node in ast.parse(source).body:
        if isinstance(node, ast.FunctionDef):
            names.add(node.name)
        elif isinstance(node, ast.ClassDef):
            names |= {f"{node.name}::{f.name}" for f in node.body if isinstance(f, ast.FunctionDef)}
    return names, source


WORKS = [(t, r, c, ref) for t, r, c, e in cells() if e.startswith("works") for ref in _tests_named(e)]


@pytest.mark.parametrize(("table", "row", "column", "ref"), WORKS)
def test_each_works_entry_names_a_test_that_exists(table, row, column, ref):
    path, name = ref.split("::", 1)
    name, _, param = name.partition("[")
    functions, source = _test_functions(path)
    assert name in functions, f"{table} / {row} / {column}: {ref} does not exist"
    if param:  # the parameter is one the test runs with
        assert repr(param.rstrip("]")) in source or f'"{param.rstrip("]")}"' in source, ref


def _settings(table: str, row: str, column: str) -> dict:
    """The wire settings an entry stands for, from its row and column."""
    if table == "Transport x feature":
        return {"transport": re.match(r"`(\w+)`", row).group(1), **SETTINGS[column]}
    if table == "Transport x option":
        name, value = row.strip("`").split("=", 1)
        return {"transport": column, name: ast.literal_eval(value)}
    return {**SETTINGS[row], **SETTINGS[column]}


def _refusals(*, when_planned: bool) -> list[tuple[str, dict, str]]:
    """(where, settings, message) of every "refused" entry: refused where the settings are
    written, or (``when_planned``) once ``auto`` has picked a transport."""
    out = []
    for table, row, column, entry in cells():
        found = re.search(r'refused[^"]*: "([^"]+)"', entry)
        if found and entry.startswith("refused once it picks") == when_planned:
            out.append((f"{table} / {row} / {column}", _settings(table, row, column), found.group(1)))
    return out


@pytest.mark.parametrize(("where", "settings", "message"), _refusals(when_planned=False))
def test_each_refused_entry_is_refused_when_the_settings_are_written(where, settings, message):
    with pytest.raises(CombinationError, match=re.escape(message)):
        SyncConfig(num_writers=1, num_readers=1, **_keywords(settings))
    with pytest.raises(ValueError, match=re.escape(message)):  # an init info's wire form: the same words
        SyncConfig.from_wire({"num_writers": 1, "num_readers": 1, **settings}, where="WeightSyncInitInfo")


def _keywords(settings: dict) -> dict:
    options = {k: v for k, v in settings.items() if k in TransportOptions.__dataclass_fields__}
    return {**{k: v for k, v in settings.items() if k not in options},
            "transport_options": TransportOptions(**options)}


def test_refused_entries_exist_for_every_rule():
    # nixl_mode, file_dir x 5; shm_streaming x 3; checksum x 4 (every transport carries deltas);
    # completion x 2 (torch, routed: a process group); the fleet commit with layer phases
    assert len(_refusals(when_planned=False)) == 5 + 5 + 3 + 4 + 2 + 1


def test_deltas_over_every_nixl_mode_are_accepted():
    """Push refused deltas at init until it carried them (tests/test_transport_nixl.py::
    test_push_deltas_write_exactly_the_changes); now every mode takes them."""
    for mode in ("pull", "push", "auto"):
        SyncConfig(num_writers=1, num_readers=1, transport="nixl",
                   transport_options=TransportOptions(delta_anchor_every=4, nixl_mode=mode))
    assert len(_refusals(when_planned=True)) == 1  # checksum with auto (every transport auto picks carries deltas)


@pytest.mark.xdist_group("vllm-stack")  # one xdist worker imports vLLM (test_job_spec.py says why)
def test_the_vllm_trainer_init_info_takes_deltas_with_its_default_layer_phases():
    """``WeightSyncTrainerInitInfo`` turns layer phases on by default; deltas with them were
    accepted on 3ee4748 and every version went out in full, then refused; now deltas move phase
    by phase (``tests/test_phases.py::test_deltas_arrive_phase_by_phase_into_one_arena``)."""
    pytest.importorskip("vllm")
    from weightsync.integrations.vllm_trainer import WeightSyncTrainerInitInfo

    info = WeightSyncTrainerInitInfo(rank=0, transport="torch", delta_anchor_every=8)
    config = info.sync_config()
    assert config.layer_phases and config.transport_options.delta_anchor_every == 8


@pytest.mark.timeout(120)
@pytest.mark.parametrize(("where", "settings", "message"), _refusals(when_planned=True))
def test_auto_choosing_shm_refuses_before_any_byte_moves(where, settings, message):
    """One writer and one reader on this host: ``auto`` picks shm, where messages are not
    checksummed. Both ranks are refused when they plan, naming the setting and
    what ``auto`` chose; the reader applies nothing (on 3ee4748 the versions went out in full,
    the setting ignored)."""
    from weightsync import WeightReader, WeightWriter
    from weightsync.engines.buffers import ShardedEngine
    from weightsync.meta import EmbeddedMetaServer, MetaClient
    from weightsync.sources.module import ShardedSource
    from weightsync.tools.tiny import tiny_config

    config = tiny_config()
    sync = SyncConfig(num_writers=1, num_readers=1, timeout=30, **_keywords(settings))
    errors: dict[str, BaseException] = {}
    engine = ShardedEngine("hf", config, 0)

    def read(meta: MetaClient) -> None:
        try:
            with WeightReader(engine, rank=0, config=sync, meta=meta) as reader:
                reader.update(timeout=30)
        except BaseException as exc:  # checked below, in the test's thread
            errors["reader"] = exc

    with EmbeddedMetaServer() as server:
        with MetaClient(server.address, token=server.token) as rmeta, \
                MetaClient(server.address, token=server.token) as wmeta:
            thread = threading.Thread(target=read, args=(rmeta,), daemon=True)
            thread.start()
            with WeightWriter(ShardedSource("hf", config, 0), rank=0, config=sync, meta=wmeta) as writer:
                with pytest.raises(CombinationError) as raised:
                    writer.write(1, timeout=30)
            thread.join(60)
    assert message in str(raised.value)
    assert "Set transport='torch'" in str(raised.value)
    assert message in str(errors["reader"])
    assert engine.weight_version is None
