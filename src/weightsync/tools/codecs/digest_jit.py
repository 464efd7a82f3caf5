"""XXH3-64 in numba, streaming, and fused into the copy that lands the bytes (one pass, not two).

Integrity checks digest every byte a sync moves (:mod:`weightsync.transport.digests`). Digesting
after the copy reads every byte a second time, out of memory again: on a 2-core VM that made
checks cost 17-112% of a sync. These kernels compute XXH3-64 (seed 0, the default secret: the
same value as the ``xxhash`` package, which the tests hold them to) *while* copying: each 8-byte
word is loaded once, stored to the destination and mixed into the hash from the same register,
so the bytes are read once (measured at 64 MiB, one thread, on a 2-core Intel Xeon VM:
4.9-5.9 GB/s, against 5.8-6.9 GB/s for ``np.copyto`` and 6.2-7.5 GB/s for the plain
non-temporal copy below; the hash's arithmetic, 13-19 GB/s from L2 against ``xxhash``'s 47-49,
is what is left to hide: ``benchmarks/digest_landing.py --kernels``). Without the copy
(``copy=False``) the same kernel digests in place.

XXH3 is sequential (its accumulators are scrambled every 1 KiB), so a stream takes the bytes of
one piece in row-major order, cut any way (rows of a strided view, slabs across messages); the
total length is fixed up front, because XXH3 treats the last 64 bytes apart. The stripe loop is
written as eight isomorphic lanes for LLVM's SLP vectoriser (AVX2: two registers of four lanes),
which numba leaves off by default: :func:`load` compiles these kernels, and only these, with it
on. Inputs up to 240 bytes use XXH3's short-input paths: the caller digests those with
``xxhash`` itself (:class:`weightsync.tools.codecs.digest.CopyHasher`).

**Stores that skip the cache.** A store to a line not in cache first reads the line (to own
it), so an ordinary copy moves three bytes over the memory bus per byte copied; a non-temporal
store writes the line whole and moves two. Landing a version, nothing reads the destination
soon (gigabytes pass through before the engine's next forward), so a reader's landing stores
non-temporally: the plain copy (:meth:`Kernels.copy`, which the device port uses for host
copies once the kernels are loaded) always, the fused one when asked (``nontemporal=True``). A
writer packing a slot or a send buffer asks for ordinary stores: a reader, ``gloo`` or the file
writer reads that buffer next, from cache if it is still there (on a 2-core AMD EPYC VM,
non-temporal packing made integrity cost 17-18% of a shared-memory sync, against 2-10% with
ordinary stores, measured alternately in one sitting). From memory the plain non-temporal copy
is the fastest copy here (``benchmarks/digest_landing.py --kernels``; ``memcpy``'s own
non-temporal path starts only past a large threshold). Such stores are not
ordered with later ones, so every kernel that stores ends with a full fence: when it returns,
its bytes are visible to every process that then sees a flag raised after it (the shared-memory
transport's streaming readers rely on that order)::

    k = load()                                   # None without numba; loaded() after it
    state = k.start(nbytes)
    k.feed(src_u8, s_at, s_stride, dst_u8, d_at, d_stride, rows, row_bytes, *state, copy=True, nontemporal=True)
    value = k.finish(nbytes, *state)
    k.copy(src_u8, s_at, s_stride, dst_u8, d_at, d_stride, rows, row_bytes)   # the copy alone
"""

from __future__ import annotations

import functools
import importlib.util
import itertools
import math
from dataclasses import dataclass
from typing import Any

import numpy as np

#: XXH3's default secret (``XXH3_kSecret``, 192 bytes).
SECRET = bytes.fromhex(
    "b8fe6c3923a44bbe7c01812cf721ad1cded46de9839097db7240a4a4b7b3671f"
    "cb79e64eccc0e578825ad07dccff7221b8084674f743248ee03590e6813a264c"
    "3c2852bb91c300cb88d0658b1b532ea371644897a20df94e3819ef46a9deacd8"
    "a8fa763fe39c343ff9dcbbc7c70b4f1d8a51e04bcdb45931c89f7ec9d9787364"
    "eac5ac8334d3ebc3c581a0fffa1363eb170ddd51b7f0da49d316552629d4689e"
    "2b16be587d47a1fc8ff8b8d17ad031ce45cb3a8f95160428afd7fbcabb4b407e")
