"""The layers of docs/architecture.md and their one-way rules, enforced on the source tree.

Every import counts: at module level, inside a function (lazy) or under ``TYPE_CHECKING``. An
import names the most specific module it reaches (``from weightsync.meta import wire`` is an
import of ``weightsync.meta.wire``, ``from weightsync.meta import MetaClient`` one of the
package ``weightsync.meta``). Each rule has a negative test: code that breaks it is caught.
"""

from __future__ import annotations

import ast
import re
import subprocess
import sys
import textwrap
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

#: one worker runs the module: the mypy build its fixtures share takes 16 s
pytestmark = pytest.mark.xdist_group("architecture")


ROOT = Path(__file__).resolve().parents[1]
SRC = ROOT / "src"
PKG = SRC / "weightsync"

#: Packages the pure core (layout/, plan/, clock/, configs/) must never import.
CORE_FORBIDDEN = (
    "torch", "weightsync.transport", "weightsync.engines", "weightsync.sources", "weightsync.meta",
    "weightsync.roles", "vllm", "sglang", "megatron", "deepspeed", "nixl",
    "nixl_cu12", "nccl", "transformers", "fastapi", "uvicorn", "httpx",
)
#: Engine / framework packages only their own adapter (or integration) modules may import.
ADAPTER_ONLY = {
    "vllm": ("engines/vllm", "integrations/vllm", "integrations/trl"), "sglang": ("engines/sglang", "integrations/sglang"),
    "transformers": ("engines/hf", "sources/"), "trl": "integrations/trl",
    "megatron": "sources/megatron", "mbridge": "sources/megatron", "deepspeed": "sources/deepspeed",
    "nixl": "transport/nixl/", "nixl_cu12": "transport/nixl/", "nccl": "transport/torch/nccl_comm",
    # weightsync's Ray actors, and the vLLM trainer engine driving vLLM's Ray workers
    "ray": ("integrations/ray/", "integrations/vllm_trainer"), "verl": "integrations/verl",
}

#: The layers: layer -> (its folders, the top-level packages of ``src/weightsync``; the layers it
#: builds on). A module may import modules of its own layer and of every layer its layer builds
#: on, directly or through others, never any other (docs/architecture.md draws this). A module
#: belongs to the layer of the folder it is in; the package root (``weightsync/__init__.py``)
#: is the one module outside every folder, in the core.
LAYERS: dict[str, tuple[tuple[str, ...], tuple[str, ...]]] = {
    "core": (("weightsync", "weightsync.layout", "weightsync.plan", "weightsync.clock", "weightsync.configs"), ()),
    "ports": (("weightsync.ports",), ("core",)),
    "tools": (("weightsync.tools",), ("ports",)),
    "adapters": (("weightsync.sources", "weightsync.engines"), ("ports", "tools")),
    "meta": (("weightsync.meta",), ("ports",)),
    "job channel": (("weightsync.job",), ("meta",)),
    "transports": (("weightsync.transport",), ("job channel", "tools")),
    "session": (("weightsync.session",), ("transports",)),
    "roles": (("weightsync.roles",), ("session", "ports")),
    "integrations": (("weightsync.integrations",), ("roles", "adapters")),
    "applications": (("weightsync.apps",), ("integrations",)),
    "command line": (("weightsync.cli",), ("applications",)),
}

#: The only imports a layer may make of a layer it does not build on: lazy re-exports of an
#: ``__init__`` (names resolved on first use, so importing the package imports nothing above
#: it; the imports the AST sees are the ``TYPE_CHECKING`` ones, for type checkers).
LAZY_REEXPORTS = frozenset({
    ("weightsync", "weightsync.session.sync_session"), ("weightsync", "weightsync.roles.writer"),
    ("weightsync", "weightsync.roles.reader"), ("weightsync", "weightsync.roles.inflight"),
    ("weightsync", "weightsync.roles.tensorstore"), ("weightsync", "weightsync.transport.shm.files"),
})

Layers = Mapping[str, tuple[tuple[str, ...], tuple[str, ...]]]


# -- the import graph ---------------------------------------------------------------------------

@dataclass(frozen=True)
class Import:
    importer: str
    imported: str
    line: int
    kind: str  # "module" (runs on import), "lazy" (inside a function) or "typing" (TYPE_CHECKING)
    is_init: bool  # the importer is a package's __init__

    def __str__(self) -> str:
        return f"{self.importer}:{self.line} imports {self.imported} ({self.kind})"


