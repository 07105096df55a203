"""Converters: SVDQuant of Flux / SD3 checkpoints (``svdq-convert``) and of loaded pipelines.

Part of the ``svdq_linear`` package (not a top-level ``converters`` package): it imports
``svdq_linear``; ``svdq_linear`` imports it only lazily (``quantize_pipeline``).
"""
