import os

import pytest
import torch

# Tests hold modules to the exact W4A4 contract unless they choose a mode themselves ("auto", the
# library default, picks the fast mode on Hopper GPUs): see test_sm90_fast.py for the fast mode.
os.environ.setdefault("SVDQ_LINEAR_MODE", "exact")

if not torch.cuda.is_available():
    # The sm90 Triton kernels run on CPU tensors under Triton's interpreter (set before they load).
    os.environ.setdefault("TRITON_INTERPRET", "1")


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)
