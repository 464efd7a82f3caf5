"""``weightsync bench --suite vllm-prefetch``, path ``serve``: a ``vllm serve`` process's pause per
update and its tokens/s during a sync, as HTTP clients see them (issue 29).

Three kinds of process, as in a real job: ``vllm serve`` (API server and engine core) with the
``"weightsync"`` worker backend (init info ``prefetch=True``); a trainer process that writes
versions and drives the server's RL routes as an RL driver does; and this process, whose
``batch`` streaming clients keep requests running on ``/v1/completions`` and time every token
chunk they receive. Side by side in one run:

* without prefetch (``updates`` versions): ``/pause`` (aborting what runs), then
  ``/start_weight_update``, ``/update_weights`` while the trainer writes, ``/finish_weight_update``,
  ``/reset_prefix_cache``, ``/resume``: the engine does not generate for the whole sync;
* with prefetch (``updates`` versions): ``/start_weight_update`` (the worker starts receiving),
  the trainer writes while the clients generate, then :func:`apply_prefetched`: ``/pause``,
  ``/update_weights`` (only the apply, and whatever of the receive had not ended), finish (and
  the mode's own reset, if any), ``/resume``; then as long a
  window of generation with no sync (idle, after :data:`SETTLE_S`). ``pause_modes``
  (:data:`PAUSE_MODES`) says how ``/pause`` treats running requests; several take turns, update
  by update, and the row reports each apart (``pause_modes``), its first as the row's own.

The pause as a client sees it is the gap between the last token before the engine paused and
the first after it resumed (:func:`client_pause`); where it went inside the engine comes from the
worker's step trace (:mod:`weightsync.integrations.vllm_step_trace`, :func:`_engine_figures`): the
engine's pause (no step ran) around the apply, and the first step after ``/resume``, which
prefills again what the pause aborted or preempted; tokens/s
count the token ids the clients received inside each window (:func:`window_rate`). The trainer
writes with ``staleness=1``, so its ``write`` returns once its bytes are sent: on a two-sided
transport (torch) that is when the worker has them; on a one-sided one (shm, streaming) the
worker's copy may outlast it, and its remainder is then part of the pause.
"""

from __future__ import annotations

import argparse
import bisect
import contextlib
import json
import os
import subprocess
import sys
import threading
import time
from collections.abc import Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from weightsync.apps.bench.runner import free_port

PREFIX = "WSSERVE "
#: seconds after a resume counted in no window (the first steps after a reload rebuild oneDNN's kernels)
SETTLE_S = 2.0
PROMPT_TOKENS = 32
#: how the driver pauses a prefetched update (``--serve-pause-modes``; docs/engines.md): the
#: ``/pause`` query, and the ``/reset_prefix_cache`` after ``/finish_weight_update`` (None: none;
#: else its ``reset_running_requests``). vLLM 0.32's ``/pause`` (``clear_cache`` true by default)
#: resets the prefix cache itself once the engine stopped, preempting what it keeps (frozen
#: requests are computed again at ``/resume``), and nothing steps until ``/resume``: ``abort`` and
#: ``keep`` need no reset of their own. ``keep-stale`` (``clear_cache=false``) keeps the frozen
#: requests' KV of the old weights and the cached prefixes of the old weights (in-flight updates
#: à la PipelineRL accept the first). ``abort-reset`` and ``keep-reset`` are the earlier driver's
#: sequence, with a reset of its own: measured side by side with the lean one.
PAUSE_MODES: dict[str, tuple[dict[str, Any], bool | None]] = {
    "abort": ({"mode": "abort"}, None),
    "keep": ({"mode": "keep"}, None),
    "keep-stale": ({"mode": "keep", "clear_cache": False}, None),
    "abort-reset": ({"mode": "abort"}, False),
    "keep-reset": ({"mode": "keep"}, True),
}


def check_pause_modes(modes: Sequence[str]) -> tuple[str, ...]:
    """``modes`` if each is one of :data:`PAUSE_MODES` (and there is one); else a ValueError naming them."""
    unknown = sorted(set(modes) - set(PAUSE_MODES))
    if unknown or not modes:
        raise ValueError(f"serve pause mode(s) {unknown} are unknown; choose from {', '.join(PAUSE_MODES)}")
    return tuple(dict.fromkeys(modes))


