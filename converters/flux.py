"""Convert a FLUX.1 pipeline to SVDQuant W4A4 with svdq-convert's Flux recipe.

    python converters/flux.py OUT_DIR [--model dev|schnell|HUB_ID|FOLDER] [svdq-convert options]

Runs ``svdq_linear.convert`` (the code behind ``svdq-convert``) on FLUX.1-dev by default; see
``converters/README.md`` for what the model needs (GPU memory for calibration, time, access).
"""

import sys

from _entry import run

MODELS = {
    "dev": "black-forest-labs/FLUX.1-dev",
    "schnell": "black-forest-labs/FLUX.1-schnell",
}

if __name__ == "__main__":
    sys.exit(run("flux", MODELS, "dev"))
