"""``KVStore``: a rollout's KV cache blocks, saved as an engine computes them, for the engine that resumes it.

A block is one engine KV block (``block_size`` tokens, every attention layer) of one rollout,
computed under one weight version. It is a file (safetensors: tensors and a string map, no
code) at ``<directory>/kv/<layout>/<rollout>/v<version>/<index>-<digest>.kv``:

* ``layout`` fingerprints the engine's KV shapes (model, dtype, block size, heads): engines
  with other shapes never see each other's blocks;
* ``digest`` chains the block's tokens to every token before it (as vLLM's prefix cache
  does), so a block is found only by a context that starts with the very tokens it saw;
* ``version`` is the weight version that computed it. A lookup names one version: KV of any
  other version is never found, let alone loaded (the engine computes it again instead), and
  :meth:`KVStore.retain_versions` deletes the KV of versions no engine serves.

Files are replaced whole (:func:`~weightsync.roles.rollouts.files.write_atomic`): a block is all
there or absent. The store keeps at most ``budget_bytes`` (per directory, and so per host for
``/dev/shm``): a save that would pass it first evicts by age, the rollout whose KV was saved
longest ago first, from its last block backwards (what stays is still a usable prefix), down to
``low_watermark`` of the budget. The byte count and the counters (saved, loaded, missed,
evicted, dropped) live in a ledger file next to the blocks, updated under the directory's lock
by every process of the host: :meth:`KVStore.metrics` reads them.

    store = KVStore(KVStoreConfig(directory="/dev/shm/weightsync-rl-job7", budget_bytes=2 << 30))
    keys = store.keys(layout, "r-17", version=7, token_ids=context, block_size=16)
    n = store.lookup(keys)                             # leading blocks present
    store.save(keys[0], {"layer0": block0, ...})
    blocks = store.load(keys[0])
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import json
import os
import shutil
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import msgpack
import numpy as np
import torch
from safetensors.torch import load as st_load
from safetensors.torch import save as st_save

from weightsync.roles.rollouts.files import locked, read_file, sweep_temporaries, write_atomic
from weightsync.roles.rollouts.record import check_rollout_id

SUFFIX = ".kv"
_LEDGER = ".ledger"


class KVMissError(LookupError):
    """A block asked for is not in the store (evicted, dropped, or never saved)."""


@dataclass(frozen=True, kw_only=True)
class KVStoreConfig:
    """Where KV blocks live and how much of them.

    Attributes:
        directory: ``/dev/shm/...`` for the engines of one host; a directory every host mounts to
            resume across hosts (the ``file`` path). The same directory as the rollout records is fine.
        budget_bytes: at most this many bytes of blocks in ``directory``.
        low_watermark: an eviction frees down to this fraction of the budget (fewer, larger
            evictions than one block at a time).
    """

    directory: str
    budget_bytes: int = 1 << 30
    low_watermark: float = 0.9

    def __post_init__(self) -> None:
        if self.budget_bytes < 1:
            raise ValueError(f"budget_bytes must be >= 1, got {self.budget_bytes}")
        if not 0 < self.low_watermark <= 1:
            raise ValueError(f"low_watermark must be in (0, 1], got {self.low_watermark}")


@dataclass(frozen=True, slots=True)
class BlockKey:
    """One block: the engine layout, rollout, weight version, index in the context and chained
    digest, and the engine shard that holds it (an engine of N workers, tensor or pipeline
    parallel, keeps N files per block: each worker its own heads or layers)."""

    layout: str
    rollout: str
    version: int
    index: int
    digest: str
    shard: int = 0

    @property
    def relpath(self) -> str:
        name = f"{self.index:06d}-{self.digest}-s{self.shard}{SUFFIX}"
        return os.path.join(self.layout, self.rollout, f"v{self.version}", name)

    def of_shard(self, shard: int) -> BlockKey:
        return dataclasses.replace(self, shard=shard)


@dataclass(frozen=True, kw_only=True)
class KVMetrics:
    """The store's bytes and counters, as every process of the host left them."""

    bytes: int = 0
    blocks: int = 0
    saved_blocks: int = 0
    saved_bytes: int = 0
    loaded_blocks: int = 0
    loaded_bytes: int = 0
    missed_blocks: int = 0
    evicted_blocks: int = 0
    evicted_bytes: int = 0
    dropped_version_blocks: int = 0
    dropped_finished_blocks: int = 0
    rejected_blocks: int = 0


def block_digests(token_ids: Sequence[int], block_size: int, count: int | None = None, *,
                  after: Sequence[str] = ()) -> list[str]:
    """The chained digest of each full block of ``token_ids`` (the first ``count`` of them).

    ``after``: the digests of the first blocks, known already (only the blocks past them are hashed).
    """
    if block_size < 1:
        raise ValueError(f"block_size must be >= 1, got {block_size}")
    full = len(token_ids) // block_size if count is None else min(count, len(token_ids) // block_size)
    out = list(after[:full])
    prev = bytes.fromhex(out[-1]) if out else f"b{block_size}".encode()
    tokens = np.asarray(token_ids[len(out) * block_size: full * block_size], dtype="<i8")
    for i in range(full - len(out)):
        prev = hashlib.blake2b(prev + tokens[i * block_size:(i + 1) * block_size].tobytes(), digest_size=12).digest()
        out.append(prev.hex())
    return out


