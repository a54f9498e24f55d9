import subprocess
import sys

import pytest
import torch

from specsampler.cli import main
from specsampler.cli.demo import RUNS


def test_tour_runs_and_shows_sampling_chains_and_trees(capsys):
    assert main(["tour", "--vocab", "2000"]) == 0
    out = capsys.readouterr().out
    for fragment in ("greedy", "top_p=0.9", "draft chain", "block", "target_only", "first_child"):
        assert fragment in out


def test_check_reports_every_chain_method_exact(capsys):
    assert main(["check", "--trials", "20000", "--only", "chain"]) == 0
    out = capsys.readouterr().out
    for method in ("token", "block", "target_only", "greedy"):
        assert method in out
    assert "all exact" in out and "FAIL" not in out and "Tree" not in out


def test_check_reports_every_tree_method_exact(capsys):
    assert main(["check", "--trials", "10000", "--only", "tree"]) == 0
    out = capsys.readouterr().out
    for rule in ("rrs / iid", "rrs / without_replacement", "traversal / iid", "target_only / top_k"):
        assert rule in out
    assert "all exact" in out and "FAIL" not in out


def test_console_script_entry_point():
    res = subprocess.run([sys.executable, "-m", "specsampler.cli", "--help"], capture_output=True, text=True)
    assert res.returncode == 0 and "demo" in res.stdout and "check" in res.stdout


def test_demo_generates_with_the_built_in_pair_and_every_method(capsys):
    pytest.importorskip("transformers")
    import warnings

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert main(["demo", "--max-new-tokens", "12", "--prompt", "def f(x):\n    return", "--prompt", "import"]) == 0
    deprecations = [w for w in caught if issubclass(w.category, (FutureWarning, DeprecationWarning))]
    assert not deprecations, [str(w.message) for w in deprecations]  # e.g. transformers 5's `past_key_values`
    out = capsys.readouterr().out
    lines = [line.strip() for line in out.splitlines()]
    for label, _ in RUNS:
        assert sum(line.startswith(label) for line in lines) == 3, label  # its text for each prompt, its table row
    assert "ngram" in str(RUNS) and "tokens/target call" in out and "speedup (target calls)" in out
    rows = [line for line in out.splitlines() if line.startswith(tuple(label for label, _ in RUNS))][-len(RUNS):]
    plain = rows[0].split()
    assert plain[2:5] == ["1.00", "-", "12"]  # one token per target call, 12 calls
    assert plain[-2:] == ["1.00x", "1.00x"]  # plain sampling against itself: wall clock and target calls
    walls = [float(r.split()[-2].rstrip("x")) for r in rows[1:]]
    assert all(w > 0 for w in walls)  # tokens per second over plain sampling's
    speedups = [float(r.split()[-1].rstrip("x")) for r in rows[1:]]
    assert min(speedups) >= 1.0 and max(speedups) > 1.5  # drafts accepted: fewer target calls


def test_demo_takes_local_model_directories(capsys):
    pytest.importorskip("transformers")
    from specsampler.generate.modelpair import PAIR_DIR

    args = ["demo", "--target", str(PAIR_DIR / "target"), "--draft", str(PAIR_DIR / "draft"), "--max-new-tokens",
            "6", "--prompt", "x = "]
    assert main(args) == 0
    assert "tree traversal" in capsys.readouterr().out
    with pytest.raises(SystemExit, match="--draft needs --target"):
        main(["demo", "--draft", str(PAIR_DIR / "draft")])
    with pytest.raises(SystemExit, match="--draft: expected a local model directory, got '/nonexistent' "):
        main(["demo", "--target", str(PAIR_DIR / "target"), "--draft", "/nonexistent"])


