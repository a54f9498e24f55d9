"""The Examples in the public functions' docstrings run and print what they say."""

import doctest

import pytest

import specsampler.verify.chain
import specsampler.verify.tree


@pytest.mark.parametrize("module", [specsampler.verify.chain, specsampler.verify.tree], ids=lambda m: m.__name__)
def test_docstring_examples_hold(module):
    result = doctest.testmod(module, optionflags=doctest.NORMALIZE_WHITESPACE)
    assert result.attempted >= 2 and result.failed == 0, result
