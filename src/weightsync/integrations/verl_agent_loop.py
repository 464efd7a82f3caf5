"""verl's agent loop on resumable multi-turn rollouts (``weightsync.roles.rollouts``).

verl (0.9.1) runs each sample of a batch through an agent loop (``AgentLoopBase.run``) inside an
``AgentLoopWorker``; the loop calls ``server_manager.generate(request_id, prompt_ids=,
sampling_params=)`` once per generated turn and returns an ``AgentLoopOutput``. The loop here,
registered as ``weightsync_tool_agent``, keeps each sample's rollout as a record in a
:class:`~weightsync.roles.rollouts.Rollouts` store: every complete turn is saved, so a sample
whose server died and that verl runs again goes on from its last complete turn instead of
turn 1. The verl user's one change is an entry in the agent loop
config file (``actor_rollout_ref.rollout.agent.agent_loop_config_path=weightsync_agent.yaml``)::

    - name: weightsync_tool_agent
      _target_: weightsync.integrations.verl_agent_loop.WeightsyncToolAgentLoop
      directory: /dev/shm/weightsync-rl-job7     # the record store: one host; shared storage across hosts
      tool: my_project.tools:answer               # module:callable, (record, turn) -> Turn or None (done)
      max_turns: 8                                # optional: generated turns per rollout

and ``actor_rollout_ref.rollout.agent.default_agent_loop=weightsync_tool_agent`` (or an
``agent_name`` column in the dataset). Why the config file: it is verl's place for the settings
of a custom agent loop (verl builds the loop per sample with ``hydra.utils.instantiate``, the
entry's keys as keyword arguments), every ``AgentLoopWorker`` reads it on whatever node Ray put
it, and nothing else reaches that constructor (environment variables would need Ray's
``runtime_env`` on every worker). The optional settings are those of :class:`AgentLoopSettings`.
(Importing this module registers the loop only where the registry has no entry of its name:
hydra imports it while building the config file's entry, which verl's ``register`` would replace.)

Each sample, on a driver thread (the store and the tool block; verl's event loop must not)::

    prompt_ids = ct_build_initial_tokens(raw_prompt)       # verl's chat template, as its own loops
    record = the rollout's record, or a new one             # id: <prefix>-<uid>-p<priority>
    until the tool says done, max_turns, or the response is response_length long:
        rollouts.generate(id, [VerlTurnEngine(server_manager)])   # one server_manager.generate call
        rollouts.append_turn(id, tool(record, turn))
    AgentLoopOutput(prompt_ids, response_ids, response_mask: 1 generated / 0 tool, response_logprobs)

**Rollout ids** are ``<prefix>-<uid>-p<priority>`` (:attr:`AgentLoopSettings.id_fields`): verl
gives every prompt of a step a ``uid`` (shared by its ``n`` samples) and every sample of the
batch a ``priority`` (its position, set by ``AgentLoopManager``). The same batch run again
(its step retried) gets the same ids and continues the records; a finished record is returned
as it is. verl draws new uids at every step, so a trainer restarted from a checkpoint starts
its rollouts over, unless ``id_fields`` names dataset columns that identify a sample and its
step. A record found under the id with another prompt is refused (the ids collided).

**Versions.** verl's servers report the step of the weights they serve
(``TokenOutput.extra_fields["global_steps"]``, set by each weight sync through verl's
checkpoint manager, whatever its backend: weightsync's writes version ``global_steps`` too).
A generated turn is recorded under ``min_global_steps`` (the version of its first token; verl's
partially-resumed turns report the range, not where it changed), and under
:attr:`AgentLoopSettings.initial_version` when the server reports none (before its first sync).

**Servers that die.** verl's client reaches a server that died as Ray's ``RayActorError``; the
engine adapter turns it into :class:`~weightsync.roles.rollouts.EngineGoneError`, and the sample
fails as it would under verl's own loops, its record keeping every complete turn. A run of the
sample again is a new route through verl's load balancer (a fresh ``request_id``) and records
the resume (``engine-removed``). A turn a weight update aborted (``stop_reason="aborted"``) is
generated again from its start with the same seed.

The record is what verl gets: generated tokens as the server returned them and the tool turn's
tokens as the tool returned them, so the tool writes whatever the chat template puts around a
tool message (verl's own loops splice those boundaries with their Continuous Token builder).

Not done here: the KV store (verl's vLLM servers would need weightsync's KV connector, and
``kv_transfer_params`` passed through ``server_manager.generate``); verl's tool machinery
(``BaseTool``, tool parsers, tool rewards); multi-modal prompts; SGLang servers (refused: the
turn's seed goes under vLLM's key); retrying a dead server within one run (verl's load balancer
routes to a server until it is removed).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import dataclasses
import hashlib
import importlib
import logging
import re
import threading
import time
import uuid
import zlib
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, get_args

from verl.experimental.agent_loop.agent_loop import AgentLoopBase, AgentLoopMetrics, AgentLoopOutput, register

from weightsync.roles.rollouts.driver import NoEngineError, Rollouts
from weightsync.roles.rollouts.engine import EngineGoneError, TurnRequest, TurnResult
from weightsync.roles.rollouts.loop import Tool, flatten, open_rollout, tool_loop
from weightsync.roles.rollouts.record import RolloutRecord, Sampling, Turn, UpdateMode
from weightsync.roles.rollouts.store import RolloutStore

logger = logging.getLogger(__name__)

#: the name the loop is registered under (``agent_name`` / ``default_agent_loop``)
AGENT_NAME = "weightsync_tool_agent"
_WHERE = ("its entry in the agent loop config file (actor_rollout_ref.rollout.agent.agent_loop_config_path, "
          f"name: {AGENT_NAME})")


@dataclass(frozen=True, kw_only=True)
class AgentLoopSettings:
    """What the agent loop config entry sets (see module docstring).

    Attributes:
        directory: the rollout records' directory, the same for every agent loop worker that
            may run a sample again (``/dev/shm/...`` on one host, shared storage across hosts).
        tool: ``module:callable`` (or ``module.callable``) of a :data:`Tool`.
        max_turns: generated turns per rollout at most.
        on_update: ``abort`` only: verl's server manager picks each turn's server, so the loop
            cannot keep a rollout on a server of its old version (``keep-stale`` is refused).
        initial_version: the version of turns whose server reports no ``global_steps``.
        id_fields: the sample's fields (keys of verl's ``non_tensor_batch``) that name its rollout.
        prefix: the rollout ids' first part.
        seed: each rollout samples with ``seed + crc32(rollout id)`` (turn ``i``: ``+ i``).
        timeout: seconds per generated turn, every attempt included.
        threads: rollouts driven at once per agent loop worker (one pool per process: a loop
            asking for another number than the pool has is refused).
    """

    directory: str
    tool: str
    max_turns: int = 8
    on_update: UpdateMode = "abort"
    initial_version: int = 0
    id_fields: tuple[str, ...] = ("uid", "priority")
    prefix: str = "verl"
    seed: int = 0
    timeout: float = 600.0
    threads: int = 256

    def __post_init__(self) -> None:
        if not self.directory:
            raise ValueError(f"{AGENT_NAME}: `directory` (where rollout records are kept) is not set: add "
                             f"`directory: /dev/shm/<job>` (or a directory every host mounts) to {_WHERE}")
        if not self.tool:
            raise ValueError(f"{AGENT_NAME}: `tool` is not set: add `tool: <module>:<callable>` (a callable "
                             f"(record, turn) -> Turn or None) to {_WHERE}")
        if self.on_update not in get_args(UpdateMode):
            raise ValueError(f"{AGENT_NAME}: `on_update` must be one of {get_args(UpdateMode)}, got {self.on_update!r}")
        if self.on_update != "abort":
            raise ValueError(f"{AGENT_NAME}: `on_update: {self.on_update}` cannot be honoured: verl's server manager "
                             "picks each turn's server, so the loop cannot keep a rollout on a server of its old "
                             "version (an aborted turn is generated again on the new one); leave `on_update` unset")
        for name in ("max_turns", "threads"):
            if getattr(self, name) < 1:
                raise ValueError(f"{AGENT_NAME}: `{name}` must be >= 1, got {getattr(self, name)}")
        if self.timeout <= 0:
            raise ValueError(f"{AGENT_NAME}: `timeout` must be > 0 seconds, got {self.timeout}")
        if not self.id_fields:
            raise ValueError(f"{AGENT_NAME}: `id_fields` is empty: name the sample fields its rollout id is made of "
                             "(default [uid, priority])")
        if not re.fullmatch(r"[A-Za-z0-9][A-Za-z0-9._-]{0,63}", self.prefix):
            raise ValueError(f"{AGENT_NAME}: `prefix` {self.prefix!r} must be 1-64 letters, digits, '.', '_' or '-' "
                             "(it begins every rollout id, which names files)")
        object.__setattr__(self, "id_fields", tuple(str(f) for f in self.id_fields))

    @classmethod
    def from_entry(cls, entry: Mapping[str, Any]) -> AgentLoopSettings:
        """The settings of an agent loop config entry's keys (``None``: the default)."""
        values = {f.name: entry[f.name] for f in dataclasses.fields(cls) if entry.get(f.name) is not None}
        values.setdefault("directory", "")
        values.setdefault("tool", "")
        if "id_fields" in values:
            values["id_fields"] = tuple(values["id_fields"])  # a ListConfig from hydra
        return cls(**values)


