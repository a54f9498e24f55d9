"""A brute-force, loop-per-token reading of docs/design.md's sampling rules ("Sampling"), for the tests only."""

import math


def naive_probs(logits, temperature=1.0, top_k=0, top_p=1.0, min_p=0.0, mask=None, is_probs=False):
    """One row: list of floats -> list of processed probabilities (float64), and the boundary margin.

    The margin is the smallest |mass before a token - top_p| seen while cutting the nucleus:
    tests skip cases within float rounding of the boundary.
    """
    V = len(logits)
    x = [v if (mask is None or mask[i]) else -math.inf for i, v in enumerate(logits)]
    if not is_probs and temperature == 0:
        best = max(range(V), key=lambda i: (x[i], -i))
        return [1.0 if i == best else 0.0 for i in range(V)], math.inf
    order = sorted(range(V), key=lambda i: (-x[i], i))
    kept = order if top_k <= 0 or top_k >= V else order[:top_k]
    if is_probs:
        w = {i: x[i] for i in kept}
    else:
        m = x[order[0]]
        w = {i: math.exp((x[i] - m) / temperature) if x[i] > -math.inf else 0.0 for i in kept}
    z = sum(w.values())
    margin = math.inf
    if top_p < 1:
        before, cut = 0.0, []
        for i in kept:
            margin = min(margin, abs(before - top_p * z) / z)
            if before < top_p * z:
                cut.append(i)
            before += w[i]
        kept = cut
    if min_p > 0:
        top = max(w[i] for i in kept)
        for i in kept:
            margin = min(margin, abs(w[i] - min_p * top) / top)
        kept = [i for i in kept if w[i] >= min_p * top]
    z = sum(w[i] for i in kept)
    out = [0.0] * V
    for i in kept:
        out[i] = w[i] / z if z > 0 else 0.0
    return out, margin
