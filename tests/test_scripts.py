"""Every script under benchmarks/ and examples/ still imports, parses its arguments and names
weightsync objects that exist, so none rots unnoticed between the runs that measure with it.

The scripts' real runs are slow (engines, several processes) and live in their own tests
(tests/test_examples.py, tests/test_example_fsdp_to_vllm.py) or are measured by hand
(docs/benchmarks.md); here each one is imported and asked for ``--help`` in one child process,
and every ``from weightsync... import name`` anywhere in it (inside functions too, where an
import runs only in a rank's process) is resolved.
"""

from __future__ import annotations

import ast
import json
import os
import sys
from pathlib import Path

from launcher import run as run_process

ROOT = Path(__file__).resolve().parent.parent
SCRIPTS = sorted(p for folder in ("benchmarks", "examples") for p in (ROOT / folder).rglob("*.py"))
#: third-party packages a script needs that the test venv does not install (the script's docs say how)
OPTIONAL = {"awex": "the awex peer benchmark needs a venv with awex (docs/benchmarks.md)",
            "verl": "verl pins transformers<5.11: its example runs in .venv-verl (tests/test_integration_verl.py)"}


def _needs_optional(path: Path) -> str:
    text = path.read_text()
    return next((why for module, why in OPTIONAL.items() if f"from {module}" in text or f"import {module}" in text
                 or f"from {module}_" in text), "")


def weightsync_imports(path: Path) -> list[tuple[int, str, str]]:
    """(line, module, name) of every ``from weightsync... import name`` in the file, at any depth."""
    out = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.ImportFrom) and node.level == 0 and (node.module or "").split(".")[0] == "weightsync":
            out += [(node.lineno, str(node.module), alias.name) for alias in node.names]
    return out


def test_the_scripts_are_found():
    names = {p.relative_to(ROOT).as_posix() for p in SCRIPTS}
    assert {"benchmarks/trl_sync.py", "examples/two_threads.py"} <= names


_CHILD = r"""
import contextlib, importlib, importlib.util, io, json, runpy, sys
results = {}
for job in json.loads(sys.argv[1]):
    path, problems = job["path"], []
    for line, module, name in job["names"]:
        try:
            if not hasattr(importlib.import_module(module), name):
                importlib.import_module(f"{module}.{name}")
        except ImportError as exc:
            problems.append(f"line {line}: from {module} import {name}: {exc}")
    try:
        spec = importlib.util.spec_from_file_location("_script_under_test", path)
        spec.loader.exec_module(importlib.util.module_from_spec(spec))
        if job["help"]:
            sys.argv = [path, "--help"]
            out = io.StringIO()
            try:
                with contextlib.redirect_stdout(out):
                    runpy.run_path(path, run_name="__main__")
                problems.append("--help returned without exiting")
            except SystemExit as exc:
                if exc.code not in (0, None) or "usage" not in out.getvalue():
                    problems.append(f"--help: exit {exc.code}")
    except BaseException as exc:  # the failure is the result
        problems.append(f"{type(exc).__name__}: {exc}")
    results[path] = problems
print("RESULTS " + json.dumps(results))
"""


def test_every_script_imports_names_what_exists_and_answers_help():
    """One child process (importing engines changes a process for good) resolves every weightsync
    name each script imports, imports the script, and runs ``--help`` of each that parses
    arguments (a script without arguments is run by its own test)."""
    jobs, skipped = [], []
    for path in SCRIPTS:
        if _needs_optional(path):
            skipped.append(path.name)
            continue
        jobs.append({"path": str(path), "help": "argparse" in path.read_text(), "names": weightsync_imports(path)})
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT / "src"), os.environ.get("PYTHONPATH", "")])}
    proc = run_process([sys.executable, "-c", _CHILD, json.dumps(jobs)], timeout=600, env=env, cwd=str(ROOT))
    assert proc.returncode == 0 and "RESULTS " in proc.stdout, proc.stderr[-3000:]
    results = json.loads(proc.stdout.split("RESULTS ", 1)[1])
    failed = {Path(p).relative_to(ROOT).as_posix(): r for p, r in results.items() if r}
    assert not failed, json.dumps(failed, indent=1)
    assert len(results) == len(jobs)
    assert set(skipped) <= {"awex_common.py", "awex_p2p_bench.py", "checkpoint_engine_cpu.py"}, skipped


def test_a_missing_name_is_found_inside_a_function(tmp_path):
    script = tmp_path / "rotted.py"
    script.write_text("def main():\n    from weightsync.tools.rss import _status_kb\n")
    assert weightsync_imports(script) == [(2, "weightsync.tools.rss", "_status_kb")]
