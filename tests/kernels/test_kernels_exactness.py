"""The exactness Monte Carlo against the Triton kernels: in the interpreter at a small size (CI),
and on a GPU at full size (``-m gpu``, with SPECSAMPLER_FULL_MC=1 for 200k trials)."""

import pytest
from kernelcheck import DEVICE
from stats import assert_exact

from conftest import mc_trials
from specsampler.verify.exactness import chain_monte_carlo, tree_monte_carlo

pytest.importorskip("triton")

# in the interpreter a program costs 30-150 ms: a few hundred trials of small models (CI), 3000 with
# SPECSAMPLER_FULL_MC=1; the full size runs on a GPU (below)
INTERPRETED = [("chain", "token", None), ("chain", "block", None), ("tree", "rrs", "without_replacement"),
               ("tree", "traversal", "iid")]


def _run(kind, method, drafting, trials, device):
    if kind == "chain":
        return chain_monte_carlo(method, 3, 2, trials, seed=31, zeros=True, device=device)
    return tree_monte_carlo(method, [2, 1], 3, trials, seed=32, draft_sampling=drafting, device=device)


@pytest.mark.montecarlo
@pytest.mark.parametrize("kind, method, drafting", INTERPRETED)
def test_kernels_are_exact_at_a_small_size(monkeypatch, kind, method, drafting):
    """In the interpreter without a GPU (CI); on the GPU with one (the real kernels, quickly)."""
    monkeypatch.setenv("SPECSAMPLER_BACKEND", "triton")
    assert_exact(_run(kind, method, drafting, mc_trials(3_000, 300), DEVICE), f"{kind} {method} {drafting}")


ON_GPU = [("chain", m, None) for m in ("token", "block", "target_only")] + [
    ("tree", m, d) for m in ("rrs", "traversal") for d in ("iid", "without_replacement")] + [
    ("tree", "target_only", "top_k")]


@pytest.mark.gpu
@pytest.mark.montecarlo
@pytest.mark.parametrize("kind, method, drafting", ON_GPU)
def test_kernels_on_the_gpu_are_exact(kind, method, drafting):
    if kind == "chain":
        mc = chain_monte_carlo(method, 4, 3, mc_trials(200_000, 50_000), seed=11, zeros=True, device="cuda")
    else:
        mc = tree_monte_carlo(method, [2, 2], 4, mc_trials(200_000, 50_000), seed=23, draft_sampling=drafting,
                              device="cuda")
    assert_exact(mc, f"{kind} {method} {drafting} on the GPU")
