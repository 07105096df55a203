"""svdq-linear: SVDQuant W4A4 (NVFP4) drop-in replacement for ``nn.Linear`` in diffusion transformers.

Importing the package registers the ``svdq_w4a4`` quantizer with diffusers, so that
``DiffusionPipeline.from_pretrained`` loads folders written by ``svdq-convert``.
"""

import warnings

from . import backends, nvfp4
from .fuse import fuse_gelu_inputs, unfuse_gelu_inputs
from .linear import NVFP4W4A16Linear, SVDQW4A4Linear, reset_prepared, set_mode
from .lora import fuse_lora, unfuse_lora
from .svdquant import SVDQuantConfig, SVDQuantWeights, svdquant

__version__ = "0.1.0"

try:
    from .diffusers_quantizer import SVDQuantizationConfig, register as _register_diffusers_quantizer
    from .pipeline import load_svdq_pipeline, quantize_linears
except ImportError as _e:  # the modules work without diffusers; loading pipelines does not
    warnings.warn(f"svdq-linear: diffusers integration unavailable ({_e})", stacklevel=2)
else:
    try:
        _register_diffusers_quantizer()
    except Exception as _e:  # a diffusers change must not take the modules down with it
        warnings.warn(
            f"svdq_linear: could not register the svdq_w4a4 quantizer with diffusers ({type(_e).__name__}: {_e}); "
            "SVDQW4A4Linear / NVFP4W4A16Linear and load_svdq_pipeline still work, but "
            "DiffusionPipeline.from_pretrained will not load svdq-convert folders",
            RuntimeWarning,
            stacklevel=2,
        )


def quantize_pipeline(pipe, rank: int = 32, calib_prompts=None, **kwargs):
    """Quantize a loaded Flux / SD3 pipeline in place (see ``svdq_linear.convert.convert.quantize_pipeline``)."""
    from .convert.convert import quantize_pipeline as _quantize_pipeline

    return _quantize_pipeline(pipe, rank=rank, calib_prompts=calib_prompts, **kwargs)


__all__ = [
    "NVFP4W4A16Linear",
    "SVDQW4A4Linear",
    "SVDQuantConfig",
    "SVDQuantWeights",
    "SVDQuantizationConfig",
    "backends",
    "fuse_gelu_inputs",
    "fuse_lora",
    "load_svdq_pipeline",
    "nvfp4",
    "quantize_linears",
    "quantize_pipeline",
    "reset_prepared",
    "set_mode",
    "svdquant",
    "unfuse_gelu_inputs",
    "unfuse_lora",
]
