"""``svdq-convert model_id out_dir``: SVDQuant W4A4 conversion of a Flux / SD3 diffusers pipeline."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from .convert import TINY_PREFIX, ConvertOptions, convert


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="svdq-convert",
        description="Convert a Flux or SD3/SD3.5 diffusers pipeline to SVDQuant W4A4 (NVFP4). The output is "
        "a diffusers pipeline folder: load it with svdq_linear.load_svdq_pipeline(out_dir), or with "
        "DiffusionPipeline.from_pretrained(out_dir) after `import svdq_linear`.",
    )
    p.add_argument("model_id", help=f"local diffusers folder, Hugging Face hub id, or a built-in demo "
                   f"({TINY_PREFIX}flux, {TINY_PREFIX}sd3, {TINY_PREFIX}sd35)")
    p.add_argument("out_dir", help="output folder (must not exist unless --overwrite; written as "
                   "<out_dir>.partial, then renamed)")
    p.add_argument("--rank", type=int, default=32, help="rank of the low-rank branch (default 32)")
    p.add_argument("--alpha", type=float, default=0.5, help="smoothing migration strength (default 0.5)")
    p.add_argument("--svd", choices=("auto", "full", "lowrank"), default="auto",
                   help="SVD method: randomized low-rank for large layers under auto (default)")
    p.add_argument("--refine-iters", type=int, default=0, help="extra low-rank refinement iterations (default 0)")
    p.add_argument("--calib-prompts", metavar="FILE", help="calibration prompts, one a line (default: shipped set)")
    p.add_argument("--calib-num", type=int, help="use only the first N calibration prompts")
    p.add_argument("--calib-steps", type=int, default=4, help="denoising steps per calibration prompt (default 4)")
    p.add_argument("--calib-resolution", type=int, default=512, help="calibration image size (default 512)")
    p.add_argument("--calib-offload", action="store_true",
                   help="calibrate with enable_model_cpu_offload (a GPU smaller than the whole pipeline)")
    p.add_argument("--no-calib", action="store_true", help="no calibration: weight-only smoothing rule (lambda = 1)")
    p.add_argument("--device", help="device for calibration and SVD (default: cuda if available, else cpu)")
    p.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float16", "float32"),
                   help="dtype of the 16-bit tensors (default bfloat16)")
    p.add_argument("--resume", action="store_true", help="continue an interrupted conversion block by block")
    p.add_argument("--overwrite", action="store_true",
                   help="replace out_dir if it holds an earlier svdq-convert output (kept until the new one is complete)")
    p.add_argument("--push-to-hub", metavar="REPO", help="upload the finished folder to this hub repository")
    p.add_argument("--quiet", action="store_true", help="no progress bars")
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    opts = ConvertOptions(
        rank=args.rank, alpha=args.alpha, svd=args.svd, refine_iters=args.refine_iters, calib=not args.no_calib,
        calib_prompts=args.calib_prompts, calib_num=args.calib_num, calib_steps=args.calib_steps,
        calib_resolution=args.calib_resolution, calib_offload=args.calib_offload, device=args.device, dtype=args.dtype, resume=args.resume,
        overwrite=args.overwrite, progress=not args.quiet,
    )
    try:
        summary = convert(args.model_id, args.out_dir, opts)
    except (FileNotFoundError, FileExistsError, ValueError, RuntimeError) as e:
        print(f"svdq-convert: error: {e}", file=sys.stderr)
        partial = Path(args.out_dir).expanduser().resolve()
        partial = partial.with_name(partial.name + ".partial")
        if (partial / "progress.json").is_file() and not isinstance(e, FileExistsError):
            print(f"svdq-convert: the finished blocks are kept in {partial}; rerun with --resume to continue",
                  file=sys.stderr)
        return 2
    print(summary.text())
    if args.push_to_hub:
        try:
            from huggingface_hub import HfApi

            api = HfApi()
            api.create_repo(args.push_to_hub, exist_ok=True)
            api.upload_folder(repo_id=args.push_to_hub, folder_path=summary.out_dir)
        except Exception as e:
            print(f"svdq-convert: error: could not push to {args.push_to_hub} ({type(e).__name__}: {e}); "
                  f"the converted folder {summary.out_dir} is complete", file=sys.stderr)
            return 3
        print(f"  pushed to {args.push_to_hub}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
