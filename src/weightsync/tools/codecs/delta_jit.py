"""Compiled inner loops of :mod:`weightsync.tools.codecs.delta` (numba), used when numba is installed.

Finding the changed elements is the whole cost of a delta on the writer. numpy needs several
passes for it (compare, find the changed words, gather them, split them into elements: 9-11
ms per 29 MB of bf16 at 2.7% changed on one core here); one compiled pass does it in about
half that, and updates the writer's copy of what the reader holds on the way. The reader's
apply is one checked scatter. numba is optional (``pip install 'weightsync[delta]'``; vLLM's
CPU build already pulls it in): :func:`load` returns None without it and delta.py uses numpy.
Kernels compile on first use and are cached on disk (``cache=True``)::

    jit = load()
    if jit is not None:
        k = jit.diff(a64, b64, a_el, b_el, per, index, values, scratch, update)   # index[:k], values[:k]
"""

from __future__ import annotations

import functools
import importlib.util
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class Kernels:
    """The compiled functions (numba dispatchers)."""

    diff: Any
    in_range: Any
    scatter: Any


@functools.cache
def load() -> Kernels | None:
    """Compile (or load from numba's cache) the kernels; None when numba is not installed."""
    if importlib.util.find_spec("numba") is None:
        return None
    from numba import njit

    _answer_dict_lookups_with_a_dict()
    jit = njit(cache=True, nogil=True)
    return Kernels(diff=jit(_diff), in_range=jit(_in_range), scatter=jit(_scatter))


def _answer_dict_lookups_with_a_dict() -> None:
    """Keep vLLM engines startable in this process after numba loaded.

    llvmlite's library handle (``llvmlite.binding.ffi.lib``) resolves unknown attributes as C
    functions, ``__dict__`` included, so ``vars(lib)`` is a function wrapper. vLLM's CPU platform
    scans every module namespace when a worker starts and calls ``vars(obj).get("kernel")``
    (``vllm/triton_utils/dispatcher.py``, 0.32): an in-process ``LLM`` built after a delta was
    computed here died with ``AttributeError: '_lib_fn_wrapper' object has no attribute 'get'``.
    The handle's own cache of resolved names answers ``__dict__`` with an empty dict instead."""
    try:
        from llvmlite.binding import ffi
    except ImportError:
        return
    table = getattr(ffi.lib, "_fntab", None)
    if isinstance(table, dict) and not isinstance(table.get("__dict__"), dict):
        table["__dict__"] = {}


def _diff(a64: Any, b64: Any, a_el: Any, b_el: Any, per: int, index: Any, values: Any,  # noqa: PLR0917
          scratch: Any, update: bool) -> int:  # numba kernels take their arrays positionally
    """Ascending positions (``index``) and new values (``values``) of the elements where ``a_el``
    differs from ``b_el``; returns how many. ``a64``/``b64`` are the same bytes as 8-byte words
    (``per`` elements each; elements after the last whole word are compared one by one).

    Branch-free where it matters: pass 1 writes every word's position to ``scratch`` and
    advances only past changed ones; pass 2 does the same for the elements of those words.
    With ``update``, ``b`` takes the new words (it then equals ``a``).
    """
    k = 0
    words = a64.size
    chunk = scratch.size
    for start in range(0, words, chunk):
        m = 0
        for w in range(start, min(words, start + chunk)):
            scratch[m] = w
            m += a64[w] != b64[w]
        for i in range(m):
            w = scratch[i]
            for e in range(w * per, w * per + per):
                v = a_el[e]
                index[k] = e
                values[k] = v
                k += v != b_el[e]
            if update:
                b64[w] = a64[w]
    for e in range(words * per, a_el.size):
        v = a_el[e]
        if v != b_el[e]:
            index[k] = e
            values[k] = v
            k += 1
            if update:
                b_el[e] = v
    return k


def _in_range(index: Any, n: int) -> bool:
    """Whether every position is in [0, n)."""
    for i in range(index.size):  # noqa: SIM110 (numba compiles loops, not generators)
        if index[i] < 0 or index[i] >= n:
            return False
    return True


def _scatter(dest: Any, index: Any, values: Any) -> None:
    for i in range(index.size):
        dest[index[i]] = values[i]