def load_tool(path: str) -> Tool:
    """The callable ``path`` names (``module:attr`` or ``module.attr``).

    Raises:
        ValueError: the module or attribute is missing, or it is not callable.
    """
    module_name, sep, attr = path.partition(":")
    if not sep:
        module_name, _, attr = path.rpartition(".")
    if not module_name or not attr:
        raise ValueError(f"{AGENT_NAME}: `tool` {path!r} must be <module>:<callable>")
    try:
        module = importlib.import_module(module_name)
    except ImportError as exc:
        raise ValueError(f"{AGENT_NAME}: `tool` {path!r}: cannot import {module_name}: {exc}") from exc
    tool = getattr(module, attr, None)
    if not callable(tool):
        raise ValueError(f"{AGENT_NAME}: `tool` {path!r}: {module_name} has no callable {attr!r}")
    return tool  # type: ignore[no-any-return]


def rollout_id(prefix: str, fields: Sequence[str], sample: Mapping[str, Any]) -> str:
    """``<prefix>-<value>-...`` of the sample's ``fields`` (``priority`` as ``p<n>``); hashed
    when a value has characters a rollout id cannot hold or the id would be too long.

    Raises:
        ValueError: the sample lacks a field.
    """
    missing = [f for f in fields if f not in sample]
    if missing:
        raise ValueError(f"{AGENT_NAME}: the sample has no {missing} (it has {sorted(sample)}); set `id_fields` "
                         f"in {_WHERE} to fields that name each sample of a step")
    parts = [f"p{_plain(sample[f])}" if f == "priority" else str(_plain(sample[f])) for f in fields]
    rid = "-".join([prefix, *parts])
    if not re.fullmatch(r"[A-Za-z0-9._-]{1,128}", rid):
        rid = f"{prefix}-{hashlib.sha256(repr(parts).encode()).hexdigest()[:32]}"
    return rid


