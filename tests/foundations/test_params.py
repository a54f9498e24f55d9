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
