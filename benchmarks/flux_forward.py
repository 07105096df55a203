"""A FLUX.1-dev-size transformer forward at 1024² (4096 image + 512 text tokens, batch 1) on the GPU:
bf16, dynamic FP8 (per-token activations, per-channel weights, ``torch._scaled_mm``), and svdq-linear
in the exact and fast modes, eager and ``torch.compile``d, with the weight bytes of each.

    python benchmarks/flux_forward.py [--layers 19 --single-layers 38] [--out DIR] [--no-compile] [--fuse]

Random weights (no model hub): the bf16 model is built on the GPU with diffusers' FLUX.1-dev config;
the svdq model swaps the quantized targets for modules holding random valid NVFP4 codes, scales and a
rank-32 branch (the kernels' speed does not depend on the values). Times: CUDA-event medians.
"""

from __future__ import annotations

import argparse
import gc
import os
import re
import sys
import time
from pathlib import Path

import torch
import torch.nn as nn

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _cuda  # noqa: E402
from _cuda import graphed  # noqa: E402


class DynamicFP8Linear(nn.Module):
    """What an H200 user picks today: E4M3 weights per output channel, E4M3 activations per token."""

    def __init__(self, lin: nn.Linear):
        super().__init__()
        w = lin.weight.detach().float()
        sw = w.abs().amax(1, keepdim=True).clamp(min=1e-12) / 448
        self.register_buffer("w8", (w / sw).to(torch.float8_e4m3fn))
        self.register_buffer("sw", sw.T.contiguous())
        self.bias = lin.bias

    @classmethod
    def stack(cls, layers: list["DynamicFP8Linear"]) -> "DynamicFP8Linear":
        """The layers stacked along N (per-channel scales: exact)."""
        fused = cls.__new__(cls)
        nn.Module.__init__(fused)
        fused.register_buffer("w8", torch.cat([m.w8 for m in layers]))
        fused.register_buffer("sw", torch.cat([m.sw for m in layers], dim=1))
        biases = [m.bias for m in layers]
        fused.bias = None if any(b is None for b in biases) else nn.Parameter(torch.cat(biases), requires_grad=False)
        return fused

    def forward(self, x):
        shape = x.shape
        x2 = x.reshape(-1, shape[-1])
        sa = x2.float().abs().amax(1, keepdim=True).clamp(min=1e-12) / 448
        a8 = (x2.float() / sa).to(torch.float8_e4m3fn)
        y = torch._scaled_mm(a8, self.w8.T, scale_a=sa, scale_b=self.sw, bias=self.bias, out_dtype=x.dtype)
        return y.reshape(*shape[:-1], -1)


def fuse_qkv(model, variant: str, single_mlp: bool = True) -> None:
    """One GEMM for q/k/v (and the context twins) in every attention: diffusers' ``fuse_qkv_projections()``
    for bf16, ``svdq_linear.fuse`` for the svdq variants (one quantization pass, the packed weight
    shared; in single blocks with ``proj_mlp`` too, unless ``single_mlp`` is False), the rows of the E4M3
    weights and their per-channel scales stacked for dynamic FP8."""
    if variant == "fp8":
        for attn in model.modules():
            if isinstance(getattr(attn, "to_q", None), DynamicFP8Linear):
                attn.to_qkv = DynamicFP8Linear.stack([attn.to_q, attn.to_k, attn.to_v])
                if isinstance(getattr(attn, "add_q_proj", None), DynamicFP8Linear):
                    attn.to_added_qkv = DynamicFP8Linear.stack([attn.add_q_proj, attn.add_k_proj, attn.add_v_proj])
                attn.fused_projections = True
        return
    if variant in ("exact", "fast"):
        from svdq_linear.fuse import fuse_attention_projections

        fuse_attention_projections(model)
        if not single_mlp:  # what svdq_linear did before single blocks stacked proj_mlp with q/k/v
            for attn in model.modules():
                attn.__dict__.pop("_svdq_single_block", None)
    model.fuse_qkv_projections()
    if variant in ("exact", "fast"):  # every layer, the stacked ones included, times the variant's mode
        from svdq_linear import SVDQW4A4Linear

        modes = {m.mode for m in model.modules() if isinstance(m, SVDQW4A4Linear)}
        if modes != {variant}:
            raise RuntimeError(f"{variant}: after fusing, the quantized layers run modes {sorted(modes)}")


