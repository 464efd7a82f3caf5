"""The arithmetic of MXFP8, MXFP4 and NVFP4: block scales and element codes, in torch.

One fixed function per step, the same on every rank and device, so that a weight quantized
from many writers' pieces is bit for bit the whole tensor quantized at once. Blocks run along
a weight's input dimension (the last here: callers move it there).

**MX (OCP Microscaling v1.0, section 6.3)**, blocks of 32, an E8M0 scale per block:

    shared = floor(log2(amax)) - emax_elem     (E2M1: emax 2, E4M3: emax 8), clamped to [-127, 127]
    code   = shared + 127                       (E8M0; amax 0: code 0; amax NaN or inf: 0xFF, NaN)
    P_i    = quantize(V_i / 2**shared)          (round to nearest even, saturating at the format's max)

``floor(log2(amax))`` is exact (``frexp``), ``V_i / 2**shared`` is exact (``ldexp``). A block
whose scale is NaN has every element 0 (any element decodes to NaN with it).

**NVFP4** (the rules of compressed-tensors' NVFP4, which vLLM loads), blocks of 16:

    gs  = 448 * 6 / amax(tensor)                (float32 ``weight_global_scale``; 1.0 when amax is 0 or not finite)
    s_b = e4m3(min(amax_b / 6 * gs, 448))       (float32 arithmetic, round to nearest even; 0 -> 0.125, e4m3's eps)
    P_i = e2m1(V_i / (s_b / gs))                (round to nearest even, saturating at 6)

A block whose ``amax_b`` is NaN has scale NaN (0x7F) and every element 0.

FP4 E2M1 codes are 4 bits, sign in bit 3 (``-0.0`` keeps it); two pack into a byte, the first
element in the low nibble (gpt-oss's ``*_blocks``, compressed-tensors' ``weight_packed``).

    codes = e2m1_codes(values)               # uint8 0..15 per element
    packed = pack_nibbles(codes)             # pairs along the last dim
"""

from __future__ import annotations

import torch

E2M1_MAX = 6.0
E4M3_MAX = 448.0
#: the largest element exponent of each element format (OCP MX: emax_elem)
EMAX = {"e2m1": 2, "e4m3": 8}
#: E8M0's NaN code
E8M0_NAN = 0xFF
#: the fp8 scale of an NVFP4 block whose scale would be 0 (compressed-tensors: e4m3's eps)
NVFP4_ZERO_SCALE = 0.125


def e2m1_codes(values: torch.Tensor) -> torch.Tensor:
    """FP4 E2M1 codes (uint8 0..15) of float32 ``values``: nearest of 0, 0.5, 1, 1.5, 2, 3, 4, 6,
    ties to the even code, saturating at 6; NaN -> 0; the sign bit from ``values``' sign."""
    mag = values.abs()
    code = ((mag > 0.25).to(torch.uint8) + (mag >= 0.75).to(torch.uint8) + (mag > 1.25).to(torch.uint8)
            + (mag >= 1.75).to(torch.uint8) + (mag > 2.5).to(torch.uint8) + (mag >= 3.5).to(torch.uint8)
            + (mag > 5.0).to(torch.uint8))
    sign = torch.signbit(values) & ~torch.isnan(values)
    return code | (sign.to(torch.uint8) << 3)


def e2m1_values(codes: torch.Tensor) -> torch.Tensor:
    """float32 values of FP4 E2M1 codes (for checks and dequantizing)."""
    table = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0], device=codes.device)
    out = table[(codes & 7).long()]
    return torch.where((codes & 8) != 0, -out, out)


def pack_nibbles(codes: torch.Tensor) -> torch.Tensor:
    """Pairs of 4-bit codes along the last dim (even length) into bytes, the first in the low nibble."""
    return codes[..., 0::2] | (codes[..., 1::2] << 4)


def unpack_nibbles(packed: torch.Tensor) -> torch.Tensor:
    """The codes of :func:`pack_nibbles`' bytes (the last dim doubles)."""
    return torch.stack([packed & 0x0F, packed >> 4], dim=-1).flatten(-2)