def client_pause(arrivals: Sequence[float], start: float, end: float) -> float:
    """The longest gap in the clients' merged token arrivals (sorted) that overlaps ``[start, end]``
    (from the driver's ``/pause`` to its ``/resume``): from the last token before the engine
    stopped to the first after it went on. Not simply the gap around one moment: a token generated
    before the pause may reach its client after ``/pause`` returned."""
    before, after = client_gap(arrivals, start, end)
    return after - before


def client_gap(arrivals: Sequence[float], start: float, end: float) -> tuple[float, float]:
    """The (last token before, first token after) of :func:`client_pause`'s gap."""
    lo, hi = bisect.bisect_left(arrivals, start), bisect.bisect_right(arrivals, end)
    if lo == 0 or hi == len(arrivals):
        raise ValueError(f"no token arrived on both sides of the pause in [{start:.3f}, {end:.3f}]")
    i = max(range(lo, hi + 1), key=lambda i: arrivals[i] - arrivals[i - 1])
    return arrivals[i - 1], arrivals[i]


def window_rate(arrivals: Sequence[float], counts: Sequence[int], windows: Sequence[tuple[float, float]]) -> float:
    """Tokens per second received over ``windows`` ((start, end) pairs) together."""
    tokens = 0
    for start, end in windows:
        lo, hi = bisect.bisect_left(arrivals, start), bisect.bisect_right(arrivals, end)
        tokens += sum(counts[lo:hi])
    return tokens / sum(end - start for start, end in windows)


