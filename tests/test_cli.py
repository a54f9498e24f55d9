import subprocess
import sys

from specsampler.cli import main


def test_demo_runs_and_shows_sampling_chains_and_trees(capsys):
    assert main(["demo", "--vocab", "2000"]) == 0
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
