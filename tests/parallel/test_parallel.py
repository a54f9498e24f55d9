"""specsampler.parallel on gloo groups of 2, 3 and 4 CPU processes (spawned once per world size and shard
layout): every rank returns the same results, equal to the one-device op on the whole rows, with
collectives whose rounds and bytes do not grow with the vocabulary."""

from __future__ import annotations

import fcntl
import os
import pickle
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest
import scenarios  # noqa: E402  (tests/parallel is on sys.path: pytest's rootdir-relative import)
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

import specsampler as ss
from specsampler import parallel

WORLDS = (2, 3, 4)
DEADLINE_S = 240


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _worker(rank: int, world: int, port: int, layout: int, out_dir: str) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    try:
        bounds = scenarios.splits(world)[layout]
        shard = parallel.VocabShard(bounds[rank], bounds[rank + 1] - bounds[rank], scenarios.V)
        even = parallel.VocabShard.even(scenarios.V)
        results = {"even": (even.start, even.size), "shard": (shard.start, shard.size)}
        for name, fn in scenarios.SCENARIOS.items():
            g = torch.Generator().manual_seed(1234)  # the same inputs on every rank
            try:
                results[name] = fn(shard, g)
            except Exception as e:  # reported by the test of that scenario, the others still run
                results[name] = f"raised {type(e).__name__}: {e}"
        with open(os.path.join(out_dir, f"rank{rank}.pkl"), "wb") as f:
            pickle.dump(results, f)
    finally:
        dist.destroy_process_group()


@pytest.fixture(scope="module", params=[(w, layout) for w in WORLDS for layout in (0, 1)],
                ids=lambda p: f"world{p[0]}-{'even' if p[1] == 0 else 'uneven'}")
