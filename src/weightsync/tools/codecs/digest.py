"""Digests of tensor bytes: one fast checksum, defined on CPU and GPU, for end-to-end checks.

A digest is a 64-bit value of the bytes a tensor holds, in row-major order, whatever its
dtype, strides or device. Two kinds exist, because no one algorithm is both the fastest on a
CPU and natural on a GPU:

* ``"xxh3"``: XXH3-64 (the ``xxhash`` package, seed 0), about 10 GB/s on one CPU core, and it
  releases the GIL, so several threads digest in parallel. Host memory only: a GPU tensor
  would be copied to the host first.
* ``"sum64"``: the bytes read as little-endian 64-bit words (the last one zero-padded), each
  word mixed with its position by a bijective integer mixer (SplitMix64's), and the results
  summed modulo 2^64; the sum and the length go through the mixer once more. Integer addition
  is associative and commutative, so a GPU reduction gives the same bits in any order and on
  any device; it is a handful of elementwise torch kernels and one sum, with no host copy.
  Every change confined to one 8-byte word (so every one-byte change) alters it, because the
  mixer is a bijection; changes to several words cancel only by chance (about 2^-64).

A value means nothing without its kind, so :class:`Digest` carries it. A job uses one kind,
chosen from where its ranks' tensors live (:func:`kind_for`): ``"xxh3"`` when every rank is on
a CPU, ``"sum64"`` as soon as one is on a GPU, so that no GPU tensor is ever copied to the host
to be digested. The same bytes give the same value of a kind on every device::

    kind = kind_for(["cpu", "cuda:0"])              # "sum64"
    d = tensor_digest(weight[:, 3:7], kind)        # a Digest (kind, value, nbytes)
    h = Hasher(kind); h.update(a); h.update(b)     # streaming: equals the digest of a's bytes then b's
    assert h.digest() == tensor_digest(torch.cat([a.view(-1).view(torch.uint8), b.view(-1).view(torch.uint8)]), kind)
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any, Literal

import numpy as np
import torch
import xxhash

from weightsync.tools.codecs import digest_jit
from weightsync.tools.codecs.digest_jit import Runs, host_runs

DigestKind = Literal["xxh3", "sum64"]
KINDS: tuple[DigestKind, ...] = ("xxh3", "sum64")

_MASK = (1 << 64) - 1
#: sum64's constants: position key, seed and length weights, and SplitMix64's multipliers.
_K_POS = 0x9E3779B97F4A7C15
_K_SEED = 0x165667B19E3779F9
_K_LEN = 0xC2B2AE3D27D4EB4F
_M1 = 0xBF58476D1CE4E5B9
_M2 = 0x94D049BB133111EB
#: Words sum64 mixes at once (8 MiB of bytes; its temporaries are a few times that).
CHUNK_WORDS = 1 << 20


def kind_for(devices: Iterable[str]) -> DigestKind:
    """The kind a job uses, from its ranks' devices (``"cpu"``, ``"cuda:N"``): ``"xxh3"`` if all
    are CPUs, else ``"sum64"`` (computed where the bytes are, never copied to the host)."""
    return "xxh3" if all(str(d).split(":")[0] == "cpu" for d in devices) else "sum64"


@dataclass(frozen=True, slots=True)
class Digest:
    """The digest of ``nbytes`` bytes: ``value`` (an unsigned 64-bit int) of ``kind``."""

    kind: DigestKind
    value: int
    nbytes: int

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise ValueError(f"unknown digest kind {self.kind!r}; known: {', '.join(KINDS)}")
        if not 0 <= self.value <= _MASK:
            raise ValueError(f"a digest value is an unsigned 64-bit int, got {self.value}")

    def __str__(self) -> str:
        return f"{self.kind}:{self.value:016x}"

    def to_wire(self) -> dict[str, Any]:
        return {"kind": self.kind, "value": self.value, "nbytes": self.nbytes}

    @classmethod
    def from_wire(cls, doc: Any) -> Digest:
        """Raises ValueError naming the field that is missing or wrong."""
        if not isinstance(doc, dict):
            raise ValueError(f"a digest is a map, not {type(doc).__name__}")
        for name in ("kind", "value", "nbytes"):
            if name not in doc:
                raise ValueError(f"digest field {name!r} is missing")
        kind, value, nbytes = doc["kind"], doc["value"], doc["nbytes"]
        if kind not in KINDS or not isinstance(value, int) or not isinstance(nbytes, int) or nbytes < 0:
            raise ValueError(f"malformed digest {doc!r:.120}")
        return cls(kind, value, nbytes)


def as_signed(value: int) -> int:
    """A digest value as the int64 that holds the same bits (to store it in an int64 tensor)."""
    return value - (1 << 64) if value >= 1 << 63 else value


def as_unsigned(value: int) -> int:
    """The inverse of :func:`as_signed`."""
    return value & _MASK


def row_major_bytes(t: torch.Tensor) -> torch.Tensor:
    """``t``'s bytes in row-major order as a 1-d uint8 tensor on its device (a copy only when
    ``t`` is not contiguous)."""
    flat = t.detach().reshape(-1)  # a view when t is contiguous, a row-major copy otherwise
    return flat.contiguous().view(torch.uint8)


class Hasher:
    """A streaming digest: :meth:`update` with tensors one after another, then :meth:`digest`.

    The result equals :func:`tensor_digest` of all the bytes fed, concatenated, so the way
    bytes are cut into pieces does not matter. For ``"sum64"`` the running sums stay on the
    device of the tensors fed (one host read, in :meth:`digest`); every tensor fed must be on
    the same device.
    """

    def __init__(self, kind: DigestKind) -> None:
        if kind not in KINDS:
            raise ValueError(f"unknown digest kind {kind!r}; known: {', '.join(KINDS)}")
        self.kind: DigestKind = kind
        self.nbytes = 0
        self._xxh = xxhash.xxh3_64() if kind == "xxh3" else None
        self._sums: _Sum64 | None = None

    def update(self, t: torch.Tensor) -> Hasher:
        data = row_major_bytes(t)
        self.nbytes += data.numel()
        if self._xxh is not None:
            if data.device.type != "cpu":
                data = data.cpu()
            self._xxh.update(data.numpy())  # type: ignore[arg-type]  # ndarray is a buffer
        else:
            if self._sums is None:
                self._sums = _Sum64(data.device)
            self._sums.update(data)
        return self

    def value(self) -> int:
        """The digest value of everything fed so far (an unsigned 64-bit int)."""
        if self._xxh is not None:
            return int(self._xxh.intdigest())
        if self._sums is None:
            return _finish(0, 0)
        return self._sums.value(self.nbytes)

    def digest(self) -> Digest:
        return Digest(self.kind, self.value(), self.nbytes)


class CopyHasher:
    """The digest of one piece of ``nbytes`` bytes, fed in row-major order while it is copied.

    :meth:`copy` stores ``src`` into ``dst`` and absorbs the bytes stored; :meth:`update` absorbs
    bytes already where they belong. A piece may arrive in parts (rows, slabs), in order; the
    value equals :func:`tensor_digest` of all of it. ``xxh3`` on host memory runs the fused
    kernels (:mod:`weightsync.tools.codecs.digest_jit`: each byte read once, for the copy and the
    hash) once this process loaded them (``digest_jit.for_rank``: ranks holding at least
    ``FUSE_MIN_BYTES``); otherwise, for a dtype conversion, a device tensor or ``sum64``, the copy comes
    first and the digest reads the destination after it (``copy`` does the copy: the device
    port's queued copy on a GPU).
    """

    def __init__(self, kind: DigestKind, nbytes: int) -> None:
        self.kind, self.nbytes, self.fed = kind, nbytes, 0
        kernels = digest_jit.loaded() if kind == "xxh3" and nbytes > digest_jit.SHORT_MAX else None
        self._kernels = kernels
        self._started: tuple[np.ndarray, ...] | None = None  # the kernels' state, made on first use
        self._hasher = Hasher(kind) if kernels is None else None
        self._value: int | None = None  # the whole piece digested at once (see update)

    @property
    def _state(self) -> tuple[np.ndarray, ...] | None:
        if self._started is None and self._kernels is not None:
            self._started = self._kernels.start(self.nbytes)
        return self._started

    @property
    def done(self) -> bool:
        return self.fed == self.nbytes

    def copy(self, dst: torch.Tensor, src: torch.Tensor, *, copy: Any = None, nontemporal: bool = False) -> None:
        """``dst.copy_(src)`` (or ``copy(dst, src)``), absorbing ``dst``'s bytes as stored. With the
        kernels, ``nontemporal`` stores around the cache: for a destination nothing reads soon (a
        reader's landing), not for a buffer a transport reads next (a writer's pack)."""
        runs = (host_runs(dst, src) if self._kernels is not None and dst.dtype == src.dtype
                and dst.device.type == src.device.type == "cpu" else None)
        if runs is None:
            (copy or _copy_now)(dst, src)
            self.update(dst)
            return
        parts = runs[2]
        if self.fed == 0 and len(parts) == 1 and parts[0][4] * parts[0][5] == self.nbytes:  # the whole piece
            assert self._kernels is not None
            d_at, d_stride, s_at, s_stride, rows, row_bytes = parts[0]
            self._value = self._kernels.once(runs[1], s_at, s_stride, runs[0], d_at, d_stride, rows, row_bytes,
                                             copy=True, nontemporal=nontemporal)
            self.fed = self.nbytes
            return
        self._feed(runs, copy=True, nontemporal=nontemporal)

    def update(self, t: torch.Tensor) -> None:
        """Absorb ``t``'s bytes (row-major), the next part of the piece."""
        size = t.numel() * t.element_size()
        if self._hasher is not None:
            self._hasher.update(t)
            self.fed += size
            return
        if self.fed == 0 and size == self.nbytes and t.device.type == "cpu" and t.is_contiguous():
            # the whole piece, dense, no copy to fuse with: xxhash's own loop reads it fastest
            self._value = int(xxhash.xxh3_64_intdigest(t.reshape(-1).view(torch.uint8).numpy()))  # type: ignore[arg-type]
            self.fed = size
            return
        runs = host_runs(t, t) if t.device.type == "cpu" else None
        if runs is None:  # a view the kernels cannot walk: its bytes, gathered
            data = row_major_bytes(t).cpu()
            runs = host_runs(data, data)
            assert runs is not None, "a 1-d uint8 tensor is one run"
        self._feed(runs, copy=False)

    def _feed(self, runs: Runs, *, copy: bool, nontemporal: bool = False) -> None:
        state = self._state
        assert self._kernels is not None and state is not None
        dst, src, parts = runs
        for d_at, d_stride, s_at, s_stride, rows, row_bytes in parts:
            if self.fed + rows * row_bytes > self.nbytes:
                raise ValueError(f"a piece of {self.nbytes} bytes was fed {self.fed + rows * row_bytes}")
            self._kernels.feed(src, s_at, s_stride, dst, d_at, d_stride, rows, row_bytes, *state, copy=copy,
                               nontemporal=nontemporal)
            self.fed += rows * row_bytes

    def value(self) -> int:
        """The digest value, once all ``nbytes`` were fed."""
        if self.fed != self.nbytes:
            raise ValueError(f"a piece of {self.nbytes} bytes was digested after {self.fed} of them")
        if self._hasher is not None:
            return self._hasher.value()
        if self._value is not None:
            return self._value
        state = self._state
        assert self._kernels is not None and state is not None
        return self._kernels.finish(self.nbytes, *state)


def _copy_now(dst: torch.Tensor, src: torch.Tensor) -> None:
    dst.copy_(src)


def tensor_digest(t: torch.Tensor, kind: DigestKind) -> Digest:
    """The digest of ``t``'s bytes in row-major order (see module docstring)."""
    return Hasher(kind).update(t).digest()


def bytes_digest(data: bytes | bytearray | memoryview, kind: DigestKind) -> Digest:
    """The digest of a host byte string (equal to :func:`tensor_digest` of the same bytes)."""
    if kind == "xxh3":
        return Digest(kind, int(xxhash.xxh3_64_intdigest(data)), len(data))
    if not len(data):
        return Hasher(kind).digest()
    return tensor_digest(torch.frombuffer(bytearray(data), dtype=torch.uint8), kind)


class _Sum64:
    """sum64's running state on one device: S = the sum of mix(word, i) over the words seen
    (i: the word's index in the stream), modulo 2^64, plus a partial last word."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.total = torch.zeros((), dtype=torch.int64, device=device)
        self.words = 0  # whole words absorbed
        self.tail = torch.zeros(0, dtype=torch.uint8, device=device)  # < 8 bytes not yet a word

    def update(self, data: torch.Tensor) -> None:
        if data.device != self.device:
            raise ValueError(f"a sum64 digest runs on one device: {data.device} after {self.device}")
        if self.tail.numel():
            need = 8 - self.tail.numel()
            head, data = data[:need], data[need:]
            self.tail = torch.cat([self.tail, head])
            if self.tail.numel() < 8:
                return
            self._absorb(self.tail.view(torch.int64))
            self.tail = self.tail[:0]
        whole = data.numel() // 8 * 8
        body = data[:whole]
        if whole and body.storage_offset() % 8:
            body = body.clone()  # word view needs 8-byte alignment (only after a piece of odd length)
        if whole:
            self._absorb(body.view(torch.int64))
        if whole < data.numel():
            self.tail = data[whole:].clone()

    def _absorb(self, words: torch.Tensor) -> None:
        for start in range(0, words.numel(), CHUNK_WORDS):
            chunk = words[start: start + CHUNK_WORDS]
            if chunk.device.type == "cpu":  # numpy's uint64 kernels are several times torch's on CPU
                self.total += as_signed(_mix_host(chunk.numpy().view(np.uint64), self.words + start))
            else:
                self.total += _mix(chunk, self.words + start).sum()
        self.words += words.numel()

    def value(self, nbytes: int) -> int:
        total = int(self.total)
        if self.tail.numel():
            word = torch.zeros(8, dtype=torch.uint8, device=self.device)
            word[: self.tail.numel()] = self.tail  # zero-padded
            total += int(_mix(word.view(torch.int64), self.words).sum())
        return _finish(total & _MASK, nbytes)


def _mix(words: torch.Tensor, base: int) -> torch.Tensor:
    """mix(w, i) for the words of one chunk (i = base + j): w XOR a key of its position, then
    SplitMix64's finaliser. Each step is a bijection of w, so for a fixed position different
    words give different values."""
    z = words ^ (_positions(words.device, words.numel()) + _wrap(base * _K_POS + _K_SEED))
    z = (z ^ _shr(z, 30)) * _wrap(_M1)
    z = (z ^ _shr(z, 27)) * _wrap(_M2)
    return z ^ _shr(z, 31)


def _mix_host(words: np.ndarray, base: int) -> int:
    """The sum of :func:`_mix` over host words, with numpy (uint64 arithmetic wraps)."""
    with np.errstate(over="ignore"):
        keys = np.arange(base, base + words.size, dtype=np.uint64)
        keys *= np.uint64(_K_POS)
        keys += np.uint64(_K_SEED)
        z = words ^ keys
        z ^= z >> np.uint64(30)
        z *= np.uint64(_M1)
        z ^= z >> np.uint64(27)
        z *= np.uint64(_M2)
        z ^= z >> np.uint64(31)
        return int(z.sum(dtype=np.uint64))


def _shr(z: torch.Tensor, bits: int) -> torch.Tensor:
    """Logical right shift of int64 words (torch's ``>>`` keeps the sign)."""
    return (z >> bits) & ((1 << (64 - bits)) - 1)


def _finish(total: int, nbytes: int) -> int:
    """sum64 = SplitMix64(S + K * nbytes): the length counts, so zero padding is not content."""
    z = (total + _K_LEN * nbytes) & _MASK
    z = ((z ^ (z >> 30)) * _M1) & _MASK
    z = ((z ^ (z >> 27)) * _M2) & _MASK
    return z ^ (z >> 31)


_POSITIONS: dict[tuple[str, int], torch.Tensor] = {}


def _positions(device: torch.device, n: int) -> torch.Tensor:
    """j * K_POS (mod 2^64) for j < n, cached per device (one chunk's worth)."""
    key = (str(device), CHUNK_WORDS)
    cached = _POSITIONS.get(key)
    if cached is None:
        cached = torch.arange(CHUNK_WORDS, dtype=torch.int64, device=device) * _wrap(_K_POS)
        _POSITIONS[key] = cached
    if n > cached.numel():
        return torch.arange(n, dtype=torch.int64, device=device) * _wrap(_K_POS)
    return cached[:n]


def _wrap(value: int) -> int:
    """An int as the int64 with the same low 64 bits (torch scalars must fit int64)."""
    return as_signed(value & _MASK)
