"""Box geometry and flat-range decomposition, against hand-computed answers."""

from __future__ import annotations

import math

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from weightsync.layout import Box, chunk_bounds, contiguous_strides, even_bounds, flat_range_regions
from weightsync.layout.box import is_contiguous_view
from weightsync.plan.reference import view


def test_intersect_and_contains():
    a = Box((0, 0), (4, 8))
    b = Box((2, 4), (4, 8))
    assert a.intersect(b) == Box((2, 4), (2, 4))
    assert a.intersect(Box((4, 0), (1, 8))) is None
    assert a.contains(Box((1, 1), (2, 2)))
    assert not a.contains(b)


def test_subtract_covers_difference_exactly():
    a = Box((0, 0), (4, 4))
    b = Box((1, 1), (2, 2))
    pieces = a.subtract(b)
    grid = np.zeros((4, 4), dtype=int)
    for p in pieces:
        grid[p.slices()] += 1
    expected = np.ones((4, 4), dtype=int)
    expected[1:3, 1:3] = 0
    assert np.array_equal(grid, expected)


def test_box_rejects_bad_input():
    with pytest.raises(ValueError, match="different ranks"):
        Box((0,), (1, 2))
    with pytest.raises(ValueError, match="non-negative"):
        Box((-1,), (2,))


@pytest.mark.parametrize(("size", "parts", "expected"), [
    (10, 3, [(0, 4), (4, 8), (8, 10)]),
    (7, 4, [(0, 2), (2, 4), (4, 6), (6, 7)]),
    (2, 4, [(0, 1), (1, 2), (2, 2), (2, 2)]),  # torch.chunk: trailing chunks empty
    (0, 2, [(0, 0), (0, 0)]),
])
def test_chunk_bounds_match_torch_chunk(size, parts, expected):
    assert chunk_bounds(size, parts) == expected


def test_even_bounds_error_names_dimension():
    with pytest.raises(ValueError, match="heads of size 10 is not divisible by 4"):
        even_bounds(10, 4, what="heads")


def test_contiguity():
    assert contiguous_strides((2, 3, 4)) == (12, 4, 1)
    assert is_contiguous_view((2, 4), (4, 1))
    assert is_contiguous_view((1, 4), (99, 1))  # unit dims do not matter
    assert not is_contiguous_view((2, 4), (8, 1))


@pytest.mark.parametrize(("shape", "start", "stop", "expected_boxes"), [
    # whole rows
    ((4, 5), 5, 15, [((1, 0), (2, 5))]),
    # partial head row, whole rows, partial tail row
    ((4, 5), 3, 17, [((0, 3), (1, 2)), ((1, 0), (2, 5)), ((3, 0), (1, 2))]),
    # within one row
    ((4, 5), 6, 9, [((1, 1), (1, 3))]),
    # 3-d: partial block decomposes recursively
    ((2, 3, 4), 5, 19, [((0, 1, 1), (1, 1, 3)), ((0, 2, 0), (1, 1, 4)), ((1, 0, 0), (1, 1, 4)),
                        ((1, 1, 0), (1, 1, 3))]),
    ((6,), 2, 5, [((2,), (3,))]),
])
def test_flat_range_regions_table(shape, start, stop, expected_boxes):
    regions = flat_range_regions(("t", shape), start, stop)
    assert [(r.box.offsets, r.box.sizes) for r in regions] == expected_boxes


@settings(deadline=None)  # a loaded 2-core machine can take over hypothesis's 200 ms for one example
@given(st.lists(st.integers(1, 5), min_size=1, max_size=4), st.data())
def test_flat_range_regions_reproduce_the_run(shape, data):
    numel = math.prod(shape)
    start = data.draw(st.integers(0, numel))
    stop = data.draw(st.integers(start, numel))
    full = np.arange(numel, dtype=np.int64).reshape(shape)
    run = full.reshape(-1)[start:stop].copy()
    for region in flat_range_regions(("t", tuple(shape)), start, stop):
        got = view(run, region.offset, region.box.sizes, region.strides)
        assert np.array_equal(got, full[region.box.slices()])
    assert sum(r.numel for r in flat_range_regions(("t", tuple(shape)), start, stop)) == stop - start
