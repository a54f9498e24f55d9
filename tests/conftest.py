import os
import sys

# Shared helpers of the tests (reference loops, statistics, kernel checks) live apart from the tests.
sys.path.insert(0, os.path.join(os.path.dirname(__file__), "helpers"))

# Triton kernels run in the interpreter where there is no GPU (must be set before triton is imported).
try:
    import torch

    if not torch.cuda.is_available():
        os.environ.setdefault("TRITON_INTERPRET", "1")
        from interpreter_shim import read_scalars_as_newer_triton

        read_scalars_as_newer_triton()
    # Under pytest-xdist (``./run.sh test``: one worker per core) each worker gets its share of the cores for
    # ATen's threads, not all of them each.
    _workers = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
    if _workers > 1:
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // _workers))
except ImportError:  # pragma: no cover
    pass

import pytest

FULL_MC = os.environ.get("SPECSAMPLER_FULL_MC") == "1"


def mc_trials(full: int, reduced: int) -> int:
    """Monte Carlo size: ``full`` with SPECSAMPLER_FULL_MC=1, else ``reduced`` (CI)."""
    return full if FULL_MC else reduced


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)
