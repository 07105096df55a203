"""svdq-linear: SVDQuant W4A4 (NVFP4) drop-in replacement for ``nn.Linear`` in diffusion transformers."""

from . import backends, nvfp4
from .linear import NVFP4W4A16Linear, SVDQW4A4Linear
from .svdquant import SVDQuantConfig, SVDQuantWeights, svdquant

__version__ = "0.1.0"

__all__ = [
    "NVFP4W4A16Linear",
    "SVDQW4A4Linear",
    "SVDQuantConfig",
    "SVDQuantWeights",
    "backends",
    "nvfp4",
    "svdquant",
]
