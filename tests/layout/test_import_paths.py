"""The layout's promises: every module path of the flat layout still imports (as the same module object),
everything in ``__all__`` resolves, and ``import specsampler`` loads the core only."""

import importlib
import subprocess
import sys

import pytest

import specsampler
from specsampler._legacy import MOVED


@pytest.mark.parametrize("old, new", sorted(MOVED.items()))
def test_flat_layout_paths_are_the_moved_modules(old, new):
    assert importlib.import_module(old) is importlib.import_module(new)


@pytest.mark.parametrize("path, names", [
    ("specsampler.mlc", ["batch_spec_verify", "Sampler", "GenerationConfig", "SampleResult", "RandomGenerator",
                         "SpecDecodeMetrics", "EventTraceRecorder"]),
    ("specsampler.longspec", ["tree_verification", "verify_stochastic"]),
    ("specsampler.generate", ["speculative_generate", "generate", "GenerationOutput"]),
    ("specsampler.oracle", ["chain", "tree", "target_joint"]),
    ("specsampler.modelpair", ["load_pair", "ByteTokenizer", "PAIR_DIR"]),
    ("specsampler.chain", ["verify_chain", "verify_chain_from_logits", "ChainResult"]),
    ("specsampler.tree", ["TokenTree"]),
    ("specsampler.treeverify", ["verify_tree", "verify_tree_from_logits", "TreeResult"]),
    ("specsampler.sampling", ["sample_from_logits", "logits_to_probs", "SampleOutput"]),
    ("specsampler.kv", ["compact_kv"]),
])
def test_public_names_import_from_their_old_paths(path, names):
    module = importlib.import_module(path)
    missing = [n for n in names if not hasattr(module, n)]
    assert not missing, f"{path} lacks {missing}"


def test_every_name_in_all_resolves():
    for name in specsampler.__all__:
        assert getattr(specsampler, name) is not None, name


@pytest.mark.parametrize("importing", ["import specsampler", "from specsampler import *; import specsampler"])
def test_import_loads_the_core_only_and_the_package_holds_no_helper_module(importing):
    # a star import loaded mlc, longspec and the oracle (listed in __all__), and the package's `import importlib`
    # was its attribute, a name the API does not have
    code = (f"import sys; {importing}; "
            "print(sorted(m for m in sys.modules if m.startswith('specsampler.')), 'transformers' in sys.modules, "
            "hasattr(specsampler, 'importlib'))")
    loaded = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    for integration in ("mlc", "longspec", "generate", "compat", "parallel", "cli", "verify.oracle"):
        assert f"'specsampler.{integration}" not in loaded, loaded
    # the transformers import checked in the child (the test process's own modules said nothing of it)
    assert loaded.rstrip().endswith("False False"), loaded
    assert {"mlc", "longspec", "oracle", "generate", "compat", "parallel"} <= set(dir(specsampler))


def test_module_run_of_an_old_path_runs_the_new_module():
    res = subprocess.run([sys.executable, "-m", "specsampler.modelpair", "--help"], capture_output=True, text=True)
    assert res.returncode == 0, res.stderr
    assert "--out" in res.stdout


def test_flat_layout_modules_are_attributes_of_the_package_in_a_fresh_process():
    # ``specsampler.chain`` as an attribute (``monkeypatch.setattr(ss.chain, ...)``) without importing it first:
    # in a fresh interpreter nothing else has imported the old path.
    code = ("import specsampler as ss; "
            "print(ss.chain is ss.verify.chain, ss.processing is ss.sampling.processing, "
            "ss.tree.TokenTree is ss.TokenTree)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.split() == ["True", "True", "True"], out