def module_names(root: Path) -> dict[str, Path]:
    """Dotted module name -> file, for every module of the packages under ``root``."""
    out = {}
    for path in sorted(root.rglob("*.py")):
        parts = list(path.relative_to(root).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        out[".".join(parts)] = path
    return out


def _imports_in(tree: ast.Module) -> Iterator[tuple[ast.Import | ast.ImportFrom, str]]:
    """Every import statement with its kind (see :class:`Import`)."""
    def walk(node: ast.AST, kind: str) -> Iterator[tuple[ast.Import | ast.ImportFrom, str]]:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, (ast.Import, ast.ImportFrom)):
                yield child, kind
            elif isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)):
                yield from walk(child, "lazy" if kind == "module" else kind)
            elif isinstance(child, ast.If) and "TYPE_CHECKING" in ast.unparse(child.test):
                yield from walk(ast.Module(body=child.body, type_ignores=[]), "typing")
                yield from walk(ast.Module(body=child.orelse, type_ignores=[]), kind)
            else:
                yield from walk(child, kind)
    yield from walk(tree, "module")


def import_graph(root: Path = SRC, package: str = "weightsync") -> list[Import]:
    """Every import between modules of ``package`` (found under ``root``)."""
    modules = module_names(root)
    edges = []
    for name, path in modules.items():
        if not (name == package or name.startswith(package + ".")):
            continue
        is_init = path.name == "__init__.py"
        here = name if is_init else name.rpartition(".")[0]
        for node, kind in _imports_in(ast.parse(path.read_text())):
            targets: list[str] = []
            if isinstance(node, ast.Import):
                targets = [alias.name for alias in node.names]
            else:
                base = node.module or ""
                if node.level:
                    parts = here.split(".")
                    base = ".".join(parts[: len(parts) - node.level + 1] + ([base] if base else []))
                targets = [f"{base}.{a.name}" if f"{base}.{a.name}" in modules else base for a in node.names]
            for named in dict.fromkeys(targets):
                target = named
                while target and target not in modules:  # `import a.b.c` of a name inside a module
                    target = target.rpartition(".")[0]
                if target and target != name:
                    edges.append(Import(name, target, node.lineno, kind, is_init))
    return edges


def _matches(name: str, prefix: str) -> bool:
    return name == prefix or name.startswith(prefix + ".")


def layer_of(module: str, layers: Layers = LAYERS) -> str | None:
    """The layer of the longest prefix naming ``module``; the root package names only itself."""
    best: tuple[int, str] | None = None
    for layer, (prefixes, _) in layers.items():
        for prefix in prefixes:
            fits = module == prefix if "." not in prefix else _matches(module, prefix)
            if fits and (best is None or len(prefix) > best[0]):
                best = (len(prefix), layer)
    return None if best is None else best[1]


def below(layer: str, layers: Layers = LAYERS) -> set[str]:
    """The layers ``layer`` builds on, directly or through others."""
    seen: set[str] = set()
    todo = list(layers[layer][1])
    while todo:
        name = todo.pop()
        if name not in seen:
            seen.add(name)
            todo.extend(layers[name][1])
    return seen


# -- the rules (each returns its offenders) ---------------------------------------------------------

def unplaced_modules(modules: Iterable[str], layers: Layers = LAYERS) -> list[str]:
    return sorted(m for m in modules if layer_of(m, layers) is None)


def layers_not_folders(pkg: Path, layers: Layers = LAYERS) -> list[str]:
    """Layers named by anything but top-level folders, and modules outside every folder (but the
    package root): ``ls src/weightsync`` shows the layers and nothing else."""
    package = pkg.name
    offenders = [f"{path.relative_to(pkg.parent)} is outside every folder: move it into its layer's folder"
                 for path in sorted(pkg.glob("*.py")) if path.name != "__init__.py"]
    for layer, (prefixes, _) in layers.items():
        for prefix in prefixes:
            rel = prefix.removeprefix(package + ".")
            if prefix != package and ("." in rel or not (pkg / rel / "__init__.py").is_file()):
                offenders.append(f"layer {layer!r} names {prefix}, which is not a top-level folder of {package}/")
    return offenders