def _plain(value: Any) -> Any:
    """A numpy scalar (verl's ``non_tensor_batch`` holds them) as its Python value."""
    return value.item() if hasattr(value, "item") else value


def _server_died(exc: BaseException) -> bool:
    """Whether ``exc`` is Ray's error for an actor that died or is unreachable (``RayActorError``
    and its subclasses). Recognised by name: only ``integrations/ray/`` imports ray."""
    return any(c.__name__ == "RayActorError" and c.__module__.startswith("ray.") for c in type(exc).__mro__)


class VerlTurnEngine:
    """verl's ``server_manager`` as a :class:`~weightsync.roles.rollouts.TurnEngine`, for one run
    of one sample: a turn is one ``server_manager.generate`` call, made on verl's event loop from
    the driver's thread.

    ``request_id`` (verl's sticky route to one server) is the rollout id and this run's token, so
    that a run after a death is routed afresh; ``name`` is ``verl-<token>``.
    """

    def __init__(self, server_manager: Any, loop: asyncio.AbstractEventLoop, *, rollout: str,
                 params: Mapping[str, Any], prompt_tokens: int, response_length: int, initial_version: int) -> None:
        """Args:
            params: verl's sampling params (kept where the record has no say: ``logprobs``, ...).
            prompt_tokens, response_length: a turn asks for no more than what is left of the response.
        """
        token = uuid.uuid4().hex[:8]
        self._name = f"verl-{token}"
        self.request_id = f"{rollout}-{token}"
        self.server_manager = server_manager
        self.loop = loop
        self.params = dict(params)
        self.prompt_tokens = prompt_tokens
        self.response_length = response_length
        self.initial_version = initial_version
        self.version: int | None = None
        self.seconds = 0.0
        self.closed = False
        self.gone: EngineGoneError | None = None
        self._call: concurrent.futures.Future[Any] | None = None

    @property
    def name(self) -> str:
        return self._name

    @property
    def weight_version(self) -> int | None:
        """The version of the last turn this engine ran (None before it ran one)."""
        return self.version

    def sampling_params(self, request: TurnRequest) -> dict[str, Any]:
        """What ``server_manager.generate`` is sent: the record's sampling and the turn's seed
        (vLLM's keys), over verl's params."""
        s = request.sampling
        left = self.response_length - (len(request.token_ids) - self.prompt_tokens)
        params = {**self.params, "temperature": s.temperature, "top_p": s.top_p, "top_k": s.top_k or -1,
                  "max_tokens": max(1, min(s.max_tokens, left)), "seed": request.seed}
        if s.stop_token_ids:
            params["stop_token_ids"] = list(s.stop_token_ids)
        if s.ignore_eos:
            params["ignore_eos"] = True
        return params

    def generate(self, request: TurnRequest, *, timeout: float) -> TurnResult:
        if self.closed:
            raise concurrent.futures.CancelledError(f"{self.name}: verl cancelled rollout {request.rollout_id}")
        params = self.sampling_params(request)
        call = self.server_manager.generate(request_id=self.request_id, prompt_ids=list(request.token_ids),
                                            sampling_params=params)
        started = time.monotonic()
        self._call = future = asyncio.run_coroutine_threadsafe(call, self.loop)
        if self.closed:  # closed while the call was being made
            future.cancel()
        try:
            output = future.result(timeout=timeout)
        except concurrent.futures.TimeoutError:
            future.cancel()
            raise TimeoutError(f"{self.name}: rollout {request.rollout_id} turn {request.turn} did not end "
                               f"within {timeout:.3g} s") from None
        except Exception as exc:
            if _server_died(exc):
                self.gone = EngineGoneError(f"{self.name}: the server of rollout {request.rollout_id} died at turn "
                                            f"{request.turn}: {type(exc).__name__}: {exc}")
                raise self.gone from exc
            raise
        finally:
            self.seconds += time.monotonic() - started
        return self.result(request, output, params["max_tokens"])

    def close(self) -> None:
        """Cancel the call in flight, and any after it (verl cancelled the sample: its event loop
        may be closing, and the driver's thread would otherwise wait out its timeout)."""
        self.closed = True
        if self._call is not None:
            self._call.cancel()

    def result(self, request: TurnRequest, output: Any, max_tokens: int) -> TurnResult:
        """The turn's result of verl's ``TokenOutput``."""
        extra = output.extra_fields or {}
        version = next((v for v in (extra.get("min_global_steps"), extra.get("global_steps")) if v is not None),
                       self.initial_version)
        self.version = int(version)
        if output.stop_reason in ("aborted", "abort"):
            return TurnResult(token_ids=(), finish_reason="abort", version_spans=(), engine=self.name)
        tokens = tuple(int(t) for t in output.token_ids)
        logprobs = tuple(output.log_probs) if output.log_probs and len(output.log_probs) == len(tokens) else ()
        return TurnResult(token_ids=tokens, finish_reason="length" if len(tokens) >= max_tokens else "stop",
                          version_spans=((self.version, 0, len(tokens)),), engine=self.name,
                          prompt_tokens=len(request.token_ids), cached_tokens=int(extra.get("num_cached_tokens") or 0),
                          logprobs=logprobs)


