import os
import sys

import pytest
import torch

sys.path.insert(0, os.path.dirname(__file__))  # test helpers (moe_reference, ...) import by name


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)
