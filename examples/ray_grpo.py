"""The async GRPO loop on Ray actors: data-parallel trainers, Hugging Face rollout workers.

Two trainer actors (data parallel: gloo all-reduce of gradients, so both hold the same
weights and each is a weightsync writer of the whole model) and two rollout actors (each a
Hugging Face ``Qwen3ForCausalLM`` from ``configs/tiny-qwen3``, random weights, and a
weightsync reader). The meta server is a named Ray actor; one call per group makes the
trainers writers and the rollout workers readers::

    conn = meta_server()
    attach_writers(trainers, config, conn)
    attach_readers(rollouts, config, conn)

Each step, every rollout worker applies the newest weights (at most ``--staleness`` versions
old), samples ``GROUP`` completions for its prompts and scores them (the share of tokens in
the lower half of the vocabulary); the trainers take one GRPO step on the batch and write
version ``step + 1``. With staleness 1 the rollout workers generate batch ``i + 1`` while the
trainers learn from batch ``i``. ``transport="auto"`` routes per pair: shared memory between
actors on one Ray node, torch (gloo) between nodes.

Run on one machine (starts a local Ray): ``python examples/ray_grpo.py --steps 5``; on a
cluster, ``--address auto``. This loop has rollout workers receive when they ask for weights
(``update`` before generating): on one node that is shared memory, which never waits for the
reader; across nodes the two-sided torch transport makes a writer's ``write`` wait until
every reader receives, so give such readers ``staleness=0`` or receive in the background
(:class:`weightsync.roles.inflight.InflightReader`).
"""

from __future__ import annotations

import argparse
import datetime
import json
import socket
import time
from importlib import resources

import ray
import torch

from weightsync import SyncConfig
from weightsync.integrations.ray import SyncActor, attach_readers, attach_writers, meta_server, stop_meta_server

PROMPTS_PER_WORKER, GROUP, PROMPT_LEN, NEW_TOKENS = 2, 4, 8, 12


def load_config(name: str) -> dict:
    return dict(json.loads((resources.files("weightsync.configs") / f"{name}.json").read_text()))


def make_model(config: dict) -> torch.nn.Module:
    from transformers import Qwen3Config, Qwen3ForCausalLM

    torch.manual_seed(0)  # the same initial weights in every actor
    fields = {k: v for k, v in config.items() if k not in ("architectures", "model_type")}
    return Qwen3ForCausalLM(Qwen3Config(**fields))