_LOCK = threading.Lock()
_ROLLOUTS: dict[str, Rollouts] = {}
_POOL: dict[int, concurrent.futures.ThreadPoolExecutor] = {}  # threads -> the process's one pool


def _rollouts(directory: str) -> Rollouts:
    """One store per directory and process (verl builds a loop per sample)."""
    with _LOCK:
        if directory not in _ROLLOUTS:
            _ROLLOUTS[directory] = Rollouts(RolloutStore(directory))
        return _ROLLOUTS[directory]


def _pool(threads: int) -> concurrent.futures.ThreadPoolExecutor:
    """The drivers' threads: verl's default executor has a handful (cores + 4), and a rollout holds
    its thread while the server generates."""
    with _LOCK:
        if not _POOL:
            _POOL[threads] = concurrent.futures.ThreadPoolExecutor(max_workers=threads,
                                                                   thread_name_prefix="weightsync-rollout")
        if threads not in _POOL:
            raise ValueError(f"{AGENT_NAME}: `threads: {threads}`, but this agent loop worker drives its rollouts "
                             f"with {next(iter(_POOL))} threads, set by the first loop it built: give every "
                             f"{AGENT_NAME} entry the same `threads`")
        return _POOL[threads]


def response_tokens(record: RolloutRecord) -> int:
    return sum(len(t.token_ids) for t in record.turns[1:])