_WORDS = np.frombuffer(SECRET, dtype="<u8")
#: The key of lane i of stripe s in a block: secret word s + i (stripes advance 8 bytes).
KEYS = np.array(np.concatenate([_WORDS[s: s + 8] for s in range(16)]), dtype=np.uint64)
#: The scramble key after every block of 16 stripes: the secret's last 64 bytes.
SCRAMBLE = np.array(_WORDS[16:24], dtype=np.uint64)
_P32_1, _P32_2, _P32_3 = 0x9E3779B1, 0x85EBCA77, 0xC2B2AE3D
_P64_1, _P64_2, _P64_3, _P64_4, _P64_5 = (0x9E3779B185EBCA87, 0xC2B2AE3D27D4EB4F, 0x165667B19E3779F9,
                                          0x85EBCA77C2B2AE63, 0x27D4EB2F165667C5)
INIT = (_P32_3, _P64_1, _P64_2, _P64_3, _P64_4, _P32_2, _P64_5, _P32_1)
#: The last stripe's keys (secret from byte 121) and the merge's (from byte 11): unaligned words.
LAST_KEYS = np.array([int.from_bytes(SECRET[121 + 8 * i: 129 + 8 * i], "little") for i in range(8)], dtype=np.uint64)
MERGE_KEYS = np.array([int.from_bytes(SECRET[11 + 8 * i: 19 + 8 * i], "little") for i in range(8)], dtype=np.uint64)
#: Longest input XXH3 digests with its short-input algorithms (not these kernels).
SHORT_MAX = 240
#: A rank whose tensors hold fewer bytes digests in a second pass (``xxhash``, a few ms per 64 MiB)
#: and never starts numba: importing it and loading the kernels from its cache takes 1.5-3 s per
#: process here, compiling them 15-40 s, more than such a rank's second passes cost in a long job.
FUSE_MIN_BYTES = 64 << 20


def for_rank(nbytes: int) -> Kernels | None:
    """The kernels for a rank whose tensors hold ``nbytes``: loaded (compiled, or read from numba's
    cache) from :data:`FUSE_MIN_BYTES` up, else only if this process loaded them already (without
    importing numba). A rank calls it once, before it holds a lease: loading takes seconds."""
    return load() if nbytes >= FUSE_MIN_BYTES else loaded()


def loaded() -> Kernels | None:
    """The kernels if :func:`load` ran in this process, else None (never compiles, never imports numba).
    :class:`weightsync.tools.codecs.digest.CopyHasher` fuses with these only."""
    return _loaded


