"""vLLM serving a LoRA adapter that weightsync updates in memory: no adapter file, adapter bytes only.

vLLM loads LoRA adapters from a directory (``LoRARequest.lora_path``). This engine instead
receives the trainer's adapter tensors into staging buffers (PEFT names, full shapes; vLLM
cuts them per TP rank itself) and, on ``apply``, builds the worker's ``LoRAModel`` from
those tensors (``LoRAModel.from_lora_tensors``, what vLLM does after reading the files) and
swaps it in under the same adapter id. The base weights never move::

    llm = LLM(model=base, enable_lora=True, max_lora_rank=8, enforce_eager=True)  # in-process
    engine = VLLMLoraEngine(llm, LoraSpec(r=8, alpha=16))
    with WeightReader(engine, rank=0, config=SyncConfig(num_writers=2, num_readers=1)) as reader:
        reader.update()
        llm.generate(prompts, params, lora_request=engine.lora_request)

Versions: an adapter's identity includes its version. ``engine.lora_request`` names the
current version in its ``lora_path`` (``weightsync://<name>/v<version>``, never read;
:func:`versioned_lora_request`), and vLLM's prefix cache keys KV blocks by adapter name and
path, not contents, so blocks computed with an older adapter are never looked up under the
new one. A request object of an older version, reused under the same name, runs with the
newest adapter (vLLM keeps one copy per id), and its old cache key would find the old
adapter's blocks: so ``apply`` also resets the prefix cache, unless ``keep_stale=True``.

Staging buffers are separate from the live adapter (``apply`` copies them), so an
``InflightReader`` can receive version N+1 while N serves. :class:`WorkerLoraEngine` does the
same from inside a vLLM worker, for the ``"weightsync"`` weight-transfer backend (``vllm
serve``, an ``LLM`` whose engine core runs in another process). Everything
vLLM-version-specific (private worker attributes) is in this module; ``vllm`` is imported
inside functions.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any, ClassVar

import torch

from weightsync.engines.vllm import spec_of
from weightsync.layout import RankLayout
from weightsync.layout.lora import PEFT_PREFIX, LoraSpec
from weightsync.ports.engine import Invalid, Validity
from weightsync.tools.torch_layout import allocate, check_tensors, dtype_name

if TYPE_CHECKING:
    from vllm import LLM
    from vllm.lora.request import LoRARequest


class _AdapterStaging:
    """Staging buffers of one adapter and its version; ``_install`` puts a copy in vLLM."""

    stages_in_phases: ClassVar[bool] = False
    keeps_received_bytes: ClassVar[bool] = True  # apply installs copies of the staged adapter
    in_place_names: tuple[str, ...] | None = None  # see InferenceEngine.in_place_names

    def __init__(self, vllm_config: Any, lora: LoraSpec, lora_id: int, rank: int) -> None:
        lora_config = vllm_config.lora_config
        if lora_config is None:
            raise ValueError("the vLLM engine has LoRA disabled: start it with enable_lora=True (vllm serve: "
                             f"--enable-lora) and max_lora_rank >= {lora.r}")
        if lora.r > lora_config.max_lora_rank:
            raise ValueError(f"adapter rank r={lora.r} exceeds the engine's max_lora_rank="
                             f"{lora_config.max_lora_rank}; start vLLM with max_lora_rank >= {lora.r}")
        if isinstance(lora_id, bool) or not isinstance(lora_id, int) or lora_id <= 0:
            raise ValueError(f"lora_id must be a positive integer (vLLM reserves 0 for 'no adapter'), got {lora_id!r}")
        engine_dtype = lora_config.lora_dtype
        if not isinstance(engine_dtype, torch.dtype):  # "auto": the model's dtype
            engine_dtype = vllm_config.model_config.dtype
        self.lora = lora
        self.lora_id = lora_id
        self._dtype = engine_dtype
        self._layout = lora.rank_layout(spec_of(vllm_config), rank, dtype=dtype_name(engine_dtype))
        self._buffers = allocate(self._layout)
        self.validity = Validity()

    # -- InferenceEngine ----------------------------------------------------------------------
    def layout(self) -> RankLayout:
        return self._layout

    def descriptor(self) -> tuple[str, Mapping[str, object]] | None:
        return None

    def receive_buffers(self) -> Mapping[str, torch.Tensor]:
        return self._buffers

    @property
    def weight_version(self) -> int | None:
        return self.validity.version

    @property
    def invalid(self) -> Invalid | None:
        return self.validity.invalid

    def receiving(self, version: int) -> None:
        """Only staging receives: the live adapter is untouched until :meth:`apply`."""

    def apply(self, version: int) -> None:
        """Swap the staged adapter in as ``version`` (the old one serves until the swap)."""
        tensors = {name: t.clone() for name, t in self._buffers.items()}  # vLLM scales B in place
        self.validity.touch(version)  # the old adapter may be gone once the install started
        try:
            self._install(tensors)
        except BaseException as exc:
            self.validity.failed(version, exc)  # serve nothing stale under a version
            raise
        self.validity.applied(version)

    def abort(self, version: int, error: BaseException) -> None:
        """A failed transfer wrote staging only: the live adapter (and its version) is unchanged;
        a failed install already made the engine invalid."""
        self.validity.failed(version, error)

    def _install(self, tensors: dict[str, torch.Tensor]) -> None:
        raise NotImplementedError


class VLLMLoraEngine(_AdapterStaging):
    """An in-process ``vllm.LLM`` with LoRA enabled, whose adapter ``lora_id`` weightsync updates.

    Args:
        llm: started with ``enable_lora=True`` and ``max_lora_rank >= lora.r``, in this process
            (``VLLM_ENABLE_V1_MULTIPROCESSING=0``).
        lora: the adapter's shape; its dtype defaults to vLLM's LoRA dtype.
        name, lora_id: the adapter's name and integer id in vLLM (``lora_id > 0``).
        rank: the reader rank.
        keep_stale: keep the prefix cache at each apply (KV computed with an older adapter may then
            be reused by requests of an older version's request object).
    """

    def __init__(self, llm: LLM, lora: LoraSpec, *, name: str = "policy", lora_id: int = 1, rank: int = 0,
                 keep_stale: bool = False) -> None:
        engine = llm.llm_engine
        if type(engine.engine_core).__name__ != "InprocClient":
            raise ValueError("VLLMLoraEngine needs an in-process vLLM engine: set "
                             "VLLM_ENABLE_V1_MULTIPROCESSING=0 before creating the LLM (an engine in other "
                             "processes takes adapters through the \"weightsync\" weight-transfer backend)")
        super().__init__(engine.vllm_config, lora, lora_id, rank)
        self.llm = llm
        self.name = name
        self.keep_stale = keep_stale

    def _install(self, tensors: dict[str, torch.Tensor]) -> None:
        self.llm.collective_rpc(_install_in_worker, args=(self.lora_id, tensors, self.lora.peft_config()))
        if not self.keep_stale and not self.llm.reset_prefix_cache():
            raise RuntimeError("vLLM could not reset its prefix cache (requests are running): KV blocks computed "
                               "with the old adapter would be reused; apply between requests, or keep_stale=True")

    # -- direct use ---------------------------------------------------------------------------
    def update(self, tensors: Mapping[str, torch.Tensor], *, version: int) -> None:
        """Install whole adapter tensors you already hold (PEFT saved names) as ``version``."""
        check_tensors(self._layout, {n: t.to(self._dtype) for n, t in tensors.items()}, "LoRA update")
        for name, buf in self._buffers.items():
            buf.copy_(tensors[name])
        self.apply(version)

    @property
    def lora_request(self) -> LoRARequest | None:
        """The request that generates with the current version (None before the first)."""
        version = self.weight_version
        return None if version is None else versioned_lora_request(self.name, self.lora_id, version)

    def adapter_tensors(self) -> dict[str, torch.Tensor]:
        """The adapter as the engine computes with it, by PEFT name: A as sent, B times ``alpha / r``.

        vLLM folds the scaling into B when it adds an adapter (``lora_b *= scaling``), so the
        bitwise check of B is against ``B * lora.scaling`` computed in the adapter dtype.
        """
        return self.llm.collective_rpc(_read_in_worker, args=(self.lora_id,))[0]


class WorkerLoraEngine(_AdapterStaging):
    """The adapter ``lora_id`` of the model inside a vLLM worker (the ``"weightsync"`` weight-transfer
    backend with ``lora`` in its init info): what :class:`VLLMLoraEngine` does, from inside the worker.

    Requests carrying ``lora_id`` (``vllm serve``: the name of the ``--lora-modules`` entry with
    that id) generate with the newest version once it is applied.
    """

    def __init__(self, model: torch.nn.Module, vllm_config: Any, lora: LoraSpec, *, lora_id: int, rank: int) -> None:
        super().__init__(vllm_config, lora, lora_id, rank)
        self.manager = lora_manager(model)
        self.vllm_config = vllm_config
        #: the adapter as last installed (as received, unscaled): put back after vLLM drops it
        self._installed: dict[str, torch.Tensor] | None = None
        keep_across_resets(self.manager, self._reinstall)

    def _install(self, tensors: dict[str, torch.Tensor]) -> None:
        kept = {name: t.clone() for name, t in tensors.items()}  # install_adapter scales B in place
        install_adapter(self.manager, self.vllm_config, self.lora_id, tensors, self.lora.peft_config())
        self._installed = kept

    def _reinstall(self) -> None:
        if self._installed is not None:
            tensors = {name: t.clone() for name, t in self._installed.items()}
            install_adapter(self.manager, self.vllm_config, self.lora_id, tensors, self.lora.peft_config())

    def adapter_tensors(self) -> dict[str, torch.Tensor]:
        return read_adapter(self.manager, self.lora_id)


def versioned_lora_request(name: str, lora_id: int, version: int) -> LoRARequest:
    """vLLM's request for version ``version`` of adapter ``name``: its path names the version, so
    vLLM's prefix cache (keyed by name and path) never serves one version's KV to another."""
    from vllm.lora.request import LoRARequest

    return LoRARequest(name, lora_id, f"weightsync://{name}/v{version}")


# -- worker side: runs where the model lives ----------------------------------------------------

def lora_manager(model: torch.nn.Module) -> Any:
    """vLLM's adapter manager of a LoRA-enabled model (the worker's ``lora_manager._adapter_manager``;
    ``LoRAModelManager`` records itself on the model it wraps)."""
    manager = getattr(model, "lora_manager", None)
    if manager is None:
        raise ValueError("the vLLM model has no LoRA manager: start the engine with LoRA enabled (vllm serve: "
                         "--enable-lora --max-lora-rank R --lora-modules NAME=DIR)")
    return manager


def keep_across_resets(adapters: Any, reinstall: Callable[[], None]) -> None:
    """Call ``reinstall`` each time vLLM empties the worker's adapter manager.

    vLLM's worker drops every adapter when a weight update finishes (``finish_weight_update``
    calls ``model_runner.reset_lora_state()``: new base weights invalidate LoRA state, it
    assumes), and would then reload adapter ``lora_id`` from its ``--lora-modules`` path, the
    first version, on the next request. An adapter-only version changes no base weight, so
    the adapter weightsync installed is put back at once. The manager's
    ``remove_all_adapters`` is wrapped on this instance only (vLLM 0.32), once; a later engine
    on the same worker (a new trainer) replaces ``reinstall``.
    """
    adapters._weightsync_reinstall = reinstall
    if getattr(adapters.remove_all_adapters, "__weightsync_reinstalls__", False):
        return
    original = adapters.remove_all_adapters

    def remove_all_adapters() -> None:
        original()
        adapters._weightsync_reinstall()

    remove_all_adapters.__weightsync_reinstalls__ = True  # type: ignore[attr-defined]
    adapters.remove_all_adapters = remove_all_adapters


def _install_in_worker(worker: Any, lora_id: int, tensors: dict[str, torch.Tensor],
                       peft_config: dict[str, Any]) -> None:
    install_adapter(worker.model_runner.lora_manager._adapter_manager, worker.vllm_config, lora_id, tensors,
                    peft_config)


def _read_in_worker(worker: Any, lora_id: int) -> dict[str, torch.Tensor]:
    return read_adapter(worker.model_runner.lora_manager._adapter_manager, lora_id)


def install_adapter(adapters: Any, vllm_config: Any, lora_id: int, tensors: dict[str, torch.Tensor],
                    peft_config: dict[str, Any]) -> None:
    """Build the ``LoRAModel`` from tensors (as vLLM does after reading files) and replace ``lora_id``."""
    from vllm.lora.lora_model import LoRAModel
    from vllm.lora.peft_helper import PEFTHelper

    lora_config = adapters.lora_config
    text_config = vllm_config.model_config.hf_config.get_text_config()
    helper = PEFTHelper.from_dict({**peft_config, "vllm_max_position_embeddings":
                                   getattr(text_config, "max_position_embeddings", None)})
    helper.validate_legal(lora_config)
    model = adapters.model
    mapper = getattr(model, "hf_to_vllm_mapper", None)
    lora = LoRAModel.from_lora_tensors(
        lora_model_id=lora_id, tensors=tensors, peft_helper=helper, device="cpu",
        dtype=lora_config.lora_dtype, model_vocab_size=adapters.vocab_size,
        weights_mapper=mapper.get_rename_mapper() if mapper is not None else None,
        skip_prefixes=getattr(model, "lora_skip_prefixes", None))
    adapters.remove_adapter(lora_id)  # also deactivates it; the next batch activates the new one
    adapters.add_adapter(lora)
    # Never evicted from the CPU-side cache: vLLM would try to reload it from its path, which
    # holds the first version at best (vllm serve's --lora-modules) or nothing at all.
    adapters._registered_adapters.pin(lora_id)


def read_adapter(adapters: Any, lora_id: int) -> dict[str, torch.Tensor]:
    """The A and B matrices of ``lora_id`` under PEFT names (packed q/k/v, gate/up unpacked)."""
    lora = adapters.get_adapter(lora_id)
    if lora is None:
        raise KeyError(f"vLLM holds no adapter with id {lora_id}")
    out: dict[str, torch.Tensor] = {}
    for module, weights in lora.loras.items():
        parts = adapters.packed_modules.get(module)
        if isinstance(weights.lora_a, list):
            pairs = zip(parts or [module], weights.lora_a, weights.lora_b, strict=True)
        else:
            pairs = zip([module], [weights.lora_a], [weights.lora_b], strict=True)
        for path, a, b in pairs:
            if a is None:
                continue
            out[f"{PEFT_PREFIX}{path}.lora_A.weight"] = a.clone()
            out[f"{PEFT_PREFIX}{path}.lora_B.weight"] = b.clone()
    return out
