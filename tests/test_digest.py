"""The digest primitive (weightsync/tools/codecs/digest.py): values against independent references,
streaming equal to one shot, every one-byte change seen, and the same bits on every device."""

from __future__ import annotations

import numpy as np
import pytest
import torch
import xxhash
from hypothesis import given, settings
from hypothesis import strategies as st

from budget import examples
from weightsync.tools.codecs import digest as digest_mod
from weightsync.tools.codecs import digest_jit
from weightsync.tools.codecs.digest import (
    CopyHasher,
    Digest,
    Hasher,
    as_signed,
    as_unsigned,
    bytes_digest,
    kind_for,
    tensor_digest,
)

M = (1 << 64) - 1


def splitmix_finish(z):
    """SplitMix64's finaliser, on numpy uint64 arrays or Python ints."""
    if isinstance(z, int):
        z = ((z ^ (z >> 30)) * digest_mod._M1) & M
        z = ((z ^ (z >> 27)) * digest_mod._M2) & M
        return z ^ (z >> 31)
    z = (z ^ (z >> np.uint64(30))) * np.uint64(digest_mod._M1)
    z = (z ^ (z >> np.uint64(27))) * np.uint64(digest_mod._M2)
    return z ^ (z >> np.uint64(31))


def sum64_reference(data: bytes) -> int:
    """sum64 written out with numpy's wrapping uint64 arithmetic (the definition in the docs)."""
    padded = data + b"\0" * (-len(data) % 8)
    words = np.frombuffer(padded, dtype="<u8")
    with np.errstate(over="ignore"):
        keys = np.arange(words.size, dtype=np.uint64) * np.uint64(digest_mod._K_POS) + np.uint64(digest_mod._K_SEED)
        total = int(splitmix_finish(words ^ keys).sum(dtype=np.uint64)) if words.size else 0
    return splitmix_finish((total + digest_mod._K_LEN * len(data)) & M)


def raw(t: torch.Tensor) -> bytes:
    return bytes(t.contiguous().reshape(-1).view(torch.uint8).numpy().tobytes())


@pytest.fixture(scope="module")
def kernels():
    """The fused kernels, loaded in this process (compiled once, then from numba's cache)."""
    loaded = digest_jit.load()
    assert loaded is not None, "numba is a dependency"
    return loaded


@pytest.fixture(params=["fused", "second pass"])
def fused(request, monkeypatch):
    """CopyHasher with the kernels loaded, and as in a process that never loaded them."""
    if request.param == "fused":
        request.getfixturevalue("kernels")
    else:
        monkeypatch.setattr(digest_jit, "_loaded", None)
    return request.param == "fused"


def test_a_small_rank_never_starts_numba_and_a_large_one_loads_the_kernels(monkeypatch):
    """With integrity on, a rank holding less than FUSE_MIN_BYTES (every test's tiny model) must
    not pay numba's start (seconds per process) in each process of a job."""
    monkeypatch.setattr(digest_jit, "_loaded", None)
    calls: list[int] = []
    monkeypatch.setattr(digest_jit, "load", lambda: calls.append(1) or "kernels")
    assert digest_jit.for_rank(digest_jit.FUSE_MIN_BYTES - 1) is None
    assert calls == []
    assert digest_jit.for_rank(digest_jit.FUSE_MIN_BYTES) == "kernels"
    assert calls == [1]
    assert CopyHasher("xxh3", 4096)._kernels is None  # loaded() only: no compile behind a copy's back


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float8_e4m3fn, torch.int64, torch.uint8])
def test_values_match_references_for_every_dtype_and_view(dtype):
    g = torch.Generator().manual_seed(1)
    base = (torch.randn(13, 7, generator=g) * 4).to(dtype)
    for t in (base, base[:, 2:5], base.t(), base[3], base[5:5]):  # contiguous, strided, transposed, row, empty
        data = raw(t)
        assert tensor_digest(t, "xxh3") == Digest("xxh3", xxhash.xxh3_64_intdigest(data), len(data))
        assert tensor_digest(t, "sum64") == Digest("sum64", sum64_reference(data), len(data))
        assert bytes_digest(data, "xxh3") == tensor_digest(t, "xxh3")
        assert bytes_digest(data, "sum64") == tensor_digest(t, "sum64")


@settings(max_examples=examples(60), deadline=None)
@given(data=st.binary(min_size=0, max_size=300), cuts=st.lists(st.integers(0, 300), max_size=6),
       kind=st.sampled_from(["xxh3", "sum64"]))
