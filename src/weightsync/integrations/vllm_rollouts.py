"""A vLLM engine as a :class:`~weightsync.roles.rollouts.TurnEngine`: turns of rollouts, their KV in the store.

    llm = start_llm(model_path, kv_directory="/dev/shm/weightsync-rl-job7", block_size=32)
    engine = VLLMTurnEngine(llm, name="e0", version=7)
    result = engine.generate(request, timeout=60)            # request: a weightsync.roles.rollouts.TurnRequest
    engine.update(8, weights_path=new_checkpoint, mode="abort")   # between two steps
    engine.update(9, apply=lambda: update_llm(llm, 9), mode="abort")   # weights from a weightsync writer

The engine runs in this process (``vllm.LLM``); the adapter drives it step by step, so that a
weight update lands between two steps as vLLM's own ``pause_generation`` would place it:
``abort`` aborts the requests in flight (their turns come back with ``finish_reason="abort"``)
and resets the prefix cache; ``keep-stale`` lets them go on with the KV of the old weights. The
new weights come from vLLM's in-place reload (``reload_weights``) of a checkpoint directory, or
from whatever the caller applies (a weightsync reader through ``update_llm``); the engine's
version label (vLLM's ``set_weight_version``, which vLLM stamps on every token it returns)
becomes ``version``, and the KV connector of this process learns it
(:func:`weightsync.integrations.vllm_kv.set_engine_version`).

Each result carries what vLLM reports of the prefill: the prompt tokens it did not compute
(``num_cached_tokens``) and those the connector restored; :meth:`VLLMTurnEngine.prefill_counters`
reads vLLM's own ``vllm:prompt_tokens_by_source`` counters.
"""

from __future__ import annotations

import itertools
import logging
import time
from collections.abc import Callable
from typing import Any

from weightsync.clock.deadline import Deadline
from weightsync.integrations import vllm_kv
from weightsync.roles.rollouts.engine import KV_PARAMS_KEY, TurnRequest, TurnResult
from weightsync.roles.rollouts.record import UPDATE_MODES

logger = logging.getLogger(__name__)


def llm_kwargs(model: str, *, kv_directory: str, budget_bytes: int = 1 << 30, block_size: int = 32,
               namespace: str = "", **overrides: Any) -> dict[str, Any]:
    """``vllm.LLM`` arguments for a rollout engine: the weightsync KV connector, stats on (the
    prefill counters), tokens in and out. vLLM's CPU attention takes block sizes in multiples of 32."""
    kwargs: dict[str, Any] = {
        "model": model, "block_size": block_size, "disable_log_stats": False, "skip_tokenizer_init": True,
        "kv_transfer_config": vllm_kv.kv_transfer_config(kv_directory, budget_bytes=budget_bytes,
                                                         namespace=namespace),
    }
    kwargs.update(overrides)
    return kwargs


def start_llm(model: str, **kwargs: Any) -> Any:
    """A ``vllm.LLM`` built with :func:`llm_kwargs`."""
    from vllm import LLM

    return LLM(**llm_kwargs(model, **kwargs))


