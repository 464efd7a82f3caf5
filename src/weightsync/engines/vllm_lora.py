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

Versions: ``engine.lora_request`` names the current version in its ``lora_path``
(``weightsync://<name>/v<version>``, never read). vLLM's prefix cache keys KV blocks by
adapter name and path, not contents, so a new path per version keeps blocks computed with
an older adapter from being reused; requests holding an older request object keep their
cache keys but run with the newest adapter (vLLM keeps one copy per id).

Staging buffers are separate from the live adapter (``apply`` copies them), so an
``InflightReader`` can receive version N+1 while N serves. Everything vLLM-version-specific
(private worker attributes) is in this module; ``vllm`` is imported inside functions.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING, Any, ClassVar

import torch

from weightsync.engines.vllm import spec_of
from weightsync.layout import RankLayout
from weightsync.layout.lora import PEFT_PREFIX, LoraSpec
from weightsync.torch_layout import allocate, check_tensors, dtype_name

if TYPE_CHECKING:
    from vllm import LLM
    from vllm.lora.request import LoRARequest


class VLLMLoraEngine:
    """An in-process ``vllm.LLM`` with LoRA enabled, whose adapter ``lora_id`` weightsync updates.

    Args:
        llm: started with ``enable_lora=True`` and ``max_lora_rank >= lora.r``, in this process
            (``VLLM_ENABLE_V1_MULTIPROCESSING=0``).
        lora: the adapter's shape; its dtype defaults to vLLM's LoRA dtype.
        name, lora_id: the adapter's name and integer id in vLLM (``lora_id > 0``).
        rank: the reader rank.
    """

    stages_in_phases: ClassVar[bool] = False
    keeps_received_bytes: ClassVar[bool] = True  # apply installs copies of the staged adapter

    def __init__(self, llm: LLM, lora: LoraSpec, *, name: str = "policy", lora_id: int = 1, rank: int = 0) -> None:
        engine = llm.llm_engine
        if type(engine.engine_core).__name__ != "InprocClient":
            raise ValueError("VLLMLoraEngine needs an in-process vLLM engine: set "
                             "VLLM_ENABLE_V1_MULTIPROCESSING=0 before creating the LLM")
        vllm_config: Any = engine.vllm_config
        lora_config = vllm_config.lora_config
        if lora_config is None:
            raise ValueError("the vLLM engine has LoRA disabled: start it with LLM(..., enable_lora=True, "
                             f"max_lora_rank={lora.r})")
        if lora.r > lora_config.max_lora_rank:
            raise ValueError(f"adapter rank r={lora.r} exceeds the engine's max_lora_rank="
                             f"{lora_config.max_lora_rank}; start vLLM with max_lora_rank >= {lora.r}")
        if lora_id <= 0:
            raise ValueError(f"lora_id must be positive (vLLM reserves 0 for 'no adapter'), got {lora_id}")
        spec = spec_of(vllm_config)
        engine_dtype = lora_config.lora_dtype
        if not isinstance(engine_dtype, torch.dtype):  # "auto": the model's dtype
            engine_dtype = vllm_config.model_config.dtype
        self.lora = lora
        self.llm = llm
        self.name = name
        self.lora_id = lora_id
        self._dtype = engine_dtype
        self._layout = lora.rank_layout(spec, rank, dtype=dtype_name(engine_dtype))
        self._buffers = allocate(self._layout)
        self._version: int | None = None

    # -- InferenceEngine ----------------------------------------------------------------------
    def layout(self) -> RankLayout:
        return self._layout

    def descriptor(self) -> tuple[str, Mapping[str, object]] | None:
        return None

    def receive_buffers(self) -> Mapping[str, torch.Tensor]:
        return self._buffers

    @property
    def weight_version(self) -> int | None:
        return self._version

    def apply(self, version: int) -> None:
        """Swap the staged adapter in as ``version`` (the old one serves until the swap)."""
        tensors = {name: t.clone() for name, t in self._buffers.items()}  # vLLM scales B in place
        try:
            self.llm.collective_rpc(_install_adapter, args=(self.lora_id, tensors, self.lora.peft_config()))
        except BaseException:
            self._version = None  # the old adapter may be gone: serve nothing stale under a version
            raise
        self._version = version

    def abort(self, version: int, error: BaseException) -> None:
        """Only staging was written: the live adapter (and its version) is unchanged."""

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
        if self._version is None:
            return None
        from vllm.lora.request import LoRARequest

        return LoRARequest(self.name, self.lora_id, f"weightsync://{self.name}/v{self._version}")

    def adapter_tensors(self) -> dict[str, torch.Tensor]:
        """The adapter as the engine computes with it, by PEFT name: A as sent, B times ``alpha / r``.

        vLLM folds the scaling into B when it adds an adapter (``lora_b *= scaling``), so the
        bitwise check of B is against ``B * lora.scaling`` computed in the adapter dtype.
        """
        return self.llm.collective_rpc(_read_adapter, args=(self.lora_id,))[0]


# -- worker side: runs where the model lives ----------------------------------------------------

def _install_adapter(worker: Any, lora_id: int, tensors: dict[str, torch.Tensor],
                     peft_config: dict[str, Any]) -> None:
    """Build the ``LoRAModel`` from tensors (as vLLM does after reading files) and replace ``lora_id``."""
    from vllm.lora.lora_model import LoRAModel
    from vllm.lora.peft_helper import PEFTHelper

    manager = worker.model_runner.lora_manager  # LRUCacheWorkerLoRAManager
    adapters = manager._adapter_manager
    helper = PEFTHelper.from_dict({**peft_config, "vllm_max_position_embeddings": manager.max_position_embeddings})
    helper.validate_legal(manager.lora_config)
    model = adapters.model
    mapper = getattr(model, "hf_to_vllm_mapper", None)
    lora = LoRAModel.from_lora_tensors(
        lora_model_id=lora_id, tensors=tensors, peft_helper=helper, device="cpu",
        dtype=manager.lora_config.lora_dtype, model_vocab_size=manager.vocab_size,
        weights_mapper=mapper.get_rename_mapper() if mapper is not None else None,
        skip_prefixes=getattr(model, "lora_skip_prefixes", None))
    adapters.remove_adapter(lora_id)  # also deactivates it; the next batch activates the new one
    adapters.add_adapter(lora)
    # Never evicted from the CPU-side cache: vLLM would try to reload it from its (fake) path.
    adapters._registered_adapters.pin(lora_id)


def _read_adapter(worker: Any, lora_id: int) -> dict[str, torch.Tensor]:
    """The worker's A and B matrices of ``lora_id`` under PEFT names (packed q/k/v, gate/up unpacked)."""
    adapters = worker.model_runner.lora_manager._adapter_manager
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
