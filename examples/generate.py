"""Generate an image with an svdq-convert output folder.

    python examples/generate.py OUT_DIR [--prompt TEXT] [--steps N] [--size PX] [-o image.png]

Real models: ``svdq-convert black-forest-labs/FLUX.1-dev flux-svdq`` (on a GPU machine; calibration
runs the original pipeline) then ``python examples/generate.py flux-svdq --steps 28 --size 1024``.
The built-in demo (``svdq-convert tiny:flux out/tiny-flux``) is a random-weight miniature: its image
is noise, but every step of the real path runs.
"""

import argparse
import json
import time
from pathlib import Path

import torch

from svdq_linear import load_svdq_pipeline


def _positive(text: str) -> int:
    value = int(text)
    if value <= 0:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text}")
    return value


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("model", help="svdq-convert output folder or hub id")
    p.add_argument("--prompt", default="A photo of an astronaut riding a horse on the moon")
    p.add_argument("--steps", type=_positive, default=None, help="default: 2 for the tiny demo, else 28")
    p.add_argument("--size", type=_positive, default=None, help="default: 64 for the tiny demo, else 1024")
    p.add_argument("--guidance", type=float, default=3.5)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--dtype", default=None, choices=["bfloat16", "float16", "float32"],
                   help="default: bfloat16 on GPU, float32 on CPU")
    p.add_argument("-o", "--output", type=Path, default=Path("svdq.png"))
    args = p.parse_args()

    from PIL import Image

    # what can fail after minutes of generation, checked first
    if args.output.suffix.lower() not in Image.registered_extensions():
        p.error(f"-o {args.output}: expected an image file name (.png, .jpg, ...)")
    try:
        args.output.parent.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        p.error(f"-o {args.output}: {e.strerror or e}")
    if args.device.startswith("cuda") and not torch.cuda.is_available():
        p.error("--device cuda: this torch sees no CUDA device")
    dtype = getattr(torch, args.dtype) if args.dtype else (torch.bfloat16 if args.device != "cpu" else torch.float32)
    t0 = time.perf_counter()
    try:
        pipe = load_svdq_pipeline(args.model, device=args.device, dtype=dtype)
    except (OSError, ValueError) as e:
        p.error(f"{args.model}: {e}")
    conf = json.loads((Path(pipe.config._name_or_path) / "transformer" / "config.json").read_text())
    tiny = str(conf["quantization_config"].get("conversion", {}).get("source", "")).startswith("tiny:")
    steps = args.steps or (2 if tiny else 28)
    size = args.size or (64 if tiny else 1024)
    extra = {"max_sequence_length": 32} if tiny else {}
    print(f"loaded {type(pipe).__name__} in {time.perf_counter() - t0:.1f} s")
    t0 = time.perf_counter()
    image = pipe(args.prompt, num_inference_steps=steps, height=size, width=size, guidance_scale=args.guidance,
                 generator=torch.Generator("cpu").manual_seed(args.seed), **extra).images[0]
    print(f"generated {image.width}x{image.height} in {steps} steps, {time.perf_counter() - t0:.1f} s")
    image.save(args.output)
    print(f"wrote {args.output}")
    if tiny:
        print("the tiny demo model has random weights, so its image is noise; for a real picture convert a real "
              "model (README, 'Real models')")


if __name__ == "__main__":
    main()
