"""The kernels build for a GPU without one: ``benchmarks/compile.py`` compiles the launches of
``specsampler.warmup`` down to cubins for sm_90. All of them take minutes on two cores, so CI compiles the
sampling launches (three kernels) and checks what the GPU's speed rests on: no spills, and passes over the rows
pipelined through 16-byte asynchronous copies (which need rows the compiler knows to be aligned, although
strides are run-time arguments); run the whole set before a GPU session (README)."""

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("triton")

SCRIPT = Path(__file__).parents[2] / "benchmarks" / "compile.py"


def _compile(tmp_path, *args, **env_vars):
    env = {k: v for k, v in os.environ.items() if k not in ("TRITON_INTERPRET", "SPECSAMPLER_PIPELINE_STAGES")}
    env["TRITON_CACHE_DIR"] = str(tmp_path / "triton-cache")  # compile afresh, not from a cache
    env.update(env_vars)
    out = tmp_path / "compile.json"
    done = subprocess.run([sys.executable, str(SCRIPT), "--out", str(out), *args], env=env, capture_output=True,
                          text=True, timeout=900)
    assert done.returncode == 0, done.stderr[-4000:]
    return {r["kernel"]: r for r in json.loads(out.read_text())["records"]}, done.stdout


def test_sampling_kernels_compile_for_sm90_pipelined_without_spills(tmp_path):
    records, stdout = _compile(tmp_path, "--methods", "sample", "--dtype", "bfloat16", "--masks", "none",
                               "--vocab-size", "128256")
    assert set(records) == {"_sample_from_logits_kernel", "_scan_parts_kernel", "_sample_kernel"}, stdout
    for r in records.values():
        assert r["spills"] == 0 and r["registers"] <= 128, r  # two 8-warp programs per SM (launch_options)
        # the passes over the rows stream tiles through asynchronous 16-byte copies: several in flight
        assert r["cp_async"] > 0 and r["shared_bytes"] >= 2 * 2048 * 2, r
    assert re.search(r"compiled 3 kernels for sm_90", stdout), stdout


def test_one_pipeline_stage_turns_the_asynchronous_copies_off(tmp_path):
    records, _ = _compile(tmp_path, "--methods", "sample", "--dtype", "bfloat16", "--masks", "none",
                          "--vocab-size", "4096", SPECSAMPLER_PIPELINE_STAGES="1")
    assert all(r["cp_async"] == 0 for r in records.values()), records


@pytest.mark.parametrize("name, value, message", [
    ("SPECSAMPLER_PIPELINE_STAGES", "0", "expected an integer >= 1, got '0'"),
    ("SPECSAMPLER_PROGRAMS_PER_SM", "two", "expected an integer from 1 to 4, got 'two'"),
])
def test_a_bad_kernel_setting_is_a_clear_error(name, value, message):
    env = {**os.environ, name: value}
    done = subprocess.run([sys.executable, "-c", "import specsampler.kernels.rows"], env=env, capture_output=True,
                          text=True, timeout=120)
    assert done.returncode != 0
    assert f"{name}: {message}" in done.stderr, done.stderr[-2000:]


def test_the_register_limit_fits_the_programs_per_sm(monkeypatch):
    from specsampler.kernels import rows

    assert rows.PROGRAMS_PER_SM == 2 or "SPECSAMPLER_PROGRAMS_PER_SM" in os.environ
    monkeypatch.setattr(rows, "PROGRAMS_PER_SM", 2)
    assert rows.launch_options(8) == {"num_warps": 8, "maxnreg": 128}  # 2 x 256 threads x 128 = 65536
    assert rows.launch_options(4) == {"num_warps": 4}  # the 255-register maximum fits two already
    monkeypatch.setattr(rows, "PROGRAMS_PER_SM", 3)
    assert rows.launch_options(8) == {"num_warps": 8, "maxnreg": 80}  # 85, allocated in units of 8
    monkeypatch.setattr(rows, "PROGRAMS_PER_SM", 1)
    assert rows.launch_options(8) == {"num_warps": 8}


def test_the_launchers_ask_for_the_register_limit(monkeypatch):
    """The kernels from logits (chain, both modes, sampling, and the first pass split over programs) are
    launched with ``launch_options``: the interpreter ignores ``maxnreg``, so the launches are watched."""
    import torch

    from specsampler.kernels import chain, rows, sampling

    monkeypatch.setattr(rows, "PROGRAMS_PER_SM", 2)  # the default, whatever the environment says
    seen = {}

    def watch(kernel):
        run = kernel.run

        def watched(*args, **kwargs):
            seen[kernel.__name__] = (kwargs.get("num_warps"), kwargs.get("maxnreg"))
            return run(*args, **kwargs)

        monkeypatch.setattr(kernel, "run", watched)

    for kernel in (sampling._sample_from_logits_kernel, chain._describe_rows_kernel, chain._chain_kernel,
                   rows._scan_parts_kernel):
        watch(kernel)
    B, K, V = 2, 2, 40
    logits = torch.randn(B, K + 1, V)
    params = (torch.zeros(B * (K + 1)), torch.zeros(B * (K + 1), dtype=torch.int64), torch.ones(B * (K + 1)),
              torch.zeros(B * (K + 1)))  # greedy rows: the launches are what is watched
    sampling.sample_from_logits(logits.view(-1, V), *params, u=torch.rand(B * (K + 1)), parts=2)
    chain.verify_chain_from_logits(logits, torch.zeros(B, K, dtype=torch.int64), None, None, "greedy", *params,
                                   rows_in_parallel=True, parts=2)
    expected = (8, 128)
    assert seen == {"_sample_from_logits_kernel": expected, "_describe_rows_kernel": expected,
                    "_chain_kernel": expected, "_scan_parts_kernel": expected}


def test_compile_errors_are_reported(tmp_path):
    """A kernel the compiler rejects (but the interpreter would run) fails the compile tool."""
    bad = tmp_path / "bad_kernel.py"
    bad.write_text(
        "import sys, torch, triton, triton.language as tl\n"
        f"sys.path.insert(0, {str(SCRIPT.parent)!r})\n"
        "import compile as tool\n"
        "@triton.jit\n"
        "def k(x_ptr, N: tl.constexpr):\n"
        "    tl.store(x_ptr + tl.arange(0, N), 1.0)  # N not a power of 2: rejected by the compiler\n"
        "from triton.runtime.jit import JITFunction\n"
        "from triton.runtime.driver import driver\n"
        "JITFunction.run = tool.compile_only\n"
        "driver.set_active(tool.TargetDriver(90))\n"
        "k[(1,)](torch.zeros(3), 3)\n"
    )
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["TRITON_CACHE_DIR"] = str(tmp_path / "triton-cache")
    done = subprocess.run([sys.executable, str(bad)], env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode != 0
    assert "power of 2" in done.stderr or "power of two" in done.stderr, done.stderr[-2000:]