def mx_scale_codes(amax: torch.Tensor, elements: str) -> torch.Tensor:
    """E8M0 scale codes (uint8) of float32 block maxima for ``elements`` ("e2m1" or "e4m3")."""
    _, exponent = torch.frexp(amax)  # amax = m * 2**exponent, m in [0.5, 1): floor(log2) = exponent - 1
    shared = (exponent.to(torch.int32) - 1 - EMAX[elements]).clamp(-127, 127)
    code = (shared + 127).to(torch.uint8)
    code = torch.where(amax == 0, torch.zeros_like(code), code)
    return torch.where(torch.isfinite(amax), code, torch.full_like(code, E8M0_NAN))


def _pow2(exponent: torch.Tensor) -> torch.Tensor:
    """2**exponent in float32, exactly, for integer exponents in [-126, 127] (built from its bits)."""
    return ((exponent.to(torch.int32) + 127) << 23).view(torch.float32)


def mx_elements(values: torch.Tensor, codes: torch.Tensor, elements: str) -> torch.Tensor:
    """MX element codes of float32 ``values`` given each element's block's E8M0 scale code
    (``codes``, broadcast against ``values``): uint8 E2M1 codes, or float8_e4m3fn values."""
    shared = codes.to(torch.int32) - 127  # in [-127, 125] for finite blocks: 2**-shared is a normal float32
    scaled = values * _pow2((-shared).clamp(-126, 127))
    nan_block = codes == E8M0_NAN
    if elements == "e2m1":
        return torch.where(nan_block, torch.zeros((), dtype=torch.uint8, device=values.device), e2m1_codes(scaled))
    q = scaled.clamp(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn)
    return torch.where(nan_block, torch.zeros((), dtype=torch.float8_e4m3fn, device=values.device), q)


def nvfp4_global_scale(amax: torch.Tensor) -> torch.Tensor:
    """``weight_global_scale`` (float32) from the tensor's (or each expert's) float32 maximum."""
    scale = torch.full_like(amax, E4M3_MAX * E2M1_MAX) / amax
    usable = torch.isfinite(amax) & (amax > 0)
    return torch.where(usable, scale, torch.ones_like(scale))


def nvfp4_block_scales(amax: torch.Tensor, global_scale: torch.Tensor) -> torch.Tensor:
    """NVFP4 block scales (float8_e4m3fn) from float32 block maxima and their tensor's global scale
    (broadcast against ``amax``)."""
    scale = (amax / E2M1_MAX * global_scale).clamp(max=E4M3_MAX).to(torch.float8_e4m3fn)
    as_float = scale.float()
    bits = torch.where(as_float == 0, torch.full_like(scale, NVFP4_ZERO_SCALE).view(torch.uint8),
                       scale.view(torch.uint8))
    nan = torch.full_like(bits, 0x7F)  # one NaN encoding, whatever sign the cast gave it
    return torch.where(torch.isnan(as_float), nan, bits).view(torch.float8_e4m3fn)


def nvfp4_elements(values: torch.Tensor, scales: torch.Tensor, global_scale: torch.Tensor) -> torch.Tensor:
    """E2M1 codes of float32 ``values`` given each element's block scale (float8_e4m3fn) and
    global scale (both broadcast against ``values``)."""
    effective = scales.float() / global_scale
    codes = e2m1_codes(values / effective)
    nan_block = torch.isnan(scales.float())
    return torch.where(nan_block, torch.zeros((), dtype=torch.uint8, device=values.device), codes)


__all__ = ["E2M1_MAX", "E4M3_MAX", "E8M0_NAN", "EMAX", "NVFP4_ZERO_SCALE", "e2m1_codes", "e2m1_values",
           "mx_elements", "mx_scale_codes", "nvfp4_block_scales", "nvfp4_elements", "nvfp4_global_scale",
           "pack_nibbles", "unpack_nibbles"]
