"""SamplingParams' scalar checks: the tensor rules (used for per-request tensors) applied to a scalar as the float32
it becomes, without making a tensor."""

import pytest
import torch

import specsampler as ss
from specsampler.params import _FIELDS

EDGES = [0.0, -0.0, 1e-46, 1e-45, 5e-324, 1e-300, 0.5, 0.9999999999, 1.0, 1.00000001, 1.0000001, 2.0, 3.4e38,
         3.5e38, 1e39, -1e-50, -1e-30, -1.0, float("inf"), float("-inf"), float("nan")]


@pytest.mark.parametrize("name", ["temperature", "top_p", "min_p"])
def test_a_scalar_is_accepted_exactly_where_its_float32_tensor_is(name):
    bad = _FIELDS[name][2]
    for v in EDGES:
        as_tensor = v == v and abs(v) != float("inf") and not bool(bad(torch.tensor(float(v))))
        try:
            ss.SamplingParams(**{name: v})
            accepted = True
        except ss.ValidationError as err:
            accepted = False
            assert f"SamplingParams.{name}" in str(err) and _FIELDS[name][3] in str(err)
        assert accepted == as_tensor, (name, v)


def test_numpy_scalars_are_numbers_and_a_value_float32_cannot_hold_says_so():
    import numpy as np

    # NumPy's scalars (what arrays of per-request settings hand out) were refused as "not a number"
    given = ss.SamplingParams(temperature=np.float32(0.5), top_k=np.int64(3), top_p=np.float64(0.9))
    assert given == ss.SamplingParams(temperature=0.5, top_k=3, top_p=0.9)
    x = torch.randn(2, 6)
    assert torch.equal(ss.sample_from_logits(x, rng=ss.Philox(np.int64(3))).tokens,
                       ss.sample_from_logits(x, rng=ss.Philox(3)).tokens)
    for bad in (np.bool_(True), "3"):
        with pytest.raises(ss.ValidationError, match="Philox.seed: expected an int or an int64 tensor"):
            ss.sample_from_logits(x, rng=ss.Philox(bad))
    # a value inside the range that float32 cannot hold: the message says what it became
    with pytest.raises(ss.ValidationError, match=r"temperature: expected a finite value >= 0, got 1e\+39 \(float32 "
                                                 r"holds it as inf\)"):
        ss.SamplingParams(temperature=1e39)
    with pytest.raises(ss.ValidationError, match=r"top_p: expected a value in \(0, 1\], got 1e-46 \(float32 holds it "
                                                 r"as 0.0\)"):
        ss.SamplingParams(top_p=1e-46)
    with pytest.raises(ss.ValidationError, match=r"temperature: expected a finite value >= 0, got inf"):
        ss.SamplingParams(temperature=10**400)  # past float64 too (it raised OverflowError)


def test_host_numbers_round_to_float32_as_numpy_does_without_it():
    """``_float32`` (the check of a scalar parameter as every row holds it) in Python's arithmetic: ties to even,
    subnormals, the edge of float32's range and past it, signs of zero."""
    import math

    import numpy as np

    from specsampler.params import _float32

    g = np.random.default_rng(1)
    values = list(g.standard_normal(20000) * 10.0 ** g.integers(-50, 50, 20000))
    values += [3.4028235677973366e38, 3.4028235e38, 3.4028236692093846e38, 3.4028236692093847e38, 1e39, 7e-46,
               7.006492321624085e-46, 7.006492321624087e-46, 2.0**-149, 2.0**-150, 1.5 * 2.0**-149, 2.5 * 2.0**-149,
               2.0**-126, 5e-324, 1e308, 0.0, 0.1, math.inf, math.nan]
    values += [(2**24 + 2 * m + 1) * 2.0 ** (e - 25) for e in range(-130, 128, 7) for m in range(4)]  # exact ties
    with np.errstate(over="ignore"):
        for v in values + [-v for v in values]:
            got, want = _float32(float(v)), float(np.float32(v))
            assert (got == want or math.isnan(got) and math.isnan(want)) and math.copysign(1, got) == math.copysign(
                1, want), v