class WeightsyncToolAgentLoop(AgentLoopBase):
    """verl's agent loop on weightsync rollouts (see module docstring)."""

    def __init__(self, *args: Any, directory: str | None = None, tool: str | None = None,
                 max_turns: int | None = None, on_update: str | None = None, initial_version: int | None = None,
                 id_fields: Sequence[str] | None = None, prefix: str | None = None, seed: int | None = None,
                 timeout: float | None = None, threads: int | None = None, **kwargs: Any) -> None:
        kwargs.pop("tools", None)  # verl's tool list (ToolAgentLoop's); this loop calls `tool`
        super().__init__(*args, **kwargs)
        self.settings = AgentLoopSettings.from_entry({
            "directory": directory, "tool": tool, "max_turns": max_turns, "on_update": on_update,
            "initial_version": initial_version, "id_fields": id_fields, "prefix": prefix, "seed": seed,
            "timeout": timeout, "threads": threads})
        backend = self.rollout_config.get("name")
        if backend != "vllm":
            raise ValueError(f"{AGENT_NAME} sends vLLM's sampling keys (seed, max_tokens); "
                             f"actor_rollout_ref.rollout.name={backend} is not supported")
        self.tool = load_tool(self.settings.tool)
        self.rollouts = _rollouts(self.settings.directory)
        self.response_length = int(self.rollout_config.response_length)

    async def run(self, sampling_params: dict[str, Any], **kwargs: Any) -> AgentLoopOutput:
        """One sample's rollout, started or continued; verl's output of its record."""
        rid = rollout_id(self.settings.prefix, self.settings.id_fields, kwargs)
        prompt_ids = await self.ct_build_initial_tokens(list(kwargs["raw_prompt"]))
        loop = asyncio.get_running_loop()
        engine = VerlTurnEngine(self.server_manager, loop, rollout=rid, params=sampling_params,
                                prompt_tokens=len(prompt_ids), response_length=self.response_length,
                                initial_version=self.settings.initial_version)
        sampling = self.sampling(rid, sampling_params)
        timing: dict[str, float] = {}
        try:
            record = await loop.run_in_executor(_pool(self.settings.threads), self.drive, rid, list(prompt_ids),
                                                engine, sampling, timing)
        except asyncio.CancelledError:
            engine.close()
            raise
        metrics = AgentLoopMetrics(generate_sequences=engine.seconds, tool_calls=timing.get("tool_calls", 0.0))
        return agent_loop_output(record, response_length=self.response_length, metrics=metrics,
                                 logprobs=bool(sampling_params.get("logprobs")))

    def sampling(self, rid: str, params: Mapping[str, Any]) -> Sampling:
        """A new record's sampling: verl's params, each rollout its own seed."""
        return Sampling(temperature=float(params.get("temperature", 1.0)), top_p=float(params.get("top_p", 1.0)),
                        top_k=max(0, int(params.get("top_k", -1))),
                        max_tokens=int(params.get("max_tokens") or self.response_length),
                        stop_token_ids=tuple(params.get("stop_token_ids") or ()),
                        ignore_eos=bool(params.get("ignore_eos", False)),
                        seed=self.settings.seed + zlib.crc32(rid.encode()))

    def drive(self, rid: str, prompt_ids: list[int], engine: VerlTurnEngine, sampling: Sampling,
              timing: dict[str, float]) -> RolloutRecord:
        """Generate and call the tool until done (in a driver thread); the finished record."""
        record = open_rollout(self.rollouts, rid, prompt_ids, sampling=sampling, on_update=self.settings.on_update,
                              hint=f"its id fields {self.settings.id_fields} do not name one sample (set `id_fields` "
                                   f"or `prefix` in {_WHERE})")
        if len(record.turns) > 1 and not record.finished:
            logger.info("rollout %s continues at turn %d on %s", rid, len(record.turns), engine.name)

        def generate() -> None:
            try:
                self.rollouts.generate(rid, [engine], timeout=self.settings.timeout)
            except NoEngineError:
                if engine.gone is not None:  # the death, with Ray's error as its cause
                    raise engine.gone  # noqa: B904 (its cause is the server's death, not this)
                raise

        def timed_tool(record: RolloutRecord, last: Turn) -> Turn | None:
            started = time.monotonic()
            try:
                return self.tool(record, last)
            finally:
                timing["tool_calls"] = timing.get("tool_calls", 0.0) + time.monotonic() - started

        return tool_loop(self.rollouts, record, generate=generate, tool=timed_tool, max_turns=self.settings.max_turns,
                         stop=lambda r: response_tokens(r) >= self.response_length)


