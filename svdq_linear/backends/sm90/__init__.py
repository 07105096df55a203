"""The sm90 backend (H100/H200): exact W4A4 and W4A16 on 16-bit wgmma through Triton.

E2M1 codes times E4M3 scales are exact in bf16 and fp16, so the contract's block-scaled product is
computed exactly on Hopper's 16-bit tensor cores: ``quantize_act`` writes the exact dequantized
activations in one pass; ``lora_act`` is one cuBLAS GEMM of ``x`` with ``proj_down / smooth``, or both come
from one read of ``x`` (``kernels.quantize_act_lora``: by default from 2048 tokens up to 96 columns,
``tuning.exact_lora_by_default``; ``SVDQ_SM90_EXACT_LORA``), or, in a captured graph, the two launch as a PDL
pair (``SVDQ_SM90_PDL``).
By tokens M (bf16):

- M <= 2, exact mode on quack's blob, on a GPU: ``small_m_fast.linear_exact``, the whole linear in one launch
  (the activations' NVFP4 codes, ``lora_act``, integer dot products of the codes, the split-K sum and the
  epilogue; ``tuning.exact_one_launch_ctas``; ``SVDQ_SM90_EXACT_ONE_LAUNCH`` = 1 / 0 forces it on / off);
- M <= 8, bf16, exact mode on quack's blob (and the fast mode where K >= 2 N): ``small_m_mma``, warp
  ``mma.sync`` on the 4-bit weight decoded in registers, split over K (``tuning.use_small_m_mma``:
  the measured crossover; ``SVDQ_SM90_SMALL_M_MMA`` = 1 / 0 forces it on up to 64 tokens / off);
- else M <= ``SMALL_M[kind]`` (exact W4A4: 64; W4A16: 32; not the fast mode, its quack GEMM wins
  there, see docs/perf.md): ``small_m.linear``, one launch that splits K across the SMs and reads the
  weight once in whichever layout the module holds (canonical or quack's); where
  ``small_m.use_fma`` (1 or 2 tokens) it quantizes the activations itself;
- M < 128, fp16/fp32 inputs, or no quack: ``kernels.w4_gemm`` (Triton: the weight decoded in
  registers as wgmma's A operand, ``* wcscale`` then the low-rank MMA into the same accumulator);
- M >= 128, bf16: quack-kernels' NVFP4 W4 GEMM (``quack_gemm``) with ``* wcscale + bias`` fused and
  the low-rank MMA issued into its accumulator after the K-loop (``quack_lowrank``, each weight tile
  reading a window of at most ``LOWRANK_MAX_WINDOW`` columns: ``plan_lowrank``; wider branches add a
  cuBLAS-made [M, N] tile in the epilogue instead). Its repacked
  weight stands in for the canonical ``qweight``/``wscales`` on the GPU (``Backend.replaced``); the
  Triton calls rebuild them per call (``SVDQ_SM90_QUACK=0`` leaves quack out).

The fast mode (``nvfp4.w4a8_fast_linear``): ``kernels.quantize_act_fp8`` writes the per-token E4M3
activations (and ``lora_act / sa``), and ``quack_fast`` runs FP8 wgmma on the 4-bit weight decoded to
E4M3 in registers (our decode format on quack's operand-transform mainloop), the low-rank MMA into the
same accumulator, then ``* sa * 2**e * wcscale + bias`` (with ``SVDQ_SM90_FAST_ONE_LAUNCH=1``, 1-64 tokens
run ``small_m_fast``: the whole linear in one launch). Its repacked codes are a permutation of the
canonical ``qweight``, which the module frees while they are cached (``Backend.replaced``: the weight
is not on the GPU twice). It needs quack-kernels and a GPU; elsewhere the reference serves the fast
mode.

Deviations from the reference stay inside the contract's tensor-core tolerance
(``svdq_linear.nvfp4``): FP32 summation order, bf16 operands of the low-rank products and, in the
quack paths, ``proj_up`` divided by the epilogue's column factor before its bf16 rounding.

Under ``TRITON_INTERPRET=1`` the same kernels run on CPU tensors (slowly): the CPU test suite checks
them that way.
"""

from __future__ import annotations

import os
import warnings
from dataclasses import dataclass

import torch

from ... import nvfp4
from ..._env import getenv, switch

from .. import (Backend, device_capability, plain_eager_call, tracing, w4a4_ada_norm_linear, w4a4_cat_gelu_linear,
                w4a8_fast_gemm,
                weights_are_offloaded)
from . import tuning  # plain Python: no Triton, cutlass or quack
from .fast_layout import fast_act_ops  # plain torch

MAX_RANK = 256
QUACK_MIN_M = 128  # tokens from which quack's W4 GEMM serves bf16 calls (docs/perf.md)
# Up to this many tokens a layer kind runs small_m's kernel, from where it beat the GEMM it replaced
# (docs/perf.md, "Small M"); SVDQ_SM90_SMALL_M=<int> sets one limit for every kind (0: never).
SMALL_M = {"w4a4": 64, "w4a16": 32}
if os.environ.get("SVDQ_SM90_SMALL_M", "").strip():
    try:
        SMALL_M = dict.fromkeys(SMALL_M, int(os.environ["SVDQ_SM90_SMALL_M"]))
    except ValueError:
        raise ValueError(f"SVDQ_SM90_SMALL_M={os.environ['SVDQ_SM90_SMALL_M']!r}: expected a whole number of "
                         "tokens (0: never)") from None
    if SMALL_M["w4a4"] < 0:
        raise ValueError(f"SVDQ_SM90_SMALL_M={os.environ['SVDQ_SM90_SMALL_M']!r}: expected 0 or more tokens")
