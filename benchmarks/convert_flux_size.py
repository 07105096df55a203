"""Time and peak host memory of ``svdq-convert --no-calib`` on a FLUX.1-dev-sized transformer (CPU).

    python benchmarks/convert_flux_size.py WORK_DIR [--layers 19 --single-layers 38] [--keep]

Writes a random-weight bf16 checkpoint with FLUX.1-dev's shapes (11.9 B parameters, ~24 GB) block
by block into WORK_DIR/src (no model hub needed), converts it in a child process, and prints/
appends a table row to docs/perf.md-style output: seconds, peak RSS, bytes before -> after.
"""

from __future__ import annotations

import argparse
import json
import re
import resource
import shutil
import subprocess
import sys
import time
from pathlib import Path

import torch


def write_source(src: Path, layers: int, single_layers: int) -> int:
    from accelerate import init_empty_weights
    from diffusers import FlowMatchEulerDiscreteScheduler, FluxTransformer2DModel
    from safetensors.torch import save_file

    config = dict(num_layers=layers, num_single_layers=single_layers, guidance_embeds=True)
    with init_empty_weights():
        model = FluxTransformer2DModel(**config)
    shapes = {k: v.shape for k, v in model.state_dict().items()}
    units: dict[str, list[str]] = {}
    for k in shapes:
        m = re.match(r"^((?:single_)?transformer_blocks\.\d+)\.", k)
        units.setdefault(m.group(1) if m else "other", []).append(k)
    (src / "transformer").mkdir(parents=True)
    weight_map, total = {}, 0
    g = torch.Generator().manual_seed(0)
    for i, keys in enumerate(units.values()):
        name = f"diffusion_pytorch_model-{i + 1:05d}-of-{len(units):05d}.safetensors"
        tensors = {k: (torch.randn(shapes[k], generator=g) * 0.02).to(torch.bfloat16) for k in keys}
        total += sum(t.numel() for t in tensors.values())
        save_file(tensors, src / "transformer" / name)
        weight_map.update({k: name for k in keys})
    (src / "transformer" / "diffusion_pytorch_model.safetensors.index.json").write_text(
        json.dumps({"metadata": {"total_size": total * 2}, "weight_map": weight_map}))
    cfg = dict(model.config)
    cfg["_class_name"] = "FluxTransformer2DModel"
    (src / "transformer" / "config.json").write_text(json.dumps(cfg, default=list))
    FlowMatchEulerDiscreteScheduler().save_pretrained(src / "scheduler")
    (src / "model_index.json").write_text(json.dumps({
        "_class_name": "FluxPipeline", "_diffusers_version": "0.42.1",
        "scheduler": ["diffusers", "FlowMatchEulerDiscreteScheduler"], "transformer": ["diffusers", "FluxTransformer2DModel"],
        "vae": [None, None], "text_encoder": [None, None], "text_encoder_2": [None, None],
        "tokenizer": [None, None], "tokenizer_2": [None, None]}))
    return total


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("work_dir", type=Path)
    p.add_argument("--layers", type=int, default=19)
    p.add_argument("--single-layers", type=int, default=38)
    p.add_argument("--rank", type=int, default=32)
    p.add_argument("--keep", action="store_true", help="keep the source and output folders")
    args = p.parse_args()
    src, out = args.work_dir / "src", args.work_dir / "out"
    shutil.rmtree(args.work_dir, ignore_errors=True)
    t0 = time.perf_counter()
    params = write_source(src, args.layers, args.single_layers)
    t_src = time.perf_counter() - t0
    t0 = time.perf_counter()
    r = subprocess.run([sys.executable, "-m", "svdq_linear.convert.cli", str(src), str(out), "--no-calib", "--rank",
                        str(args.rank), "--device", "cpu", "--quiet"], capture_output=True, text=True)
    t_conv = time.perf_counter() - t0
    peak_gib = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss / 2**20
    print(r.stdout, r.stderr[-2000:] if r.returncode else "", sep="\n")
    print(f"| FLUX.1-dev shapes ({args.layers}+{args.single_layers} blocks, {params / 1e9:.2f} B params), "
          f"--no-calib rank {args.rank}, CPU {torch.get_num_threads()} threads | source written in {t_src:.0f} s "
          f"| convert {t_conv:.0f} s | peak RSS {peak_gib:.2f} GiB | exit {r.returncode} |")
    if not args.keep:
        shutil.rmtree(args.work_dir, ignore_errors=True)


if __name__ == "__main__":
    main()
