"""Statistical assertions shared by the Monte Carlo tests."""

import numpy as np

from specsampler.verify.exactness import MonteCarlo, chi_square_counts

P_MIN = 1e-4


def assert_counts_match(counts, probs, p_min: float = P_MIN, label: str = "") -> float:
    """Chi-square goodness of fit of observed ``counts`` against exact ``probs`` (same order);
    outcomes of probability 0 must never occur. Returns the p-value."""
    p, impossible = chi_square_counts(counts, probs)
    assert impossible == 0, f"{label}: {impossible} draws of probability-0 outcomes"
    assert p > p_min, f"{label}: chi-square p-value {p:.3g} <= {p_min}"
    return p


def assert_mean_within(samples, mean: float, sigmas: float = 5.0, label: str = "", atol: float = 1e-5) -> None:
    """The sample mean is within ``sigmas`` standard errors (plus float32 rounding) of the exact ``mean``."""
    samples = np.asarray(samples, dtype=np.float64)
    se = samples.std(ddof=1) / np.sqrt(len(samples)) if len(samples) > 1 else 0.0
    gap = abs(samples.mean() - mean)
    assert gap <= sigmas * se + atol, f"{label}: mean {samples.mean():.5f} vs exact {mean:.5f} (SE {se:.2g})"


def assert_exact(mc: MonteCarlo, label: str = "") -> None:
    """A Monte Carlo run agrees with its oracle: distributions, impossible outcomes, mean accepted."""
    assert mc.oracle_error < 1e-12, f"{label}: oracle off the target by {mc.oracle_error:.3g}"
    assert mc.impossible == 0, f"{label}: {mc.impossible} draws of probability-0 outcomes"
    assert mc.p_emitted > P_MIN, f"{label}: emitted sequences vs oracle, chi-square p = {mc.p_emitted:.3g}"
    assert mc.p_continued > P_MIN, f"{label}: continued sequences vs target, chi-square p = {mc.p_continued:.3g}"
    assert_mean_within(mc.accepted, mc.exact.expected_accepted, label=f"{label} accepted")
    if mc.meter is not None:
        assert_mean_within(mc.meter, mc.exact.expected_accepted, label=f"{label} expected_accepted")