def summarize(arrivals: Sequence[tuple[float, int]], trace: dict[str, Any],
              engine: Sequence[tuple[float, str]] = ()) -> dict[str, Any]:
    """The row's figures (medians over updates) from the clients' token arrivals ((time, tokens)
    pairs), the trainer's trace (:func:`_trainer`'s record: monotonic times of each step) and the
    engine's (``engine``: :mod:`weightsync.integrations.vllm_step_trace` events; none: no engine figures)."""
    ordered = sorted(arrivals)
    times, counts = [t for t, _ in ordered], [n for _, n in ordered]

    def median(values: list[float]) -> float:
        return sorted(values)[len(values) // 2]

    blocking, prefetch = trace["blocking"], trace["prefetch"]
    modes = trace.get("pause_modes", ["abort"])
    during = [(u["start"], u["received"]) for u in prefetch]
    by_mode = {mode: [u for u in prefetch if u.get("mode", "abort") == mode] for mode in modes}
    first = by_mode[modes[0]]  # the row's prefetch figures: the first pause mode's
    out: dict[str, Any] = {
        "updates": len(first),
        "blocking_pause_s": median([client_pause(times, u["start"], u["end"]) for u in blocking]),
        "blocking_update_s": median([u["updated"] - u["paused"] for u in blocking]),
        "blocking_sync_s": median([u["end"] - u["start"] for u in blocking]),
        "prefetch_pause_s": median([client_pause(times, u["received"], u["end"]) for u in first]),
        "prefetch_update_s": median([u["updated"] - u["update"] for u in first]),
        # the driver's own pause: /pause called to /resume returned (the client's gap adds a step each side)
        "prefetch_driver_pause_s": median([u["end"] - u["received"] for u in first]),
        "prefetch_sync_s": median([u["end"] - u["start"] for u in first]),
        "during_tokens_per_s": window_rate(times, counts, during),
        "idle_tokens_per_s": window_rate(times, counts, [tuple(w) for w in trace["idle"]]),
        "during_windows_s": [round(end - start, 3) for start, end in during],
    }
    out["pause_over_update"] = out["prefetch_pause_s"] / out["prefetch_update_s"]
    out["pause_over_blocking_pause"] = out["prefetch_pause_s"] / out["blocking_pause_s"]
    out["during_over_idle"] = out["during_tokens_per_s"] / out["idle_tokens_per_s"]
    out["pause_modes"] = {mode: _mode_figures(times, ups, median) for mode, ups in by_mode.items()}
    if engine:
        from weightsync.integrations.vllm_step_trace import engine_pauses, step_seconds

        pauses = engine_pauses(engine)
        steady = step_seconds(engine, [tuple(w) for w in trace["idle"]])
        if steady:  # a decode step; the longest: the prefill of a batch the clients sent afresh, no update near
            out["decode_step_s"], out["longest_idle_step_s"] = median(steady), max(steady)
        for mode, ups in by_mode.items():
            out["pause_modes"][mode] |= _engine_figures(times, ups, pauses, median)
    return out


def _engine_figures(times: Sequence[float], updates: list[dict[str, float]], pauses: list[dict[str, float]],
                    median: Any) -> dict[str, float]:
    """Where the clients' gap went, inside the engine (medians over ``updates``): ``engine_pause_s``
    (no forward ran: the last step's end to the next one's start), of it ``apply_s`` (the backend's
    ``update_weights``), ``before_apply_s`` (/pause and /update_weights reaching the engine) and
    ``after_apply_s`` (finish, any reset, /resume); ``step_after_s`` (the first step after, which
    prefills what the pause aborted or preempted); ``gap_before_s`` (the clients' last token
    before to the engine's stop) and ``gap_after_s`` (the first step's end to the clients' first
    token after)."""
    rows = []
    for u in updates:
        inside = [p for p in pauses if u["paused"] <= p["apply_start"] <= u["updated"]]
        if not inside:
            continue
        p = inside[0]
        before, after = client_gap(times, u["received"], u["end"])
        rows.append({"engine_pause_s": p["restarted"] - p["stopped"],
                     "apply_s": p["apply_end"] - p["apply_start"], "before_apply_s": p["apply_start"] - p["stopped"],
                     "after_apply_s": p["restarted"] - p["apply_end"],
                     "step_after_s": p["step_after_s"], "gap_before_s": p["stopped"] - before,
                     "gap_after_s": after - p["step_after_end"]})
    if not rows:
        return {}
    figures = {k: median([r[k] for r in rows]) for k in rows[0]}
    figures["engine_pause_over_apply"] = figures["engine_pause_s"] / figures["apply_s"]
    return figures


def _mode_figures(times: Sequence[float], updates: list[dict[str, float]], median: Any) -> dict[str, float]:
    """One pause mode's prefetched updates: the clients' pause, ``/update_weights``, the driver's pause."""
    pauses = [client_pause(times, u["received"], u["end"]) for u in updates]
    pause, update = median(pauses), median([u["updated"] - u["update"] for u in updates])
    return {"updates": len(updates), "pause_s": pause, "update_s": update,
            "driver_pause_s": median([u["end"] - u["received"] for u in updates]), "pause_over_update": pause / update,
            "pauses_s": [round(p, 3) for p in pauses]}


# -- the trainer process ------------------------------------------------------------------------


class _Routes:
    """The server's RL routes, each raising on an HTTP error."""

    def __init__(self, url: str, timeout: float) -> None:
        import httpx

        self.http = httpx.Client(base_url=url, timeout=timeout)

    def post(self, path: str, body: dict[str, Any] | None = None, **params: Any) -> Any:
        response = self.http.post(path, json=body, params=params)
        response.raise_for_status()
        return response.json() if response.content else None

    def finish(self, version: int, mode: str = "abort-reset") -> None:
        """Finish ``version``, then reset the prefix cache if pause ``mode`` does (:data:`PAUSE_MODES`)."""
        self.post("/finish_weight_update", {"weight_version": str(version)})
        reset_running = PAUSE_MODES[mode][1]
        if reset_running is None:
            return
        if not self.post("/reset_prefix_cache", reset_running_requests=reset_running)["success"]:
            raise RuntimeError(f"vLLM could not reset its prefix cache after a {mode!r} pause")


def apply_prefetched(routes: _Routes, version: int, mode: str) -> dict[str, float]:
    """The driver's pause around ``version``, prefetched since ``/start_weight_update``: ``/pause``
    as pause ``mode`` says (:data:`PAUSE_MODES`), ``/update_weights`` (the apply), ``/finish_weight_update``
    (the version stamp) and the mode's reset if any, ``/resume``; the monotonic time each returned."""
    routes.post("/pause", **PAUSE_MODES[mode][0])
    t = {"paused": time.monotonic()}
    t["update"] = t["paused"]
    routes.post("/update_weights", {"update_info": {"version": version}})
    t["updated"] = time.monotonic()
    routes.finish(version, mode)
    t["finished"] = time.monotonic()
    routes.post("/resume")
    t["end"] = time.monotonic()
    return t


def _trainer(config: dict[str, Any], url: str, *, job: str, updates: int, transport: str,
             timeout: float, pause_modes: Sequence[str] = ("abort",)) -> dict[str, Any]:
    from weightsync.roles.writer import WeightWriter
    from weightsync.session.config import SCOPES, SyncConfig
    from weightsync.tools.tiny import CanonicalSource, canonical_weights
    from weightsync.tools.torch_layout import fill_from_canonical

    source = CanonicalSource(config)
    # staleness 1: write() returns once its bytes are out, not once the server applied them
    sync = SyncConfig(num_writers=1, num_readers=1, job=job, timeout=timeout, transport=transport, staleness=1)
    weights = [canonical_weights(config, seed) for seed in (1, 2)]
    routes = _Routes(url, timeout)
    info = {k: v for k, v in sync.to_wire().items() if SCOPES[k] != "rank"}
    routes.post("/init_weight_transfer_engine", {"init_info": {
        **info, "rank": 0, "prefetch": True, "meta_address": os.environ["WEIGHTSYNC_META_ADDR"],
        "meta_token": os.environ["WEIGHTSYNC_META_TOKEN"]}})
    trace: dict[str, Any] = {"blocking": [], "prefetch": [], "idle": [], "pause_modes": list(pause_modes)}
    pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="update-route")
    try:
        with WeightWriter(source, rank=0, config=sync) as writer:
            def write(version: int) -> None:
                fill_from_canonical(source.layout(), source.tensors(), weights[version % 2])
                writer.write(version)

            def blocking(version: int) -> dict[str, float]:
                t: dict[str, float] = {"start": time.monotonic()}
                routes.post("/pause", mode="abort")
                t["paused"] = time.monotonic()
                routes.post("/start_weight_update")
                update = pool.submit(routes.post, "/update_weights", {"update_info": {"version": version}})
                write(version)
                update.result(timeout=timeout)
                t["updated"] = time.monotonic()
                routes.finish(version)  # the blocking sync keeps the earlier sequence: it is the baseline
                routes.post("/resume")
                t["end"] = time.monotonic()
                return t

            blocking(1)  # forms the transport and lays staging out
            for version in range(2, 2 + updates):
                trace["blocking"].append(blocking(version))
            # the pause modes take turns, so that each sees the same load
            modes = [mode for _ in range(updates) for mode in pause_modes]
            for version, mode in enumerate(modes, start=2 + updates):
                t: dict[str, Any] = {"start": time.monotonic(), "mode": mode}
                routes.post("/start_weight_update")  # the worker starts receiving; the engine generates
                write(version)
                t["received"] = time.monotonic()
                t |= apply_prefetched(routes, version, mode)
                trace["prefetch"].append(t)
                time.sleep(SETTLE_S)
                idle = (time.monotonic(), time.monotonic() + t["received"] - t["start"])
                time.sleep(idle[1] - idle[0])
                trace["idle"].append(idle)
    finally:
        pool.shutdown(wait=False)
        with contextlib.suppress(Exception):
            routes.post("/shutdown_weight_transfer_engine")
    return trace


