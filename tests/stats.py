"""Statistical assertions shared by the Monte Carlo tests."""

import numpy as np
from scipy import stats

P_MIN = 1e-4


def assert_counts_match(counts, probs, p_min: float = P_MIN, label: str = "") -> float:
    """Chi-square goodness of fit of observed ``counts`` against exact ``probs`` (same order).

    Outcomes of probability 0 must never occur; outcomes with expected count < 5 are pooled.
    Returns the p-value; fails below ``p_min``.
    """
    counts = np.asarray(counts, dtype=np.float64).ravel()
    probs = np.asarray(probs, dtype=np.float64).ravel()
    n = counts.sum()
    zero = probs <= 0
    assert counts[zero].sum() == 0, f"{label}: {int(counts[zero].sum())} draws of probability-0 outcomes"
    counts, expected = counts[~zero], probs[~zero] / probs[~zero].sum() * n
    small = expected < 5
    if small.any():
        counts = np.append(counts[~small], counts[small].sum())
        expected = np.append(expected[~small], expected[small].sum())
    if len(counts) < 2:
        return 1.0
    p = stats.chisquare(counts, expected).pvalue
    assert p > p_min, f"{label}: chi-square p-value {p:.3g} <= {p_min}"
    return p


def assert_mean_within(samples, mean: float, sigmas: float = 5.0, label: str = "") -> None:
    """The sample mean is within ``sigmas`` standard errors of the exact ``mean``."""
    samples = np.asarray(samples, dtype=np.float64)
    se = samples.std(ddof=1) / np.sqrt(len(samples)) if len(samples) > 1 else 0.0
    gap = abs(samples.mean() - mean)
    assert gap <= sigmas * se + 1e-12, f"{label}: mean {samples.mean():.5f} vs exact {mean:.5f} ({gap / se:.1f} SE)"
