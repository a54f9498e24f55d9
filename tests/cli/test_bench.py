import json

import pytest

from specsampler.cli.bench import (
    _case_label,
    every_node_tree_verify,
    materialising_chain_verify,
    run,
    run_generate,
    sort_sampler,
    spine_tree,
)


def test_bench_writes_records_with_the_documented_fields(tmp_path):
    out = tmp_path / "bench.json"
    records = run("cpu", reps=1, quick=True, out=str(out))
    assert json.loads(out.read_text()) == records
    assert [r["op"] for r in records] == ["chain_verify", "sample_from_logits", "sample_from_logits",
                                          "sample_from_logits", "tree_verify_from_logits"]
    assert "softmax_multinomial" in records[1]["baselines"]  # plain sampling against what PyTorch users write
    for r in records:
        for key in ("device", "dtype", "shape", "median_us", "bytes_read", "gbps", "floor_ratio", "baselines", "met"):
            assert key in r, key
        assert r["median_us"] > 0 and r["floor_ratio"] > 0 and all(v > 0 for v in r["baselines"].values())
        assert r["steal_ms"] is None or r["steal_ms"] >= 0


def test_plot_labels_name_each_case_by_its_method_or_filters():
    # a plain temperature case is not top-p (the plot once said so)
    assert _case_label({"B": 64, "V": 128256, "temperature": 0.8}) == "temperature"
    assert _case_label({"temperature": 0.8, "top_k": 50, "top_p": 0.9}) == "top-k+top-p"
    assert _case_label({"temperature": 0.8, "top_p": 0.9}) == "top-p"
    assert _case_label({"method": "token", "V": 32000}) == "token"


def test_steal_is_read_from_proc_stat(monkeypatch):
    import builtins
    import io
    import os

    from specsampler.cli import bench

    stat = "cpu  6899457 0 529983 4828731 22352 0 3416 51141 0 0\ncpu0 1 2 3\n"
    real_open = builtins.open
    monkeypatch.setattr(builtins, "open", lambda path, *a, **k: io.StringIO(stat) if path == "/proc/stat"
                        else real_open(path, *a, **k))
    assert bench.steal_ms() == 51141 * 1000 / os.sysconf("SC_CLK_TCK")
    monkeypatch.setattr(builtins, "open", lambda path, *a, **k: io.StringIO("cpu 1 2\n"))
    assert bench.steal_ms() is None


def test_baselines_compute_what_they_stand_for():
    import torch

    g = torch.Generator().manual_seed(0)
    logits = torch.randn(4, 50, generator=g)
    tokens = sort_sampler(logits, 1.0, 1, 0.9, g)  # top-k 1: the argmax
    assert torch.equal(tokens, logits.argmax(-1))
    p = torch.zeros(2, 3, 6)
    p[..., 0] = 0.9
    p[..., 1:] = 0.02
    q = p[:, :2].flip(-1)  # the drafts (token 0) are likely under p, not under q: always accepted
    y, n = materialising_chain_verify(p, torch.zeros(2, 2, dtype=torch.long), q, g)
    assert (n == 2).all() and ((y >= 0) & (y < 6)).all()
    parents = torch.tensor([spine_tree(8, 3)])
    assert parents[0, :4].tolist() == [-1, 0, 1, 2]
    logits = torch.full((1, 8, 5), -10.0)
    tokens = torch.tensor([[0, 1, 2, 3, 4, 4, 4, 4]])
    for node in range(3):
        logits[0, node, node + 1] = 10.0  # the spine token of each node dominates
    n = every_node_tree_verify(logits, tokens, parents, 1.0, 0.9, g)
    assert n.tolist() == [3]


def test_the_gpu_script_runs_its_smoke_test_and_compares_runs(tmp_path):
    """benchmarks/gpu.py on the CPU (``--quick``): its records, ``--no-baselines`` and ``--compare``."""
    import os
    import subprocess
    import sys
    from pathlib import Path

    script = Path(__file__).parents[2] / "benchmarks" / "gpu.py"
    common = [sys.executable, str(script), "--device", "cpu", "--quick", "--only", "sampling", "--reps", "1",
              "--inner", "1"]
    with_base, without = tmp_path / "a.json", tmp_path / "b.json"
    env = {k: v for k, v in os.environ.items()  # the default settings
           if k not in ("SPECSAMPLER_PIPELINE_STAGES", "SPECSAMPLER_PROGRAMS_PER_SM")}
    for out, extra in ((with_base, []), (without, ["--no-baselines"])):
        subprocess.run([*common, *extra, "--out", str(out)], check=True, capture_output=True, timeout=300, env=env)
    a, b = json.loads(with_base.read_text()), json.loads(without.read_text())
    assert [r["op"] for r in a] == ["sample_from_logits"] * 4 and [r["shape"] for r in a] == [r["shape"] for r in b]
    assert [r["shape"] for r in a] == [{"B": 16, "V": 32000, "top_k": 50, "top_p": 0.95},  # the target's, and
                                       {"B": 16, "V": 32000, "top_k": 0, "top_p": 1.0},  # the diagnostics
                                       {"B": 16, "V": 32000, "greedy": True},
                                       {"B": 16, "V": 32000, "top_k": 0, "top_p": 0.95}]
    assert all(set(r["baselines"]) == {"torch"} for r in a) and all(r["baselines"] == {} for r in b)
    assert a[0]["pipeline_stages"] == 4 and a[0]["programs_per_sm"] == 2 and a[0]["median_us"] > 0
    shown = subprocess.run([sys.executable, str(script), "--compare", str(with_base), str(without)], check=True,
                           capture_output=True, text=True, timeout=120).stdout
    assert "stages=4 per_sm=2" in shown and "1.00x" in shown and "B=16 V=32000" in shown
    # --chain-vocab: the chain shapes of that vocabulary only (gpu_session.sh splits its compile passes by it)
    for vocab, methods in (("32000", ["token", "target_only"]), ("1000", [])):
        out = tmp_path / f"chain-{vocab}.json"
        subprocess.run([sys.executable, str(script), "--device", "cpu", "--quick", "--only", "chain", "--reps", "1",
                        "--inner", "1", "--no-baselines", "--chain-vocab", vocab, "--out", str(out)], check=True,
                       capture_output=True, timeout=300, env=env)
        assert [r["shape"]["method"] for r in json.loads(out.read_text())] == methods