class VLLMTurnEngine:
    """A ``vllm.LLM`` of this process generating rollout turns (see module docstring).

    Args:
        llm: built with :func:`llm_kwargs` (the KV connector configured, stats on).
        name: how records and logs name this engine.
        version: the weight version it serves now.
        between_steps: called between two engine steps (a host process reads its commands there).
    """

    def __init__(self, llm: Any, *, name: str, version: int | None,
                 between_steps: Callable[[], None] | None = None) -> None:
        self.llm = llm
        self._name = name
        self.between_steps = between_steps
        self._ids = itertools.count()
        self._running: set[str] = set()
        self._aborted: set[str] = set()
        self._set_version(version)

    @property
    def name(self) -> str:
        return self._name

    @property
    def weight_version(self) -> int | None:
        return self._version

    def _set_version(self, version: int | None) -> None:
        self._version = version
        if version is not None:
            self.llm.llm_engine.set_weight_version(str(version))
        vllm_kv.set_engine_version(version)

    # -- turns -------------------------------------------------------------------------------------
    def submit(self, request: TurnRequest) -> str:
        """Queue a turn; returns its request id (:meth:`step` reports it when it ends)."""
        from vllm import SamplingParams
        from vllm.inputs import TokensPrompt

        s = request.sampling
        extra = {} if request.kv_transfer_params() is None else {"kv_transfer_params": request.kv_transfer_params()}
        params = SamplingParams(temperature=s.temperature, top_p=s.top_p, top_k=s.top_k if s.top_k else -1,
                                max_tokens=s.max_tokens, seed=request.seed, stop_token_ids=list(s.stop_token_ids),
                                ignore_eos=s.ignore_eos, detokenize=False, logprobs=0, extra_args=extra)
        rid = f"{request.rollout_id}-t{request.turn}-{next(self._ids)}"
        self.llm.llm_engine.add_request(rid, TokensPrompt(prompt_token_ids=list(request.token_ids)), params)
        self._running.add(rid)
        return rid

    def step(self) -> dict[str, TurnResult]:
        """One engine step; the turns that ended in it (aborted ones included), by request id."""
        done = {rid: self._aborted_result() for rid in self._aborted}
        self._aborted.clear()
        for out in self.llm.llm_engine.step():
            if out.finished:
                done[out.request_id] = self._result(out)
        self._running.difference_update(done)
        return done

    def generate(self, request: TurnRequest, *, timeout: float) -> TurnResult:
        """Run one turn to its end (other queued turns step along)."""
        deadline = Deadline.after(timeout)
        rid = self.submit(request)
        while True:
            if deadline.expired:
                self.llm.llm_engine.abort_request([rid])
                self._running.discard(rid)
                raise TimeoutError(f"engine {self.name}: turn {request.turn} of rollout {request.rollout_id} did "
                                   f"not end within {timeout} s")
            if self.between_steps is not None:
                self.between_steps()
            done = self.step()
            if rid in done:
                return done[rid]

    def _result(self, out: Any) -> TurnResult:
        completion = out.outputs[0]
        spans = tuple((int(s.version), s.start, s.end) for s in completion.weight_versions or ()
                      if s.version.isdigit())
        if not spans and self._version is not None:
            spans = ((self._version, 0, len(completion.token_ids)),)
        restored = int(((out.kv_transfer_params or {}).get(KV_PARAMS_KEY) or {}).get("restored_tokens", 0))
        logprobs = tuple(float(step[t].logprob) for t, step in zip(completion.token_ids, completion.logprobs or (),
                                                                    strict=False))
        return TurnResult(token_ids=tuple(completion.token_ids), finish_reason=str(completion.finish_reason),
                          version_spans=spans, engine=self.name, prompt_tokens=len(out.prompt_token_ids or ()),
                          cached_tokens=int(out.num_cached_tokens or 0), restored_tokens=restored,
                          logprobs=logprobs if len(logprobs) == len(completion.token_ids) else ())

    def _aborted_result(self) -> TurnResult:
        return TurnResult(token_ids=(), finish_reason="abort", version_spans=(), engine=self.name)

    # -- updates -----------------------------------------------------------------------------------
    def update(self, version: int, *, mode: str = "abort", weights_path: str | None = None,
               apply: Callable[[], None] | None = None) -> list[str]:
        """Move the engine to ``version`` between two steps.

        Args:
            mode: ``abort`` aborts the turns in flight and resets the prefix cache (no KV of the
                old weights is used after it); ``keep-stale`` keeps both.
            weights_path: a checkpoint directory, loaded in place by vLLM's ``reload_weights``; or
            apply: what loads the new weights into ``self.llm`` (``weightsync.engines.vllm.update_llm``
                with a weightsync reader, vLLM's own weight-transfer calls, ...).

        Returns:
            the request ids that ``abort`` aborted (:meth:`step` reports them as aborted turns).
        """
        if mode not in UPDATE_MODES:
            raise ValueError(f"update mode {mode!r} is not one of {UPDATE_MODES}")
        if (weights_path is None) == (apply is None):
            raise ValueError("pass exactly one of weights_path (a checkpoint vLLM reloads in place) and apply "
                             "(a function that loads the new weights into the engine)")
        aborted: list[str] = []
        engine = self.llm.llm_engine
        if mode == "abort":
            aborted = sorted(self._running)
            engine.abort_request(aborted)
            self._aborted.update(aborted)
        start = time.perf_counter()
        if apply is not None:
            apply()
        else:
            self.llm.collective_rpc("reload_weights", kwargs={"weights_path": weights_path})
        self._set_version(version)
        if mode == "abort":
            self.llm.reset_prefix_cache()
        logger.info("engine %s: version %d loaded in %.2f s (%s, %d turns aborted)", self.name, version,
                    time.perf_counter() - start, mode, len(aborted))
        return aborted

    def prefill_counters(self) -> dict[str, float]:
        """vLLM's ``vllm:prompt_tokens_by_source`` counters (``local_compute``, ``local_cache_hit``,
        ``external_kv_transfer``) and ``vllm:prompt_tokens``, summed over engines."""
        out: dict[str, float] = {}
        for metric in self.llm.get_metrics():
            if metric.name == "vllm:prompt_tokens_by_source":
                source = metric.labels.get("source", "")
                out[source] = out.get(source, 0.0) + float(metric.value)
            elif metric.name == "vllm:prompt_tokens":
                out["total"] = out.get("total", 0.0) + float(metric.value)
        return out

    def kv_counters(self) -> dict[str, float]:
        """The weightsync KV connector's metrics on vLLM's registry (``vllm:weightsync_kv_*``, the
        prefix dropped: ``loaded_blocks``, ``store_bytes``, ...), summed over engines."""
        out: dict[str, float] = {}
        for metric in self.llm.get_metrics():
            if metric.name.startswith(vllm_kv.METRIC_PREFIX):
                name = metric.name[len(vllm_kv.METRIC_PREFIX):]
                out[name] = out.get(name, 0.0) + float(metric.value)
        return out