def _listed_reexport(edge: Import, allowed: frozenset[tuple[str, str]]) -> bool:
    return edge.is_init and edge.kind != "module" and (edge.importer, edge.imported) in allowed


def upward_imports(edges: Iterable[Import], layers: Layers = LAYERS,
                   allowed: frozenset[tuple[str, str]] = LAZY_REEXPORTS) -> list[str]:
    """Imports of a layer the importer's layer does not build on, but the listed lazy re-exports."""
    offenders = []
    for edge in edges:
        src, dst = layer_of(edge.importer, layers), layer_of(edge.imported, layers)
        if src is None or dst is None or dst == src or dst in below(src, layers) or _listed_reexport(edge, allowed):
            continue
        offenders.append(f"{edge} : layer '{src}' does not build on layer '{dst}'")
    return offenders


def unused_reexport_exceptions(edges: Iterable[Import], allowed: frozenset[tuple[str, str]] = LAZY_REEXPORTS
                               ) -> list[tuple[str, str]]:
    """Listed exceptions no import needs any more (the list stays exact)."""
    used = {(e.importer, e.imported) for e in edges if e.is_init and e.kind != "module"}
    return sorted(allowed - used)


def import_cycles(edges: Iterable[Import], allowed: frozenset[tuple[str, str]] = LAZY_REEXPORTS) -> list[list[str]]:
    """Groups of modules that import each other, directly or not (Tarjan's strongly connected
    components), ignoring the listed lazy re-exports."""
    graph: dict[str, set[str]] = {}
    for e in edges:
        if not _listed_reexport(e, allowed):
            graph.setdefault(e.importer, set()).add(e.imported)
            graph.setdefault(e.imported, set())
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    cycles: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            group = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                group.append(w)
                if w == v:
                    break
            if len(group) > 1:
                cycles.append(sorted(group))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return cycles


def integrations_imported_below(edges: Iterable[Import], layers: Layers = LAYERS) -> list[str]:
    """Imports of an integration from outside the integrations and the layers built on them."""
    above = {name for name in layers if name == "integrations" or "integrations" in below(name, layers)}
    return [str(e) for e in edges
            if _matches(e.imported, "weightsync.integrations") and layer_of(e.importer, layers) not in above]


#: The job protocol: every method of what the job channel asks of the meta server (its
#: ``MetaPort``, ``TransportBoard`` included). Only the job channel (and the meta package itself)
#: may call them on a meta client, so that every key and message of the protocol lives in one module.
PROTOCOL_PORT = "weightsync.ports.coordinator.MetaPort"
#: What speaks the protocol: the meta clients (all share ClientBase) and the ports they fill.
PROTOCOL_SPEAKERS = ("weightsync.meta.client_base.ClientBase", "weightsync.meta.etcd.base.EtcdBase",
                     "weightsync.ports.coordinator.MetaPort",
                     "weightsync.ports.coordinator.TransportBoard")
#: Where the protocol may be spoken.
PROTOCOL_HOMES = ("weightsync.job.channel", "weightsync.job.liveness", "weightsync.job.board", "weightsync.job.reader_waits",
                  "weightsync.job.fleet_commit", "weightsync.job.epochs", "weightsync.ports.coordinator",
                  "weightsync.meta")


def type_checked(extra: Mapping[str, str] | None = None) -> tuple[Any, dict[str, Any]]:
    """mypy's build of every module of ``src/weightsync`` (plus ``extra``: module -> source text):
    (the expression -> type map, module -> syntax tree). Libraries are skipped (their values
    are ``Any``), which keeps this to seconds."""
    from mypy import build
    from mypy.modulefinder import BuildSource
    from mypy.options import Options

    options = Options()
    options.python_version = (3, 11)
    options.follow_imports = "skip"
    options.ignore_missing_imports = True
    options.check_untyped_defs = True
    options.preserve_asts = True
    options.export_types = True
    options.incremental = False
    sources = [BuildSource(str(path), name) for name, path in module_names(SRC).items()]
    sources += [BuildSource(None, name, text) for name, text in (extra or {}).items()]
    result = build.build(sources, options)
    return result.types, {name: state.tree for name, state in result.graph.items() if state.tree is not None}


