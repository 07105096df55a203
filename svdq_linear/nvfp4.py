"""The numerics contract of svdq-linear: NVFP4 codes, block scales, packing and the W4A4 formula.

Every backend, converter and test imports this module; backends differ from it only in speed.

E2M1 codes (4 bits)
    bit 3 is the sign, bits 0-2 index the magnitudes ``{0, 0.5, 1, 1.5, 2, 3, 4, 6}``.
    ``round_e2m1`` rounds to the nearest magnitude, ties to the even code (so 0.25 -> 0,
    0.75 -> 1, 1.25 -> 1, 1.75 -> 2, 2.5 -> 2, 3.5 -> 4, 5 -> 4) and saturates at +-6. The sign bit
    is set only for strictly negative inputs, so a negative value that rounds to zero is code 0x8
    (-0) while +0, -0.0 and NaN give code 0x0.

Block scales (one per 16 consecutive k)
    ``s = e4m3(amax / 6)``: the block's max |x| divided by 6 in float32 (IEEE division), rounded to
    float8_e4m3fn to nearest, ties to even, saturating at 448. Special blocks:

    - all-zero block, or ``amax / 6 < 2**-10`` (rounds to 0 in E4M3): ``s = 0`` and every code is 0;
    - ``amax / 6`` in E4M3's subnormal range ``[2**-10, 2**-6)``: the subnormal scale is used as is;
      elements whose ``x / s`` exceeds 6 after the rounding of ``s`` saturate to +-6;
    - a block holding NaN or +-Inf: ``s = NaN`` (byte 0x7F) and every code is 0, so any output that
      reads the block is NaN. Kernels must take the block max with NaN propagation (``max.NaN``).

Codes
    ``code = round_e2m1(x * r)`` with ``r = 1.0f / s`` (float32 IEEE division, ``div.rn``; ``r = 0``
    when ``s`` is 0 or NaN) and ``x * r`` one float32 multiply rounded to nearest. Kernels use the same
    reciprocal-then-multiply rule, never ``x / s`` and never an approximate reciprocal.

Canonical layouts (what modules store and files hold)
    codes ``[rows, K/2] uint8`` row-major, element ``2i`` in the low nibble, ``2i+1`` in the high
    nibble of byte ``i``; scales ``[rows, K/16] float8_e4m3fn`` row-major. Kernels repack once at
    load time into what they need and cache it on the module.

Activations use one level of scaling at run time: the per-tensor factor chosen at conversion is
folded into ``smooth`` (and ``wcscale``/``proj_down``). Weights get an offline per-row scale
(``quantize_weight``) that is folded into ``wcscale``.

The W4A4 linear (``w4a4_linear``)::

    xs = x * (1 / smooth)                      # float32, reciprocal then multiply
    y  = (Q(xs) (*) Qw) * wcscale + bias + (xs @ proj_down) @ proj_up^T

The weight-only linear (``w4a16_linear``) keeps 16-bit activations::

    y  = (x @ Qw^T) * wcscale + bias           # float32 accumulation

``(*)`` is the block-scaled FP4 product ``sum_k (a_k s_a) (w_k s_w)`` with float32 accumulation.
E2M1 times E4M3 is exact in bf16, fp16 and fp32, so backends may dequantize into any of them before a
tensor-core product that accumulates in float32. The low-rank branch reads the unquantized ``xs``.

What a tensor-core backend may do differently, and the tolerance that follows (``tolerance``)
    1. Sum the FP4 products (and split-K partials) in any order in float32: at most
       ``K * 2**-24 * sum_k |a_k w_k|`` per output before ``* wcscale``.
    2. Round the low-rank operands: ``xs`` and ``proj_down`` to bf16 or tf32, ``lora_act = xs @
       proj_down`` to bf16 or tf32, ``proj_up`` (or ``proj_up / wcscale`` where a kernel adds the
       low-rank product before its ``* wcscale`` epilogue) to bf16: each rounding is a relative 2**-8
       at most, bounded together by ``4 * 2**-8 * (|xs| @ |proj_down|) @ |proj_up|^T``. (The fast mode
       below, adding it before ``* sa * (nw * wcscale)``, rounds ``lora_act / sa`` and ``proj_up /
       (nw * wcscale)`` instead: the same count of roundings.)
    3. Round the output once to its dtype: ``eps(dtype) * |y|``.
    4. Codes that do not change values: the sign of a zero code (0x0 or 0x8) and the codes inside a
       NaN/Inf block (any code: the block's scale is NaN, so every output that reads it is NaN).
    Activation codes and scales themselves are bit-exact when a backend writes them.

The fast mode (``w4a8_fast_linear``; FP8 tensor cores on Hopper, same checkpoint)
    Weights: the NVFP4 value ``w = e2m1 * s16`` divided by a per-output-channel power of two
    ``nw = 2**ceil(log2(max_k |w| / 448))`` (1 for an all-zero row) and rounded once to E4M3
    (nearest-even): ``w8 = e4m3(w / nw)``. Dividing by a power of two is exact, so the E4M3 rounding
    is the only one and a kernel that decodes ``e2m1 * (s16 / nw)`` in registers (the product is
    exact in fp16) reproduces ``w8`` bit for bit. Activations: per token, ``sa = max_k |xs| / 448``
    (1 for an all-zero row) and ``a8 = e4m3(xs * r)``, ``r = min(1 / sa, FLOAT32_MAX)`` (a row whose
    max lies below 448 / FLOAT32_MAX, ~1.3e-36, would otherwise overflow ``1 / sa`` and turn into
    NaN codes), bit-exact like the NVFP4 activation codes. Then ``y = (a8 @ w8^T) * sa * (nw * wcscale) + bias + (xs @ proj_down) @ proj_up^T``.
    It differs from the exact W4A4 contract by design: E4M3 keeps 4 significant bits of a weight
    (NVFP4 x E4M3 needs up to 6), a relative 2**-4 at most, and an activation carries a per-token
    E4M3 value (4 significant bits, one scale per token) instead of an NVFP4 code (2 bits, one scale
    per 16). ``docs/perf.md`` compares the two modes' errors against the 16-bit layer.
    A kernel may, besides points 1-3 above, accumulate ``a8 @ w8^T`` with Hopper's FP8 tensor-core
    accumulator (fewer than 24 significant bits between its fp32 promotions): ``fast_tolerance``
    states the bound that the conformance tests hold it to.

Inputs built from two tensors (``cat_gelu``; ``SVDQW4A4Linear.forward_cat_gelu``)
    A Flux single block's ``proj_out`` reads ``cat([attn, gelu_tanh(mlp)], -1)`` and a feed-forward's
    down projection ``gelu_tanh(h)``: the layer's input ``x = cat_gelu(xa, xb)``, the GELU (PyTorch's
    tanh form) rounded to the inputs' dtype as the tensor would hold it. Every formula above applies to
    that ``x``. A backend may read the two tensors and apply the GELU as it loads them instead of
    writing ``x``. Its GELU may differ from the exact value by a few float32 ulps before the rounding
    to the inputs' dtype, and may be a zero (of either sign) where the exact value lies below 2**-100;
    so an element of its ``x`` may be the neighbour of the exactly rounded GELU (a relative 2**-8 in
    bf16), which moves the output within the activation rounding's share of the tolerances above.
    PyTorch's own float32 GELU cancels in ``1 + tanh(u)`` below v ~ -4.5 (-0.0 from v ~ -5.5): there
    it sits further from the exact value than a backend's, on values below 1e-5.

Inputs made by an adaLN norm (``ada_norm``; ``SVDQW4A4Linear.forward_ada_norm``)
    The q/k/v of Flux and SD3 blocks (and a Flux single block's MLP) read ``layer_norm(x) * (1 + scale) +
    shift`` (``ada_norm``, each step in the input's dtype). A backend may read ``x``, ``shift`` and ``scale``
    and normalize as it loads instead of writing that input. Its row mean and variance are summed in
    another order than PyTorch's (and a compiler's), so an element of its input may be the neighbour of
    the tensor's (a relative 2**-8 in bf16), as for the GELU above.
"""

