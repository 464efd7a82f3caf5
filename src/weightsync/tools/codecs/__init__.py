"""Codecs: how a writer's bytes are turned into fewer bytes on the wire, and back.

* :mod:`~weightsync.tools.codecs.fp8`: FP8 quantize-on-send (the writers' side of ``layout.quant``);
* :mod:`~weightsync.tools.codecs.delta`: lossless encodings of a payload against its previous
  version (compiled inner loops in :mod:`~weightsync.tools.codecs.delta_jit` when numba is installed).

They work on torch tensors in a rank's memory and know nothing of transports or the meta
server; the transports use them (delta per pair: :mod:`weightsync.transport.delta.pairs`).
"""
