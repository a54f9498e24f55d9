"""Generation with the oldest transformers release the package allows (pyproject: ``transformers>=4.56``).

That release lives outside the project's environment (which has the newest): point
``SPECSAMPLER_TRANSFORMERS_FLOOR`` at a directory holding it, e.g.

    pip install --no-deps --target /tmp/tf456 transformers==4.56.2 huggingface_hub==0.35.3 tokenizers==0.22.1 \
        requests urllib3 idna charset_normalizer certifi

(that huggingface_hub imports ``requests``, which the project's environment need not hold)

and the test runs the built-in pair in a subprocess with that directory first on the import path.
Skipped when the variable is not set.
"""

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).parents[2]
FLOOR = os.environ.get("SPECSAMPLER_TRANSFORMERS_FLOOR")

SCRIPT = """
import re, sys, warnings
import torch, transformers
import specsampler as ss
from specsampler.generate import generate, speculative_generate
from specsampler.generate.modelpair import load_pair

assert transformers.__version__.startswith(sys.argv[1]), transformers.__version__
warnings.simplefilter("error", FutureWarning)
warnings.simplefilter("error", DeprecationWarning)
target, draft, tok = load_pair()
ids = torch.tensor(tok.encode("def read_config(path):\\n    "))
want = target.generate(ids[None], attention_mask=torch.ones_like(ids)[None], max_new_tokens=24, do_sample=False,
                       pad_token_id=0)[0, len(ids):].tolist()
greedy = ss.SamplingParams(temperature=0.0)
assert generate(target, ids, 24, greedy).tokens.tolist() == want
for kwargs in (dict(drafter="chain"), dict(drafter="tree", tree_shape=[2, 2, 1]), dict(drafter="ngram")):
    model = None if kwargs["drafter"] == "ngram" else draft
    assert speculative_generate(target, model, ids, 24, greedy, **kwargs).tokens.tolist() == want, kwargs
    speculative_generate(target, model, ids, 24, ss.SamplingParams(temperature=0.8, top_p=0.95), rng=ss.Philox(0),
                         **kwargs)
print("ok", transformers.__version__)
"""


def floor_version() -> str:
    """The lowest transformers version pyproject.toml allows."""
    return re.search(r'"transformers>=([0-9.]+)"', (ROOT / "pyproject.toml").read_text()).group(1)


@pytest.mark.skipif(not FLOOR, reason="SPECSAMPLER_TRANSFORMERS_FLOOR (a directory with the oldest transformers) unset")
def test_generation_runs_without_warnings_on_the_oldest_supported_transformers():
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([FLOOR, str(ROOT / "src")])}
    res = subprocess.run([sys.executable, "-c", SCRIPT, floor_version()], env=env, capture_output=True, text=True,
                         timeout=600)
    assert res.returncode == 0, res.stderr[-3000:]
    assert res.stdout.startswith("ok " + floor_version())