class KVStore:
    """KV blocks of rollouts under ``config.directory`` (see module docstring). Safe across processes."""

    def __init__(self, config: KVStoreConfig) -> None:
        self.config = config
        self.root = os.path.join(config.directory, "kv")
        os.makedirs(self.root, exist_ok=True)
        sweep_temporaries(self.root)
        with locked(self.root):
            self._recount()

    # -- keys ------------------------------------------------------------------------------------
    @staticmethod
    def keys(layout: str, rollout: str, *, version: int, token_ids: Sequence[int], block_size: int,
             count: int | None = None) -> list[BlockKey]:
        """The keys of the full blocks of ``token_ids`` (at most ``count``) for this rollout and version."""
        check_rollout_id(rollout)
        return [BlockKey(layout, rollout, int(version), i, d)
                for i, d in enumerate(block_digests(token_ids, block_size, count))]

    def path(self, key: BlockKey) -> str:
        return os.path.join(self.root, key.relpath)

    def lookup(self, keys: Sequence[BlockKey], *, shards: int = 1) -> int:
        """How many of ``keys``, from the first, are in the store (every one of their ``shards``)."""
        for i, key in enumerate(keys):
            if not all(os.path.exists(self.path(key.of_shard(s))) for s in range(shards)):
                return i
        return len(keys)

    # -- blocks ----------------------------------------------------------------------------------
    def save(self, key: BlockKey, tensors: Mapping[str, torch.Tensor]) -> bool:
        """Store one block (every layer's tensor); returns False if it alone exceeds the budget.

        Evicts by age first when the budget would be passed (see module docstring).
        """
        blob = st_save({name: t.detach().contiguous() for name, t in tensors.items()}, metadata=_meta(key))
        path = self.path(key)
        os.makedirs(os.path.dirname(path), exist_ok=True)
        with locked(self.root):
            ledger = self._ledger()
            if len(blob) > self.config.budget_bytes:
                ledger["rejected_blocks"] += 1
                self._write_ledger(ledger)
                return False
            with contextlib.suppress(FileNotFoundError):
                old = os.path.getsize(path)
                ledger["bytes"] -= old
                ledger["blocks"] -= 1
            if ledger["bytes"] + len(blob) > self.config.budget_bytes:
                ledger = self._evict(len(blob), keep=path)
            ledger["bytes"] += len(blob)
            ledger["blocks"] += 1
            ledger["saved_blocks"] += 1
            ledger["saved_bytes"] += len(blob)
            self._write_ledger(ledger)  # counted before it exists: a writer killed now over-counts, never under
            write_atomic(path, blob, durable=False)
        return True

    def load(self, key: BlockKey) -> dict[str, torch.Tensor]:
        """One block's tensors by layer.

        Raises:
            KVMissError: the block is not there, or its file does not hold this key.
        """
        try:
            blob = read_file(self.path(key))
            tensors = st_load(blob)
            meta = _file_meta(blob)
        except FileNotFoundError:
            self._count(missed_blocks=1)
            raise KVMissError(f"no KV block {key.relpath} (evicted, dropped or never saved)") from None
        except Exception as exc:  # a torn or foreign file is a miss: the engine computes the block
            self._count(missed_blocks=1)
            raise KVMissError(f"KV block {key.relpath} is unreadable: {exc}") from None
        if meta != _meta(key):
            self._count(missed_blocks=1)
            raise KVMissError(f"KV block file {key.relpath} holds {meta}, not {_meta(key)}")
        self._count(loaded_blocks=1, loaded_bytes=len(blob))
        return tensors

    # -- retention -------------------------------------------------------------------------------
    def retain_versions(self, versions: Iterable[int]) -> int:
        """Delete the KV of every version not in ``versions`` (those no engine serves); returns blocks deleted."""
        keep = {f"v{int(v)}" for v in versions}
        return self._drop(lambda rollout, version: version not in keep, "dropped_version_blocks")

    def drop_rollout(self, rollout: str) -> int:
        """Delete a rollout's KV (it finished); returns blocks deleted."""
        check_rollout_id(rollout)
        return self._drop(lambda r, version: r == rollout, "dropped_finished_blocks")

    def versions(self) -> set[int]:
        """The weight versions some block is kept for."""
        return {int(v[1:]) for _, _, v in self._version_dirs()}

    def metrics(self) -> KVMetrics:
        with locked(self.root):
            return KVMetrics(**self._ledger())

    @staticmethod
    def read_metrics(directory: str) -> KVMetrics | None:
        """The ledger of the store in ``directory`` as last written, or None if it has none.

        For a metrics scrape: it does not open the store (no sweep, no recount, no lock; the ledger
        is replaced whole, so a read sees one complete ledger) and creates nothing.
        """
        root = os.path.join(directory, "kv")
        if not os.path.exists(os.path.join(root, _LEDGER)):
            return None
        return KVMetrics(**_read_ledger(root))

    # -- internals -------------------------------------------------------------------------------
    def _version_dirs(self) -> list[tuple[str, str, str]]:
        out = []
        for layout in _subdirs(self.root):
            for rollout in _subdirs(os.path.join(self.root, layout)):
                out += [(layout, rollout, v) for v in _subdirs(os.path.join(self.root, layout, rollout))]
        return out

    def _drop(self, doomed: Any, counter: str) -> int:
        """Delete the (layout, rollout, version) directories ``doomed(rollout, version)`` names."""
        if not any(doomed(rollout, version) for _, rollout, version in self._version_dirs()):
            return 0  # the common case (after every turn): no lock, no count
        dropped = 0
        with locked(self.root):
            for layout, rollout, version in self._version_dirs():
                if doomed(rollout, version):
                    path = os.path.join(self.root, layout, rollout, version)
                    with contextlib.suppress(FileNotFoundError):
                        dropped += sum(1 for n in os.listdir(path) if n.endswith(SUFFIX))
                    shutil.rmtree(path, ignore_errors=True)
                    with contextlib.suppress(OSError):
                        os.rmdir(os.path.dirname(path))  # the rollout's, once empty
            ledger = self._recount()
            ledger[counter] += dropped
            self._write_ledger(ledger)
        return dropped

    def _scan(self) -> dict[str, list[tuple[int, int, float, str]]]:
        """Per (layout, rollout, version) directory: its blocks as (index, size, mtime, path)."""
        groups: dict[str, list[tuple[int, int, float, str]]] = {}
        for layout, rollout, version in self._version_dirs():
            path = os.path.join(self.root, layout, rollout, version)
            blocks = []
            with contextlib.suppress(FileNotFoundError):
                for entry in os.scandir(path):
                    if entry.name.endswith(SUFFIX) and not entry.name.startswith("."):
                        with contextlib.suppress(FileNotFoundError):
                            st = entry.stat()
                            blocks.append((int(entry.name.split("-", 1)[0]), st.st_size, st.st_mtime, entry.path))
            groups[path] = blocks
        return groups

    def _evict(self, need: int, *, keep: str) -> dict[str, int]:
        """Free room for ``need`` bytes (down to the low watermark), oldest rollout first, last block first."""
        groups = self._scan()
        held = sum(size for blocks in groups.values() for _, size, _, _ in blocks)
        target = int(self.config.budget_bytes * self.config.low_watermark) - need
        evicted = freed = 0
        by_age = sorted(groups.values(), key=lambda blocks: max((m for _, _, m, _ in blocks), default=0.0))
        for blocks in by_age:
            for _, size, _, path in sorted(blocks, reverse=True):
                if held - freed <= target:
                    break
                if path == keep:
                    continue
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(path)
                    freed += size
                    evicted += 1
        ledger = self._recount()
        ledger["evicted_blocks"] += evicted
        ledger["evicted_bytes"] += freed
        return ledger

    def _recount(self) -> dict[str, int]:
        """The ledger with bytes and blocks counted from the files (the truth after any crash)."""
        ledger = self._ledger()
        blocks = [b for group in self._scan().values() for b in group]
        ledger["bytes"], ledger["blocks"] = sum(size for _, size, _, _ in blocks), len(blocks)
        self._write_ledger(ledger)
        return ledger

    def _ledger(self) -> dict[str, int]:
        return _read_ledger(self.root)

    def _write_ledger(self, ledger: Mapping[str, int]) -> None:
        write_atomic(os.path.join(self.root, _LEDGER), msgpack.packb(dict(ledger)), durable=False)

    def _count(self, **counts: int) -> None:
        with locked(self.root):
            ledger = self._ledger()
            for name, n in counts.items():
                ledger[name] += n
            self._write_ledger(ledger)