def test_streaming_equals_one_shot_whatever_the_cuts(data, cuts, kind):
    t = torch.frombuffer(bytearray(data), dtype=torch.uint8) if data else torch.zeros(0, dtype=torch.uint8)
    bounds = sorted({0, len(data), *(c for c in cuts if c <= len(data))})
    h = Hasher(kind)
    for lo, hi in zip(bounds, bounds[1:]):
        h.update(t[lo:hi])
    assert h.digest() == tensor_digest(t, kind)


@settings(max_examples=examples(30), deadline=None)
@given(size=st.integers(0, 3000) | st.integers(3000, 20000), seed=st.integers(0, 2**31),
       rows=st.lists(st.tuples(st.integers(1, 8), st.integers(1, 3000)), min_size=1, max_size=4),
       gap=st.integers(0, 9), skew=st.integers(0, 7), nontemporal=st.booleans())
def test_fused_copy_digest_is_xxh3_whatever_the_cut(kernels, size, seed, rows, gap, skew, nontemporal):
    """The fused kernels (copy + XXH3 in one pass) against the xxhash package: the bytes of one
    piece cut into parts of strided rows at odd offsets (as slabs and strided views arrive),
    copied into a strided destination, with ordinary or non-temporal stores; the copy is exact
    and the digest is XXH3's."""
    data = torch.randint(0, 256, (size,), dtype=torch.uint8, generator=torch.Generator().manual_seed(seed))
    hasher, again = CopyHasher("xxh3", size), CopyHasher("xxh3", size)
    assert size <= digest_jit.SHORT_MAX or hasher._kernels is kernels
    at, k = 0, 0
    while at < size:  # part k: `count` rows of `width` bytes, `gap` apart, at offset `skew` of a buffer
        count, width = rows[k % len(rows)]
        if count * width > size - at:
            count, width = 1, size - at
        src = torch.zeros(skew + count * (width + gap), dtype=torch.uint8)
        dst = torch.zeros(skew + 1 + count * (width + gap + 1), dtype=torch.uint8)
        src_view = src[skew:].as_strided((count, width), (width + gap, 1))
        dst_view = dst[skew + 1:].as_strided((count, width), (width + gap + 1, 1))
        src_view.copy_(data[at: at + count * width].view(count, width))
        hasher.copy(dst_view, src_view, nontemporal=nontemporal)
        assert torch.equal(dst_view, src_view)
        again.update(dst_view)
        at, k = at + count * width, k + 1
    expected = xxhash.xxh3_64_intdigest(raw(data))
    assert hasher.value() == again.value() == expected


def test_a_reader_lands_around_the_cache_and_a_writer_packs_through_it(kernels, monkeypatch):
    """A reader's landing stores non-temporally (nothing reads engine memory soon); a writer's
    pack stores through the cache (the transport reads the slot next). Asking the kernels for
    non-temporal stores without a copy is an error, not a digest that ignores it."""
    from weightsync.layout import ModelSpec, parse_layout
    from weightsync.layout.roster import Roster
    from weightsync.plan import PlanOptions, build_local_plan
    from weightsync.tools.torch_layout import allocate
    from weightsync.transport import digests as digests_module
    from weightsync.transport.tensors import flat_views, op_dst_view, op_src_view

    asked: list[bool] = []
    real = CopyHasher.copy
    monkeypatch.setattr(CopyHasher, "copy", lambda self, dst, src, *, copy=None, nontemporal=False: (
        asked.append(nontemporal), real(self, dst, src, copy=copy, nontemporal=nontemporal))[1])
    spec = ModelSpec(family="llama", vocab_size=64, hidden_size=32, intermediate_size=64, num_layers=1, num_heads=4,
                     num_kv_heads=4, head_dim=8, dtype="float32")
    writer = parse_layout("megatron:tp=1").rank_layout(spec, 0)
    reader = parse_layout("vllm:tp=1").rank_layout(spec, 0)
    options = PlanOptions()
    plans = {role: build_local_plan(Roster.from_layouts([writer]), Roster.from_layouts([reader]), role=role, rank=0,
                                    options=options) for role in ("writer", "reader")}
    src, dst = flat_views(allocate(writer)), flat_views(allocate(reader))
    book = {role: digests_module.VersionDigests(plans[role], None, role=role, rank=0, kind="xxh3", device="cpu")
            for role in plans}
    op = max(plans["reader"].ops, key=lambda o: o.nbytes)
    book["writer"].begin(0)
    book["writer"].pack(op, op_dst_view(dst, op), op_src_view(src, op))
    book["reader"].begin(0)
    book["reader"].land(op, op_dst_view(dst, op), op_src_view(src, op))
    assert asked == [False, True]
    data = np.zeros(512, dtype=np.uint8)
    with pytest.raises(ValueError, match="nontemporal says how a copy stores"):
        kernels.once(data, 0, 512, data, 0, 512, 1, 512, copy=False, nontemporal=True)