def test_a_model_directory_transformers_cannot_load_is_a_usage_error(tmp_path, capsys):
    # a config without weights, or a config that is not JSON, ended in transformers' OSError traceback (status 1)
    pytest.importorskip("transformers")
    from specsampler.generate.modelpair import PAIR_DIR

    no_weights, bad_json = tmp_path / "no_weights", tmp_path / "bad_json"
    no_weights.mkdir(), bad_json.mkdir()
    (no_weights / "config.json").write_text((PAIR_DIR / "draft" / "config.json").read_text())
    (bad_json / "config.json").write_text("{not json")
    for path in (no_weights, bad_json):
        with pytest.raises(SystemExit) as done:
            main(["demo", "--target", str(PAIR_DIR / "target"), "--draft", str(path), "--max-new-tokens", "2"])
        assert done.value.code == 2
        err = capsys.readouterr().err
        assert f"error: --draft: expected a model directory transformers can load, got '{path}'" in err
        assert "Traceback" not in err


@pytest.mark.parametrize("argv, message", [
    (["demo", "--top-p", "1.5"],
     "specsampler demo: error: argument --top-p: SamplingParams: SamplingParams.top_p: expected a value in"),
    # after the models had loaded, naming no option
    (["demo", "--temperature", "nan"], "specsampler demo: error: argument --temperature: SamplingParams: "),
    (["demo", "--device", "gpu"], "specsampler demo: error: argument --device: 'gpu' is not a torch device"),
    (["bench", "--quick", "--device", "tpu:0"], "specsampler bench: error: argument --device: 'tpu:0' is not a torch"),
    (["warmup", "--vocab-size", "256", "--device", "cpu"],
     "specsampler warmup: error: warmup: device: expected a device whose ops run the Triton kernels"),
    # torch's "Expected one of cpu, cuda, ..." RuntimeError traceback (status 1)
    (["warmup", "--vocab-size", "256", "--device", "bogus"],
     "specsampler warmup: error: argument --device: 'bogus' is not a torch device"),
    # an OverflowError traceback from the Philox seeds (status 1)
    (["demo", "--seed", "99999999999999999999"],
     "specsampler demo: error: argument --seed: expected an int in [0, 2**63), got '99999999999999999999'"),
])
def test_bad_argument_values_are_usage_errors_not_tracebacks(argv, message, capsys, monkeypatch):
    """A value the library rejects (ValueError naming it) ends the command with status 2 and one line, as argparse's
    own errors do; warmup on a device whose ops compile nothing says so (it raised Triton's or CUDA's errors)."""
    import specsampler.cli.demo as demo

    monkeypatch.setattr(demo, "_load", lambda args: pytest.fail("the models were loaded"))
    monkeypatch.delenv("SPECSAMPLER_BACKEND", raising=False)
    with pytest.raises(SystemExit) as done:
        main(argv)
    assert done.value.code == 2
    assert message in capsys.readouterr().err


@pytest.mark.skipif(torch.cuda.is_available(), reason="a GPU is visible: --device cuda is usable here")
@pytest.mark.parametrize("command", [["demo"], ["bench", "--quick"], ["bench", "generate", "--quick"]])
def test_a_device_this_machine_lacks_is_a_usage_error_before_any_work(command, capsys):
    # it ended in torch's "Torch not compiled with CUDA enabled" assertion, deep inside the first model load
    with pytest.raises(SystemExit) as done:
        main([*command, "--device", "cuda"])
    assert done.value.code == 2
    assert "argument --device: 'cuda': " in capsys.readouterr().err


def test_bench_generate_quick_takes_the_new_tokens_it_is_given(monkeypatch):
    # --quick ran 24 new tokens whatever --max-new-tokens said
    import importlib

    bench = importlib.import_module("specsampler.cli.bench")
    seen = []
    monkeypatch.setattr(bench, "run_generate", lambda *a: seen.append(a[-1]))
    for argv in (["--quick", "--max-new-tokens", "4"], ["--max-new-tokens", "40"], ["--quick"], []):
        assert main(["bench", "generate", *argv]) == 0
    assert seen == [4, 40, None, None]  # None: run_generate's default, 24 with quick and 96 without


def test_bench_succeeds_whatever_targets_it_misses(monkeypatch):
    """A benchmark measures; a slow machine misses its targets, and the table says so (it exited 1 then)."""
    import importlib

    monkeypatch.setattr(importlib.import_module("specsampler.cli.bench"), "run",
                        lambda *a, **k: [{"op": "x", "met": False}])
    assert main(["bench", "--quick"]) == 0


