"""What ``weightsync doctor --engines``'s engine checks share: the proof and the child process.

The proof: an engine started on a tiny checkpoint B (``weightsync.tools.tiny``) generates greedily;
a writer in a thread then syncs version 1 (weights A) into it, the output must change, and
version 2 (B again) must bring back B's greedy output token for token. One engine start, and
the update is shown both to take effect and to be exact. Each engine's module
(:mod:`~weightsync.integrations.vllm_selfcheck`, :mod:`~weightsync.integrations.sglang_selfcheck`)
starts its engine and runs :func:`round_trip` in a child process, which prints one line of
JSON after its prefix; :func:`run_child` runs it and reads that line.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
from collections.abc import Callable, Mapping
from typing import Any


def run_child(module: str, prefix: str, *, what: str, timeout: float,
              env: Mapping[str, str] | None = None) -> tuple[bool, str]:
    """Run ``python -m module`` (with ``env`` added to this environment); (passed, what happened)."""
    try:
        proc = subprocess.run([sys.executable, "-m", module], env={**os.environ, **(env or {})}, text=True,
                              capture_output=True, timeout=timeout, check=False)
    except subprocess.TimeoutExpired:
        return False, f"the {what} self-check did not finish within {timeout:.0f}s"
    lines = [line[len(prefix):] for line in proc.stdout.splitlines() if line.startswith(prefix)]
    if proc.returncode != 0 or not lines:
        return False, f"exit {proc.returncode}: {' | '.join(proc.stderr.strip().splitlines()[-3:])}"[:500]
    out = json.loads(lines[-1])
    return bool(out["ok"]), str(out["detail"])


def round_trip(engine: Any, greedy: Callable[[], list[int]], config: dict[str, Any], server: Any,
               weights: tuple[Any, Any]) -> tuple[list[int], list[int], list[Any]]:
    """Write versions 1 and 2 (``weights``: A, then B) from a trainer thread whose tensors live
    where ``engine`` stages (``CanonicalSource.beside``), read each into ``engine`` and generate
    after each: (output after 1, output after 2, the two ``UpdateResult``)."""
    from weightsync.meta.client import MetaClient
    from weightsync.roles.reader import WeightReader
    from weightsync.roles.writer import WeightWriter
    from weightsync.session.sync_session import SyncConfig
    from weightsync.tools.tiny import CanonicalSource
    from weightsync.tools.torch_layout import fill_from_canonical

    sync = SyncConfig(num_writers=1, num_readers=1, job="selfcheck", timeout=120.0)
    source = CanonicalSource.beside(engine, config)
    errors: list[BaseException] = []

    def train() -> None:
        try:
            with WeightWriter(source, rank=0, config=sync,
                              meta=MetaClient(server.address, job="selfcheck", token=server.token)) as writer:
                for version, values in enumerate(weights, start=1):
                    fill_from_canonical(source.layout(), source.tensors(), values)
                    writer.write(version)
        except BaseException as exc:  # reported by the caller's thread
            errors.append(exc)

    trainer = threading.Thread(target=train, name="selfcheck-trainer")
    trainer.start()
    outputs, results = [], []
    with WeightReader(engine, rank=0, config=sync,
                      meta=MetaClient(server.address, job="selfcheck", token=server.token)) as reader:
        for version in (1, 2):
            results.append(reader.update(version))
            outputs.append(greedy())
    trainer.join(120)
    if errors:
        raise errors[0]
    return outputs[0], outputs[1], results


def verdict(out_a: list[int], out_b: list[int], ref_b: list[int], *, where: str = "") -> tuple[bool, str]:
    """Whether version 1 changed the output and version 2 restored it, and the sentence that says so."""
    ok = out_a != ref_b and out_b == ref_b
    if ok:
        return True, f"{where}version 1 changed the output, version 2 restored it token for token"
    return False, f"{where}outputs {'did not change' if out_a == ref_b else 'were not restored'} after the updates"
