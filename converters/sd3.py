"""Convert a Stable Diffusion 3 / 3.5 pipeline to SVDQuant W4A4 with svdq-convert's SD3 recipe.

    python converters/sd3.py OUT_DIR [--model sd3-medium|sd35-medium|sd35-large|HUB_ID|FOLDER] [options]

Runs ``svdq_linear.convert`` (the code behind ``svdq-convert``) on SD3.5-medium by default; see
``converters/README.md`` for what each model needs.
"""

import sys

from _entry import run

MODELS = {
    "sd3-medium": "stabilityai/stable-diffusion-3-medium-diffusers",
    "sd35-medium": "stabilityai/stable-diffusion-3.5-medium",
    "sd35-large": "stabilityai/stable-diffusion-3.5-large",
}

if __name__ == "__main__":
    sys.exit(run("sd3", MODELS, "sd35-medium"))