# The on/off settings below are read with _env.switch: "1" stands for 1/true/yes/on, "0" for 0/false/no/off, and
# any other value but "auto" or nothing is an error naming the setting.
ENV_QUACK = "SVDQ_SM90_QUACK"  # "0": never use quack (the Triton GEMM for every exact call)
# small_m_mma (warp-level tensor cores) serves the small-M calls where tuning.use_small_m_mma measured it
# faster; "1": every call it can take (exact mode on quack's blob within SMALL_M["w4a4"], fast mode; up to
# 64 tokens); "0": none
ENV_SMALL_M_MMA = "SVDQ_SM90_SMALL_M_MMA"
# "1": small_m_mma's fused kernel (low-rank MMA, split-K sum and epilogue in one launch) where the prepared
# state has the accumulator form; off by default until the H200 has checked and timed it
ENV_MMA_FUSED = "SVDQ_SM90_MMA_FUSED"
# the fast mode's one-launch kernel (small_m_fast: the activation pass, lora_act, the product and the
# epilogue in one launch) serves the calls where tuning.use_fast_one_launch measured it faster (one token;
# 16 tokens of a large weight); "1": every call of 1-64 tokens; "0": none
ENV_FAST_ONE_LAUNCH = "SVDQ_SM90_FAST_ONE_LAUNCH"
# the exact mode's one-launch kernel (small_m_fast.linear_exact: the activations' NVFP4 codes, lora_act,
# integer dot products of the codes, the epilogue in one launch) serves the exact calls of 1-2 tokens on
# quack's blob on a GPU (tuning.exact_one_launch_ctas: it won at every Flux layer at one token, and at two
# with its split for four CTAs an SM on the narrow weights); "1": those calls anywhere (the interpreter's
# tests); "0": none
ENV_EXACT_ONE_LAUNCH = "SVDQ_SM90_EXACT_ONE_LAUNCH"
# "1": under torch.compile, the fast mode's activation pass of a call above MMA_TOKENS tokens is traced
# as PyTorch ops (fast_layout.fast_act_ops) that the compiler fuses into the kernels producing the
# input, and only the GEMM is an opaque op (w4a8_fast_gemm); "0" (default; measured faster): the Triton
# pass inside the op. a8 and sa have the same bits either way; lora_act comes from the compiler's
# matmul instead of the Triton kernel (another fp32 summation order, within the contract). Read when a
# call is traced: changing it for a compiled model needs torch._dynamo.reset(). Calls through
# forward_cat_gelu (fuse_gelu_inputs) keep their own op: their pass reads the two tensors itself.
ENV_COMPILER_PASS = "SVDQ_SM90_COMPILER_PASS"
# "1": while a CUDA graph is being captured, the exact mode's lora_act (cuBLAS, reading x) runs on a second
# stream beside the activation pass (which reads x too) instead of before it: two reads of x at once,
# joined before the GEMM. Off by default: on the H100 it gained 3-4 % at fused q/k/v and 4096 x 3072 -> 3072
# and lost 3-7 % at the larger layers (docs/perf.md, twenty-second session). Eager calls always run serially
# (a stream fork costs host time there, where the calls are host-bound).
ENV_LORA_STREAM = "SVDQ_SM90_LORA_STREAM"
_SIDE_STREAMS: dict[int, torch.cuda.Stream] = {}
# lora_act (Triton) launched with programmatic dependent launch (PDL), the activation pass as its dependent
# reading x beside it (kernels.quantize_act_after_lora / quantize_act_fp8(lora_pdl=True)). "1": every call that
# can; "0": never; unset (or "auto"): the calls captured into a CUDA graph. Measured on the H100 in graphs of
# back-to-back calls (docs/perf.md, twenty-sixth session, timeline_exact.py, 10-12 rounds): the pair was faster
# at every Flux shape but one in both modes (exact 1.01-1.26x the two launches, fast 1.02-1.10x; the single
# blocks' fused input in the exact mode 0.98x, within that layer's spread), largely because the plain pass's
# writes are still in L2 when the GEMM starts and their write-back slows it (8 us at fused q/k/v). In eager
# and compiled calls without a graph, where the host's launches bound the forward, the pair's extra launch
# lost (the Flux forward 4-6 %, twenty-fourth session), so they keep the plain launches.
ENV_PDL = "SVDQ_SM90_PDL"


def _pdl(x: torch.Tensor, kernels, auto: bool = True) -> bool:
    """Whether this call takes the PDL pair (``SVDQ_SM90_PDL``, read per call: "1", "0", or unset / "auto" for
    a call captured into a CUDA graph) on a device that has it. ``auto=False``: the caller has another setting
    the user asked for (``SVDQ_SM90_LORA_STREAM=1``), which unset / "auto" leaves in place."""
    if not x.is_cuda:
        return False
    on = switch(ENV_PDL)
    if on is not None:
        return on and kernels.pdl_supported(x.device)
    return auto and kernels.pdl_supported(x.device) and torch.cuda.is_current_stream_capturing()


def _lora_beside(x: torch.Tensor, pds: torch.Tensor, pass_fn):
    """``(x.to(bf16) @ pds, pass_fn())``: with ``SVDQ_SM90_LORA_STREAM=1`` while the current stream captures a
    CUDA graph, the product on a side stream forked from it and joined back (the output allocated on the
    current stream, so its lifetime is that stream's); otherwise one after the other."""
    if not (x.is_cuda and switch(ENV_LORA_STREAM) is True and torch.cuda.is_current_stream_capturing()):
        return x.to(torch.bfloat16) @ pds, pass_fn()
    cur = torch.cuda.current_stream(x.device)
    side = _SIDE_STREAMS.get(x.device.index)
    if side is None:
        side = _SIDE_STREAMS[x.device.index] = torch.cuda.Stream(x.device)
    xb = x.to(torch.bfloat16)  # (on the current stream: a cast's output is that stream's too)
    lora = torch.empty(x.shape[0], pds.shape[1], device=x.device, dtype=torch.bfloat16)
    side.wait_stream(cur)
    with torch.cuda.stream(side):
        torch.mm(xb, pds, out=lora)
    out = pass_fn()
    cur.wait_stream(side)
    return lora, out


def _route_small_m_mma(mode: str, x: torch.Tensor, n: int) -> bool:
    """Whether this call of ``x [M, K]`` runs small_m_mma (a CUDA kernel: never under the Triton
    interpreter on the CPU)."""
    on = switch(ENV_SMALL_M_MMA)  # read per call (benchmarks toggle it)
    m, k = x.shape
    if on is False or not 1 <= m <= tuning.MMA_TOKENS or not x.is_cuda:  # no tokens: the other paths' empty output
        return False
    return on is True or tuning.use_small_m_mma(mode, m, n, k)


def _route_exact_one_launch(x: torch.Tensor, n: int) -> int | None:
    """None where this exact call of ``x [M, K]`` (``n`` outputs, on quack's blob) does not run
    small_m_fast.linear_exact; else the CTAs an SM its split targets (0: what residency fits)."""
    on = switch(ENV_EXACT_ONE_LAUNCH)  # read per call (benchmarks toggle it)
    m, k = x.shape
    if on is False or (on is None and not x.is_cuda):  # not under the interpreter by default: too slow there
        return None
    return tuning.exact_one_launch_ctas(m, n, k)  # None outside its 1-2 tokens


def _route_fast_one_launch(x: torch.Tensor, n: int) -> bool:
    """Whether this fast-mode call of ``x [M, K]`` (``n`` outputs) runs small_m_fast. By default only on a
    GPU (under the Triton interpreter on the CPU the routed path is the one that finishes in reasonable
    time); the setting "1" takes it anywhere, the tests' interpreter runs included."""
    on = switch(ENV_FAST_ONE_LAUNCH)  # read per call (benchmarks toggle it)
    m, k = x.shape
    if on is False or not 1 <= m <= 64:  # small_m_fast.MAX_M
        return False
    return on is True or (x.is_cuda and tuning.use_fast_one_launch(m, n, k))


LOWRANK_MAX_WINDOW = 64  # widest low-rank window a weight tile reads in the accumulator path (docs/perf.md)