# -- this process: the server and its clients ---------------------------------------------------


class _Clients:
    """``batch`` streaming greedy completions kept running, each token chunk timed (monotonic)."""

    def __init__(self, url: str, model: str, batch: int) -> None:
        self.url, self.model, self.batch = url, model, batch
        self.arrivals: list[tuple[float, int]] = []
        self.stop = threading.Event()
        self.threads = [threading.Thread(target=self._run, args=(b,), daemon=True) for b in range(batch)]

    def __enter__(self) -> _Clients:
        for thread in self.threads:
            thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop.set()
        for thread in self.threads:
            thread.join(60)

    def _run(self, b: int) -> None:
        import httpx

        body = {"model": self.model, "prompt": [(7 * i + 3 * b) % 500 + 4 for i in range(PROMPT_TOKENS)],
                "max_tokens": 64, "temperature": 0, "ignore_eos": True, "stream": True, "return_token_ids": True}
        with httpx.Client(timeout=httpx.Timeout(10.0, read=600.0)) as http:
            while not self.stop.is_set():
                try:
                    with http.stream("POST", f"{self.url}/v1/completions", json=body) as response:
                        for line in response.iter_lines():
                            if self.stop.is_set():
                                return
                            if not line.startswith("data: {"):
                                continue
                            choices = json.loads(line[len("data: "):]).get("choices") or [{}]
                            n = len(choices[0].get("token_ids") or [])
                            if n:
                                self.arrivals.append((time.monotonic(), n))
                except httpx.HTTPError:
                    time.sleep(0.1)  # a request the pause aborted: the next one waits for the resume