def test_the_gpu_session_script_runs_its_bench_tune_and_parallel_phases_on_the_cpu(tmp_path):
    """benchmarks/gpu_session.sh (the command of a GPU session's device calls) with ``GPU_ARGS=--quick`` on the
    CPU, a stand-in ``nvidia-smi`` on the PATH: the bench phase, its JSON and its line in the session log,
    tune's runs under two settings, compared side by side, and the vocab-parallel benchmark (gloo here, NCCL on
    one GPU there) with its rounds."""
    import os
    import subprocess
    import sys
    from pathlib import Path

    root, work = Path(__file__).parents[2], tmp_path / "repo"  # run where no .flashinfer/ pack lies
    work.mkdir()
    for part in ("src", "benchmarks"):
        (work / part).symlink_to(root / part)
    fake = tmp_path / "bin"
    fake.mkdir()
    (fake / "nvidia-smi").write_text("#!/bin/sh\necho 'CPU stand-in, 0 MiB, none'\n")
    (fake / "nvidia-smi").chmod(0o755)
    env = {k: v for k, v in os.environ.items() if not k.startswith("SPECSAMPLER_")}
    # the script's python3: this environment's (its bin folder, where a venv's python3 finds the venv)
    env.update(PATH=f"{fake}:{Path(sys.executable).parent}:{env['PATH']}", TRITON_CACHE_DIR=str(tmp_path / "cache"),
               GPU_ARGS="--quick --device cpu --reps 1 --inner 1",
               SETTINGS="SPECSAMPLER_PIPELINE_STAGES=1;SPECSAMPLER_PIPELINE_STAGES=4",
               PARALLEL_ARGS="--device cpu --worlds 2 --B 2 --K 2 --V 1000 --reps 1")
    for phase in ("bench", "tune", "parallel"):
        done = subprocess.run(["bash", "benchmarks/gpu_session.sh", phase], cwd=work, timeout=600,
                              env={**env, "OUT": str(tmp_path / phase)}, capture_output=True, text=True)
        assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    (result,) = (tmp_path / "bench").glob("gpu-*.json")  # gpu-cpu.json, or named after a GPU the machine has
    records = json.loads(result.read_text())
    assert [r["op"] for r in records] == (["chain_verify_from_logits"] * 2 + ["sample_from_logits"] * 4
                                          + ["tree_verify_from_logits"])
    assert all(set(r["baselines"]) == {"torch"} for r in records)
    assert "[bench] exit 0 after" in (tmp_path / "bench" / "session.log").read_text()
    compared = (tmp_path / "tune" / "tune-compare.txt").read_text()
    tuned = json.loads((tmp_path / "tune" / "tune-0.json").read_text())  # every suite, latency included
    assert {r["op"] for r in tuned} >= {"chain_verify_from_logits", "sample_from_logits", "tree_verify_from_logits"}
    assert "stages=1 per_sm=2" in compared and "stages=4 per_sm=2" in compared
    assert compared.count("\n") == 1 + len(tuned)  # a header, then each record under both settings
    parallel_runs = json.loads((tmp_path / "parallel" / "gpu-parallel.json").read_text())
    shards = {r["op"]: r["shard"]["rounds"] for r in parallel_runs}
    assert shards["verify_tree_from_logits rrs iid, top-k 50 + top-p 0.9"] == 2
    assert shards["verify_chain_from_logits greedy"] == 1


def test_bench_generate_reports_wall_forward_and_library_time_per_method(tmp_path, capsys):
    pytest.importorskip("transformers")
    from specsampler.cli.demo import RUNS

    out = tmp_path / "generate.json"
    report = run_generate("cpu", reps=1, quick=True, out=str(out))
    assert json.loads(out.read_text()) == report
    assert report["threads"] == 1 and report["library_share_target"] == 0.30
    records = report["records"]
    assert [(r["method"], r["B"]) for r in records] == [(label, B) for B in (1, 3) for label, _ in RUNS]
    for r in records:
        assert r["wall_ms"] > r["forward_ms"] > 0 and r["tokens_per_s"] > 0 and r["steps"] > 0
        assert r["library_ms"] == pytest.approx(r["wall_ms"] - r["forward_ms"], abs=0.02 * r["wall_ms"])
        assert r["new_tokens"] == 24 * r["B"]
    plain = [r for r in records if r["settings"] is None]
    assert [r["speedup"] for r in plain] == [1.0, 1.0] and all(r["steps"] == 24 for r in plain)
    for r in records:
        if r["B"] == 1 and r["settings"] is not None:  # met: a small library share, and no slower than plain
            assert r["met"] == (r["library_share"] <= 0.30 and r["speedup"] >= 1.0)
    text = capsys.readouterr().out
    assert "library ms/step" in text and "n-gram lookup" in text