def _speakers(typ: Any) -> list[str]:
    """What a receiver's type says it is: "speaker" (a meta client or port), "unknown" (``Any``
    that our own code left unannotated: it may be one), or nothing (anything else, libraries'
    values included: with their imports skipped they are ``Any`` too, but never a meta client)."""
    from mypy.types import AnyType, CallableType, Instance, TypeOfAny, TypeType, UnionType, get_proper_type

    proper = get_proper_type(typ) if typ is not None else None
    if isinstance(proper, UnionType):
        return [kind for item in proper.items for kind in _speakers(item)]
    if isinstance(proper, TypeType):
        proper = get_proper_type(proper.item)
    if isinstance(proper, CallableType) and proper.is_type_obj():
        proper = get_proper_type(proper.ret_type)
    if isinstance(proper, Instance):
        return ["speaker"] if any(base.fullname in PROTOCOL_SPEAKERS for base in proper.type.mro) else []
    if isinstance(proper, AnyType):
        while proper.type_of_any == TypeOfAny.from_another_any and proper.source_any is not None:
            proper = proper.source_any
        return ["unknown"] if proper.type_of_any == TypeOfAny.unannotated else []
    return []


def protocol_calls(trees: Mapping[str, Any]) -> set[str]:
    """The methods of :data:`PROTOCOL_PORT` and of the ports it extends, read from its type."""
    from mypy.nodes import Decorator, FuncDef, OverloadedFuncDef

    module, _, name = PROTOCOL_PORT.rpartition(".")
    port = trees[module].names[name].node
    return {member for base in port.mro if base.fullname.startswith("weightsync.")
            for member, symbol in base.names.items()
            if isinstance(symbol.node, (FuncDef, Decorator, OverloadedFuncDef)) and not member.startswith("_")}


def protocol_calls_outside_the_channel(types: Mapping[Any, Any], trees: Mapping[str, Any]) -> list[str]:
    """Protocol methods reached outside job/channel.py and meta/ on a receiver that is a meta client,
    by its type, whatever its name (or whose type is unknown, so it may be one)."""
    from mypy.traverser import NameAndMemberCollector

    calls = protocol_calls(trees)
    offenders = []
    for module, tree in sorted(trees.items()):
        if not _matches(module, "weightsync") or any(_matches(module, home) for home in PROTOCOL_HOMES):
            continue
        collector = NameAndMemberCollector()
        tree.accept(collector)
        for member in collector.member_exprs:
            if member.name in calls and (kinds := _speakers(types.get(member.expr))):
                offenders.append(f"{module}:{member.line} .{member.name} on {'/'.join(sorted(set(kinds)))} "
                                 f"{types.get(member.expr)}")
    return offenders


#: Where ports live: a ``Protocol`` class of these packages is a port.
PORT_HOMES = ("weightsync.ports", "weightsync.job")


def _ports_of(typ: Any) -> list[str]:
    """The ports a value's static type is (a union: each member that is one)."""
    from mypy.types import Instance, TypeType, UnionType, get_proper_type

    proper = get_proper_type(typ) if typ is not None else None
    if isinstance(proper, UnionType):
        return [port for item in proper.items for port in _ports_of(item)]
    if isinstance(proper, TypeType):
        proper = get_proper_type(proper.item)
    if isinstance(proper, Instance) and proper.type.is_protocol \
            and any(_matches(proper.type.fullname, home) for home in PORT_HOMES):
        return [proper.type.fullname]
    return []


def port_probes(types: Mapping[Any, Any], trees: Mapping[str, Any]) -> list[str]:
    """``hasattr``/``getattr`` calls whose object is typed as a port: a capability the port should
    declare (a port says what its implementations can do; callers never probe for it)."""
    from mypy.nodes import CallExpr
    from mypy.traverser import NameAndMemberCollector

    where = {}  # the callee's node -> its module (the trees' traversers are compiled: no subclass)
    for module, tree in trees.items():
        if _matches(module, "weightsync"):
            collector = NameAndMemberCollector()
            tree.accept(collector)
            where.update({id(name): module for name in collector.name_exprs
                          if name.fullname in ("builtins.hasattr", "builtins.getattr")})
    offenders = []
    for call in types:
        if isinstance(call, CallExpr) and id(call.callee) in where and call.args:
            offenders += [f"{where[id(call.callee)]}:{call.line} {call.callee.name}() on {port}"  # type: ignore[attr-defined]
                          for port in _ports_of(types.get(call.args[0]))]
    return sorted(offenders)