@contextlib.contextmanager
def vllm_serve(model: Path, args: Sequence[str], *, env: dict[str, str], log: Path, timeout: float,
               port: int | None = None) -> Iterator[str]:
    """``vllm serve`` of ``model`` with the weightsync backend and ``args``, on ``port`` (default:
    a free one) of 127.0.0.1, its output in ``log``; its URL once ``/health`` answers. The
    server and its engine core are stopped on exit (SIGTERM to its process group, then SIGKILL)."""
    import httpx

    port = port or free_port()
    cmd = [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", str(model), "--host", "127.0.0.1",
           "--port", str(port), *args, "--weight-transfer-config", json.dumps({"backend": "weightsync"})]
    with open(log, "wb") as out:
        proc = subprocess.Popen(cmd, env=env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + timeout
        while True:
            with contextlib.suppress(httpx.HTTPError):
                if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                    break
            if proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"vllm serve did not come up: {log.read_text()[-3000:]}")
            time.sleep(0.5)
        yield url
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, 15)
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, 9)
            proc.wait(30)


def _server(checkpoint: Path, batch: int, env: dict[str, str], log: Path, timeout: float) -> Any:
    """``vllm serve`` on CPU as the serve tests start it (:func:`vllm_serve`), ``batch`` sequences at once."""
    return vllm_serve(checkpoint, ["--dtype", "float32", "--enforce-eager", "--max-model-len", "256",
                                   "--max-num-seqs", str(batch), "--skip-tokenizer-init",
                                   "--kv-cache-memory-bytes", str(64 << 20), "--seed", "0"],
                      env=env, log=log, timeout=timeout)


def serve_case(name: str, checkpoint: Path, *, job: str, updates: int, transport: str, timeout: float,
               env: dict[str, str], batch: int = 4, pause_modes: Sequence[str] = ("abort",)) -> dict[str, Any]:
    """The ``serve`` row's figures, or ``{"error": ...}`` naming what failed."""
    from weightsync.integrations.vllm_step_trace import ENV, read

    steps = checkpoint.parent / f"steps-{job}.trace"
    env = {k: v for k, v in env.items() if k != "VLLM_ENABLE_V1_MULTIPROCESSING"} | {
        "VLLM_SERVER_DEV_MODE": "1", ENV: str(steps)}
    log = checkpoint.parent / f"serve-{job}.log"
    with _server(checkpoint, batch, env, log, timeout) as url, _Clients(url, str(checkpoint), batch) as clients:
        deadline = time.monotonic() + timeout
        while not clients.arrivals and time.monotonic() < deadline:  # warm: the clients generate
            time.sleep(0.2)
        time.sleep(SETTLE_S)
        trainer = subprocess.Popen([sys.executable, "-m", "weightsync.apps.bench.vllm_prefetch_serve", "--model", name,
                                    "--url", url, "--job", job, "--updates", str(updates), "--transport", transport,
                                    "--timeout", str(timeout), "--pause-modes", ",".join(pause_modes)],
                                   env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        try:
            out, err = trainer.communicate(timeout=timeout * 3)
        except subprocess.TimeoutExpired:
            trainer.kill()
            trainer.communicate()
            return {"error": "the trainer timed out"}
    lines = [line[len(PREFIX):] for line in out.splitlines() if line.startswith(PREFIX)]
    if trainer.returncode or not lines:
        tail = " | ".join(err.strip().splitlines()[-3:])
        return {"error": f"trainer exit {trainer.returncode}: {tail}"}
    return summarize(clients.arrivals, json.loads(lines[-1]), read(str(steps)) if steps.exists() else ())


def main(argv: list[str] | None = None) -> int:
    from weightsync.apps.bench.vllm_memory import MODELS, model_config

    parser = argparse.ArgumentParser(prog="python -m weightsync.apps.bench.vllm_prefetch_serve")
    parser.add_argument("--model", required=True, choices=sorted(MODELS))
    parser.add_argument("--url", required=True)
    parser.add_argument("--job", required=True)
    parser.add_argument("--updates", type=int, required=True)
    parser.add_argument("--transport", default="auto")
    parser.add_argument("--timeout", type=float, default=600.0)
    parser.add_argument("--pause-modes", default="abort")
    args = parser.parse_args(argv)
    trace = _trainer(model_config(args.model), args.url, job=args.job, updates=args.updates, transport=args.transport,
                     timeout=args.timeout, pause_modes=check_pause_modes(args.pause_modes.split(",")))
    print(PREFIX + json.dumps(trace), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
