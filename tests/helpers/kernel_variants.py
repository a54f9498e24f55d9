"""pytest plugin: count the distinct kernel specialisations that tests launch in the Triton interpreter.

A GPU run compiles each specialisation once (seconds each), so this number decides how long a first GPU run of
the kernel tests takes (``benchmarks/gpu_session.sh check``). Usage, from ``tests/``: ``TRITON_INTERPRET=1
PYTHONPATH=.:helpers python -m pytest -p kernel_variants kernels``; prints the count per kernel at the end. The
keys are those Triton's JIT computes for sm_90 (:func:`specialisations.specialisation_key`).
"""

from __future__ import annotations

from specialisations import recorded_specialisations

_RECORDING = recorded_specialisations()
SEEN = _RECORDING.__enter__()  # for the whole session


def pytest_terminal_summary(terminalreporter):
    per_kernel = {kernel: len(keys) for kernel, keys in SEEN.items()}
    terminalreporter.write_line(f"kernel specialisations launched: {sum(per_kernel.values())} ({per_kernel})")
