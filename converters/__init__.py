"""Converters: SVDQuant of Flux / SD3 checkpoints (``svdq-convert``) and of loaded pipelines."""