#: Code that breaks the protocol rule (and code that keeps it), type-checked with the tree.
PROTOCOL_PROBES = {
    "weightsync.probe_named_like_a_channel": """
        from weightsync.meta.client import MetaClient

        def sneak(channel: MetaClient) -> None:
            channel.publish_version(1, "f", writer_rank=0, num_writers=1)
    """,
    "weightsync.probe_async_and_aliased": """
        from weightsync.meta.client import AsyncMetaClient

        async def sneak(job: AsyncMetaClient) -> None:
            board = job
            await board.put_document("key", b"")
    """,
    "weightsync.probe_through_the_port": """
        from weightsync.ports.coordinator import MetaPort

        def sneak(port: MetaPort) -> None:
            port.report_applied(0, 1)
    """,
    "weightsync.probe_untyped": """
        def sneak(whatever):
            return whatever.wait_version(after=0, timeout=1.0)
    """,
    "weightsync.probe_through_the_channel": """
        from weightsync.clock.deadline import Deadline
        from weightsync.job.channel import JobChannel

        def fine(meta: JobChannel) -> None:
            meta.wait_version(after=0, deadline=Deadline.after(1.0))
    """,
    "weightsync.probe_port_capability": """
        from weightsync.ports.engine import InferenceEngine, PhasedEngine

        class Reader:
            engine: InferenceEngine

        def sneak(reader: Reader, phased: PhasedEngine | None) -> bool:
            return hasattr(reader.engine, "in_place_names") or getattr(phased, "device", None) is not None

        def fine(engine: InferenceEngine) -> bool:
            return engine.stages_in_phases and getattr(engine.receive_buffers(), "keys", None) is not None
    """,
    "weightsync.meta.probe_inside": """
        from weightsync.meta.client import MetaClient

        def fine(client: MetaClient) -> None:
            client.put_document("key", b"")
    """,
}


#: the rules read from mypy's types: its build of the tree takes 16-28 s, in `make test` only (tests/tiers.py)
TYPED = pytest.mark.stack("mypy")


@pytest.fixture(scope="module")  # one worker builds it (the module's xdist group): 16 s
def typed_tree() -> tuple[Any, dict[str, Any]]:
    return type_checked({name: textwrap.dedent(text) for name, text in PROTOCOL_PROBES.items()})


# -- the rules on this source tree ----------------------------------------------------------------

@pytest.fixture(scope="module")
def edges() -> list[Import]:
    return import_graph()


def test_every_module_has_a_layer():
    assert not unplaced_modules(module_names(SRC)), "add these to LAYERS (and docs/architecture.md)"


def test_the_layers_are_the_top_level_folders():
    offenders = layers_not_folders(PKG)
    assert not offenders, "\n".join(offenders)


def test_no_import_goes_up_a_layer(edges):
    offenders = upward_imports(edges)
    assert not offenders, "\n".join(offenders)
    assert not unused_reexport_exceptions(edges), "LAZY_REEXPORTS lists exceptions nothing needs"


def test_no_import_circle(edges):
    assert not import_cycles(edges)


def test_integrations_are_imported_by_nothing_below_them(edges):
    offenders = integrations_imported_below(edges)
    assert not offenders, "\n".join(offenders)


@TYPED
def test_only_the_job_channel_speaks_the_protocol(typed_tree):
    offenders = [o for o in protocol_calls_outside_the_channel(*typed_tree) if ".probe_" not in o.split(":")[0]]
    assert not offenders, "go through weightsync.job.channel.JobChannel:\n" + "\n".join(offenders)


def documented_layers(doc: str) -> dict[str, tuple[set[str], set[str]]]:
    """The first code block of docs/architecture.md: layer -> (its modules, the layers it builds on)."""
    out = {}
    for line in doc.split("```\n")[1].splitlines():
        left, _, builds_on = line.partition("->")
        name, modules = re.split(r"\s{2,}", left.strip(), maxsplit=1)
        out[name] = (set(modules.split()), {x.strip() for x in builds_on.split(",") if x.strip()})
    return out


