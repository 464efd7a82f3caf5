"""The smallest complete weightsync job: one writer and one reader in one process.

A training "model" and an inference "model" (two plain torch modules with Hugging Face
parameter names) run in two threads; every step the trainer perturbs its weights, writes
a version, and the reader applies it in place. Run: ``python examples/two_threads.py``.
"""

from __future__ import annotations

import threading

import torch

from weightsync import SyncConfig, WeightReader, WeightWriter
from weightsync.engines import ModuleEngine
from weightsync.layout import ModelSpec
from weightsync.meta import EmbeddedMetaServer, MetaClient
from weightsync.sources import ModuleSource

CONFIG = {"architectures": ["Qwen3ForCausalLM"], "hidden_size": 64, "intermediate_size": 128,
          "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16,
          "vocab_size": 256, "torch_dtype": "float32"}
STEPS = 3


def make_module() -> torch.nn.Module:
    """A stand-in for an HF model: one parameter per canonical tensor, HF names."""
    module = torch.nn.Module()
    for name, tensor in ModelSpec.from_hf_config(CONFIG).canonical_tensors().items():
        module.register_parameter(name.replace(".", "__"), torch.nn.Parameter(torch.zeros(tensor.shape)))
    return _Renamed(module)


class _Renamed(torch.nn.Module):
    """Expose ``a__b__c`` parameters as ``a.b.c`` (HF names) through named_parameters."""

    def __init__(self, inner: torch.nn.Module) -> None:
        super().__init__()
        self.inner = inner

    def named_parameters(self, *args, **kwargs):  # type: ignore[no-untyped-def, override]
        for name, p in self.inner.named_parameters():
            yield name.replace("__", "."), p


def main() -> None:
    config = SyncConfig(num_writers=1, num_readers=1, transport="shm", timeout=60)
    trainer, server_model = make_module(), make_module()
    with EmbeddedMetaServer() as server:
        def client() -> MetaClient:
            return MetaClient(server.address, token=server.token)

        reader = WeightReader(ModuleEngine(server_model, CONFIG), rank=0, config=config, meta=client())
        writer = WeightWriter(ModuleSource(trainer, CONFIG), rank=0, config=config, meta=client())

        def serve() -> None:
            for _ in range(STEPS):
                result = reader.update()
                print(f"reader applied version {result.version}: {result.nbytes} bytes, "
                      f"{result.gbps:.2f} GB/s")

        thread = threading.Thread(target=serve)
        thread.start()
        for step in range(STEPS):
            with torch.no_grad():
                for p in trainer.parameters():
                    p.add_(torch.randn_like(p))
            writer.write(step)
        thread.join(60)
        same = all(torch.equal(a, b) for a, b in zip(trainer.parameters(), server_model.parameters(), strict=True))
        print("weights identical:", same)
        writer.close()
        reader.close()


if __name__ == "__main__":
    main()
