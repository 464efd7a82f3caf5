"""A tiny GRPO-style RL loop on CPU, run synchronously and asynchronously (staleness K=1).

Three processes: two FSDP2 trainer ranks (gloo) and this one, which generates with a
Hugging Face model (``configs/tiny-qwen3``, random weights). Each step:

1. the generator samples ``GROUP`` completions for each of ``PROMPTS`` prompts and scores
   them with a programmatic reward (the share of completion tokens in the lower half of
   the vocabulary), then *puts* tokens and rewards into a :class:`~weightsync.roles.tensorstore.TensorStore`
   (one-sided: it never waits for the trainers);
2. each trainer *gets* its half of the batch (the store reshards: whole groups per rank),
   takes one GRPO step (group-normalised advantages, policy gradient) and writes the new
   weights (``WeightWriter`` over ``DTensorSource``, shared memory);
3. the generator's :class:`~weightsync.roles.inflight.InflightReader` receives the weights in the
   background and applies them between two generations.

Synchronous (K=0): batch ``i`` is generated with the weights trained on batches ``< i``, and
``write`` returns when the generator applied them, so generation and training alternate.
Asynchronous (K=1): batch ``i`` may use weights one version older, so the generator samples
batch ``i+1`` while the trainers learn from batch ``i``. The script prints samples/s of both
and their ratio. Run: ``python examples/async_grpo.py [--steps 30]``.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import socket
import subprocess
import sys
import time
from importlib import resources

import torch

from weightsync import StoreConfig, SyncConfig, TensorSlice, TensorStore, WeightWriter

PROMPTS, GROUP, PROMPT_LEN, NEW_TOKENS = 4, 4, 8, 12
TRAINERS = 2


def load_config(name: str) -> dict:
    """A bundled Hugging Face config (``src/weightsync/configs/<name>.json``)."""
    return dict(json.loads((resources.files("weightsync.configs") / f"{name}.json").read_text()))


def reward(completions: torch.Tensor, vocab: int) -> torch.Tensor:
    """Share of completion tokens in the lower half of the vocabulary (one number per sample)."""
    return (completions < vocab // 2).float().mean(dim=1)


def make_model(config: dict) -> torch.nn.Module:
    from transformers import Qwen3Config, Qwen3ForCausalLM

    torch.manual_seed(0)  # the same initial weights in every process
    fields = {k: v for k, v in config.items() if k not in ("architectures", "model_type")}
    return Qwen3ForCausalLM(Qwen3Config(**fields))


def sync_config(mode: str, staleness: int) -> SyncConfig:
    return SyncConfig(num_writers=TRAINERS, num_readers=1, job=f"grpo-{mode}", transport="shm",
                      staleness=staleness, timeout=120)


def store_config(mode: str, staleness: int) -> StoreConfig:
    # batches not yet read by the trainers: at most staleness + 2 (see module docstring)
    return StoreConfig(job=f"rollouts-{mode}", slots=staleness + 3, timeout=120)


# -- trainer ranks ---------------------------------------------------------------------------------

def trainer(rank: int, modes: list[tuple[str, int]], steps: int) -> None:
    import torch.distributed as dist
    from torch.distributed.fsdp import fully_shard

    from weightsync.sources import DTensorSource

    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=TRAINERS, timeout=datetime.timedelta(seconds=120))
    config = load_config("tiny-qwen3")
    batch = PROMPTS * GROUP
    for mode, staleness in modes:
        model = make_model(config)
        for layer in model.model.layers:
            fully_shard(layer)
        fully_shard(model)
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
        source = DTensorSource(model, config, rank=rank)
        with WeightWriter(source, rank=rank, config=sync_config(mode, staleness)) as writer, \
                TensorStore(store_config(mode, staleness)) as rollouts:
            writer.write(0)  # the initial weights
            mine = TensorSlice.part((batch, PROMPT_LEN + NEW_TOKENS), index=rank, count=TRAINERS)
            for step in range(steps):
                got = rollouts.multi_get({"tokens": mine,
                                          "rewards": TensorSlice.part((batch,), index=rank, count=TRAINERS)},
                                         version=step)
                tokens, rewards = got["tokens"], got["rewards"].view(-1, GROUP)
                advantages = ((rewards - rewards.mean(1, keepdim=True)) / (rewards.std(1, keepdim=True) + 1e-4))
                logits = model(input_ids=tokens).logits[:, PROMPT_LEN - 1:-1]
                logp = torch.log_softmax(logits.float(), -1).gather(-1, tokens[:, PROMPT_LEN:, None]).squeeze(-1)
                loss = -(advantages.reshape(-1, 1) * logp).mean()
                loss.backward()
                optimizer.step()
                optimizer.zero_grad()
                writer.write(step + 1)
            writer.meta.wait_readers(min_version=steps, readers=1, timeout=120)  # then unlink the memory
    dist.destroy_process_group()


# -- generator (this process) ----------------------------------------------------------------------

def generate(model: torch.nn.Module, step: int, vocab: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(step)
    prompts = torch.randint(0, vocab, (PROMPTS, PROMPT_LEN), generator=g).repeat_interleave(GROUP, dim=0)
    torch.manual_seed(10_000 + step)
    with torch.no_grad():
        return model.generate(prompts, attention_mask=torch.ones_like(prompts), do_sample=True,
                              max_new_tokens=NEW_TOKENS, min_new_tokens=NEW_TOKENS, top_k=0, top_p=1.0,
                              pad_token_id=0, eos_token_id=None)


def run_mode(mode: str, staleness: int, steps: int, config: dict) -> dict:
    from weightsync import InflightReader
    from weightsync.engines import ModuleEngine

    model = make_model(config).eval()
    vocab = config["vocab_size"]
    engine = ModuleEngine(model, config)
    with InflightReader(engine, rank=0, config=sync_config(mode, staleness)) as inflight, \
            TensorStore(store_config(mode, staleness), rank=0) as rollouts:
        inflight.wait_version(0)  # trainers are up: the clock starts now
        start = time.perf_counter()
        rewards, lags, pauses, waits = [], [], [], 0.0
        for step in range(steps):
            t0 = time.perf_counter()
            inflight.wait_version(step - staleness)  # the staleness bound on the generator's side
            waits += time.perf_counter() - t0
            if inflight.step_boundary() is not None:
                pauses.append(inflight.last_pause)
            lags.append(step - (inflight.version or 0))
            tokens = generate(model, step, vocab)
            r = reward(tokens[:, PROMPT_LEN:], vocab)
            rollouts.multi_put({"tokens": tokens, "rewards": r})
            rollouts.complete(step)  # one-sided: returns at once
            rewards.append(r.mean().item())
        inflight.wait_version(steps)  # the last batch was trained on and its weights are live
        seconds = time.perf_counter() - start
        pauses += [r.phases["apply"] for r in inflight.results[-1:]]
    return {"mode": mode, "staleness": staleness, "steps": steps, "samples": steps * PROMPTS * GROUP,
            "seconds": seconds, "samples_per_s": steps * PROMPTS * GROUP / seconds,
            "max_version_lag": max(lags), "generator_wait_s": waits,
            "max_apply_pause_ms": 1e3 * max(pauses, default=0.0),
            "staging_bytes": inflight.extra_bytes, "reward_first": rewards[0],
            "reward_last": sum(rewards[-3:]) / len(rewards[-3:])}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--trainer-rank", type=int, default=None, help=argparse.SUPPRESS)
    parser.add_argument("--modes", default="sync:0,async:1", help="name:staleness pairs")
    args = parser.parse_args()
    modes = [(m.split(":")[0], int(m.split(":")[1])) for m in args.modes.split(",")]
    if args.trainer_rank is not None:
        trainer(args.trainer_rank, modes, args.steps)
        return
    from weightsync.meta import EmbeddedMetaServer

    torch.set_num_threads(1)
    config = load_config("tiny-qwen3")
    with EmbeddedMetaServer() as server:
        env = {**os.environ, "WEIGHTSYNC_META_ADDR": server.address, "WEIGHTSYNC_META_TOKEN": server.token,
               "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port()), "OMP_NUM_THREADS": "1"}
        os.environ.update(WEIGHTSYNC_META_ADDR=server.address, WEIGHTSYNC_META_TOKEN=server.token)
        procs = [subprocess.Popen([sys.executable, __file__, "--trainer-rank", str(r), "--steps", str(args.steps),
                                   "--modes", args.modes], env=env) for r in range(TRAINERS)]
        try:
            results = [run_mode(mode, k, args.steps, config) for mode, k in modes]
            for p in procs:
                if p.wait(timeout=120) != 0:
                    sys.exit(f"trainer exited with {p.returncode}")
        finally:
            for p in procs:
                if p.poll() is None:
                    p.kill()
                    p.wait(10)
    for r in results:
        print(f"{r['mode']:>5} (K={r['staleness']}): {r['samples']} samples in {r['seconds']:.2f}s = "
              f"{r['samples_per_s']:.1f} samples/s; max version lag {r['max_version_lag']}, "
              f"generator waited {r['generator_wait_s']:.2f}s, apply pause <= {r['max_apply_pause_ms']:.2f} ms, "
              f"staging {r['staging_bytes'] / 2**20:.2f} MiB; reward {r['reward_first']:.3f} -> "
              f"{r['reward_last']:.3f}")
    if len(results) == 2:
        print(f"async/sync samples/s ratio: {results[1]['samples_per_s'] / results[0]['samples_per_s']:.2f}")
    print("RESULTS " + json.dumps(results))


if __name__ == "__main__":
    main()