@dataclass(frozen=True)
class Kernels:
    """The compiled kernels and the Python ends of a stream (see module docstring)."""

    feed_kernel: Any
    finish_kernel: Any
    once_kernel: Any
    copy_kernel: Any

    def copy(self, src: np.ndarray, s_at: int, s_stride: int, dst: np.ndarray, d_at: int, d_stride: int,  # noqa: PLR0917
             rows: int, row_bytes: int) -> None:
        """Copy ``rows`` runs of ``row_bytes`` bytes (run r at ``s_at + r * s_stride`` in ``src``, at
        ``d_at + r * d_stride`` in ``dst``) with non-temporal stores, then fence."""
        self.copy_kernel(src, s_at, s_stride, dst, d_at, d_stride, rows, row_bytes)

    def once(self, src: np.ndarray, s_at: int, s_stride: int, dst: np.ndarray, d_at: int, d_stride: int,  # noqa: PLR0917
             rows: int, row_bytes: int, *, copy: bool, nontemporal: bool = False) -> int:
        """The XXH3-64 value of a whole input of ``rows`` runs (over :data:`SHORT_MAX` bytes), copied
        into ``dst`` first when ``copy`` (storing non-temporally when ``nontemporal``: see the
        module docstring): :meth:`start`, :meth:`feed` and :meth:`finish` in one call
        (a version lands ~1,000 pieces, most in one go: their Python ends cost as much as the
        kernels' extra work)."""
        nbytes = rows * row_bytes
        if nbytes <= SHORT_MAX:
            raise ValueError(f"the kernels digest inputs over {SHORT_MAX} bytes, got {nbytes}")
        return int(self.once_kernel(src, s_at, s_stride, dst, d_at, d_stride, rows, row_bytes, _INIT, KEYS, SCRAMBLE,
                                    LAST_KEYS, MERGE_KEYS, _mode(copy, nontemporal)))

    @staticmethod
    def start(nbytes: int) -> tuple[np.ndarray, ...]:
        """A fresh stream's state for ``nbytes`` (> :data:`SHORT_MAX`) bytes: accumulators, the
        partial-stripe buffer, the last absorbed stripe, and counters (stripes absorbed, stripes
        to absorb, bytes buffered, bytes fed)."""
        if nbytes <= SHORT_MAX:
            raise ValueError(f"the kernels digest inputs over {SHORT_MAX} bytes, got {nbytes}")
        return (np.array(INIT, dtype=np.uint64), np.zeros(64, dtype=np.uint8), np.zeros(64, dtype=np.uint8),
                np.array([0, (nbytes - 1) // 64, 0, 0], dtype=np.int64))

    def feed(self, src: np.ndarray, s_at: int, s_stride: int, dst: np.ndarray, d_at: int, d_stride: int,  # noqa: PLR0917
             rows: int, row_bytes: int, acc: np.ndarray, buf: np.ndarray, prev: np.ndarray, st: np.ndarray, *,
             copy: bool, nontemporal: bool = False) -> None:
        """Absorb ``rows`` runs of ``row_bytes`` bytes of ``src`` (uint8, run r at byte
        ``s_at + r * s_stride``), copying each into ``dst`` first when ``copy`` (storing
        non-temporally when ``nontemporal``)."""
        if st[3] + rows * row_bytes > st[1] * 64 + 64:
            raise ValueError(f"a stream was fed {int(st[3]) + rows * row_bytes} bytes, more than it was started for")
        self.feed_kernel(src, s_at, s_stride, dst, d_at, d_stride, rows, row_bytes, acc, buf, prev, st, KEYS, SCRAMBLE,
                         _mode(copy, nontemporal))

    def finish(self, nbytes: int, acc: np.ndarray, buf: np.ndarray, prev: np.ndarray, st: np.ndarray) -> int:
        """The XXH3-64 value once all ``nbytes`` were fed: the last stripe (the input's last 64
        bytes, with the secret at byte 121), then the merge (secret at byte 11) and avalanche."""
        if int(st[3]) != nbytes:
            raise ValueError(f"a stream of {nbytes} bytes was fed {int(st[3])}")
        return int(self.finish_kernel(nbytes, acc, buf, prev, int(st[2]), LAST_KEYS, MERGE_KEYS))


#: How the fused kernels store (their ``store`` argument): not at all, through the cache, around it.
_NO_COPY, _CACHED, _NON_TEMPORAL = 0, 1, 2


def _mode(copy: bool, nontemporal: bool) -> int:
    if nontemporal and not copy:
        raise ValueError("nontemporal says how a copy stores: it needs copy=True")
    return _NON_TEMPORAL if nontemporal else _CACHED if copy else _NO_COPY


@functools.cache
def load() -> Kernels | None:
    """Compile (or load from numba's cache) the kernels; None when numba is not installed."""
    if importlib.util.find_spec("numba") is None:
        return None
    import numba
    from numba.core import config
    from numba.core.compiler_lock import global_compiler_lock

    from weightsync.tools.codecs.delta_jit import _answer_dict_lookups_with_a_dict

    global _stripes_jit, _feed_jit, _finish_jit, _loaded, _store, _fence  # noqa: PLW0603 (compiled helpers, bound once here)
    _answer_dict_lookups_with_a_dict()
    _store, _fence = _store_and_fence()
    u8, u64, i64 = numba.uint8[::1], numba.uint64[::1], numba.int64
    signature = numba.void(u8, i64, i64, u8, i64, i64, i64, i64, u64, u8, u8, numba.int64[::1], u64, u64, i64)
    with global_compiler_lock:  # no other compilation sees the setting
        saved = config.SLP_VECTORIZE
        config.SLP_VECTORIZE = 1
        try:
            _stripes_jit = numba.njit(nogil=True, boundscheck=False, error_model="numpy", inline="always")(_stripes)
            feed = _feed_jit = numba.njit(signature, cache=True, nogil=True, boundscheck=False,
                                          error_model="numpy")(_feed)
            finish = _finish_jit = numba.njit(numba.uint64(i64, u64, u8, u8, i64, u64, u64), cache=True, nogil=True,
                                              boundscheck=False, error_model="numpy")(_finish)
            once = numba.njit(numba.uint64(u8, i64, i64, u8, i64, i64, i64, i64, u64, u64, u64, u64, u64, i64),
                              cache=True, nogil=True, boundscheck=False,
                              error_model="numpy")(_once)
            copy = numba.njit(numba.void(u8, i64, i64, u8, i64, i64, i64, i64), cache=True, nogil=True,
                              boundscheck=False, error_model="numpy")(_copy)
        finally:
            config.SLP_VECTORIZE = saved
    _loaded = Kernels(feed_kernel=feed, finish_kernel=finish, once_kernel=once, copy_kernel=copy)
    from weightsync.ports import device

    device.use_host_copy(_host_copy)
    return _loaded


def _store_and_fence() -> tuple[Any, Any]:
    """Two numba intrinsics: ``store(array, index, value)``, an element store marked
    non-temporal (LLVM's ``!nontemporal``: ``movnti`` on x86-64, ``stnp`` on ARM), and
    ``fence()``, a sequentially consistent fence (``mfence``, ``dmb ish``), which orders the
    non-temporal stores before every later store."""
    from llvmlite import ir
    from numba import types
    from numba.extending import intrinsic

    @intrinsic
    def store(typingctx, array, index, value):  # type: ignore[no-untyped-def]
        def codegen(context, builder, signature, args):  # type: ignore[no-untyped-def]
            data = context.make_array(signature.args[0])(context, builder, args[0]).data
            instruction = builder.store(args[2], builder.gep(data, [args[1]]))
            instruction.set_metadata("nontemporal", builder.module.add_metadata([ir.Constant(ir.IntType(32), 1)]))
            return context.get_dummy_value()

        return types.void(array, index, value), codegen

    @intrinsic
    def fence(typingctx):  # type: ignore[no-untyped-def]
        def codegen(context, builder, signature, args):  # type: ignore[no-untyped-def]
            builder.fence("seq_cst")
            return context.get_dummy_value()

        return types.void(), codegen

    return store, fence


#: Host copies of fewer bytes go to ``torch`` (a call into a kernel costs more than it saves).
COPY_MIN_BYTES = 16 << 10


def _host_copy(dst: Any, src: Any) -> bool:
    """The device port's host copy once the kernels are loaded (see module docstring): ``dst``'s
    elements from ``src``'s, same dtype and shape, both in host memory; False when it does not
    apply (small, a conversion, a broadcast, a last dimension with a stride, a tensor autograd
    tracks), and the port copies with ``torch``."""
    if (_loaded is None or dst.dtype != src.dtype or dst.shape != src.shape
            or dst.numel() * dst.element_size() < COPY_MIN_BYTES or dst.device.type != "cpu"
            or src.device.type != "cpu" or dst.requires_grad):  # torch's copy says what is wrong with those
        return False
    runs = host_runs(dst, src)
    if runs is None:
        return False
    dst_bytes, src_bytes, parts = runs
    for d_at, d_stride, s_at, s_stride, rows, row_bytes in parts:
        _loaded.copy_kernel(src_bytes, s_at, s_stride, dst_bytes, d_at, d_stride, rows, row_bytes)
    return True


class _Span:
    """``nbytes`` of host memory at ``address``, for numpy (no copy; the caller keeps the tensor alive)."""

    def __init__(self, address: int, nbytes: int) -> None:
        self.__array_interface__ = {"data": (address, False), "shape": (nbytes,), "typestr": "|u1", "version": 3}


def _span(address: int, shape: tuple[int, ...], strides: tuple[int, ...], item: int) -> np.ndarray:
    """The bytes a view spans, from its first element to its last, as a 1-d uint8 array (no copy)."""
    last = sum((n - 1) * s for n, s in zip(shape, strides, strict=True)) if math.prod(shape) else -1
    return np.asarray(_Span(address, (last + 1) * item))


#: (dst's bytes, src's bytes, [(dst byte, dst row stride, src byte, src row stride, rows, bytes per row)])
Runs = tuple[np.ndarray, np.ndarray, list[tuple[int, int, int, int, int, int]]]


def host_runs(dst: Any, src: Any) -> Runs | None:
    """``dst``'s and ``src``'s elements (same shape and element size, host memory), row-major, as
    runs of bytes for the kernels (:mod:`weightsync.tools.codecs.digest_jit`); None when a last
    dimension is strided."""
    item = dst.element_size()
    if tuple(dst.shape) != tuple(src.shape) or src.element_size() != item:
        raise ValueError(f"copy of {tuple(src.shape)} x {src.element_size()} bytes into "
                         f"{tuple(dst.shape)} x {item} bytes")
    return _runs_at((dst.data_ptr(), tuple(dst.stride())), (src.data_ptr(), tuple(src.stride())), tuple(dst.shape),
                    item)


@functools.lru_cache(maxsize=1 << 15)
def _runs_at(dst: tuple[int, tuple[int, ...]], src: tuple[int, tuple[int, ...]], shape: tuple[int, ...],
             item: int) -> Runs | None:
    """:func:`_runs` of views given by (address, strides) and their shape. Cached: a transport lands the same
    views every version (its plan's ops into the same buffers, from the same slots), and working
    the runs out again cost more than the kernels' own loop over a version of ~1,000 pieces. A
    cached span is an address and a length, valid while a view with that geometry lives there."""
    (d_address, d_strides), (s_address, s_strides) = dst, src
    spans = (_span(d_address, shape, d_strides, item), _span(s_address, shape, s_strides, item))
    if not math.prod(shape):
        return spans[0], spans[1], []
    dims = [[n, d, s] for n, d, s in zip(shape, d_strides, s_strides, strict=True) if n != 1]
    if dims and (dims[-1][1] != 1 or dims[-1][2] != 1):
        return None
    while len(dims) >= 2 and all(dims[-2][k] == dims[-1][0] * dims[-1][k] for k in (1, 2)):
        inner = dims.pop()
        dims[-1] = [dims[-1][0] * inner[0], 1, 1]
    row = dims.pop()[0] if dims else 1
    rows, d_step, s_step = (dims.pop() if dims else (1, 0, 0))
    parts: list[tuple[int, int, int, int, int, int]] = []
    for index in itertools.product(*(range(n) for n, _, _ in dims)):
        d = sum(i * ds for i, (_, ds, _) in zip(index, dims, strict=True))
        s = sum(i * ss for i, (_, _, ss) in zip(index, dims, strict=True))
        parts.append((d * item, d_step * item, s * item, s_step * item, rows, row * item))
    return spans[0], spans[1], parts


_stripes_jit: Any = None
_store: Any = None
_fence: Any = None
_feed_jit: Any = None
_finish_jit: Any = None
_loaded: Kernels | None = None
_INIT = np.array(INIT, dtype=np.uint64)


def _once(src, s_at, s_stride, dst, d_at, d_stride, rows, row_bytes, init, keys, scr, last_keys, merge_keys, store):  # type: ignore[no-untyped-def]  # noqa: PLR0917
    """:meth:`Kernels.once`: a fresh stream's state, the runs fed, the value."""
    nbytes = rows * row_bytes
    acc = init.copy()
    buf = np.zeros(64, dtype=np.uint8)
    prev = np.zeros(64, dtype=np.uint8)
    st = np.zeros(4, dtype=np.int64)
    st[1] = (nbytes - 1) // 64
    _feed_jit(src, s_at, s_stride, dst, d_at, d_stride, rows, row_bytes, acc, buf, prev, st, keys, scr, store)
    return _finish_jit(nbytes, acc, buf, prev, st[2], last_keys, merge_keys)


def _copy(src, s_at, s_stride, dst, d_at, d_stride, rows, row_bytes):  # type: ignore[no-untyped-def]  # noqa: PLR0917
    """:meth:`Kernels.copy`: each run's whole words with non-temporal stores, its last bytes
    (under 8) with ordinary ones, then the fence."""
    words = row_bytes // 8
    for r in range(rows):
        sp = s_at + r * s_stride
        dp = d_at + r * d_stride
        s64 = src[sp: sp + 8 * words].view(np.uint64)
        d64 = dst[dp: dp + 8 * words].view(np.uint64)
        for i in range(words):
            _store(d64, i, s64[i])
        for i in range(8 * words, row_bytes):
            dst[dp + i] = src[sp + i]
    _fence()


def _feed(src, s_at, s_stride, dst, d_at, d_stride, rows, row_bytes, acc, buf, prev, st, keys, scr, store):  # type: ignore[no-untyped-def]  # noqa: PLR0917
    """Absorb ``rows`` runs (see :meth:`Kernels.feed`). Bytes go into the 64-byte partial stripe
    ``buf`` until it is whole, whole stripes straight from the run; stripes past the limit are
    the input's tail (at most 64 bytes), kept in ``buf`` for :meth:`Kernels.finish`."""
    g, limit, held = st[0], st[1], st[2]
    buf64 = buf.view(np.uint64)
    for r in range(rows):
        sp = s_at + r * s_stride
        dp = d_at + r * d_stride
        left = row_bytes
        while left > 0:
            k = 0 if held > 0 or g >= limit else min(left // 64, limit - g)
            if k == 0:  # into the partial stripe
                take = min(left, 64 - held)
                for i in range(take):
                    b = src[sp + i]
                    if store != _NO_COPY:
                        dst[dp + i] = b
                    buf[held + i] = b
                held += take
                sp += take
                dp += take
                left -= take
                if held == 64 and g < limit:
                    _stripes_jit(buf64, buf64, 1, acc, g, keys, scr, _NO_COPY)
                    prev[:] = buf
                    g += 1
                    held = 0
                continue
            _stripes_jit(src[sp: sp + 64 * k].view(np.uint64), dst[dp: dp + 64 * k].view(np.uint64), k, acc, g,
                         keys, scr, store)  # whole stripes straight from the run
            prev[:] = src[sp + 64 * (k - 1): sp + 64 * k]
            g += k
            sp += 64 * k
            dp += 64 * k
            left -= 64 * k
    st[0], st[2] = g, held
    st[3] += rows * row_bytes
    if store == _NON_TEMPORAL:
        _fence()  # the stripes' non-temporal stores, visible before anything the caller stores next


def _finish(nbytes, acc, buf, prev, held, last_keys, merge_keys):  # type: ignore[no-untyped-def]  # noqa: PLR0917
    """XXH3's end of a long input: the last stripe, the merge of the lanes, the avalanche."""
    last = np.empty(64, dtype=np.uint8)
    last[: 64 - held] = prev[held:]
    last[64 - held:] = buf[:held]
    words = last.view(np.uint64)
    lanes = acc.copy()
    lo32, sh32 = np.uint64(0xFFFFFFFF), np.uint64(32)
    for i in range(8):
        key = words[i] ^ last_keys[i]
        lanes[i ^ 1] += words[i]
        lanes[i] += (key & lo32) * (key >> sh32)
    result = np.uint64(nbytes) * np.uint64(_P64_1)
    for i in range(4):
        a, b = lanes[2 * i] ^ merge_keys[2 * i], lanes[2 * i + 1] ^ merge_keys[2 * i + 1]
        lo_lo = (a & lo32) * (b & lo32)  # the 128-bit product, folded: low 64 bits XOR high 64 bits
        hi_lo = (a >> sh32) * (b & lo32)
        lo_hi = (a & lo32) * (b >> sh32)
        cross = (lo_lo >> sh32) + (hi_lo & lo32) + lo_hi
        upper = (hi_lo >> sh32) + (cross >> sh32) + (a >> sh32) * (b >> sh32)
        result += ((cross << sh32) | (lo_lo & lo32)) ^ upper
    h = result ^ (result >> np.uint64(37))
    h *= np.uint64(0x165667919E3779F9)
    return h ^ (h >> sh32)


def _stripes(src, dst, count, acc, g, keys, scr, store):  # type: ignore[no-untyped-def]  # noqa: PLR0917
    """XXH3's accumulate over ``count`` stripes of ``src`` (8 words each), stored to ``dst`` too
    unless ``store`` is :data:`_NO_COPY`; the first is stripe ``g`` of the stream, and a block
    ends after every 16th (scramble). Lane i adds its word XOR key, low 32 times high 32 bits, and its neighbour's
    (i ^ 1) word. Within a block the two sums are kept per lane (p, r), without the swap, so
    the eight lanes are isomorphic; the swap is applied once per block (addition commutes:
    the accumulators are XXH3's)."""
    lo, sh32, sh47 = np.uint64(0xFFFFFFFF), np.uint64(32), np.uint64(47)
    prime = np.uint64(_P32_1)
    a0, a1, a2, a3, a4, a5, a6, a7 = acc[0], acc[1], acc[2], acc[3], acc[4], acc[5], acc[6], acc[7]
    t = 0
    while t < count:
        n = min(16 - (g & 15), count - t)
        kb0 = (g & 15) * 8
        zero = np.uint64(0)
        p0 = p1 = p2 = p3 = p4 = p5 = p6 = p7 = zero
        r0 = r1 = r2 = r3 = r4 = r5 = r6 = r7 = zero
        for s in range(n):
            b = (t + s) * 8
            kb = kb0 + s * 8
            w0, w1, w2, w3 = src[b], src[b + 1], src[b + 2], src[b + 3]
            w4, w5, w6, w7 = src[b + 4], src[b + 5], src[b + 6], src[b + 7]
            if store == _NON_TEMPORAL:  # see module docstring; the caller fences
                _store(dst, b, w0)
                _store(dst, b + 1, w1)
                _store(dst, b + 2, w2)
                _store(dst, b + 3, w3)
                _store(dst, b + 4, w4)
                _store(dst, b + 5, w5)
                _store(dst, b + 6, w6)
                _store(dst, b + 7, w7)
            elif store == _CACHED:
                dst[b], dst[b + 1], dst[b + 2], dst[b + 3] = w0, w1, w2, w3
                dst[b + 4], dst[b + 5], dst[b + 6], dst[b + 7] = w4, w5, w6, w7
            z0, z1, z2, z3 = w0 ^ keys[kb], w1 ^ keys[kb + 1], w2 ^ keys[kb + 2], w3 ^ keys[kb + 3]
            z4, z5, z6, z7 = w4 ^ keys[kb + 4], w5 ^ keys[kb + 5], w6 ^ keys[kb + 6], w7 ^ keys[kb + 7]
            p0 += (z0 & lo) * (z0 >> sh32)
            p1 += (z1 & lo) * (z1 >> sh32)
            p2 += (z2 & lo) * (z2 >> sh32)
            p3 += (z3 & lo) * (z3 >> sh32)
            p4 += (z4 & lo) * (z4 >> sh32)
            p5 += (z5 & lo) * (z5 >> sh32)
            p6 += (z6 & lo) * (z6 >> sh32)
            p7 += (z7 & lo) * (z7 >> sh32)
            r0 += w0
            r1 += w1
            r2 += w2
            r3 += w3
            r4 += w4
            r5 += w5
            r6 += w6
            r7 += w7
        a0 += p0 + r1
        a1 += p1 + r0
        a2 += p2 + r3
        a3 += p3 + r2
        a4 += p4 + r5
        a5 += p5 + r4
        a6 += p6 + r7
        a7 += p7 + r6
        g += n
        t += n
        if (g & 15) == 0:
            a0 = ((a0 ^ (a0 >> sh47)) ^ scr[0]) * prime
            a1 = ((a1 ^ (a1 >> sh47)) ^ scr[1]) * prime
            a2 = ((a2 ^ (a2 >> sh47)) ^ scr[2]) * prime
            a3 = ((a3 ^ (a3 >> sh47)) ^ scr[3]) * prime
            a4 = ((a4 ^ (a4 >> sh47)) ^ scr[4]) * prime
            a5 = ((a5 ^ (a5 >> sh47)) ^ scr[5]) * prime
            a6 = ((a6 ^ (a6 >> sh47)) ^ scr[6]) * prime
            a7 = ((a7 ^ (a7 >> sh47)) ^ scr[7]) * prime
    acc[0], acc[1], acc[2], acc[3], acc[4], acc[5], acc[6], acc[7] = a0, a1, a2, a3, a4, a5, a6, a7