@TYPED
def test_no_port_is_probed_with_hasattr_or_getattr(typed_tree):
    offenders = [o for o in port_probes(*typed_tree) if ".probe_" not in o.split(":")[0]]
    assert not offenders, "declare the capability on the port instead of probing for it:\n" + "\n".join(offenders)


#: The size limits of docs/architecture.md: a module, and a function (nested ones counted on their own).
MAX_MODULE_LINES = 500
MAX_FUNCTION_LINES = 80


def oversized(pkg: Path) -> list[str]:
    """Modules over :data:`MAX_MODULE_LINES` lines and functions over :data:`MAX_FUNCTION_LINES`."""
    offenders = []
    for path in sorted(pkg.rglob("*.py")):
        text = path.read_text()
        rel = path.relative_to(pkg.parent).as_posix()
        if (lines := len(text.splitlines())) > MAX_MODULE_LINES:
            offenders.append(f"{rel}: {lines} lines (at most {MAX_MODULE_LINES}: split it along a seam)")
        for node in ast.walk(ast.parse(text)):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) \
                    and (lines := node.end_lineno - node.lineno + 1) > MAX_FUNCTION_LINES:  # type: ignore[operator]
                offenders.append(f"{rel}:{node.lineno} {node.name}(): {lines} lines (at most {MAX_FUNCTION_LINES})")
    return offenders


def test_no_module_or_function_is_oversized():
    offenders = oversized(PKG)
    assert not offenders, "\n".join(offenders)


def test_the_architecture_doc_draws_the_layers_as_they_are():
    def shown(prefix: str) -> str:
        rel = prefix.removeprefix("weightsync.").replace(".", "/")
        return f"{rel}/" if (PKG / rel).is_dir() else f"{rel}.py"

    expected = {name: ({shown(p) for p in prefixes if p != "weightsync"}, set(builds_on))
                for name, (prefixes, builds_on) in LAYERS.items()}
    assert documented_layers((ROOT / "docs" / "architecture.md").read_text()) == expected


def imports_of(path: Path) -> set[str]:
    tree = ast.parse(path.read_text())
    names: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names.add(node.module)
    return names


#: Adapters never reach across: a source is not an engine, and neither moves bytes itself.
ADAPTER_FORBIDDEN = {
    "sources": ("weightsync.engines", "weightsync.transport"),
    "engines": ("weightsync.sources", "weightsync.transport"),
}


def forbidden_imports(pkg: Path, package: str, forbidden: Iterable[str]) -> list[str]:
    """Imports (of any package, libraries included) of ``forbidden`` names in ``pkg/package``."""
    forbidden = tuple(forbidden)
    return [f"{path.relative_to(pkg)} imports {name}" for path in sorted((pkg / package).rglob("*.py"))
            for name in sorted(imports_of(path)) if any(_matches(name, bad) for bad in forbidden)]


def libraries_outside_their_adapter(pkg: Path) -> list[str]:
    offenders = []
    for path in sorted(pkg.rglob("*.py")):
        rel = path.relative_to(pkg).as_posix()
        for name in sorted(imports_of(path)):
            for library, home in ADAPTER_ONLY.items():
                homes = home if isinstance(home, tuple) else (home,)
                if _matches(name, library) and not any(rel.startswith(h) for h in homes):
                    offenders.append(f"{rel} imports {name}")
    return offenders


@pytest.mark.parametrize("package", ["layout", "plan", "clock", "configs"])
def test_core_imports_nothing_outside_the_core(package):
    offenders = forbidden_imports(PKG, package, CORE_FORBIDDEN)
    assert not offenders, "core must stay pure:\n" + "\n".join(offenders)


def test_engines_are_imported_only_inside_their_adapter():
    offenders = libraries_outside_their_adapter(PKG)
    assert not offenders, "\n".join(offenders)


@pytest.mark.parametrize("package", sorted(ADAPTER_FORBIDDEN))
def test_sources_and_engines_import_neither_each_other_nor_a_transport(package):
    offenders = forbidden_imports(PKG, package, ADAPTER_FORBIDDEN[package])
    assert not offenders, "\n".join(offenders)


