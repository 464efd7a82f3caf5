"""Version readback for vLLM: which version an engine serves, and which version generated an output.

Every worker of the ``"weightsync"`` backend answers :data:`WORKER_VERSION` with its
:class:`~weightsync.ports.engine.ServingVersion` (plain data); a driver combines its workers'
answers into the engine's::

    serving_llm(llm)                           # an LLM (in or out of process): ServingVersion
    llm.collective_rpc(WORKER_VERSION)         # each worker's answer, as dicts
    # vllm serve: GET /weightsync/version (weightsync.integrations.vllm_serve_version)

Which version generated an output: vLLM stamps every generated token with the engine's weight
version label (``CompletionOutput.weight_versions``: spans of tokens, labels ``"7"``, or
``"invalid:7"`` after a failed update), set by weightsync's drivers at every apply. A request
that spans an update has more than one span; :func:`generated_under` never names one version
for it (``version`` None, ``changed`` True), so the trainer drops or reweights it::

    outputs = llm.generate(prompts, params)
    for out in outputs:
        tag = generated_under(out.outputs[0])   # GeneratedUnder(version=7, valid=True, changed=False)

The tokens of a prompt's prefill carry no label of their own: with the prefix cache reset at
every apply (the default) its KV is computed under the version of the first output token's span;
with ``keep-stale`` it may come from an older version, which the tag cannot show.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from weightsync.ports.engine import ServingVersion

if TYPE_CHECKING:
    from vllm import LLM

#: The method the ``"weightsync"`` backend gives each vLLM worker it runs in: its
#: :class:`ServingVersion` as plain data (``to_wire``). Drivers ask it by name:
#: ``llm.collective_rpc(WORKER_VERSION)``; ``vllm serve``: ``GET /weightsync/version``.
WORKER_VERSION = "weightsync_version"

#: vLLM's weight version label of an engine no weightsync driver has labelled (vLLM 0.32's default)
UNLABELLED = "default"


def engine_serving(answers: Iterable[Mapping[str, Any]]) -> ServingVersion:
    """One engine's :class:`ServingVersion` from its workers' :data:`WORKER_VERSION` answers.

    Raises:
        ValueError: an answer is malformed, or there is none.
    """
    return ServingVersion.combine([ServingVersion.from_wire(dict(a)) for a in answers])


def serving_llm(llm: LLM) -> ServingVersion:
    """Which version ``llm`` (the ``"weightsync"`` backend, in or out of process) serves, since when,
    valid or not: its workers' answers combined."""
    return engine_serving(llm.collective_rpc(WORKER_VERSION))


@dataclass(frozen=True, slots=True)
class GeneratedUnder:
    """The version one output was generated under.

    Attributes:
        version: the version every generated token came from; None when they came from several
            (``changed``), from an invalid engine, or from an engine weightsync never labelled.
        valid: False if any token came from an engine left invalid by a failed update.
        changed: the weights changed while the request generated (more than one span).
        labels: vLLM's weight-version label of each span, in order (``"7"``, ``"invalid:8"``).
    """

    version: int | None
    valid: bool
    changed: bool
    labels: tuple[str, ...]

    @classmethod
    def from_labels(cls, labels: Iterable[str]) -> GeneratedUnder:
        labels = tuple(labels)
        valid = not any(label.startswith("invalid:") for label in labels)
        changed = len(set(labels)) > 1
        only = labels[0] if labels and not changed else None
        version = int(only) if only is not None and only.isdigit() else None
        return cls(version, valid, changed, labels)

    def to_wire(self) -> dict[str, Any]:
        return {"version": self.version, "valid": self.valid, "changed": self.changed, "labels": list(self.labels)}


def generated_under(output: Any) -> GeneratedUnder:
    """The version a finished ``CompletionOutput`` (``RequestOutput.outputs[i]``) was generated
    under, from vLLM's own ``weight_versions`` spans (module docstring).

    Raises:
        ValueError: the output is not finished (vLLM attaches the spans to the last output only).
    """
    spans = getattr(output, "weight_versions", None)
    if spans is None:
        if getattr(output, "finish_reason", None) is None:
            raise ValueError("generated_under: the output is not finished; vLLM attaches the weight version "
                             "spans to a request's last output (RequestOutput.finished)")
        return GeneratedUnder(None, True, False, ())
    return GeneratedUnder.from_labels(span.version for span in spans)


def with_versions(outputs: Iterable[Any]) -> list[tuple[Any, GeneratedUnder]]:
    """``llm.generate``'s outputs, each with the version its first completion was generated under
    (every completion of a request runs in the same steps, so under the same versions)."""
    return [(out, generated_under(out.outputs[0])) for out in outputs]