def unfuse_qkv(model) -> None:
    model.unfuse_qkv_projections()  # deletes to_qkv / to_added_qkv (diffusers' and svdq_linear.fuse's)


def build_variant(base, variant: str, recipe):
    """The model timed for ``variant``: ``base`` itself for bf16, else a copy with its linears swapped."""
    import copy

    import svdq_linear

    if variant == "bf16":
        return base
    model = copy.deepcopy(base)
    if variant == "fp8":
        swap(model, recipe.w4a4 + recipe.w4a16, DynamicFP8Linear)
        return model
    swap(model, recipe.w4a4, lambda lin: random_quantized(lin, "w4a4"))
    swap(model, recipe.w4a16, lambda lin: random_quantized(lin, "w4a16"))
    svdq_linear.set_mode(model, variant)
    return model


def swap(model, names, build):
    for name in names:
        parent, _, child = name.rpartition(".")
        owner = model.get_submodule(parent) if parent else model
        setattr(owner, child, build(getattr(owner, child)))


def random_quantized(lin: nn.Linear, kind: str, rank: int = 32):
    from svdq_linear import NVFP4W4A16Linear, SVDQW4A4Linear

    n, k = lin.out_features, lin.in_features
    dev = lin.weight.device
    if kind == "w4a4":
        m = SVDQW4A4Linear(k, n, rank=rank, bias=lin.bias is not None, dtype=torch.bfloat16, device="meta")
    else:
        m = NVFP4W4A16Linear(k, n, bias=lin.bias is not None, dtype=torch.bfloat16, device="meta")
    sd = {"qweight": torch.randint(0, 256, (n, k // 2), dtype=torch.uint8, device=dev),
          "wscales": (torch.rand(n, k // 16, device=dev) * 0.02 + 0.01).to(torch.float8_e4m3fn),
          "wcscale": torch.ones(n, device=dev)}
    if kind == "w4a4":
        sd.update(smooth=torch.ones(k, device=dev), proj_down=torch.randn(k, rank, device=dev).bfloat16() / k**0.5,
                  proj_up=torch.randn(n, rank, device=dev).bfloat16() * 0.01)
    if lin.bias is not None:
        sd["bias"] = lin.bias.detach()
    m.load_state_dict(sd, assign=True)
    return m


def inputs(dev):
    g = torch.Generator(device=dev).manual_seed(0)
    return dict(
        hidden_states=torch.randn(1, 4096, 64, device=dev, dtype=torch.bfloat16, generator=g),
        encoder_hidden_states=torch.randn(1, 512, 4096, device=dev, dtype=torch.bfloat16, generator=g),
        pooled_projections=torch.randn(1, 768, device=dev, dtype=torch.bfloat16, generator=g),
        timestep=torch.tensor([0.5], device=dev, dtype=torch.bfloat16),
        img_ids=torch.zeros(4096, 3, device=dev, dtype=torch.bfloat16),
        txt_ids=torch.zeros(512, 3, device=dev, dtype=torch.bfloat16),
        guidance=torch.tensor([3.5], device=dev, dtype=torch.bfloat16),
        return_dict=False,
    )


def timed(fn, iters=10):
    fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(iters):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        torch.cuda.synchronize()
        times.append(a.elapsed_time(b))
    return sorted(times)[len(times) // 2]


def graph_replay_time(fn, iters=10):
    """``fn`` (eager) captured once in a CUDA graph; the median of its replays: GPU time without the host."""
    return timed(graphed(fn), iters)


# kernel name (lower case) -> what it is, first match wins; the rest is "other"
CATEGORIES = [
    ("compiler-fused elementwise / norms", re.compile(r"^triton_")),  # inductor's (names may say "attention")
    ("attention", re.compile(r"flash|fmha|sdpa|attention")),
    ("activation passes (ours, Triton)", re.compile(r"^_quantize|^_lora_act|^_lora_scale")),
    ("adaLN norm passes (ours: statistics, lora_act, pass)", re.compile(r"^_ada_")),
    ("small-M kernels and split-K sums (ours)", re.compile(r"^_small_m|^_splitk|small_m_mma|smallmmma")),
    ("quack GEMM (CuTe DSL)", re.compile(r"quack|kernel_cutlass_kernel")),
    ("cuBLAS / cuBLASLt GEMM (lora_act in the svdq variants)", re.compile(r"nvjet|xmma|gemm|cublas|splitkreduce|cutlass")),
    ("copies / fills", re.compile(r"memset|memcpy|copy|fill|cat|elementwise|vectorized|reduce")),
]


def kernel_breakdown(fn, runs: int = 3) -> tuple[list[tuple[str, float, int]], list[tuple[str, float, int]]]:
    """GPU time of one call by kernel category and the top kernels: (name, ms a call, launches a call)."""
    from torch.profiler import ProfilerActivity, profile

    fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(runs):
            fn()
        torch.cuda.synchronize()
    kernels = []
    for ev in prof.key_averages():
        t = getattr(ev, "device_time_total", None)
        if t is None:
            t = getattr(ev, "cuda_time_total", 0.0)
        if t > 0 and ev.count and str(getattr(ev, "device_type", "CUDA")).endswith("CUDA"):  # kernels, not ops
            kernels.append((ev.key, t / 1e3 / runs, ev.count // runs))
    kernels.sort(key=lambda k: -k[1])
    cats: dict[str, list] = {}
    for name, ms, n in kernels:
        cat = next((c for c, rx in CATEGORIES if rx.search(name.lower())), "other")
        acc = cats.setdefault(cat, [0.0, 0])
        acc[0] += ms
        acc[1] += n
    return sorted(((c, v[0], v[1]) for c, v in cats.items()), key=lambda c: -c[1]), kernels[:25]


def host_profile(variant: str, mode: str, fn, top: int = 30) -> list[str]:
    """cProfile's top functions by own time over one forward (host wall ms beside it)."""
    text, host, total = _cuda.host_profile(fn, top=top)
    return [f"\n### {variant}: host profile of one {mode} forward (cProfile: host {host * 1e3:.0f} ms until "
            f"the call returned, {total * 1e3:.0f} ms until the GPU finished)\n", "```", text, "```"]


def weight_bytes(model) -> int:
    return sum(t.numel() * t.element_size() for t in list(model.parameters()) + list(model.buffers()))


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--layers", type=int, default=19)
    p.add_argument("--single-layers", type=int, default=38)
    p.add_argument("--out", default="bench_out")
    p.add_argument("--no-compile", action="store_true")
    p.add_argument("--compile-mode", default="max-autotune-no-cudagraphs",
                   help="torch.compile mode (reduce-overhead adds CUDA graphs)")
    p.add_argument("--variants", default="bf16,fp8,exact,fast",
                   help="comma-separated: bf16, fp8, exact, fast, fast-cublas (lora_act on cuBLAS), fast-cp (compiled "
                        "calls leave the activation pass to the compiler: SVDQ_SM90_COMPILER_PASS=1); a -gelu suffix "
                        "(fast-gelu, exact-gelu, ...) switches the blocks with fuse_gelu_inputs (the linears after a "
                        "GELU read its parts); a -pdl suffix before it (fast-pdl) sets SVDQ_SM90_PDL=1 for the "
                        "variant, -nopdl (fast-nopdl) SVDQ_SM90_PDL=0; with --fuse, -sep after those (fast-sep, "
                        "fast-nopdl-sep-gelu) keeps single blocks' proj_mlp apart from their fused q/k/v; -written "
                        "before -sep (fast-written) has the layers after an adaLN norm read the norm's written "
                        "output (by default they read its input), -norm that input explicitly; -rows after "
                        "-gelu (fast-rows) takes the norm pass's rows form")
    p.add_argument("--graph", action="store_true", help="also time the eager forward captured in a CUDA graph")
    p.add_argument("--fuse", action="store_true",
                   help="fuse q/k/v (diffusers' fuse_qkv_projections; one quantization pass for the svdq variants)")
    p.add_argument("--profile", action="store_true",
                   help="the compiled forward's GPU time by kernel category and its top kernels (torch.profiler)")
    p.add_argument("--compile-first", action="store_true",
                   help="compile each variant before any eager call (what pipe.transformer.compile() then a "
                        "call does); eager columns empty, held GB after the first compiled call")
    p.add_argument("--cprofile", action="store_true",
                   help="the host: cProfile's top functions (own time) of one eager and one compiled forward")
    p.add_argument("--whole-model-compile", action="store_true",
                   help="torch.compile the whole model instead of diffusers' regional compilation "
                        "(compile_repeated_blocks: one compile per block class, minutes less)")
    args = p.parse_args()
    if args.compile_first and (args.no_compile or args.whole_model_compile):
        p.error("--compile-first compiles the blocks in place: not with --no-compile or --whole-model-compile")
    from diffusers import FluxTransformer2DModel

    import svdq_linear
    from svdq_linear.convert.recipes import recipe_for

    dev = torch.device("cuda")
    torch.manual_seed(0)
    with torch.device(dev):
        base = FluxTransformer2DModel(num_layers=args.layers, num_single_layers=args.single_layers,
                                      guidance_embeds=True).to(torch.bfloat16).eval()
    recipe = recipe_for(base)
    kw = inputs(dev)
    out_dir = Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    lines = [f"# Flux-size forward — {torch.cuda.get_device_name()} — {time.strftime('%Y-%m-%d %H:%M')}",
             f"\n{args.layers} double + {args.single_layers} single blocks, 4096 + 512 tokens, batch 1, bf16 "
             f"activations; ms (median of 10); ratio = bf16 time / variant time (same mode: eager or compiled); "
             f"compiled: torch.compile(mode={args.compile_mode!r}"
             f"{', whole model' if args.whole_model_compile else ', regional: compile_repeated_blocks(fullgraph=True)'}).\n",
             "eager + graph: the eager forward captured once in a CUDA graph, replays timed (no host overhead, "
             "no compiler fusion).\n",
             "compiled + graph: the compiled forward captured once in a CUDA graph (with --graph and a compile "
             "mode without CUDA graphs of its own).\n",
             "held GB: what the variant adds to the GPU's allocated memory once it has run eagerly (its weights "
             "as the kernels hold them, prepared states, fused copies; the bf16 model, built first, is not counted "
             "again: its row shows only what fusing adds).\n",
             "| variant | weight GB | held GB | eager ms | eager ratio | eager + graph ms | ratio | compiled ms | "
             "compiled ratio | compiled + graph ms | ratio |",
             "|---|---|---|---|---|---|---|---|---|---|---|"]
    print("\n".join(lines), flush=True)
    ref = {}
    profiles: list[str] = []
    lora_env = os.environ.get("SVDQ_SM90_LORA_ACT")
    cp_env = os.environ.get("SVDQ_SM90_COMPILER_PASS", "0")
    norm_env = os.environ.get("SVDQ_SM90_ADA_NORM")  # a variant without -norm / -written keeps the caller's
    form_env = os.environ.get("SVDQ_SM90_ADA_NORM_FORM")
    for variant in args.variants.split(","):
        # "-gelu": Flux single blocks' proj_out and the feed-forwards' down projections read their GELU'd
        # input from its parts (svdq_linear.fuse.fuse_gelu_inputs)
        gelu_in = variant.endswith("-gelu")
        v = variant.removesuffix("-gelu")
        # "-sep" (fast-sep): with --fuse, single blocks keep proj_mlp apart from their fused q/k/v
        single_mlp = not v.endswith("-sep")
        v = v.removesuffix("-sep")
        # "-written" (fast-written): with --fuse, the fused layers after an adaLN norm read the norm's written
        # output (SVDQ_SM90_ADA_NORM=0); "-norm": they normalize as they load (=1); without either, the caller's
        # setting (unset: the library's default, they normalize as they load)
        # "-rows" (fast-rows): the norm pass in its rows form (SVDQ_SM90_ADA_NORM_FORM=rows); else the caller's form
        if v.endswith("-rows"):
            os.environ["SVDQ_SM90_ADA_NORM_FORM"] = "rows"
            v = v.removesuffix("-rows")
        elif form_env is None:
            os.environ.pop("SVDQ_SM90_ADA_NORM_FORM", None)
        else:
            os.environ["SVDQ_SM90_ADA_NORM_FORM"] = form_env
        if v.endswith("-norm") or v.endswith("-written"):
            os.environ["SVDQ_SM90_ADA_NORM"] = "1" if v.endswith("-norm") else "0"
            v = v.removesuffix("-norm").removesuffix("-written")
        elif norm_env is None:
            os.environ.pop("SVDQ_SM90_ADA_NORM", None)
        else:
            os.environ["SVDQ_SM90_ADA_NORM"] = norm_env
        # "-pdl" (fast-pdl, exact-pdl): lora_act and the activation pass as a PDL pair (SVDQ_SM90_PDL=1)
        # "-nopdl": never (SVDQ_SM90_PDL=0); without either, the default: the pair in captured graphs only
        if v.endswith("-pdl") or v.endswith("-nopdl"):
            os.environ["SVDQ_SM90_PDL"] = "1" if v.endswith("-pdl") else "0"
            v = v.removesuffix("-pdl").removesuffix("-nopdl")
        else:
            os.environ.pop("SVDQ_SM90_PDL", None)
        # "fast-cp": compiled calls leave the activation pass to the compiler (SVDQ_SM90_COMPILER_PASS=1)
        os.environ["SVDQ_SM90_COMPILER_PASS"] = "1" if v.endswith("-cp") else cp_env
        # "fast-cublas": the fast mode with lora_act on cuBLAS (SVDQ_SM90_LORA_ACT=cublas), beside "fast"
        kind = v.removesuffix("-cp").removesuffix("-cublas")
        if v.removesuffix("-cp") != kind:
            os.environ["SVDQ_SM90_LORA_ACT"] = "cublas"
        elif lora_env is None:
            os.environ.pop("SVDQ_SM90_LORA_ACT", None)
        else:
            os.environ["SVDQ_SM90_LORA_ACT"] = lora_env
        torch.cuda.synchronize()
        mem0 = torch.cuda.memory_allocated()
        model = build_variant(base, kind, recipe)
        gb = weight_bytes(model) / 1e9  # before fusing: bf16's and FP8's fused q/k/v are copies
        if args.fuse:
            fuse_qkv(model, kind, single_mlp)
        if gelu_in:
            from svdq_linear.fuse import fuse_gelu_inputs

            print(f"{variant}: {fuse_gelu_inputs(model)} blocks read their GELU'd input from its parts", flush=True)
        with torch.inference_mode():
            t_eager = t_graph = float("nan")
            if args.compile_first:  # no eager call before the compile: the layers prepare at trace time
                model.compile_repeated_blocks(fullgraph=True, mode=args.compile_mode)
                model(**kw)
            else:
                t_eager = timed(lambda: model(**kw))
            torch.cuda.synchronize()
            held = (torch.cuda.memory_allocated() - mem0) / 1e9
            if args.graph and not args.compile_first:
                try:
                    t_graph = graph_replay_time(lambda: model(**kw))
                except Exception as e:  # a host sync inside the forward cannot be captured
                    print(f"{variant}: CUDA-graph capture failed: {type(e).__name__}: {e}", flush=True)
            if args.cprofile and not args.compile_first:  # before compile_repeated_blocks compiles in place
                profiles.extend(host_profile(variant, "eager", lambda: model(**kw)))
                print("\n".join(profiles[-4:]), flush=True)
            t_comp = t_comp_graph = float("nan")
            if not args.no_compile:
                if args.whole_model_compile:
                    cm = torch.compile(model, mode=args.compile_mode)
                else:  # in place: the 19 + 38 blocks share two compiled graphs
                    if not args.compile_first:  # (compiled above)
                        model.compile_repeated_blocks(fullgraph=True, mode=args.compile_mode)
                    cm = model
                t_comp = timed(lambda: cm(**kw), iters=10)
                if args.graph and "cudagraphs" not in args.compile_mode and args.compile_mode != "reduce-overhead":
                    try:  # the compiled forward (compiler fusion) captured in one CUDA graph (no host)
                        t_comp_graph = graph_replay_time(lambda: cm(**kw))
                    except Exception as e:  # noqa: BLE001
                        print(f"{variant}: capturing the compiled forward failed: {type(e).__name__}: {e}", flush=True)
            if args.cprofile and not args.no_compile:
                profiles.extend(host_profile(variant, "compiled", lambda: cm(**kw)))
                print("\n".join(profiles[-4:]), flush=True)
            if args.profile:
                cats, top = kernel_breakdown(lambda: (cm if not args.no_compile else model)(**kw))
                total = sum(c[1] for c in cats)
                prof_lines = [f"\n### {variant}: GPU time of one {'eager' if args.no_compile else 'compiled'} forward "
                              f"by kernel (torch.profiler, {total:.1f} ms of kernels)\n",
                              "| category | ms | share | launches |", "|---|---|---|---|"]
                prof_lines += [f"| {c} | {ms:.2f} | {100 * ms / total:.0f}% | {n} |" for c, ms, n in cats]
                prof_lines += ["", "| kernel (top 25) | ms | launches |", "|---|---|---|"]
                prof_lines += [f"| `{name[:110]}` | {ms:.2f} | {n} |" for name, ms, n in top]
                profiles.extend(prof_lines)
                print("\n".join(prof_lines), flush=True)
        ref.setdefault("eager", t_eager)
        ref.setdefault("comp", t_comp)
        ref.setdefault("graph", t_graph)
        ref.setdefault("comp_graph", t_comp_graph)
        row = (f"| {variant} | {gb:.2f} | {held:.2f} | {t_eager:.1f} | {ref['eager'] / t_eager:.2f}x | {t_graph:.1f} | "
               f"{ref['graph'] / t_graph:.2f}x | {t_comp:.1f} | "
               f"{ref['comp'] / t_comp:.2f}x | {t_comp_graph:.1f} | {ref['comp_graph'] / t_comp_graph:.2f}x |")
        lines.append(row)
        print(row, flush=True)
        (out_dir / "flux_forward.md").write_text("\n".join(lines + profiles) + "\n")
        if model is base:
            if args.fuse:
                unfuse_qkv(base)
            # compile_repeated_blocks compiled base's blocks in place, and the next variants are deep copies
            # of base: without this their "eager" forwards ran the compiled blocks (eager fast 279 ms against
            # 189 ms as a first variant, docs/perf.md 2026-12-04 fifth session)
            for mod in base.modules():
                if getattr(mod, "_compiled_call_impl", None) is not None:
                    mod._compiled_call_impl = None
            torch._dynamo.reset()
        else:
            del model
            torch._dynamo.reset()
            gc.collect()  # else the next variant's held GB counts this one's weights freed after its mem0
            torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