def test_engine_adapters_are_lazy_attributes_of_the_engines_package():
    """``from weightsync.engines import VLLMEngine`` works (docs), importing vLLM only then."""
    code = ("import sys, weightsync.engines as e; assert 'vllm' not in sys.modules; "
            "from weightsync.engines import VLLMEngine, update_llm; "
            "assert VLLMEngine.__module__ == 'weightsync.engines.vllm' and callable(update_llm)")
    subprocess.run([sys.executable, "-c", code], check=True, timeout=300)


# -- negative tests: a tree that breaks each rule is caught ------------------------------------------

def _tree(tmp_path: Path, files: Mapping[str, str]) -> Path:
    for rel, text in files.items():
        path = tmp_path / "weightsync" / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(textwrap.dedent(text))
    for directory in {p.parent for p in (tmp_path / "weightsync").rglob("*.py")}:
        (directory / "__init__.py").touch()
    return tmp_path


def test_an_upward_import_is_caught_wherever_it_hides(tmp_path):
    root = _tree(tmp_path, {
        "engines/vllm.py": "def backend():\n    from weightsync.roles.reader import WeightReader\n",
        "layout/box.py": "def f():\n    from weightsync.roles.reader import WeightReader\n",
        "plan/ops.py": "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from weightsync.roles import writer\n",
        "roles/reader.py": "from weightsync.layout import box\nfrom weightsync.engines import vllm\n",
        "roles/writer.py": "",
        "tools/devices.py": "from weightsync.meta import client\n",
        "meta/client.py": "from weightsync.ports import device\n",
        "ports/device.py": "",
        "sources/module.py": "from weightsync.meta import client\n",
    })
    assert upward_imports(import_graph(root)) == [
        "weightsync.engines.vllm:2 imports weightsync.roles.reader (lazy) : layer 'adapters' does not build on layer "
        "'roles'",
        "weightsync.layout.box:2 imports weightsync.roles.reader (lazy) : layer 'core' does not build on layer 'roles'",
        "weightsync.plan.ops:3 imports weightsync.roles.writer (typing) : layer 'core' does not build on layer 'roles'",
        "weightsync.roles.reader:2 imports weightsync.engines.vllm (module) : layer 'roles' does not build on layer "
        "'adapters'",
        "weightsync.sources.module:1 imports weightsync.meta.client (module) : layer 'adapters' does not build on "
        "layer 'meta'",
        "weightsync.tools.devices:1 imports weightsync.meta.client (module) : layer 'tools' does not build on layer "
        "'meta'",
    ]


def test_only_listed_lazy_reexports_of_an_init_may_point_up(tmp_path):
    lazy = "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from weightsync.roles.writer import W\n"
    root = _tree(tmp_path, {"__init__.py": lazy, "layout/__init__.py": lazy, "roles/writer.py": "W = 1\n",
                            "plan/__init__.py": "from weightsync.roles.writer import W\n"})
    edges = import_graph(root)
    allowed = frozenset({("weightsync", "weightsync.roles.writer"), ("weightsync.plan", "weightsync.roles.writer")})
    assert upward_imports(edges, allowed=allowed) == [
        "weightsync.layout:3 imports weightsync.roles.writer (typing) : layer 'core' does not build on layer 'roles'",
        "weightsync.plan:1 imports weightsync.roles.writer (module) : layer 'core' does not build on layer 'roles'",
    ]
    assert unused_reexport_exceptions(edges, frozenset({("weightsync", "weightsync.roles.reader")})) == [
        ("weightsync", "weightsync.roles.reader")]


def test_a_module_outside_every_layer_is_caught(tmp_path):
    root = _tree(tmp_path, {"newthing.py": "", "layout/box.py": ""})
    assert unplaced_modules(module_names(root)) == ["weightsync.newthing"]


def test_a_layer_that_is_not_a_folder_is_caught(tmp_path):
    root = _tree(tmp_path, {"__init__.py": "", "newthing.py": "", "layout/box.py": "", "roles/writer.py": ""})
    layers = {"core": (("weightsync", "weightsync.layout"), ()),
              "roles": (("weightsync.roles.writer", "weightsync.newthing", "weightsync.missing"), ("core",))}
    assert layers_not_folders(root / "weightsync", layers) == [
        "weightsync/newthing.py is outside every folder: move it into its layer's folder",
        "layer 'roles' names weightsync.roles.writer, which is not a top-level folder of weightsync/",
        "layer 'roles' names weightsync.newthing, which is not a top-level folder of weightsync/",
        "layer 'roles' names weightsync.missing, which is not a top-level folder of weightsync/",
    ]