from __future__ import annotations

import torch

BLOCK_SIZE = 16
"""Elements of K that share one E4M3 scale."""

E2M1_MAX = 6.0
E4M3_MAX = 448.0
NVFP4_MAX = E2M1_MAX * E4M3_MAX
"""Largest magnitude a single-level NVFP4 block can represent (2688)."""
E4M3_MIN_NORMAL = 2.0**-6
"""Smallest normal E4M3 value: a block scale below it is subnormal (fewer significant bits) or zero."""

E4M3_NAN_BYTE = 0x7F
FLOAT32_MAX = 3.4028234663852886e38

E2M1_MAGNITUDES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)
"""Magnitude of E2M1 codes 0..7; code | 8 is the negative of the same magnitude."""

# Decision points between neighbouring magnitudes. A midpoint whose upper neighbour has an even
# code rounds up (compare with >=), otherwise down (compare with >): ties go to the even code.
_E2M1_MIDPOINTS = ((0.25, False), (0.75, True), (1.25, False), (1.75, True), (2.5, False), (3.5, True), (5.0, False))

SUPPORTED_ACT_DTYPES = (torch.bfloat16, torch.float16, torch.float32)


def e2m1_values(device: torch.device | str | None = None, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """The 16 E2M1 code values, ``[16]``, indexed by code (0x8 is -0.0)."""
    mags = torch.tensor(E2M1_MAGNITUDES, dtype=dtype, device=device)
    return torch.cat([mags, -mags])


def round_e2m1(q: torch.Tensor) -> torch.Tensor:
    """Round float values to E2M1 codes (uint8 in 0..15), nearest-even, saturating at +-6."""
    q = q.float()
    a = q.abs()
    mag = torch.zeros(q.shape, dtype=torch.uint8, device=q.device)
    for midpoint, up_is_even in _E2M1_MIDPOINTS:
        mag += (a >= midpoint) if up_is_even else (a > midpoint)
    # NaN compares false everywhere: magnitude 0, sign clear.
    return mag | ((q < 0).to(torch.uint8) << 3)


def decode_e2m1(codes: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Values of E2M1 codes (uint8 in 0..15)."""
    return e2m1_values(codes.device, dtype)[codes.long()]


def pack_e2m1(codes: torch.Tensor) -> torch.Tensor:
    """Pack codes ``[..., K]`` (uint8 0..15) two per byte into ``[..., K/2]``; element 2i -> low nibble."""
    if codes.shape[-1] % 2:
        raise ValueError(f"expected an even last dimension to pack E2M1 codes, got {codes.shape[-1]}")
    codes = codes.to(torch.uint8)
    return codes[..., 0::2] | (codes[..., 1::2] << 4)


def unpack_e2m1(packed: torch.Tensor) -> torch.Tensor:
    """Unpack ``[..., K/2]`` uint8 into codes ``[..., K]`` (uint8 0..15)."""
    if packed.dtype != torch.uint8:
        raise TypeError(f"expected packed E2M1 codes as uint8, got {packed.dtype}")
    lo, hi = packed & 0xF, packed >> 4
    return torch.stack([lo, hi], dim=-1).flatten(-2)


def round_e4m3(x: torch.Tensor) -> torch.Tensor:
    """Round to float8_e4m3fn, nearest-even, saturating at +-448; NaN and +-Inf become NaN (0x7F)."""
    x = x.float()
    out = x.clamp(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn)
    nan = torch.full_like(out.view(torch.uint8), E4M3_NAN_BYTE).view(torch.float8_e4m3fn)
    return torch.where(torch.isfinite(x), out, nan)


def _blocks(x: torch.Tensor) -> torch.Tensor:
    k = x.shape[-1]
    if k % BLOCK_SIZE:
        raise ValueError(f"expected the last dimension to be a multiple of {BLOCK_SIZE}, got {k}")
    return x.reshape(*x.shape[:-1], k // BLOCK_SIZE, BLOCK_SIZE)


def block_amax(x: torch.Tensor) -> torch.Tensor:
    """Max |x| of each block of 16, ``[..., K/16]`` float32 (NaN propagates; Inf gives Inf)."""
    return _blocks(x.float()).abs().amax(dim=-1)


def _div(a: torch.Tensor, c: float) -> torch.Tensor:
    """``a / c`` as one IEEE division per element on every device (PyTorch's CUDA kernels turn a division
    by a scalar into a multiplication by its reciprocal, which rounds differently)."""
    return a / torch.full_like(a, c)


def block_scales(x: torch.Tensor) -> torch.Tensor:
    """E4M3 block scales ``[..., K/16]`` of float32 values ``[..., K]`` under the contract's rules."""
    return round_e4m3(_div(block_amax(x), E2M1_MAX))


def range_violations(xs: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Blocks of float32 ``xs [..., K]`` that single-level NVFP4 cannot represent well: two masks
    ``[..., K/16]``.

    ``saturated``: the block max exceeds ``NVFP4_MAX`` (its scale saturates at 448, so elements above
    6 * 448 clip to +-6 codes). ``underflow``: a nonzero block whose E4M3 scale (the contract's
    ``block_scales`` rule) is subnormal or zero (below ``E4M3_MIN_NORMAL``): fewer significant bits
    in the scale, or every code zero. NaN/Inf blocks are in neither.
    """
    amax = block_amax(xs)
    scales = block_scales(xs).float()
    return amax > NVFP4_MAX, (amax > 0) & (scales < E4M3_MIN_NORMAL)


def quantize_nvfp4(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Single-level NVFP4 quantization of ``x [..., K]``.

    Returns ``(packed [..., K/2] uint8, scales [..., K/16] float8_e4m3fn)``. ``x`` is first rounded to
    float32 (a no-op for bf16/fp16/fp32 inputs).
    """
    x = x.float()
    scales = block_scales(x)
    s = scales.float()
    # s = 0 and s = NaN both give r = 0: all-zero codes (a NaN scale still makes the block NaN).
    recip = torch.where(s > 0, 1.0 / s, torch.zeros_like(s))
    q = _blocks(x) * recip.unsqueeze(-1)
    codes = round_e2m1(q).reshape(x.shape)
    return pack_e2m1(codes), scales


def dequantize_nvfp4(packed: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Values ``[..., K]`` of packed codes ``[..., K/2]`` under scales ``[..., K/16]`` (exact in fp32)."""
    if scales.dtype != torch.float8_e4m3fn:
        raise TypeError(f"expected float8_e4m3fn block scales, got {scales.dtype}")
    k = packed.shape[-1] * 2
    if scales.shape[:-1] != packed.shape[:-1] or scales.shape[-1] * BLOCK_SIZE != k:
        raise ValueError(
            f"block scales {tuple(scales.shape)} do not match packed codes {tuple(packed.shape)} "
            f"(expected [..., {k // BLOCK_SIZE}])"
        )
    compute = torch.float64 if dtype == torch.float64 else torch.float32
    vals = decode_e2m1(unpack_e2m1(packed), compute)
    out = _blocks(vals) * scales.to(compute).unsqueeze(-1)
    return out.reshape(*packed.shape[:-1], k).to(dtype)


def quantize_weight(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Offline two-level NVFP4 of a weight ``[N, K]``: a float32 scale per row, E4M3 scales per block.

    Each row is divided by ``row_scale = max|w_row| / 2688`` so that its largest block scale is 448,
    then quantized single-level. Returns ``(qweight [N, K/2] uint8, wscales [N, K/16] float8_e4m3fn,
    row_scale [N] float32)``; ``w ~= dequantize_nvfp4(qweight, wscales) * row_scale[:, None]``.
    Raises on non-finite weights.
    """
    if w.dim() != 2:
        raise ValueError(f"expected a 2-D weight [N, K], got shape {tuple(w.shape)}")
    w = w.float()
    if not torch.isfinite(w).all():
        raise ValueError("weight holds NaN or Inf values; cannot quantize it")
    row_max = w.abs().amax(dim=1)
    # at least the smallest normal float32: a row whose max is below 2688 * 2**-126 would get a subnormal scale
    # of few bits (its values clip) or 0 (Inf / NaN block scales)
    tiny = torch.finfo(torch.float32).tiny
    row_scale = torch.where(row_max > 0, (row_max / NVFP4_MAX).clamp(min=tiny), torch.ones_like(row_max))
    qweight, wscales = quantize_nvfp4(w / row_scale[:, None])
    return qweight, wscales, row_scale


def dequantize_weight(qweight: torch.Tensor, wscales: torch.Tensor, row_scale: torch.Tensor) -> torch.Tensor:
    """The float32 weight ``[N, K]`` of ``quantize_weight``'s output (``row_scale`` is ``wcscale``)."""
    return dequantize_nvfp4(qweight, wscales) * row_scale.float()[:, None]


def check_act_dtype(x: torch.Tensor) -> None:
    if x.dtype not in SUPPORTED_ACT_DTYPES:
        names = ", ".join(str(d).removeprefix("torch.") for d in SUPPORTED_ACT_DTYPES)
        raise TypeError(f"expected a {names} input, got {x.dtype}")


def cat_gelu(xa: torch.Tensor | None, xb: torch.Tensor) -> torch.Tensor:
    """``cat([xa, gelu_tanh(xb)], -1)`` in xb's dtype (just the GELU when ``xa`` is None): the input of
    ``SVDQW4A4Linear.forward_cat_gelu``."""
    g = torch.nn.functional.gelu(xb, approximate="tanh")
    return g if xa is None else torch.cat([xa, g], dim=-1)


def ada_norm(x: torch.Tensor, shift: torch.Tensor, scale: torch.Tensor, eps: float) -> torch.Tensor:
    """``layer_norm(x) * (1 + scale) + shift`` in x's dtype, as diffusers' ``AdaLayerNormZero`` computes it: ``x [B,
    S, K]``, ``shift`` / ``scale`` ``[B, K]`` (no affine weight in the norm). The input of
    ``SVDQW4A4Linear.forward_ada_norm``."""
    normed = torch.nn.functional.layer_norm(x, (x.shape[-1],), eps=eps)
    return normed * (1 + scale[:, None]) + shift[:, None]


def smooth_input(x: torch.Tensor, smooth: torch.Tensor) -> torch.Tensor:
    """``xs = x * (1 / smooth)`` in float32, the rule every backend follows."""
    return x.float() * (1.0 / smooth.float())


def proj_down_smoothed(proj_down: torch.Tensor, smooth: torch.Tensor) -> torch.Tensor:
    """``proj_down / smooth`` in bf16: the operand the tensor-core backends multiply ``x`` (in bf16) by for
    ``lora_act`` (item 2 of the tolerance: bf16 operands of the low-rank product)."""
    return (proj_down.float() / smooth.float()[:, None]).to(torch.bfloat16)


def w4a4_linear(
    x: torch.Tensor,
    qweight: torch.Tensor,
    wscales: torch.Tensor,
    smooth: torch.Tensor,
    proj_down: torch.Tensor,
    proj_up: torch.Tensor,
    wcscale: torch.Tensor,
    bias: torch.Tensor | None = None,
    accum_dtype: torch.dtype = torch.float32,
) -> torch.Tensor:
    """The contract's ``y`` for ``x [M, K]``, computed plainly in ``accum_dtype`` (float32 or float64).

    Activation codes and scales are always those of ``quantize_nvfp4`` on the float32 ``xs``; the
    products and sums run in ``accum_dtype``. Returns ``[M, N]`` in ``accum_dtype``.
    """
    xs = smooth_input(x, smooth)
    a_packed, a_scales = quantize_nvfp4(xs)
    a = dequantize_nvfp4(a_packed, a_scales, accum_dtype)
    w = dequantize_nvfp4(qweight, wscales, accum_dtype)
    y = (a @ w.T) * wcscale.to(accum_dtype)
    if bias is not None:
        y = y + bias.to(accum_dtype)
    low_rank = (xs.to(accum_dtype) @ proj_down.to(accum_dtype)) @ proj_up.to(accum_dtype).T
    return y + low_rank


def w4a16_linear(
    x: torch.Tensor,
    qweight: torch.Tensor,
    wscales: torch.Tensor,
    wcscale: torch.Tensor,
    bias: torch.Tensor | None = None,
    accum_dtype: torch.dtype = torch.float32,
) -> torch.Tensor:
    """The weight-only ``y`` for ``x [M, K]`` in ``accum_dtype``: ``(x @ Qw^T) * wcscale + bias``."""
    w = dequantize_nvfp4(qweight, wscales, accum_dtype)
    y = (x.to(accum_dtype) @ w.T) * wcscale.to(accum_dtype)
    return y if bias is None else y + bias.to(accum_dtype)


def tolerance(
    x: torch.Tensor,
    qweight: torch.Tensor,
    wscales: torch.Tensor,
    smooth: torch.Tensor,
    proj_down: torch.Tensor,
    proj_up: torch.Tensor,
    wcscale: torch.Tensor,
    bias: torch.Tensor | None,
    out_dtype: torch.dtype,
) -> torch.Tensor:
    """Elementwise bound ``[M, N]`` (float64) on ``|y_backend - y_contract|`` for a tensor-core backend.

    The sum of the four allowances of the module docstring, evaluated on magnitudes in float64.
    NaN where the contract's output is NaN (a NaN/Inf block): those elements must be NaN.
    """
    xs = smooth_input(x, smooth).double()
    a_packed, a_scales = quantize_nvfp4(xs.float())
    a = dequantize_nvfp4(a_packed, a_scales, torch.float64).abs()
    w = dequantize_nvfp4(qweight, wscales, torch.float64).abs()
    k = x.shape[-1]
    main = (a @ w.T) * wcscale.double().abs() * (k * 2.0**-24)
    xs_abs = xs.abs().nan_to_num(nan=float("inf"))
    low_rank = (xs_abs @ proj_down.double().abs()) @ proj_up.double().abs().T * (4 * 2.0**-8)
    y = w4a4_linear(x, qweight, wscales, smooth, proj_down, proj_up, wcscale, bias, torch.float64)
    eps = {torch.float32: 2.0**-24, torch.bfloat16: 2.0**-8, torch.float16: 2.0**-11}[out_dtype]
    tiny = {torch.float32: 2.0**-149, torch.bfloat16: 2.0**-133, torch.float16: 2.0**-24}[out_dtype]
    return main + low_rank + eps * y.abs() + tiny


def fast_weight_exponent(qweight: torch.Tensor, wscales: torch.Tensor) -> torch.Tensor:
    """``e [N] int32`` with ``nw = 2**e`` the fast mode's per-row normalizer: the smallest power of two
    with ``max_k |w| / nw <= 448`` (0 for an all-zero row)."""
    row_max = dequantize_nvfp4(qweight, wscales, torch.float64).abs().amax(dim=1)
    # row_max has at most 7 significant bits, so row_max / 448 is either a power of two (and exact in
    # float64) or a relative 2**-8 away from one: log2 and ceil in float64 cannot land on the wrong side.
    e = torch.ceil(torch.log2(row_max / E4M3_MAX))
    return torch.where(row_max > 0, e, torch.zeros_like(e)).to(torch.int32)


def fast_weight(qweight: torch.Tensor, wscales: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The fast mode's weight: ``(w8 [N, K] float8_e4m3fn, nw [N] float32)`` (see the module docstring)."""
    w = dequantize_nvfp4(qweight, wscales)
    nw = torch.ldexp(torch.ones(w.shape[0], device=w.device), fast_weight_exponent(qweight, wscales).float())
    return round_e4m3(w / nw[:, None]), nw


def fast_act(xs: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The fast mode's activations: ``(a8 [M, K] float8_e4m3fn, sa [M] float32)`` of float32 ``xs``."""
    amax = xs.abs().amax(dim=-1)
    sa = torch.where(amax > 0, _div(amax, E4M3_MAX), torch.ones_like(amax))
    r = (1.0 / sa).clamp(max=FLOAT32_MAX)  # a row max below 448 / FLOAT32_MAX would overflow 1 / sa
    return round_e4m3(xs * r[..., None]), sa


def w4a8_fast_linear(
    x: torch.Tensor,
    qweight: torch.Tensor,
    wscales: torch.Tensor,
    smooth: torch.Tensor,
    proj_down: torch.Tensor,
    proj_up: torch.Tensor,
    wcscale: torch.Tensor,
    bias: torch.Tensor | None = None,
    accum_dtype: torch.dtype = torch.float32,
) -> torch.Tensor:
    """The fast mode's ``y`` for ``x [M, K]`` in ``accum_dtype`` (the module docstring's formula)."""
    xs = smooth_input(x, smooth)
    a8, sa = fast_act(xs)
    w8, nw = fast_weight(qweight, wscales)
    y = (a8.to(accum_dtype) @ w8.to(accum_dtype).T) * sa.to(accum_dtype)[:, None]
    y = y * (nw * wcscale.float()).to(accum_dtype)
    if bias is not None:
        y = y + bias.to(accum_dtype)
    return y + (xs.to(accum_dtype) @ proj_down.to(accum_dtype)) @ proj_up.to(accum_dtype).T