def agent_loop_output(record: RolloutRecord, *, response_length: int, metrics: AgentLoopMetrics,
                      logprobs: bool) -> AgentLoopOutput:
    """verl's output of a finished record: every turn after the prompt is the response (cut at
    ``response_length``, as verl's loops do), masked 1 on generated tokens and 0 on the tools'."""
    tokens = flatten(record)
    response, mask, probs = tokens.response_ids, tokens.mask, tokens.logprobs
    versions = [v for t in record.turns for v in t.versions]
    return AgentLoopOutput(
        prompt_ids=tokens.prompt_ids, response_ids=response[:response_length],
        response_mask=mask[:response_length], response_logprobs=probs[:response_length] if logprobs else None,
        num_turns=len(record.turns), metrics=metrics,
        extra_fields={"turn_scores": [], "tool_rewards": [], "weightsync_rollout_id": record.rollout_id,
                      "min_global_steps": min(versions, default=None), "max_global_steps": max(versions, default=None)})


def _register() -> None:
    """Register the loop under :data:`AGENT_NAME` unless an entry of that name is there: verl's
    ``register`` replaces it, and hydra imports this module first while building the loop of the
    agent loop config file's entry, whose settings would then be lost for every later sample
    (agent_loop.py: ``register``, ``AgentLoopWorker.__init__`` fills ``_agent_loop_registry``)."""
    from verl.experimental.agent_loop import agent_loop

    if AGENT_NAME not in agent_loop._agent_loop_registry:
        register(AGENT_NAME)(WeightsyncToolAgentLoop)


_register()