def test_an_import_circle_is_caught_even_through_a_lazy_import(tmp_path):
    root = _tree(tmp_path, {
        "transport/torch/gloo.py": "from weightsync.transport.torch import delta\n",
        "transport/torch/delta.py": "def f():\n    from weightsync.transport.torch.gloo import G\n",
        "transport/shm/transport.py": "from weightsync.transport.torch import gloo\n",
    })
    assert import_cycles(import_graph(root)) == [["weightsync.transport.torch.delta",
                                                  "weightsync.transport.torch.gloo"]]


def test_an_integration_imported_from_below_is_caught(tmp_path):
    root = _tree(tmp_path, {
        "engines/vllm.py": "def register():\n    import weightsync.integrations.vllm_backend\n",
        "integrations/vllm_backend.py": "from weightsync.roles import reader\n",
        "cli/commands/serve.py": "from weightsync.integrations import vllm_backend\n",
        "roles/reader.py": "",
    })
    assert integrations_imported_below(import_graph(root)) == [
        "weightsync.engines.vllm:2 imports weightsync.integrations.vllm_backend (lazy)"]


@TYPED
def test_a_protocol_call_outside_the_channel_is_caught_by_what_its_receiver_is(typed_tree):
    found = [o for o in protocol_calls_outside_the_channel(*typed_tree) if ".probe_" in o.split(":")[0]]
    assert found == [
        "weightsync.probe_async_and_aliased:6 .put_document on speaker weightsync.meta.async_client.AsyncMetaClient",
        "weightsync.probe_named_like_a_channel:5 .publish_version on speaker weightsync.meta.client.MetaClient",
        "weightsync.probe_through_the_port:5 .report_applied on speaker weightsync.ports.coordinator.MetaPort",
        "weightsync.probe_untyped:3 .wait_version on unknown Any",
    ]


@TYPED
def test_a_probed_port_is_caught_by_its_type(typed_tree):
    found = [o for o in port_probes(*typed_tree) if ".probe_" in o.split(":")[0]]
    assert found == [
        "weightsync.probe_port_capability:8 getattr() on weightsync.ports.engine.PhasedEngine",
        "weightsync.probe_port_capability:8 hasattr() on weightsync.ports.engine.InferenceEngine",
    ]


def test_an_oversized_module_or_function_is_caught(tmp_path):
    body = "".join(f"    x{i} = {i}\n" for i in range(MAX_FUNCTION_LINES))
    root = _tree(tmp_path, {
        "plan/long.py": "def long():\n" + body + "\n" * (MAX_MODULE_LINES - MAX_FUNCTION_LINES),
        "plan/fine.py": "def fine():\n" + body[:-len(f"    x{MAX_FUNCTION_LINES - 1} = {MAX_FUNCTION_LINES - 1}\n")],
    })
    assert oversized(root / "weightsync") == [
        f"weightsync/plan/long.py: {MAX_MODULE_LINES + 1} lines (at most {MAX_MODULE_LINES}: split it along a seam)",
        f"weightsync/plan/long.py:1 long(): {MAX_FUNCTION_LINES + 1} lines (at most {MAX_FUNCTION_LINES})",
    ]


def test_a_library_in_the_core_or_outside_its_adapter_is_caught(tmp_path):
    root = _tree(tmp_path, {
        "plan/ops.py": "def f():\n    import torch\n",
        "engines/hf.py": "import transformers\nfrom weightsync.transport import shm\n",
        "sources/module.py": "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from weightsync.engines import hf\n",
        "session/sync_session.py": "import vllm\n",
        "integrations/vllm_backend.py": "import vllm\n",
    })
    pkg = root / "weightsync"
    assert forbidden_imports(pkg, "plan", CORE_FORBIDDEN) == ["plan/ops.py imports torch"]
    assert libraries_outside_their_adapter(pkg) == ["session/sync_session.py imports vllm"]
    assert forbidden_imports(pkg, "engines", ADAPTER_FORBIDDEN["engines"]) == [
        "engines/hf.py imports weightsync.transport"]
    assert forbidden_imports(pkg, "sources", ADAPTER_FORBIDDEN["sources"]) == [
        "sources/module.py imports weightsync.engines"]
