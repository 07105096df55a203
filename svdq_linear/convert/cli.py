"""``svdq-convert model_id out_dir``: SVDQuant W4A4 conversion of a Flux / SD3 diffusers pipeline.

Errors are one line on stderr (``svdq-convert: error: ...``) with exit status 2 (3: the push to the
hub failed after a complete conversion; 130: interrupted). ``--resume`` advice follows only where a
rerun with ``--resume`` and the same options can continue.
"""

from __future__ import annotations

import argparse
import contextlib
import sys
import warnings

from safetensors import SafetensorError

from svdq_linear.svdquant import DEFAULT_ACT_HEADROOM, MAX_ACT_HEADROOM

from .convert import TINY_PREFIX, ConvertOptions, ConvertWarning, _one_line, convert, resume_hint


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
    p.add_argument("--act-headroom", type=int, default=DEFAULT_ACT_HEADROOM, metavar="H",
                   help=f"place the calibrated activation maximum H to H+1 powers of two below NVFP4's saturation "
                   f"point 6*448: room for inputs up to 2^H x hotter than the calibration set, at some precision "
                   f"for much quieter ones (0..{MAX_ACT_HEADROOM}; default {DEFAULT_ACT_HEADROOM}, see docs/perf.md)")
    p.add_argument("--calib-prompts", metavar="FILE", help="calibration prompts, one a line (default: shipped set)")
    p.add_argument("--calib-num", type=int, help="use only the first N calibration prompts")
    p.add_argument("--calib-steps", type=int, help="denoising steps per calibration prompt (default 4)")
    p.add_argument("--calib-resolution", type=int,
                   help="calibration image size (default: the pipeline's own size, at most 512, within what its "
                   "positional embedding covers)")
    p.add_argument("--calib-offload", action="store_true",
                   help="calibrate with enable_model_cpu_offload (a GPU smaller than the whole pipeline)")
    p.add_argument("--calib-input", action="append", metavar="NAME=FILE", default=[],
                   help="an image the calibration call passes besides the prompt, by call argument: image, "
                   "mask_image, control_image, control_mask (img2img, inpainting, fill and control pipelines); "
                   "repeat for each")
    p.add_argument("--no-calib", action="store_true", help="no calibration: weight-only smoothing rule (lambda = 1)")
    p.add_argument("--device", help="device for calibration and SVD (default: cuda if available, else cpu)")
    p.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float16", "float32"),
                   help="dtype of the 16-bit tensors (default bfloat16)")
    p.add_argument("--resume", action="store_true", help="continue an interrupted conversion block by block")
    p.add_argument("--overwrite", action="store_true",
                   help="start over: discard an unfinished <out_dir>.partial, and replace out_dir if it holds an "
                   "earlier svdq-convert output (kept until the new one is complete)")
    p.add_argument("--push-to-hub", metavar="REPO", help="upload the finished folder to this hub repository "
                   "(created private)")
    p.add_argument("--public", action="store_true", help="with --push-to-hub: create the repository public")
    p.add_argument("--quiet", action="store_true",
                   help="no progress bars, and no warnings from diffusers, transformers or huggingface_hub")
    return p


@contextlib.contextmanager
def _quiet_libraries(quiet: bool):
    """``--quiet``: diffusers', transformers' and huggingface_hub's progress bars and warnings off
    (restored afterwards, for callers of ``main`` in a live process)."""
    if not quiet:
        yield
        return
    import diffusers.utils.logging as dlog
    import huggingface_hub.utils as hub_utils
    import transformers.utils.logging as tlog

    before = (dlog.get_verbosity(), tlog.get_verbosity(), dlog.is_progress_bar_enabled(),
              tlog.is_progress_bar_enabled(), hub_utils.are_progress_bars_disabled())
    dlog.set_verbosity_error()
    tlog.set_verbosity_error()
    dlog.disable_progress_bar()
    tlog.disable_progress_bar()
    hub_utils.disable_progress_bars()
    try:
        yield
    finally:
        dlog.set_verbosity(before[0])
        tlog.set_verbosity(before[1])
        if before[2]:
            dlog.enable_progress_bar()
        if before[3]:
            tlog.enable_progress_bar()
        if not before[4]:
            hub_utils.enable_progress_bars()


def _error(msg: str) -> None:
    print(f"svdq-convert: error: {msg}", file=sys.stderr)


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.public and not args.push_to_hub:
        _error("--public needs --push-to-hub REPO")
        return 2
    if args.no_calib and args.calib_steps is not None:
        _error("--calib-steps sets up the calibration runs, which --no-calib skips: pass one or the other")
        return 2
    calib_inputs = {}
    for item in args.calib_input:
        name, sep, path = item.partition("=")
        if not sep or not name or not path or name in calib_inputs:
            _error(f"--calib-input: expected NAME=FILE, each NAME once, got {item!r}")
            return 2
        calib_inputs[name] = path
    opts = ConvertOptions(
        rank=args.rank, alpha=args.alpha, svd=args.svd, refine_iters=args.refine_iters,
        act_headroom=args.act_headroom, calib=not args.no_calib, calib_prompts=args.calib_prompts,
        calib_num=args.calib_num, calib_steps=4 if args.calib_steps is None else args.calib_steps,
        calib_resolution=args.calib_resolution,
        calib_offload=args.calib_offload, calib_inputs=calib_inputs or None, device=args.device, dtype=args.dtype,
        resume=args.resume, overwrite=args.overwrite, progress=not args.quiet,
    )
    with _quiet_libraries(args.quiet), warnings.catch_warnings():
        # ours are the CLI's own output, as its errors: said at every run, whatever filters the process has (-W
        # ignore, or a second run in one process, whose registry had swallowed them)
        warnings.simplefilter("always", ConvertWarning)
        plain = warnings.showwarning

        def show(message, category, filename, lineno, file=None, line=None):
            if issubclass(category, ConvertWarning):  # ours: one line, as the errors
                print(f"svdq-convert: warning: {message}", file=sys.stderr)
            else:
                plain(message, category, filename, lineno, file, line)

        warnings.showwarning = show
        try:
            summary = convert(args.model_id, args.out_dir, opts)
        except (OSError, ValueError, TypeError, RuntimeError, SafetensorError, KeyboardInterrupt) as e:
            interrupted = isinstance(e, KeyboardInterrupt)
            _error("interrupted" if interrupted else _one_line(e))
            partial = resume_hint(e)
            if partial is not None:
                print(f"svdq-convert: the finished blocks are kept in {partial}; rerun with --resume to continue "
                      f"(same options)", file=sys.stderr)
            return 130 if interrupted else 2
        print(summary.text())
        if args.push_to_hub:
            try:
                from huggingface_hub import HfApi

                api = HfApi()
                api.create_repo(args.push_to_hub, exist_ok=True, private=not args.public)
                api.upload_folder(repo_id=args.push_to_hub, folder_path=summary.out_dir)
            except Exception as e:
                _error(f"could not push to {args.push_to_hub} ({type(e).__name__}: {_one_line(e)}); "
                       f"the converted folder {summary.out_dir} is complete")
                return 3
            print(f"  pushed to {args.push_to_hub} ({'public' if args.public else 'private'})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