def _pad_cols(t: torch.Tensor, multiple: int) -> torch.Tensor:
    """[rows, R] -> [rows, R rounded up to ``multiple``] with zero columns."""
    r = t.shape[1]
    return t if r % multiple == 0 else torch.nn.functional.pad(t, (0, multiple - r % multiple))


def plan_lowrank(proj_up: torch.Tensor) -> tuple[int, torch.Tensor] | None:
    """How the quack paths put the low-rank MMA into their accumulator: ``(W, segments)``, each 64
    weight rows reading the ``W`` columns ``[s W, s W + W)`` of ``proj_up`` (and of ``lora_act``) with
    ``s = segments[rows // 64]`` ([N / 64] int32); or None (the [M, N] tile path instead).

    Dropping a group's all-zero columns is exact, so any ``proj_up`` qualifies whose nonzero columns
    fit such windows of at most ``LOWRANK_MAX_WINDOW`` columns, the same window for both halves of a
    128-row tile: a dense rank up to 64 (one window), and the block-diagonal ``proj_up`` of fused
    linears (q/k/v, the single blocks' inputs), whose segments each read their own rank's window."""
    n, r = proj_up.shape
    if r == 0 or n % 64 or tracing():  # traced: no data-dependent choice, the tile path
        return None
    nz = (proj_up != 0).reshape(n // 64, 64, r).any(1)  # [G, R]: the columns each 64 rows use
    used = nz.any(1)
    col = torch.arange(r, device=proj_up.device)
    lo = torch.where(nz, col, r).amin(1)
    hi = torch.where(nz, col, -1).amax(1)
    for w in range(16, LOWRANK_MAX_WINDOW + 1, 16):
        if not bool(((lo // w == hi // w) | ~used).all()):
            continue
        seg = torch.where(used, lo // w, 0)
        if n % 128 == 0:  # a 128-row tile reads one window: an unused half takes its partner's
            pair, pair_used = seg.reshape(-1, 2), used.reshape(-1, 2)
            if not bool(((pair[:, 0] == pair[:, 1]) | ~pair_used.all(1)).all()):
                continue
            pair = torch.where(pair_used, pair, pair.flip(1))
            seg = pair.reshape(-1)
        return w, seg.to(torch.int32).contiguous()
    return None


@dataclass
class Sm90Prepared:
    """What the sm90 kernels read besides the canonical tensors (built once per device)."""

    # [K, R'] bf16: proj_down / smooth[:, None], for lora_act = x @ it (R' = S * W in the accumulator path)
    proj_down_smoothed: torch.Tensor | None
    # the quack paths' proj_up, bf16: in the accumulator path [N, W], each row's window of proj_up divided
    # by the epilogue's per-column factor (wcscale, or 2**e * wcscale in the fast mode); in the tile path
    # [N, R], proj_up itself for the cuBLAS-made [M, N] tile
    proj_up_bf16: torch.Tensor | None
    quack: object | None  # quack_gemm.QuackWeight or quack_fast.FastWeight: the weight repacked for quack
    lowrank_segments: torch.Tensor | None = None  # [N / 64] int32 (plan_lowrank): set in the accumulator path
    # [K] float32 1 / smooth (both W4A4 modes): the activation passes read it instead of dividing a column a tile
    inv_smooth: torch.Tensor | None = None
    # the fast mode: (flat indices, bytes) of the scales the strip cannot give back (fast_layout.scale_patch);
    # not a kernel operand
    scale_patch: tuple[torch.Tensor, torch.Tensor] | None = None

    def tensors(self) -> list[torch.Tensor]:
        """[proj_down', proj_up', (segments)] + the quack weight's tensors + [inv_smooth]: the one 1-D float32
        tensor of the list, always last (``_exact_inv``)."""
        out = [t for t in (self.proj_down_smoothed, self.proj_up_bf16, self.lowrank_segments) if t is not None]
        if self.quack is not None:
            out += self.quack.tensors()
        if self.inv_smooth is not None:
            out.append(self.inv_smooth)
        return out


def _quack_module():
    """quack_gemm, or None where quack-kernels / cutlass are missing (warned once)."""
    global _QUACK
    if _QUACK is None:
        try:
            from . import quack_gemm

            _QUACK = quack_gemm
        except Exception as e:  # ImportError, or a cutlass that cannot load
            warnings.warn(f"svdq-linear sm90: quack-kernels unavailable ({type(e).__name__}: {e}); "
                          "large-M layers use the Triton GEMM", stacklevel=3)
            _QUACK = False
    return _QUACK or None


_QUACK = None


def _small_m_mma_module():
    from . import small_m_mma  # needs cutlass and quack, like the fast mode that calls it

    return small_m_mma


def _quack_fast_module():
    """quack_fast, or None where quack-kernels / cutlass are missing (warned once, by _quack_module)."""
    global _QUACK_FAST
    if _QUACK_FAST is None:
        _QUACK_FAST = False
        if _quack_module() is not None:
            try:
                from . import quack_fast

                _QUACK_FAST = quack_fast
            except Exception as e:
                warnings.warn(f"svdq-linear sm90: the fast-mode kernel is unavailable ({type(e).__name__}: {e})",
                              stacklevel=3)
    return _QUACK_FAST or None


_QUACK_FAST = None


class Sm90Backend(Backend):
    name = "sm90"
    kinds = frozenset({"w4a4", "w4a4_fast", "w4a16"})

    def __init__(self):
        from . import kernels  # imports Triton

        self.kernels, self.tuning = kernels, tuning
        self.interpret = os.environ.get("TRITON_INTERPRET") == "1"

    def _device_ok(self, device: torch.device) -> bool:
        if self.interpret:
            return device.type == "cpu"
        cap = device_capability(device)
        return cap is not None and cap[0] == 9

    def supports(self, device, kind):
        if kind == "w4a4_fast" and (self.interpret or not self._device_ok(device) or _quack_fast_module() is None):
            return False  # the FP8 GEMM is a CuTe DSL kernel on quack: no CPU interpreter, no quack
        return kind in self.kinds and self._device_ok(device)

    def declines(self, module, device):
        t = module._parameters  # not the attributes: a stood-in tensor would be rebuilt
        if not (t["qweight"].is_contiguous() and t["wscales"].is_contiguous()):
            return "the packed weight is not contiguous"
        if module.kind == "w4a4_fast":
            n, k = module.out_features, module.in_features
            if n % 64 or k % 128:
                return f"fast mode needs out_features % 64 == 0 and in_features % 128 == 0, got {n} x {k}"
            if weights_are_offloaded(module):
                return "offloaded weights (the fast layout would be rebuilt for every call)"
        if module.kind in ("w4a4", "w4a4_fast"):
            if module.rank > MAX_RANK:
                return f"rank {module.rank} > {MAX_RANK}"
            if not module.proj_up.is_contiguous():
                return "proj_up is not contiguous"
        return None

    def declines_call(self, module, x):
        if not self._device_ok(x.device):
            return f"input on {x.device}"
        if module.kind == "w4a16" and x.dtype not in (torch.bfloat16, torch.float16):
            return f"{x.dtype} input (the weight-only product runs on 16-bit operands)"
        return None

    def _use_quack(self, module) -> bool:
        n, k = module.out_features, module.in_features
        # Under per-call offload the repacked copy would be rebuilt for every call: use the Triton GEMM.
        # quack serves bf16 activations, which follow the module's dtype in a pipeline: an fp16 module
        # would keep a repacked copy that no call reads.
        return (not self.interpret and not weights_are_offloaded(module) and switch(ENV_QUACK) is not False
                and n % 128 == 0 and k % 128 == 0 and module.proj_up.dtype == torch.bfloat16
                and _quack_module() is not None)

    def prepare(self, module, device):
        if device.type == "cuda":  # the zeroed words that small-M launches captured in CUDA graphs take
            from .small_m import reserve_sync_words

            reserve_sync_words(device)
        if module.kind == "w4a16":
            return None
        r = module.rank
        pds = nvfp4.proj_down_smoothed(module.proj_down, module.smooth) if r else None
        patch = None
        if module.kind == "w4a4_fast":
            fw = _quack_fast_module().prepare(module.qweight, module.wscales, module.wcscale, module.bias)
            colscale = fw.cs.reshape(-1, 1)
            quack_up = True
            from .fast_layout import scale_patch

            patch = scale_patch(module.wscales, fw.strip, fw.nw)
        else:
            quack = _quack_module() if self._use_quack(module) else None
            fw = quack.prepare(module.qweight, module.wscales, module.wcscale, module.bias) if quack else None
            colscale = module.wcscale.float().reshape(-1, 1)
            quack_up = fw is not None
        up = seg = None
        if r and quack_up:
            plan = plan_lowrank(module.proj_up)
            if plan is not None:
                w, seg = plan
                from . import quack_lowrank  # (quack_up: quack is there)

                quack_lowrank.register_runs(seg)  # the launch passes the table's runs as two words
                pds = _pad_cols(pds, w).contiguous()
                up_scaled = _pad_cols(module.proj_up.float() / colscale, w)
                window = (seg.repeat_interleave(64).long() * w)[:, None] + torch.arange(w, device=device)
                up = torch.gather(up_scaled, 1, window).to(torch.bfloat16).contiguous()
            else:
                up = module.proj_up.to(torch.bfloat16).contiguous()
        # IEEE division: the bits of nvfp4.smooth_input's factor
        inv = (1.0 / module.smooth.float()).contiguous()
        return Sm90Prepared(pds, up, fw, seg, inv, patch)

    def extra_tensors(self, prepared):
        return [] if prepared is None else prepared.tensors()

    def linear(self, module, x, prepared, kind=None):
        kind = kind or module.kind
        if kind == "w4a4_fast" and self._compiler_pass(module, x, prepared):
            return self._fast_traced(module, x, prepared)
        return super().linear(module, x, prepared, kind)

    def _compiler_pass(self, module, x, prepared) -> bool:
        """Whether this traced fast-mode call leaves its activation pass to the compiler: the quack GEMM
        with the low-rank branch in its accumulator (or none), and more tokens than small_m_mma takes
        (a static count: a dynamic one keeps the whole op)."""
        if not tracing() or switch(ENV_COMPILER_PASS) is not True or self.interpret:
            return False
        if type(getattr(prepared, "quack", None)).__name__ != "FastWeight":
            return False
        m = x.shape[0]
        return (isinstance(m, int) and m > tuning.MMA_TOKENS
                and (module.rank == 0 or prepared.lowrank_segments is not None))

    def _fast_traced(self, module, x, prepared):
        out_dtype = torch.float16 if x.dtype == torch.float16 else torch.bfloat16
        fw = prepared.quack.tensors()
        if module.rank:
            pds = prepared.proj_down_smoothed
            xb = x.to(torch.bfloat16)
            # inductor lowers mm's out_dtype on CUDA only (the CPU branch is for tests)
            lora = torch.mm(xb, pds, out_dtype=torch.float32) if x.is_cuda else xb.float() @ pds.float()
            a8, sa, la = fast_act_ops(x, prepared.inv_smooth, lora)
            extra = [prepared.proj_up_bf16, prepared.lowrank_segments, *fw]
        else:
            (a8, sa), la, extra = fast_act_ops(x, prepared.inv_smooth), None, fw
        y = w4a8_fast_gemm(a8, sa, la, extra, out_dtype, self.name)
        return y if x.dtype == out_dtype else y.to(x.dtype)

    def run_fast_gemm(self, a8, sa, la, extra, out_dtype):
        quack_fast = _quack_fast_module()
        fw = quack_fast.weight(extra[-4:])
        lr_acc = None if la is None else (extra[0], la, extra[1])
        return quack_fast.gemm(a8, sa, fw, out_dtype=out_dtype, lr_acc=lr_acc)

    def replaced(self, prepared):
        # Both quack layouts are byte permutations of the canonical tensors, so those leave the device
        # while the state is cached: the fast kernel's blob stands in for qweight, and its strip with the
        # rows' powers of two (and a patch for the scales of all-zero blocks) for wscales; the exact
        # kernel's blob and strip stand in for qweight and wscales, and the
        # Triton GEMM that serves the exact mode's other calls rebuilds them per call (run_w4a4).
        kind = type(getattr(prepared, "quack", None)).__name__
        if kind == "FastWeight":
            from .fast_layout import rebuild_scales, unpack_fast_weight

            fw = prepared.quack
            blob, strip, nw, patch = fw.blob, fw.strip, fw.nw, prepared.scale_patch
            out = {"qweight": lambda: unpack_fast_weight(blob)}
            if nw is not None and patch is not None:  # the strip and 2**e give the scales back, bit for bit
                out["wscales"] = lambda: rebuild_scales(strip, nw, patch)
            return out
        if kind == "QuackWeight":
            from .quack_gemm import unpack_scales, unpack_weight

            qw = prepared.quack
            return {"qweight": lambda: unpack_weight(qw.blob), "wscales": lambda: unpack_scales(qw.sf)}
        return {}

    def run_w4a4(self, x, qweight, wscales, smooth, proj_down, proj_up, wcscale, bias, extra):
        m, k = x.shape
        r = proj_down.shape[1]
        inv, extra = _exact_inv(extra)
        if m <= SMALL_M["w4a4"]:
            return self._small_w4a4(x, qweight, wscales, smooth, proj_down, proj_up, wcscale, bias, extra)
        use_quack = self._exact_on_quack(extra, r, m, x.dtype)

        xq_dtype = torch.bfloat16 if use_quack else None

        def quantize():
            return self.kernels.quantize_act(x, smooth, out_dtype=xq_dtype, inv_smooth=inv)[0]

        pds = _proj_down_smoothed(extra, proj_down, smooth) if r else None
        env = getenv(self.tuning.ENV_EXACT_LORA) if r else None
        plan = self.tuning.exact_lora_plan(m, k, pds.shape[1], env, self.tuning.sm_count(x.device)) if env else None
        # the PDL pair (SVDQ_SM90_PDL; by default in captured graphs), then with SVDQ_SM90_EXACT_LORA unset the one
        # read where tuning says: unless SVDQ_SM90_LORA_STREAM=1 asks for the second stream (the two launches)
        stream = switch(ENV_LORA_STREAM) is True
        pdl = plan is None and r > 0 and x.stride(1) == 1 and _pdl(x, self.kernels, auto=not stream)
        lora_env = getenv(self.tuning.ENV_LORA_ACT) if pdl else None
        lora_plan = self.tuning.lora_act_plan(m, k, pds.shape[1], lora_env) if pdl else None
        if r and not env and lora_plan is None and not stream and self.tuning.exact_lora_by_default(m, pds.shape[1]):
            plan = self.tuning.exact_lora_plan(m, k, pds.shape[1], "one", self.tuning.sm_count(x.device))
        if plan is not None:  # the pass and lora_act [M, R] bf16 in one read of x
            with self.kernels.setting_launch(self.tuning.ENV_EXACT_LORA, env, "quantize_act_lora at {} and R = {}",
                                             plan, pds.shape[1], hint="take fewer rows, a shorter k-step or fewer "
                                             "stages, or 'two' (the pass, then cuBLAS)"):
                xq, lora = self.kernels.quantize_act_lora(
                    x, smooth, pds, out_dtype=xq_dtype, block_m=plan.block_m, block_k=plan.block_k, split=plan.split,
                    num_warps=plan.num_warps, num_stages=plan.num_stages, inv_smooth=inv)
        elif lora_plan is not None:  # lora_act's partials (Triton), the pass beside it as its PDL dependent
            with _lora_act_setting(self.kernels, lora_env, lora_plan, pds.shape[1]):
                part = self.kernels.lora_act(x, pds, torch.float32, block_m=lora_plan.block_m, split=lora_plan.split,
                                             num_warps=lora_plan.num_warps, num_stages=lora_plan.num_stages, pdl=True)
            xq, lora = self.kernels.quantize_act_after_lora(x, smooth, part, out_dtype=xq_dtype, inv_smooth=inv)
        elif r:  # lora_act [M, R] bf16: x read once more, at copy speed (beside the pass: _lora_beside)
            lora, xq = _lora_beside(x, pds, quantize)
        else:
            lora, xq = None, quantize()
        return self._exact_gemm(xq, lora, use_quack, x.dtype, qweight, wscales, proj_up, wcscale, bias, extra)

    @staticmethod
    def _exact_on_quack(extra, r: int, m: int, dtype: torch.dtype) -> bool:
        # extra: [proj_down', proj_up', (segments)] when r, then the 4 tensors of QuackWeight when prepared
        return len(extra) >= (6 if r else 4) and m >= QUACK_MIN_M and dtype == torch.bfloat16

    def _exact_gemm(self, xq, lora, use_quack, x_dtype, qweight, wscales, proj_up, wcscale, bias, extra):
        """The exact mode's GEMM above SMALL_M on the quantized activations ``xq`` and ``lora_act``."""
        m, k = xq.shape
        n, r = wcscale.shape[0], proj_up.shape[1]
        if use_quack:
            from . import quack_gemm
            from .quack_gemm import weight as quack_gemm_weight

            qw = quack_gemm_weight(extra[-4:])
            if len(extra) == 7:  # the low-rank MMA in the accumulator
                return quack_gemm.gemm(xq, qw, lr_acc=(extra[1], lora, extra[2]))
            return quack_gemm.gemm(xq, qw, lora @ extra[1].T if r else None)
        if r and lora.shape[1] != r:  # padded to whole windows for the quack path
            lora = lora[:, :r].contiguous()
        if qweight.numel() == 0:  # quack's repacked tensors stand in for the canonical ones (replaced)
            from .quack_gemm import unpack_scales, unpack_weight

            qweight, wscales = unpack_weight(extra[-4]), unpack_scales(extra[-3])
        cfg = self.tuning.pick(m, n, k)
        return self.kernels.w4_gemm(xq, qweight, wscales, wcscale, bias, proj_up if r else None, lora, x_dtype, cfg)

    def run_w4a4_cat_gelu(self, xa, xb, qweight, wscales, smooth, proj_down, proj_up, wcscale, bias, extra):
        """The exact mode on ``cat_gelu(xa, xb)`` from ``tuning.CAT_GELU_MIN_M`` tokens:
        ``kernels.quantize_act_cat`` and ``kernels.lora_act(xb=)`` read the two tensors; fewer tokens, or
        widths the kernels do not take, write the input and run ``run_w4a4``."""
        m, r = xb.shape[0], proj_down.shape[1]
        if not self._exact_reads_cat(xa, xb):
            return super().run_w4a4_cat_gelu(xa, xb, qweight, wscales, smooth, proj_down, proj_up, wcscale, bias,
                                             extra)
        inv, extra = _exact_inv(extra)
        lora = None
        if r:
            pds = _proj_down_smoothed(extra, proj_down, smooth)
            part = self._lora_act_cat(xa, xb, pds)  # fp32 ([S, M, R'] partial sums over K where split)
            lora = (part.sum(0) if part.dim() == 3 else part).to(torch.bfloat16)  # as x.to(bf16) @ pds
        use_quack = self._exact_on_quack(extra, r, m, xb.dtype)
        xq, _, _ = self.kernels.quantize_act_cat(xa, xb, smooth, out_dtype=torch.bfloat16 if use_quack else None,
                                                 inv_smooth=inv)
        return self._exact_gemm(xq, lora, use_quack, xb.dtype, qweight, wscales, proj_up, wcscale, bias, extra)

    def _small_w4a4(self, x, qweight, wscales, smooth, proj_down, proj_up, wcscale, bias, extra):
        """A few tokens (``small_m``): one launch reading the weight once (plus ``lora_act``'s GEMM); where
        ``small_m.use_fma`` the kernel quantizes the activations itself."""
        from . import small_m

        m, n, r = x.shape[0], wcscale.shape[0], proj_down.shape[1]
        layout, w, s = small_m.CANONICAL, qweight, wscales
        if qweight.numel() == 0:  # quack's repacked tensors stand in for the canonical ones (replaced)
            layout, w, s = small_m.QUACK, extra[-4], extra[-3]
        ctas = _route_exact_one_launch(x, n) if layout == small_m.QUACK else None
        if ctas is not None:
            from . import small_m_fast
            from .quack_gemm import weight as quack_gemm_weight

            qw = quack_gemm_weight(extra[-4:])  # its fp32 wcscale and bias: views, no launch
            sm = smooth if smooth.dtype == torch.float32 and smooth.is_contiguous() else smooth.float().contiguous()
            pds = _proj_down_smoothed(extra, proj_down, smooth)[:, :r] if r else None
            b = None if bias is None else qw.bias.reshape(-1)
            up = proj_up.contiguous() if r else None
            return small_m_fast.linear_exact(x, sm, w, s, qw.wc.reshape(-1), b, pds, up, out_dtype=x.dtype,
                                             ctas_per_sm=ctas or None,
                                             num_stages=tuning.exact_one_launch_stages(x.shape[0], n, x.shape[1]))
        mma = layout == small_m.QUACK and x.dtype == torch.bfloat16 and _route_small_m_mma("exact", x, n)
        if mma and switch(ENV_MMA_FUSED) is True and len(extra) in (4, 7):  # no branch, or its accumulator form
            from .quack_gemm import weight as quack_gemm_weight

            qw = quack_gemm_weight(extra[-4:])
            lr = (extra[1], x @ extra[0], extra[2]) if len(extra) == 7 else (None, None, None)
            return _small_m_mma_module().linear_fused(self.kernels.quantize_act(x, smooth)[0], w, s, qw.wc, qw.bias,
                                                      *lr, out_dtype=x.dtype)
        lora = None
        if r:
            pds = _proj_down_smoothed(extra, proj_down, smooth)
            lora = x.to(torch.bfloat16) @ pds[:, :r]
        if mma:
            xq = self.kernels.quantize_act(x, smooth)[0]
            return _small_m_mma_module().linear(xq, w, s, wcscale.float(), bias,
                                                proj_up if r else None, lora, out_dtype=x.dtype)
        if small_m.use_fma(m, n, x.shape[1]):
            a, act = x, small_m.ACT_NVFP4
        else:
            a, act = self.kernels.quantize_act(x, smooth)[0], small_m.ACT_X
        return small_m.linear(a, layout, w, s, wcscale.float(), n, act=act, smooth=smooth, bias=bias,
                              proj_up=proj_up if r else None, lora_act=lora, out_dtype=x.dtype)

    def run_w4a4_fast(self, x, qweight, wscales, smooth, proj_down, proj_up, wcscale, bias, extra):
        quack_fast = _quack_fast_module()
        r = proj_down.shape[1]
        inv, extra = extra[-1], extra[:-1]  # Sm90Prepared.tensors(): inv_smooth comes last
        fw = quack_fast.weight(extra[-4:])
        out_dtype = torch.float16 if x.dtype == torch.float16 else torch.bfloat16
        if _route_fast_one_launch(x, fw.cs.numel()):
            from . import small_m_fast

            # the prepared proj_down / smooth: its first r columns (the accumulator path pads at the end)
            return small_m_fast.linear(x, inv, fw.blob, fw.strip, fw.cs, fw.bias if bias is not None else None,
                                       extra[0][:, :r] if r else None, proj_up.contiguous() if r else None,
                                       out_dtype=x.dtype)
        if _route_small_m_mma("fast", x, fw.cs.numel()):
            mma = _small_m_mma_module()
            if switch(ENV_MMA_FUSED) is True and len(extra) == 7:  # the accumulator form, in one launch
                a8, sa, la = self.kernels.quantize_act_fp8(x, smooth, lora=_mm_f32(x.to(torch.bfloat16), extra[0]),
                                                           inv_smooth=inv, gemm_order=True)
                out = mma.linear_fast_fused(a8, sa, fw, extra[1], la, extra[2], out_dtype=out_dtype)
            elif switch(ENV_MMA_FUSED) is True and len(extra) == 4:  # no low-rank branch
                a8, sa = self.kernels.quantize_act_fp8(x, smooth, inv_smooth=inv, gemm_order=True)
                out = mma.linear_fast_fused(a8, sa, fw, out_dtype=out_dtype)
            else:
                a8, sa = self.kernels.quantize_act_fp8(x, smooth, inv_smooth=inv, gemm_order=True)
                # the prepared proj_down / smooth: its first r columns (the accumulator path pads at the end)
                lora = _mm_f32(x.to(torch.bfloat16), extra[0][:, :r]) if r else None
                out = mma.linear_fast(a8, sa, fw, bias, proj_up if r else None, lora, out_dtype)
            return out if x.dtype == out_dtype else out.to(x.dtype)
        if len(extra) == 7:  # [proj_down', proj_up', segments] + FastWeight: the low-rank MMA in the accumulator
            pds, up, seg = extra[:3]
            plan = _lora_plan(x, pds)  # read once: the pair's choice and lora_act's launch take the same plan
            pdl = self._fast_lora_pdl(x, plan)
            a8, sa, la = self.kernels.quantize_act_fp8(x, smooth, lora=self._lora_act(x, pds, pdl, plan),
                                                       inv_smooth=inv, gemm_order=True, lora_pdl=pdl)
            out = quack_fast.gemm(a8, sa, fw, out_dtype=out_dtype, lr_acc=(up, la, seg))
        else:
            lowrank = None
            if r:
                pds, up = extra[0], extra[1]
                lowrank = ((x.to(torch.bfloat16) @ pds) @ up.T).to(out_dtype)  # [M, N], the epilogue's tile
            a8, sa = self.kernels.quantize_act_fp8(x, smooth, inv_smooth=inv, gemm_order=True)
            out = quack_fast.gemm(a8, sa, fw, lowrank, out_dtype=out_dtype)
        return out if x.dtype == out_dtype else out.to(x.dtype)

    def linear_cat_gelu(self, module, xa, xb, prepared, kind=None):
        kind = kind or module.kind
        fast = kind == "w4a4_fast"
        if fast:
            reads = self._reads_cat_gelu(module, xa, xb, prepared)
        else:
            reads = kind == "w4a4" and self._exact_reads_cat(xa, xb)
        if not reads:
            return super().linear_cat_gelu(module, xa, xb, prepared, kind)
        t = module._parameters
        args = (xa, xb, t["qweight"], t["wscales"], t["smooth"], t["proj_down"], t["proj_up"], t["wcscale"],
                t["bias"], self.extra_tensors(prepared))
        if plain_eager_call(xb) and (xa is None or plain_eager_call(xa)):
            return (self.run_w4a4_fast_cat_gelu if fast else self.run_w4a4_cat_gelu)(*args)
        return w4a4_cat_gelu_linear(*args, fast, self.name)

    def linear_ada_norm(self, module, x, shift, scale, eps, tokens, prepared, kind=None):
        kind = kind or module.kind
        fast = kind == "w4a4_fast"
        if not ((fast or kind == "w4a4") and self._reads_ada_norm(module, x, shift, scale, prepared, fast)):
            return super().linear_ada_norm(module, x, shift, scale, eps, tokens, prepared, kind)
        t = module._parameters
        args = (x, shift, scale, eps, tokens, t["qweight"], t["wscales"], t["smooth"], t["proj_down"], t["proj_up"],
                t["wcscale"], t["bias"], self.extra_tensors(prepared), fast)
        if plain_eager_call(x) and plain_eager_call(shift) and plain_eager_call(scale):
            return self.run_w4a4_ada_norm(*args)
        return w4a4_ada_norm_linear(*args, self.name)

    def _reads_ada_norm(self, module, x, shift, scale, prepared, fast: bool) -> bool:
        """Whether this call normalizes as it loads (``norm_pass``): quack's GEMM (the fast one, or the exact one
        with bf16 input) with the low-rank branch in its accumulator (or none), at least ``tuning.ADA_NORM_MIN_M``
        tokens (a static count), K % 128 == 0, 16-bit x, shift and scale of unit stride along K sharing a row
        stride, and ``SVDQ_SM90_ADA_NORM`` not "0" (``tuning.ada_norm_enabled``); else the input is written out and
        the layer runs on it."""
        m, k = x.shape
        if (self.interpret or not isinstance(m, int) or m < tuning.ADA_NORM_MIN_M or k % 128
                or not tuning.ada_norm_enabled() or x.dtype not in (torch.bfloat16, torch.float16)
                or shift.stride(1) != 1 or scale.stride(1) != 1 or shift.stride(0) != scale.stride(0)):
            return False
        want = "FastWeight" if fast else "QuackWeight"
        if type(getattr(prepared, "quack", None)).__name__ != want or (not fast and x.dtype != torch.bfloat16):
            return False
        return module.rank == 0 or prepared.lowrank_segments is not None

    def run_w4a4_ada_norm(self, x, shift, scale, eps, tokens, qweight, wscales, smooth, proj_down, proj_up, wcscale,
                          bias, extra, fast):
        """``norm_pass``: the activation pass (and ``lora_act``) normalizing ``x`` as it loads, then the mode's quack
        GEMM with the low-rank branch in its accumulator; an unprepared call (no ``inv_smooth`` in ``extra``) writes
        the input."""
        from . import norm_pass

        r = proj_down.shape[1]
        if fast:
            inv, ex = extra[-1], extra[:-1]  # Sm90Prepared.tensors(): inv_smooth comes last
            if len(ex) != (7 if r else 4):
                return super().run_w4a4_ada_norm(x, shift, scale, eps, tokens, qweight, wscales, smooth, proj_down,
                                                 proj_up, wcscale, bias, extra, fast)
            quack_fast = _quack_fast_module()
            fw = quack_fast.weight(ex[-4:])
            a8, sa, la = norm_pass.ada_norm_fast(x, shift, scale, eps, inv, ex[0] if r else None, tokens=tokens,
                                                 **self._ada_norm_launch(x))
            out = quack_fast.gemm(a8, sa, fw, out_dtype=torch.float16 if x.dtype == torch.float16 else torch.bfloat16,
                                  lr_acc=(ex[1], la, ex[2]) if r else None)
            return out if out.dtype == x.dtype else out.to(x.dtype)
        inv, ex = _exact_inv(extra)
        if inv is None or len(ex) != (7 if r else 4):
            return super().run_w4a4_ada_norm(x, shift, scale, eps, tokens, qweight, wscales, smooth, proj_down,
                                             proj_up, wcscale, bias, extra, fast)
        xq, lora = norm_pass.ada_norm_exact(x, shift, scale, eps, inv, ex[0] if r else None, tokens=tokens,
                                            out_dtype=torch.bfloat16, **self._ada_norm_launch(x))
        return self._exact_gemm(xq, lora, True, x.dtype, qweight, wscales, proj_up, wcscale, bias, ex)

    def _ada_norm_launch(self, x: torch.Tensor) -> dict:
        """The norm pass's launch settings, read per call: ``SVDQ_SM90_ADA_NORM_TILE``'s tile,
        ``SVDQ_SM90_ADA_NORM_FORM``'s form, and PDL for the pair and rows forms where the call takes PDL pairs
        (``_pdl``)."""
        block_m, warps = tuning.ada_norm_tile()
        form = tuning.ada_norm_form()
        return dict(block_m=block_m, num_warps=warps, form=form, pdl=form != "split" and _pdl(x, self.kernels))

    def _reads_cat_gelu(self, module, xa, xb, prepared) -> bool:
        """Whether the fast mode reads ``cat_gelu(xa, xb)`` from its two tensors (``kernels.quantize_act_fp8_cat``
        and ``kernels.lora_act(xb=)``): quack's FP8 GEMM with the low-rank branch in its accumulator (or
        none), at least ``tuning.CAT_GELU_MIN_M`` tokens (a static count), xa's width a multiple of 128 and the
        row within the one-pass kernel; else the input is written out and the fast mode runs on it."""
        if type(getattr(prepared, "quack", None)).__name__ != "FastWeight":
            return False
        return self._fast_reads_cat(xa, xb) and (module.rank == 0 or prepared.lowrank_segments is not None)

    @staticmethod
    def _cat_shapes(xa, xb, min_m: int) -> bool:
        """Two tensors the two-source kernels take: more than ``min_m`` tokens (a static count), xa's
        width a multiple of 128, xb not empty, one dtype."""
        m = xb.shape[0]
        return (isinstance(m, int) and m > min_m and (0 if xa is None else xa.shape[1]) % 128 == 0
                and xb.shape[1] > 0 and (xa is None or xa.dtype == xb.dtype))

    def _exact_reads_cat(self, xa, xb) -> bool:  # from CAT_GELU_MIN_M tokens (above small-M's); whole NVFP4 blocks
        return (self._cat_shapes(xa, xb, max(SMALL_M["w4a4"], tuning.CAT_GELU_MIN_M - 1))
                and xb.shape[1] % 16 == 0)

    def _fast_reads_cat(self, xa, xb) -> bool:  # from CAT_GELU_MIN_M tokens; a row in the one-pass kernel
        return (self._cat_shapes(xa, xb, max(tuning.MMA_TOKENS, tuning.CAT_GELU_MIN_M - 1))
                and xb.dtype in (torch.bfloat16, torch.float16)
                and (0 if xa is None else xa.shape[1]) + xb.shape[1] <= self.kernels.ROW_MAX_K)

    def run_w4a4_fast_cat_gelu(self, xa, xb, qweight, wscales, smooth, proj_down, proj_up, wcscale, bias, extra):
        r = proj_down.shape[1]
        inv, ex = extra[-1], extra[:-1]  # Sm90Prepared.tensors(): inv_smooth comes last
        if len(ex) != (7 if r else 4) or not self._fast_reads_cat(xa, xb):
            return super().run_w4a4_fast_cat_gelu(xa, xb, qweight, wscales, smooth, proj_down, proj_up, wcscale,
                                                  bias, extra)
        quack_fast = _quack_fast_module()
        fw = quack_fast.weight(ex[-4:])
        out_dtype = xb.dtype
        if r:  # [proj_down', proj_up', segments] + FastWeight: the low-rank MMA in the accumulator
            pds, up, seg = ex[:3]
            pdl = xb.stride(1) == 1 and (xa is None or xa.stride(1) == 1) and _pdl(xb, self.kernels)
            a8, sa, la = self.kernels.quantize_act_fp8_cat(xa, xb, inv, lora=self._lora_act_cat(xa, xb, pds, pdl),
                                                           gemm_order=True, lora_pdl=pdl)
            return quack_fast.gemm(a8, sa, fw, out_dtype=out_dtype, lr_acc=(up, la, seg))
        a8, sa = self.kernels.quantize_act_fp8_cat(xa, xb, inv, gemm_order=True)
        return quack_fast.gemm(a8, sa, fw, out_dtype=out_dtype)

    def _lora_act_cat(self, xa, xb, pds: torch.Tensor, pdl: bool = False) -> torch.Tensor:
        """``lora_act`` of ``cat_gelu(xa, xb)`` by ``kernels.lora_act`` from the two tensors, on the plan of
        ``_lora_act`` (cuBLAS would need the input written out, so its default plan serves below
        ``LORA_ACT_MIN_M`` tokens and under ``SVDQ_SM90_LORA_ACT=cublas``)."""
        m, k, r = xb.shape[0], pds.shape[0], pds.shape[1]
        env = getenv(tuning.ENV_LORA_ACT)
        plan = tuning.lora_act_plan(m, k, r, env)
        if plan is None:  # "cublas" (or unset below LORA_ACT_MIN_M tokens): the default plan, not the setting's
            plan, env = tuning.lora_act_plan(max(m, tuning.LORA_ACT_MIN_M), k, r), None
        with _lora_act_setting(self.kernels, env, plan, r):
            return self.kernels.lora_act(xa, pds, torch.float32, block_m=plan.block_m, split=plan.split,
                                         num_warps=plan.num_warps, num_stages=plan.num_stages, xb=xb, gelu_b=True,
                                         pdl=pdl)

    def _fast_lora_pdl(self, x: torch.Tensor, plan: tuning.LoraActPlan | None) -> bool:
        """Whether this fast call takes the PDL pair: the switch on, x of unit stride along K and within the
        one-pass kernel's rows, and ``lora_act`` on the Triton kernel (``plan``, from ``_lora_plan``)."""
        return (x.stride(1) == 1 and x.shape[1] <= self.kernels.ROW_MAX_K and _pdl(x, self.kernels)
                and plan is not None)

    def _lora_act(self, x: torch.Tensor, pds: torch.Tensor, pdl: bool = False, plan: object = ...) -> torch.Tensor:
        """The fast mode's ``lora_act = x @ pds`` in fp32: cuBLAS, or ``kernels.lora_act`` where
        ``tuning.lora_act_plan`` says (its split's partial sums, which ``quantize_act_fp8`` adds); ``plan``: that
        plan when the caller has it (``_lora_plan``; None: cuBLAS; unset: read here). ``pdl``: the Triton kernel
        as the PDL pair's first launch (``_fast_lora_pdl`` said so)."""
        if plan is ...:
            plan = _lora_plan(x, pds)
        if plan is None:
            return _mm_f32(x.to(torch.bfloat16), pds)
        with _lora_act_setting(self.kernels, _lora_act_env, plan, pds.shape[1]):
            return self.kernels.lora_act(x, pds, torch.float32, block_m=plan.block_m, split=plan.split,
                                         num_warps=plan.num_warps, num_stages=plan.num_stages, pdl=pdl)

    def run_w4a16(self, x, qweight, wscales, wcscale, bias, extra):
        if x.stride(1) != 1:
            x = x.contiguous()
        if x.shape[0] <= SMALL_M["w4a16"]:
            from . import small_m

            return small_m.linear(x, small_m.CANONICAL, qweight, wscales, wcscale.float(), qweight.shape[0],
                                  act=small_m.ACT_X, bias=bias, out_dtype=x.dtype)
        cfg = self.tuning.pick(x.shape[0], qweight.shape[0], x.shape[1])
        return self.kernels.w4_gemm(x, qweight, wscales, wcscale, bias, None, None, x.dtype, cfg)


def _lora_act_env() -> str | None:
    """``SVDQ_SM90_LORA_ACT``'s value, read where a launch on its plan was refused (``_lora_act_setting``)."""
    return getenv(tuning.ENV_LORA_ACT)


def _lora_act_setting(kernels, env, plan: tuning.LoraActPlan, r: int):
    """``kernels.setting_launch`` around a ``kernels.lora_act`` launch on ``plan`` with ``r`` columns: a launch Triton
    refuses for want of resources names ``SVDQ_SM90_LORA_ACT`` where ``env`` (its value, or ``_lora_act_env`` to read
    it only then) chose the plan, and is Triton's error where the plan is the default one (``env`` None)."""
    return kernels.setting_launch(tuning.ENV_LORA_ACT, env, "lora_act at {} and R = {}", plan, r,
                                  hint="take fewer rows or stages, or 'cublas'")


def _lora_plan(x: torch.Tensor, pds: torch.Tensor) -> tuning.LoraActPlan | None:
    """``tuning.lora_act_plan`` of the fast mode's ``lora_act`` for ``x`` and ``pds [K, R]`` under
    ``SVDQ_SM90_LORA_ACT`` (read per call): None for cuBLAS."""
    return tuning.lora_act_plan(x.shape[0], x.shape[1], pds.shape[1], getenv(tuning.ENV_LORA_ACT))


def _exact_inv(extra: list[torch.Tensor]) -> tuple[torch.Tensor | None, list[torch.Tensor]]:
    """``(inv_smooth, the rest)`` of an exact-mode ``extra``: the prepared ``1 / smooth`` comes last and is the
    list's one 1-D float32 tensor (the quack weight's ``wc`` / ``bias`` are [1, N], the segments int32); a list
    made without it (an unprepared call: []) gives None."""
    if extra and extra[-1].dim() == 1 and extra[-1].dtype == torch.float32:
        return extra[-1], extra[:-1]
    return None, extra


def _proj_down_smoothed(extra: list[torch.Tensor], proj_down: torch.Tensor, smooth: torch.Tensor) -> torch.Tensor:
    """``proj_down / smooth`` in bf16 (``lora_act = x @ it``): the prepared one (``extra[0]``; padded to
    whole windows where the branch joins quack's accumulator), or made here for an unprepared call."""
    return extra[0] if extra else nvfp4.proj_down_smoothed(proj_down, smooth)


_MM_OUT_DTYPE = True  # torch.mm(..., out_dtype=) serves this build (cleared on the first refusal)


def _mm_f32(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """``a @ b`` of bf16 operands with an fp32 result (one rounding less than a bf16 result)."""
    global _MM_OUT_DTYPE
    if _MM_OUT_DTYPE:
        try:
            return torch.mm(a, b, out_dtype=torch.float32)
        except (RuntimeError, TypeError, NotImplementedError):  # a build without the mixed-dtype mm
            _MM_OUT_DTYPE = False
    return (a @ b).float()


def make_backend() -> Sm90Backend:
    return Sm90Backend()