def ranks(request, tmp_path_factory):
    """The results of every rank of one spawned group: ``[rank] -> {scenario: result}``. Spawned once a run: under
    xdist a module fixture is set up in each worker that runs one of its tests, so the first worker to need a group
    spawns it, and the others wait for its results (a lock in the run's directory shared by the workers)."""
    world, layout = request.param
    if "PYTEST_XDIST_WORKER" not in os.environ:
        return _spawn(world, layout)
    shared = tmp_path_factory.getbasetemp().parent  # this run's, shared by its workers
    results = shared / f"parallel-world{world}-layout{layout}.pkl"
    with open(shared / f"parallel-world{world}-layout{layout}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if results.exists():
            with open(results, "rb") as f:
                return pickle.load(f)
        out = _spawn(world, layout)
        with open(results, "wb") as f:
            pickle.dump(out, f)
        return out


def _spawn(world: int, layout: int) -> list[dict]:
    """Run every scenario on a spawned gloo group of ``world`` ranks (shard ``layout``): each rank's results."""
    with tempfile.TemporaryDirectory() as out:
        ctx = mp.start_processes(_worker, args=(world, _free_port(), layout, out), nprocs=world, join=False,
                                 start_method="spawn")
        deadline = time.monotonic() + DEADLINE_S
        while not ctx.join(timeout=5):
            if time.monotonic() > deadline:
                for p in ctx.processes:
                    p.kill()
                pytest.fail(f"world {world}: the group did not finish in {DEADLINE_S} s (a rank waits in a collective)")
        results = []
        for r in range(world):
            with open(os.path.join(out, f"rank{r}.pkl"), "rb") as f:
                results.append(pickle.load(f))
    return results


def _same_on_every_rank(ranks, name):
    first = ranks[0][name]
    assert not isinstance(first, str), first
    for r, res in enumerate(ranks[1:], 1):
        assert res[name] == first, f"rank {r} differs from rank 0 in {name}"
    return first


def test_greedy_sampling_equals_the_one_device_op_on_every_rank(ranks):
    """In one round: the argmax keys' all_reduce, or with 2 or more log-probabilities (here 3) the rows' best
    candidates, as the one-device op keeps them (a row whose maximum is +inf has no mass: its token is still the
    argmax)."""
    got, want, calls = _same_on_every_rank(ranks, "sample")
    assert got == want
    assert len(calls) == 1


def test_greedy_chain_verification_equals_the_one_device_op_on_every_rank(ranks):
    for got, want, calls in _same_on_every_rank(ranks, "chain"):
        assert got == want
        assert len(calls) == 1


def test_greedy_tree_verification_equals_the_one_device_op_on_every_rank(ranks):
    for got, want, calls in _same_on_every_rank(ranks, "tree"):
        assert got == want
        assert len(calls) == 1


def test_sampling_with_every_parameter_mix_equals_the_one_device_op_on_every_rank(ranks):
    for got, want, _ in _same_on_every_rank(ranks, "sampled"):
        assert got == want


def test_the_shard_path_under_a_plain_torch_compile_gives_the_one_device_tokens(ranks):
    got, want = _same_on_every_rank(ranks, "compiled")
    assert got == want


def test_every_chain_method_equals_the_one_device_op_on_every_rank(ranks):
    for method, got, want, _ in _same_on_every_rank(ranks, "sampled_chain"):
        assert got == want, method


def test_every_tree_method_equals_the_one_device_op_on_every_rank(ranks):
    for method, got, want, _ in _same_on_every_rank(ranks, "sampled_tree"):
        assert got == want, method


ROWS = {"sampled": 14, "sampled_chain": 10 * 5, "sampled_tree": 8 * 8}  # the rows each scenario's calls process


def test_every_collective_sends_at_most_a_kibibyte_per_row(ranks):
    """Every round sends O(rows) bytes: a row's summary (its maximum, an approximate histogram of 128 bins, a
    description of its nucleus's edge: 64 sub-interval masses at these widths and 32 distinct weights, a draw's
    window) stays under 1 KiB, besides a 16-byte header; that this does not grow with the vocabulary is
    test_rounds_and_bytes_do_not_grow_with_the_vocabulary's."""
    for name, rows in ROWS.items():
        for entry in ranks[0][name]:
            for _, sent in entry[-1]:
                assert sent <= 16 + 1024 * rows, (name, sent)


def test_rounds_and_bytes_do_not_grow_with_the_vocabulary(ranks):
    """At V and 64 V: rows of zeros but one token (verification on the shards' columns), and rows of -inf but one
    (every row held whole by chain and tree verification: one nonzero probability a row at both sizes)."""
    comms = ranks[0]["comms"]
    for (small, small_out), (large, large_out) in (comms[:2], comms[2:]):
        assert small == large
        assert small_out == large_out  # the same decisions at both sizes: the comparison is of like with like
        assert len(small[0]) == 1  # greedy sampling (with two log-probabilities: its candidates), one round


def test_calls_at_the_contract_s_edges_behave_as_the_one_device_op_with_every_strategy(ranks):
    # an empty batch crashed auto's plan; logits requiring grad broke the shard path's out= ops; validate='full'
    # skipped draft_probs and rejected the NaN padding of absent nodes' rows; a greedy tree's target-only result
    # carried an expected count the one-device op does not
    got = _same_on_every_rank(ranks, "edges")
    for strategy in ("auto", "shard", "gather"):
        chain, tree = got[strategy, "empty"]
        assert chain["tokens"] == [] and chain["num_accepted"] == [] and tree["tokens"] == [], strategy
        assert got[strategy, "grad"][0] == got[strategy, "grad"][1], strategy
        assert got[strategy, "negative q"] == ("ValueError naming draft_probs",) * 2, strategy
        assert got[strategy, "absent rows"][0] == got[strategy, "absent rows"][1], strategy
        assert got[strategy, "greedy target-only"][0] == got[strategy, "greedy target-only"][1], strategy


def test_errors_are_raised_on_every_rank_and_none_waits(ranks):
    assert _same_on_every_rank(ranks, "errors") == [  # with either strategy
        "ValidationError naming logits (on rank 0)", "ValidationError naming rng", "ValidationError naming rng",
        "ValidationError naming shard", "ValidationError naming arguments"] * 2


def test_parallel_verification_is_exact_against_the_oracle(ranks):
    results = _same_on_every_rank(ranks, "exactness")
    if results is None:
        pytest.skip("the Monte Carlo runs at world size 2")
    for name, (p_emitted, *rest) in results.items():
        assert rest[-1] == 0, f"{name}: outcomes of probability 0"
        assert p_emitted > 1e-4, f"{name}: emitted sequences differ from the oracle's (p = {p_emitted:.2e})"
        if len(rest) == 2:
            assert rest[0] > 1e-4, f"{name}: continued sequences differ from the target's joint distribution"


def _processing_rounds(kind: str) -> int:
    """Rounds that process a batch of rows of a kind (docs/design.md): 1 for greedy and top-k rows (their candidates),
    2 with temperature or min-p rows (the maximum, then the kept masses), 3 with top-p rows (the maximum and an
    estimate of the nucleus's edge, then its description, usually once more)."""
    return {"top-k": 1, "top-k, top-p": 1, "temperature": 2, "min-p": 2}.get(kind, 3)


def _traversal_rounds(parents: list[int]) -> int:
    """The rounds traversal's residuals take: the most, over nodes, of their children plus the sibling ranks (among
    their siblings, from 0) along their path from the root."""
    children = [parents.count(i) for i in range(len(parents))]
    rank = [parents[:i].count(p) if i else 0 for i, p in enumerate(parents)]
    path = [0] * len(parents)
    for i in range(1, len(parents)):
        path[i] = path[parents[i]] + rank[i]
    return max(path[i] + children[i] for i in range(len(parents)) if children[i])


def test_the_shard_path_stays_within_its_rounds_at_every_world_size(ranks):
    """Sampling: at most 3 rounds, 4 with top-p rows; chains: at most 5 for every method; trees: the processing,
    one round per child (rrs) or per deletion along the post-order's longest chain (traversal), and a draw: at most
    2 per depth level + 3 on trees with at most two children a node; and every call equal to the one-device op."""
    for op, kind, top_p, info, calls, _, same in _same_on_every_rank(ranks, "rounds"):
        assert same, (op, kind)
        n, P = len(calls), _processing_rounds(kind)
        if op == "sample":
            assert n <= P + (kind not in ("top-k", "top-k, top-p")) <= (4 if top_p else 3), (op, kind, n)
        elif op.startswith("chain"):
            assert n <= P + (1 if op.endswith("target_only") else 2) <= 5, (op, kind, n)
        else:
            walk = {"rrs": info["children"], "traversal": _traversal_rounds(info["shape"])}.get(op[5:].split("/")[0], 0)
            assert n <= P + walk + 1, (op, kind, n)
            if info["children"] <= 2:
                assert n <= 2 * info["depth"] + 3, (op, kind, n)


def test_a_tree_walk_ends_its_rounds_once_every_request_is_settled(ranks):
    """Where every first child is accepted (drafts from the target's own rows), rrs and traversal need no residual:
    the processing and the draw only (a root of eight children would otherwise take eight residual rounds), and the
    one-device op's tokens; so do trees of a root alone (which the shard path once failed on)."""
    for name, kind, same, n, accepted in _same_on_every_rank(ranks, "settled"):
        assert same, (name, kind)
        assert all(a >= 1 for a in accepted) or name.endswith("[-1]"), (name, kind, accepted)
        assert n <= _processing_rounds(kind) + 1, (name, kind, n)


def test_top_k_rows_verify_any_tree_or_chain_in_two_rounds(ranks):
    """Top-k rows hold their candidates on every rank: rrs and traversal with i.i.d. drafts read every child's q at
    its parent's candidates in one round after the processing, then walk and draw on each rank alone (a root of
    eight children, which took up to 10 rounds); chains likewise (token: the stop rows' q, none where every draft
    is accepted: 1 round, was 3; block: every position's); draft probabilities below 0 or NaN (a residual's mass
    outside the candidates) keep the rounds of the shard walk; the one-device op's tokens either way."""
    for name, kind, same, n in _same_on_every_rank(ranks, "compact"):
        assert same, (name, kind)
        if name.startswith("chain token accepted"):  # no residual: no draft row read, whatever its values
            assert n == 1, (name, n)
        else:
            assert (n == 2) if name.endswith("q None") else (n > 2), (name, kind, n)


def test_rows_of_few_probabilities_verify_any_tree_or_chain_in_one_round_after_the_processing(ranks):
    """Rows holding at most walks.HELD_WIDTH nonzero probabilities on every rank (small nuclei, min-p, a short
    vocabulary): one round gathers the rows' entries and the draft probabilities there, then rrs and traversal
    walk and draw on each rank alone (a root of eight children took up to 11 rounds; without replacement one more
    round for each removal of a child past the processing's two, whose shared q's mass is not yet known, where the
    link makes that cheaper than the shared q's rows whole in the same round), and so do chain token and block (were
    P + 2); wider rows likewise where the link makes that one round cheaper than the walk's rounds (here: latency
    only). A draft probability below 0 or NaN (a residual mass outside the entries),
    known from round 1, and rows wider than the width gathered (on a bandwidth-only link) take the shard path. The
    one-device op's tokens in every case; on the bandwidth-bound link, a node of more children than the processing's
    rounds carry masses for takes more rounds than where the shared q's rows are gathered."""
    results = _same_on_every_rank(ranks, "nuclei")
    held = {}
    for name, kind, same, n, _, extra in results:
        assert same, (name, kind)
        if name.endswith((" held", scenarios.GATHERED_BY_LINK, scenarios.MASSES_A_ROUND)):
            assert n <= _processing_rounds(kind) + 1 + extra, (name, kind, n)
        if name.endswith(" held"):
            held[name[:-len(" held")], kind] = n
    for name, kind, _, n, accepted, extra in results:  # the same rows otherwise: the same processing, then more rounds
        call, case = next((c, name[len(c) + 1:]) for c, k in held if k == kind and name.startswith(c + " "))
        no_residual = call == "chain token" and min(accepted) == 4  # every draft accepted: the draw alone either way
        # on the bandwidth-bound link the shared q's later masses take rounds of their own (its rows not gathered)
        more = bool(extra) if case == scenarios.MASSES_A_ROUND else case != "held" and not no_residual
        if case == scenarios.GATHERED_BY_LINK:  # the same processing and one round, as the rows held
            assert n == held[call, kind], (name, kind, n)
        elif more:
            assert n > held[call, kind], (name, kind, n)
    assert any(a > 0 for *_, accepted, _ in ranks[0]["nuclei"] for a in accepted)  # walks past the root too


def test_the_cost_model_plans_the_rounds_and_bytes_the_shard_path_sends(ranks):
    """The bytes each round sends, as cost.*_plan predict them: exactly, except where the shard path took fewer
    rounds than planned (a top-p row's nucleus settled in one description, a chain with no rejection, a tree walk
    settled before its last residual round): then every round it took matches a planned one, in order; the plan
    is the most a call takes (trees: every residual round; top-p rows: descriptions of the most sub-intervals, which
    a call uses only where its intervals hold many tokens)."""
    for op, kind, top_p, info, calls, plan, _ in ranks[0]["rounds"]:
        sent = [b for _, b in calls]
        if op.endswith("without_replacement") and kind in ("top-k", "top-k, top-p"):
            assert sent == plan[:len(sent)], (op, kind)  # candidates held: the shared q's masses a prefix
        elif op.startswith(("tree rrs", "tree traversal")) and not top_p:
            assert sent == plan[:len(sent) - 1] + plan[-1:], (op, kind)  # the residual rounds a prefix, the draw
        elif not top_p and info.get("rejected", True):
            assert sent == plan, (op, kind)
        else:
            it = iter(plan)
            assert all(any(b <= p for p in it) for b in sent), (op, kind, sent, plan)  # within a subsequence of it


def test_flat_nuclei_and_wide_trees_equal_the_one_device_op(ranks):
    """Rows whose nucleus's edge holds many tokens (their cut described over more rounds), ties, top-p with min-p,
    trees whose nodes have three and four children: the one-device tokens, within the documented rounds at the CI
    size (V = 3001); at full size (V = 32000) the flattest rows hold more than 32 distinct weights in a 1/256 octave
    on a rank, and each further description (64 or more times narrower) costs a round."""
    extra = 0 if scenarios.WIDE_V < 10_000 else 3
    for name, got, want, calls in _same_on_every_rank(ranks, "wide"):
        assert got == want, name
        usual = {"sample": 4, "chain target_only": 4}.get(name, 5 if name.startswith("chain") else 8)
        assert len(calls) <= usual + extra, name


def test_nuclei_of_tens_of_thousands_of_tokens_keep_a_chain_within_five_rounds(ranks):
    """Top-p 0.9 over 128256 logits of N(0, 1) at temperature 0.8: a quarter octave of weight around the nucleus's
    edge holds thousands of tokens a rank, and a description of 64 sub-intervals left more than 32 distinct weights
    in the next one (a third description: 6 rounds for a token chain, 5 for sampling); described in as many
    sub-intervals as round 1's bound on those tokens asks (up to one per 128 ids of the shards), the cut settles in
    the second: token at most 5 rounds, sampling 4, the one-device tokens."""
    for name, same, rounds in _same_on_every_rank(ranks, "large vocabulary"):
        assert same, name
        assert rounds <= (5 if name.startswith("chain") else 4), (name, rounds)


def test_a_short_estimate_costs_rounds_never_tokens(ranks):
    """A draw whose window cannot cover the bounds it was given takes one more round (the owner sends the token);
    a top-p cut whose estimated interval misses the crossing (above it, below it) is described over the rest of the
    range: the one-device tokens either way."""
    res = _same_on_every_rank(ranks, "fallbacks")
    got, want, rounds = res["draw"]
    assert got == want and rounds == 2
    for name in ("above", "below"):
        got, want, rounds = res[name]
        assert got == want, name
        assert rounds > 3, name  # the usual 3 (maximum, description, draw) were not enough


def test_gather_and_auto_give_the_one_device_results(ranks):
    """gather: the rows all-gathered in one round (two where a shard holds more than ceil(V / world) ids), then the
    one-device op: its results, greedy and sampled, bf16 logits with masks; auto: under a latency-only link the
    strategy of fewer rounds (gather for sampled rows, the shards' one all_reduce for greedy ones). A gloo group's
    default link is Ethernet's."""
    res = _same_on_every_rank(ranks, "strategies")
    assert res.pop("default link")
    even = all(r["shard"][1] <= -(-37 // len(ranks)) for r in ranks)
    for name, got in res.items():
        for strategy, (same, _) in got.items():
            assert same, (name, strategy)
        gather, shard = got["gather"][1], got["shard"][1]
        assert [c for c, _ in gather] == ["all_gather"] * (1 if even else 2), name
        assert got["auto, latency only"][1] == (shard if name == "sample greedy" else gather), name


def test_walks_gather_rows_whose_entries_cost_less_than_the_rounds_they_save():
    """cost.entries_width: the widest rows (nonzero probabilities a rank) whose one round of entries and the rounds
    the held walk still takes cost no more than the walk's rounds on the shards' columns; any width where the rows'
    whole columns (no ids) cost that little."""
    from specsampler.parallel import cost

    link, wide = parallel.Link(10.0, 1.0), 10**9
    # 2 rounds saved (4 instead of the entries' and one later): 20 s; an entry: 2 other ranks, 4 (2 * 2 + 1) bytes each
    assert cost.entries_width(link, 3, 2, 1, instead=4, later=1, columns=wide) == 20 / 40
    assert cost.entries_width(link, 3, 2, 1, instead=2, later=1, columns=wide) == 0.0  # no round saved
    assert cost.entries_width(parallel.Link(1.0, 0.0), 2, 5, 5, instead=2, later=0, columns=wide) == float("inf")
    assert cost.entries_width(parallel.Link(0.0, 1.0), 2, 5, 5, instead=9, later=0, columns=wide) == 0.0
    # one round saved, 100 s: whole columns of 4 (1 + 1) bytes fit up to 12 columns; past them, 100 / 12 entries
    link = parallel.Link(100.0, 1.0)
    assert cost.entries_width(link, 2, 1, 1, instead=2, later=0, columns=12) == float("inf")
    assert cost.entries_width(link, 2, 1, 1, instead=2, later=0, columns=13) == 100 / 12
    # NVLink's defaults, a chain token at B = 32, TP 2, one round saved: rows of up to 15,625 entries a rank
    assert round(cost.entries_width(parallel.LINKS["nvlink"], 2, 32, 32, 2, 0, wide)) == 15625


def test_auto_keeps_wide_rows_on_the_shards_when_bytes_cost(ranks):
    """Under a bandwidth-only link, rows of 3001 ids stay on the shards (a few KiB a row less than gathering)."""
    for name, same, calls, shard_calls in _same_on_every_rank(ranks, "wide auto"):
        assert same and calls == shard_calls, name


# VocabShard.even at V = 37: ceil(37 / world) ids per rank in rank order, the last rank the rest
EVEN = {2: [(0, 19), (19, 18)], 3: [(0, 13), (13, 13), (26, 11)], 4: [(0, 10), (10, 10), (20, 10), (30, 7)]}


def test_even_shards_follow_megatrons_split(ranks):
    assert [tuple(r["even"]) for r in ranks] == EVEN[len(ranks)]


def test_shard_arguments_are_checked():
    with pytest.raises(ValueError, match="size"):
        parallel.VocabShard(30, 8, 37)
    with pytest.raises(ValueError, match="shard"):
        parallel.sample_from_logits(torch.zeros(1, 5), shard=None)
    with pytest.raises(ValueError, match=r"shard.size = 4"):
        parallel.sample_from_logits(torch.zeros(1, 5), ss.SamplingParams(temperature=0.0),
                                    shard=parallel.VocabShard(0, 4, 8))
    with pytest.raises(ValueError, match="strategy"):
        parallel.sample_from_logits(torch.zeros(1, 4), shard=parallel.VocabShard(0, 4, 8), strategy="fast")
    with pytest.raises(ValueError, match="link"):
        parallel.verify_chain_from_logits(torch.zeros(1, 2, 4), torch.zeros(1, 1, dtype=torch.long),
                                          shard=parallel.VocabShard(0, 4, 8), link="infiniband")


def test_the_torchrun_example_runs_on_two_ranks():
    root = Path(__file__).resolve().parents[2]
    torchrun = Path(sys.executable).with_name("torchrun")
    res = subprocess.run([str(torchrun), "--nproc-per-node", "2", str(root / "examples" / "vocab_parallel.py")],
                         capture_output=True, text=True, timeout=DEADLINE_S)
    assert res.returncode == 0, res.stderr[-2000:]
    assert res.stdout.count("accepted [5, 2, 5, 5], 1 collective of 192 bytes") == 2, res.stdout