@pytest.mark.parametrize("argv, message", [
    # 0 new tokens ran every method and ended in a TypeError formatting the table's missing speedups (status 1)
    (["demo", "--max-new-tokens", "0"], "argument --max-new-tokens: expected an int >= 1, got '0'"),
    (["bench", "generate", "--max-new-tokens", "0"], "argument --max-new-tokens: expected an int >= 1, got '0'"),
    (["demo", "--num-draft-tokens", "0"], "argument --num-draft-tokens: expected an int >= 1, got '0'"),
    # "invalid literal for int() with base 10: 'x'", naming no option
    (["demo", "--tree-shape", "2,x"], "argument --tree-shape: expected comma-separated ints >= 1"),
    (["demo", "--tree-shape", "2,0"], "argument --tree-shape: expected comma-separated ints >= 1"),
    # an empty prompt was reported as "input_ids: expected an integer tensor, got torch.float32"
    (["demo", "--prompt", "a", "--prompt", ""], "argument --prompt: expected a non-empty prompt"),
])
def test_demo_arguments_it_cannot_use_are_usage_errors_naming_the_option(argv, message, capsys, monkeypatch):
    import specsampler.cli.demo as demo

    monkeypatch.setattr(demo, "_load", lambda args: pytest.fail("the models were loaded"))
    with pytest.raises(SystemExit) as done:
        main(argv)
    assert done.value.code == 2
    err = capsys.readouterr().err
    assert f"error: {message}" in err and "Traceback" not in err


@pytest.mark.parametrize("argv, message", [
    # a negative count ended in torch's "zeros: Dimension size must be non-negative" traceback, 0 in "FAILURES above"
    (["check", "--trials", "-5"], "argument --trials: expected an int >= 1000, got '-5'"),
    (["check", "--trials", "0"], "argument --trials: expected an int >= 1000, got '0'"),
    # 10 trials gave "z=inf FAIL" rows and "FAILURES above" for exact methods (a z-test on a sample's own spread)
    (["check", "--trials", "999"], "argument --trials: expected an int >= 1000, got '999'"),
    # the tour drafts each node's top-2: a vocabulary of 1 ended in topk's "selected index k out of range" traceback
    (["tour", "--vocab", "1"], "argument --vocab: expected an int >= 2, got '1'"),
    # -1 ended in "no median for empty data"; 0 silently meant the default
    (["bench", "--quick", "--reps", "-1"], "argument --reps: expected an int >= 1, got '-1'"),
    (["bench", "--quick", "--reps", "0"], "argument --reps: expected an int >= 1, got '0'"),
])
def test_counts_the_commands_cannot_use_are_usage_errors_naming_the_option(argv, message, capsys, monkeypatch):
    import importlib

    for name in ("run", "run_generate"):
        monkeypatch.setattr(importlib.import_module("specsampler.cli.bench"), name,
                            lambda *a, **k: pytest.fail("the benchmark ran"))
    with pytest.raises(SystemExit) as done:
        main(argv)
    assert done.value.code == 2
    err = capsys.readouterr().err
    assert f"error: {message}" in err and "Traceback" not in err


def test_demo_prompts_are_integer_ids_and_a_prompt_of_no_tokens_names_prompt():
    from specsampler.cli.demo import _batch
    from specsampler.generate.modelpair import ByteTokenizer

    ids, mask = _batch(ByteTokenizer(), ["ab", "c"], "cpu")
    assert ids.dtype == mask.dtype == torch.long and ids.tolist() == [[97, 98], [0, 99]]

    class Silent(ByteTokenizer):  # a tokenizer that turns a prompt into no tokens (a float tensor was built)
        def encode(self, text):
            return [] if text == "?" else super().encode(text)

    with pytest.raises(ValueError, match=r"--prompt: expected a prompt of at least one token, got '\?' \(no tokens\)"):
        _batch(Silent(), ["?"], "cpu")