def reward(completions: torch.Tensor, vocab: int) -> torch.Tensor:
    return (completions < vocab // 2).float().mean(dim=1)


class Trainer(SyncActor):
    """One data-parallel trainer rank: a full model, gradients all-reduced over gloo."""

    def __init__(self, rank: int, world: int) -> None:
        torch.set_num_threads(1)
        self.rank, self.world = rank, world
        self.config = load_config("tiny-qwen3")
        self.model = make_model(self.config)
        self.optimizer = torch.optim.AdamW(self.model.parameters(), lr=1e-2)

    def address(self) -> tuple[str, int]:
        with socket.socket() as s:
            s.bind(("", 0))
            return ray.util.get_node_ip_address(), int(s.getsockname()[1])

    def join_group(self, host: str, port: int) -> None:
        import torch.distributed as dist

        dist.init_process_group("gloo", init_method=f"tcp://{host}:{port}", rank=self.rank, world_size=self.world,
                                timeout=datetime.timedelta(seconds=120))

    def weightsync_source(self):  # type: ignore[no-untyped-def]
        from weightsync.sources import ModuleSource

        return ModuleSource(self.model, self.config)

    def train(self, step: int, tokens: torch.Tensor, rewards: torch.Tensor) -> dict:
        import torch.distributed as dist

        rewards = rewards.view(-1, GROUP)
        advantages = (rewards - rewards.mean(1, keepdim=True)) / (rewards.std(1, keepdim=True) + 1e-4)
        logits = self.model(input_ids=tokens).logits[:, PROMPT_LEN - 1:-1]
        logp = torch.log_softmax(logits.float(), -1).gather(-1, tokens[:, PROMPT_LEN:, None]).squeeze(-1)
        loss = -(advantages.reshape(-1, 1) * logp).mean()
        loss.backward()
        for p in self.model.parameters():  # data parallel: every rank applies the mean gradient
            dist.all_reduce(p.grad)
            p.grad /= self.world
        self.optimizer.step()
        self.optimizer.zero_grad()
        return {"loss": loss.item(), **self.weightsync_write(step + 1)}

    def done(self) -> None:
        import torch.distributed as dist

        self.weightsync_leave()
        dist.destroy_process_group()


class Rollout(SyncActor):
    """One Hugging Face rollout worker; its model's parameters are updated in place."""

    def __init__(self, rank: int) -> None:
        torch.set_num_threads(1)
        self.rank = rank
        self.config = load_config("tiny-qwen3")
        self.model = make_model(self.config).eval()

    def weightsync_engine(self):  # type: ignore[no-untyped-def]
        from weightsync.engines import ModuleEngine

        return ModuleEngine(self.model, self.config)

    def generate(self, step: int, min_version: int) -> dict:
        applied = self.weightsync_update(max(min_version, 0))
        vocab = self.config["vocab_size"]
        g = torch.Generator().manual_seed(1000 * step + self.rank)
        prompts = torch.randint(0, vocab, (PROMPTS_PER_WORKER, PROMPT_LEN), generator=g)
        torch.manual_seed(10_000 + 1000 * step + self.rank)
        with torch.no_grad():
            tokens = self.model.generate(prompts.repeat_interleave(GROUP, dim=0),
                                         attention_mask=torch.ones(len(prompts) * GROUP, PROMPT_LEN,
                                                                   dtype=torch.long),
                                         do_sample=True, max_new_tokens=NEW_TOKENS, min_new_tokens=NEW_TOKENS,
                                         top_k=0, top_p=1.0, pad_token_id=0, eos_token_id=None)
        return {"tokens": tokens, "rewards": reward(tokens[:, PROMPT_LEN:], vocab), "version": applied["version"]}


def run(steps: int, staleness: int, trainers_n: int, rollouts_n: int) -> dict:
    conn = meta_server()
    config = SyncConfig(num_writers=trainers_n, num_readers=rollouts_n, job=f"ray-grpo-{time.time_ns()}",
                        staleness=staleness, timeout=120)
    trainers = [ray.remote(Trainer).options(num_cpus=0).remote(r, trainers_n) for r in range(trainers_n)]
    rollouts = [ray.remote(Rollout).options(num_cpus=0).remote(r) for r in range(rollouts_n)]
    host, port = ray.get(trainers[0].address.remote())
    ray.get([t.join_group.remote(host, port) for t in trainers])
    writers = attach_writers(trainers, config, conn)
    attach_readers(rollouts, config, conn)
    print(f"trainers on nodes {[w['node'][:12] for w in writers]}")
    initial = [t.weightsync_write.remote(0) for t in trainers]  # the initial weights
    start = time.perf_counter()
    lags, rewards = [], []
    pending = [r.generate.remote(0, 0) for r in rollouts]
    ray.get(initial)
    for step in range(steps):
        batches = ray.get(pending)
        if step + 1 < steps:  # asynchronous: the next batch is generated while this one trains
            pending = [r.generate.remote(step + 1, step + 1 - staleness) for r in rollouts]
        lags += [step - b["version"] for b in batches]
        tokens = torch.cat([b["tokens"] for b in batches])
        scores = torch.cat([b["rewards"] for b in batches])
        rewards.append(scores.mean().item())
        share = len(tokens) // trainers_n  # whole groups per trainer (GROUP divides share)
        results = ray.get([t.train.remote(step, tokens[i * share:(i + 1) * share], scores[i * share:(i + 1) * share])
                           for i, t in enumerate(trainers)])
        print(f"step {step}: reward {rewards[-1]:.3f}, loss {results[0]['loss']:.4f}, "
              f"version {results[0]['version']} written ({results[0]['bytes']} bytes from trainer 0), "
              f"rollouts used versions {[b['version'] for b in batches]}")
    seconds = time.perf_counter() - start
    ray.get([r.weightsync_update.remote(steps) for r in rollouts])  # the last weights are live everywhere
    ray.get([t.done.remote() for t in trainers] + [r.weightsync_leave.remote() for r in rollouts])
    return {"steps": steps, "staleness": staleness, "seconds": seconds, "max_version_lag": max(lags),
            "reward_first": rewards[0], "reward_last": rewards[-1]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--staleness", type=int, default=1)
    parser.add_argument("--trainers", type=int, default=2)
    parser.add_argument("--rollouts", type=int, default=2)
    parser.add_argument("--address", default=None, help="a Ray cluster to join (default: start one here)")
    args = parser.parse_args()
    if (args.rollouts * PROMPTS_PER_WORKER) % args.trainers:
        parser.error("--trainers must divide the number of prompts (2 per rollout worker)")
    ray.init(address=args.address, num_cpus=None if args.address else 4, log_to_driver=False)
    try:
        result = run(args.steps, args.staleness, args.trainers, args.rollouts)
    finally:
        stop_meta_server()
        ray.shutdown()
    print("RESULT " + json.dumps(result))


if __name__ == "__main__":
    main()