@settings(max_examples=examples(30), deadline=None)
@given(rows=st.integers(1, 6), width=st.integers(1, 9000), gap=st.integers(0, 17), skew=st.integers(0, 15),
       seed=st.integers(0, 2**31))
def test_the_plain_copy_kernel_copies_every_byte_and_nothing_else(kernels, rows, width, gap, skew, seed):
    """The non-temporal copy (whole words, then the last bytes) of strided rows at odd offsets:
    the destination equals the source, and the gaps between its rows keep what they held."""
    gen = torch.Generator().manual_seed(seed)
    src = torch.randint(0, 256, (skew + rows * (width + gap),), dtype=torch.uint8, generator=gen)
    dst = torch.randint(0, 256, (skew + 3 + rows * (width + gap + 5),), dtype=torch.uint8, generator=gen)
    before = dst.clone()
    kernels.copy(src.numpy(), skew, width + gap, dst.numpy(), skew + 3, width + gap + 5, rows, width)
    for r in range(rows):
        d_at, s_at = skew + 3 + r * (width + gap + 5), skew + r * (width + gap)
        assert torch.equal(dst[d_at: d_at + width], src[s_at: s_at + width])
        before[d_at: d_at + width] = src[s_at: s_at + width]
    assert torch.equal(dst, before)  # nothing outside the rows was written


def test_the_device_port_copies_host_tensors_with_the_kernels_once_they_are_loaded(kernels, monkeypatch):
    """After :func:`digest_jit.load` the real port's host copies go through the copy kernel when it
    applies (same dtype and shape, 16 KiB or more, a last dimension of stride 1), and through
    ``torch`` otherwise; both give the same tensor as ``torch``'s copy."""
    from weightsync.ports import device

    port = device.TorchDevices()
    used = []
    real = kernels.copy_kernel
    monkeypatch.setattr(digest_jit, "_loaded", digest_jit.Kernels(
        kernels.feed_kernel, kernels.finish_kernel, kernels.once_kernel,
        lambda *a: used.append(a[-1]) or real(*a)))
    base = torch.randn(64, 300, generator=torch.Generator().manual_seed(3)).to(torch.bfloat16)
    cases = {  # name -> (dst, src, kernel used)
        "dense": (torch.zeros(64, 300, dtype=torch.bfloat16), base, True),
        "rows of a wider tensor": (torch.zeros(64, 320, dtype=torch.bfloat16)[:, 10:310], base, True),
        "small": (torch.zeros(4, 300, dtype=torch.bfloat16), base[:4], False),
        "converting": (torch.zeros(64, 300), base, False),
        "transposed": (torch.zeros(300, 64, dtype=torch.bfloat16).t(), base, False),
        "broadcast": (torch.zeros(64, 300, dtype=torch.bfloat16), base[:1], False),
    }
    for name, (dst, src, kernel) in cases.items():
        used.clear()
        port.copy(dst, src)
        assert torch.equal(dst, src.to(dst.dtype).expand_as(dst)), name
        assert bool(used) == kernel, name
    leaf = torch.zeros(64, 300, dtype=torch.bfloat16, requires_grad=True)
    with pytest.raises(RuntimeError, match="requires grad"):  # torch's own error, not a silent write
        port.copy(leaf, base)


