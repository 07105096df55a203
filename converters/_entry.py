"""What the per-model scripts share: pick the model, then run ``svdq-convert`` (``svdq_linear.convert``)."""

from __future__ import annotations

import argparse

from svdq_linear.convert import cli


def run(script: str, models: dict[str, str], default: str, argv: list[str] | None = None) -> int:
    """``python converters/<script>.py OUT_DIR [--model NAME|HUB_ID|FOLDER] [svdq-convert options]``.

    ``--model`` takes a short name of ``models`` or anything ``svdq-convert`` takes (a hub id, a local
    diffusers folder, ``tiny:...``); the other arguments go to ``svdq-convert`` as they are.
    """
    p = argparse.ArgumentParser(add_help=False)
    p.add_argument("--model", default=default)
    known, rest = p.parse_known_args(argv)
    if "-h" in rest or "--help" in rest:
        names = ", ".join(f"{k} ({v})" for k, v in models.items())
        print(f"usage: python converters/{script}.py OUT_DIR [--model NAME|HUB_ID|FOLDER] [svdq-convert options]\n"
              f"  --model: {names}, or a hub id or local folder (default: {default})\n")
        cli.build_parser().print_help()
        return 0
    return cli.main([models.get(known.model, known.model), *rest])