def _read_ledger(root: str) -> dict[str, int]:
    """The ledger under ``root``; zeros for a missing or unreadable one (a recount restores bytes and blocks)."""
    base = dataclasses.asdict(KVMetrics())
    try:
        stored = msgpack.unpackb(read_file(os.path.join(root, _LEDGER)), raw=False)
    except (FileNotFoundError, ValueError, msgpack.ExtraData, msgpack.FormatError):
        return base
    if isinstance(stored, dict):
        base.update({k: int(v) for k, v in stored.items() if k in base and isinstance(v, int)})
    return base


def _meta(key: BlockKey) -> dict[str, str]:
    return {"format": "1", "layout": key.layout, "rollout": key.rollout, "version": str(key.version),
            "index": str(key.index), "digest": key.digest, "shard": str(key.shard)}


def _file_meta(blob: bytes) -> dict[str, str]:
    """The string map of a safetensors blob (its JSON header's ``__metadata__``)."""
    size = int.from_bytes(blob[:8], "little")
    meta = json.loads(blob[8: 8 + size]).get("__metadata__", {})
    return {k: str(v) for k, v in meta.items()}


def _subdirs(path: str) -> list[str]:
    try:
        return sorted(e.name for e in os.scandir(path) if e.is_dir() and not e.name.startswith("."))
    except FileNotFoundError:
        return []
