"""Versions of real trained weights: a small transformers model trained a few RL-like steps.

Delta sync pays off only on weights that move the way training moves them (few bf16
elements per step), which random versions do not. This trains a transformers causal LM from
an HF config dict with fp32 master weights and AdamW, and saves each step's weights cast to
bf16 as ``out/step{k}.safetensors`` (checkpoint names), for sources to load and send::

    changed = train_snapshots(config, steps=8, lr=1e-6, out=Path(tmp))   # bf16 fraction changed per step
    load_file(f"{tmp}/step3.safetensors")
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch


def train_snapshots(config: dict[str, Any], steps: int, lr: float, out: Path) -> list[float]:
    """Train ``steps`` AdamW steps (fp32 master weights); save each step's bf16 weights; changed fractions."""
    from safetensors.torch import save_file
    from transformers import AutoConfig, AutoModelForCausalLM

    torch.manual_seed(0)
    hf = AutoConfig.for_model(**{k: v for k, v in config.items() if k != "architectures"})
    net = AutoModelForCausalLM.from_config(hf)
    net.float().train()
    optim = torch.optim.AdamW(net.parameters(), lr=lr, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.01)
    gen = torch.Generator().manual_seed(1)
    previous: dict[str, torch.Tensor] | None = None
    changed = []
    for step in range(1, steps + 1):
        tokens = torch.randint(0, config["vocab_size"], (4, 128), generator=gen)
        loss = net(input_ids=tokens, labels=tokens).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(net.parameters(), 1.0)
        optim.step()
        optim.zero_grad(set_to_none=True)
        weights = {n: p.detach().to(torch.bfloat16).contiguous() for n, p in net.state_dict().items()}
        if previous is not None:
            diff = sum(int((weights[n].view(torch.int16) != previous[n].view(torch.int16)).sum()) for n in weights)
            changed.append(diff / sum(t.numel() for t in weights.values()))
        save_file(weights, str(out / f"step{step}.safetensors"))
        previous = weights
    return changed