@pytest.mark.parametrize("kind", ["xxh3", "sum64"])
def test_copy_hasher_equals_the_digest_of_what_it_stored(kind, fused):
    """Every view a transport copies: dense, strided rows, 3-d boxes, a transposed (inner stride
    not 1) view, one element; and a copy that converts (digest of the converted bytes)."""
    base = torch.randn(12, 40, 36, generator=torch.Generator().manual_seed(6)).to(torch.bfloat16)
    views = [base, base[:, 3:30, :], base[5, :, 8:], base.transpose(1, 2), base[:, :, 7], base[2:3, 4:5, 5:6],
             base[:7, 1:2, :]]
    for view in views:
        dst = torch.zeros(14, 44, 44, dtype=torch.bfloat16)[: view.shape[0], : view.shape[1], : view.shape[2]] \
            if view.dim() == 3 else torch.zeros_like(view)
        hasher = CopyHasher(kind, view.numel() * view.element_size())
        assert (hasher._kernels is not None) == (fused and kind == "xxh3" and view.numel() * 2 > digest_jit.SHORT_MAX)
        hasher.copy(dst, view)
        assert torch.equal(dst, view)
        assert hasher.value() == tensor_digest(view, kind).value, tuple(view.shape)
    wide = torch.zeros(12, 40, 36, dtype=torch.float32)
    hasher = CopyHasher(kind, wide.numel() * 4)
    hasher.copy(wide, base)
    assert hasher.value() == tensor_digest(base.float(), kind).value
    with pytest.raises(ValueError, match="was digested after 0 of them"):
        CopyHasher(kind, 10).value()


def test_sum64_chunks_compose(monkeypatch):
    """Words beyond one chunk are weighted by their index in the stream, not in the chunk."""
    data = torch.randint(0, 256, (8 * 37 + 5,), dtype=torch.uint8, generator=torch.Generator().manual_seed(2))
    expected = sum64_reference(raw(data))
    monkeypatch.setattr(digest_mod, "CHUNK_WORDS", 4)
    assert tensor_digest(data, "sum64").value == expected
    h = Hasher("sum64")
    for lo in range(0, data.numel(), 11):  # odd piece sizes: partial words carried across updates
        h.update(data[lo: lo + 11])
    assert h.value() == expected


@pytest.mark.parametrize("kind", ["xxh3", "sum64"])
def test_every_one_byte_change_is_seen(kind):
    data = torch.randint(0, 256, (67,), dtype=torch.uint8, generator=torch.Generator().manual_seed(3))
    before = tensor_digest(data, kind)
    seen = set()
    for at in range(data.numel()):
        for flip in (1, 0x80, 0xFF):
            changed = data.clone()
            changed[at] ^= flip
            after = tensor_digest(changed, kind)
            assert after != before, (at, flip)
            seen.add(after.value)
    assert len(seen) == 3 * data.numel()  # no two of these changes collide either


def test_length_counts_and_zero_padding_is_not_content():
    assert tensor_digest(torch.zeros(3, dtype=torch.uint8), "sum64") != tensor_digest(
        torch.zeros(4, dtype=torch.uint8), "sum64")
    assert bytes_digest(b"", "sum64").value == sum64_reference(b"")


def test_kind_for_a_job_and_the_wire_form():
    assert kind_for(["cpu", "cpu"]) == "xxh3"
    assert kind_for(["cpu", "cuda:1"]) == "sum64"
    d = tensor_digest(torch.arange(10.0), "sum64")
    assert Digest.from_wire(d.to_wire()) == d
    assert str(d) == f"sum64:{d.value:016x}"
    with pytest.raises(ValueError, match="field 'kind' is missing"):
        Digest.from_wire({"value": 1, "nbytes": 2})
    with pytest.raises(ValueError, match="unknown digest kind 'md5'"):
        Digest("md5", 1, 2)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="unknown digest kind"):
        Hasher("crc")  # type: ignore[arg-type]
    for v in (0, 1, (1 << 63) - 1, 1 << 63, (1 << 64) - 1):
        assert as_unsigned(as_signed(v)) == v
        assert -(1 << 63) <= as_signed(v) < 1 << 63


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("kind", ["xxh3", "sum64"])
def test_same_value_on_gpu_and_cpu(kind):
    t = torch.randn(1000, 33, generator=torch.Generator().manual_seed(4)).to(torch.bfloat16)
    assert tensor_digest(t.cuda(), kind) == tensor_digest(t, kind)
    assert tensor_digest(t.cuda()[:, 1:9], kind) == tensor_digest(t[:, 1:9], kind)


def test_the_device_kernels_equal_the_host_ones():
    """GPUs run sum64's torch kernels, CPUs its numpy ones: run the torch ones here, on the CPU."""
    words = torch.randint(-(1 << 62), 1 << 62, (1001,), dtype=torch.int64, generator=torch.Generator().manual_seed(5))
    words[::7] |= -(1 << 63)  # top bits set: the logical shifts matter
    for base in (0, 3, 1 << 40):
        on_device = as_unsigned(int(digest_mod._mix(words, base).sum()))
        assert on_device == digest_mod._mix_host(words.numpy().view(np.uint64), base)
