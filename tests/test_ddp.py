"""DPDDPStrategy on 2 CPU processes (gloo): exactness, noise added once, lock-step under tiny q, users sharded by rank."""

from __future__ import annotations

import json
import math
import subprocess
import sys
from collections import Counter
from pathlib import Path

import pytest
import torch
from _worker import run_worker, worker_env
from conftest import TinyModule, make_trainer

from lightning_dp import DPStrategy
from lightning_dp.accounting import compute_epsilon

HERE = Path(__file__).resolve().parent


@pytest.fixture(scope="module")
def ddp_results(tmp_path_factory):
    out = tmp_path_factory.mktemp("ddp")
    run_worker("ddp_worker.py", out)

    def load(name: str) -> list[dict]:
        return [json.loads((out / f"{name}.rank{r}.json").read_text()) for r in (0, 1)]

    return out, load


@pytest.mark.slow
def test_two_processes_equal_single_process_training(ddp_results):
    out, load = ddp_results
    torch.manual_seed(0)
    single = TinyModule(n=64, batch_size=64)
    make_trainer(DPStrategy(noise_multiplier=0.0, max_grad_norm=math.inf, seed=0), max_epochs=5).fit(single)
    ddp_state = torch.load(out / "exact.pt", weights_only=True)
    for key, value in single.state_dict().items():
        torch.testing.assert_close(ddp_state[key], value, rtol=1e-5, atol=1e-6)
    ranks = load("exact")
    # each rank: its half of the logical batch (after the sensitivity check's passes)
    assert [r["batches"][-5:] for r in ranks] == [[32] * 5, [32] * 5]
    assert ranks[0]["sample_rate"] == 1.0


@pytest.mark.slow
def test_noise_is_added_once_in_total(ddp_results):
    _, load = ddp_results
    ranks = load("noise")
    expected = 2.0 * 3.0 / 40.0  # σC / B_logical, split over 2 ranks
    assert ranks[0]["numel"] > 30_000
    assert abs(ranks[0]["std"] / expected - 1) < 0.03  # √2× too large if every rank added full noise
    assert ranks[0]["checksum"] == ranks[1]["checksum"]  # every rank applies the same private gradient


@pytest.mark.slow
def test_tiny_sample_rate_keeps_ranks_in_lock_step(ddp_results):
    _, load = ddp_results
    r0, r1 = load("tiny_q")
    assert r0["steps"] == r1["steps"] == 100  # 200 examples / (1 per device × 2 devices)
    assert r0["epsilon"] == r1["epsilon"]
    assert r0["epsilon"] == pytest.approx(
        compute_epsilon(noise_multiplier=1.0, sample_rate=0.01, steps=100, delta=1e-5)
    )
    assert r0["seen"] < 100
    assert r1["seen"] < 100
    assert r0["weights"] == r1["weights"]


@pytest.mark.slow
def test_cli_on_two_processes_matches_single_process_epsilon(tmp_path):
    """The issue's acceptance run: the digits config on 2 CPU processes, same q, steps and ε."""
    config = str(HERE.parent / "configs" / "digits_dpsgd.yaml")
    common = ["--config", config, "--trainer.enable_progress_bar", "false", "--trainer.max_epochs", "1"]

    def run(*extra: str) -> dict:
        out = tmp_path / str(len(extra))
        out.mkdir()
        cmd = [
            sys.executable,
            "-m",
            "lightning_dp.commands.cli",
            "fit",
            *common,
            "--trainer.logger.init_args.save_dir",
            str(out),
            *extra,
        ]
        done = subprocess.run(cmd, cwd=out, env=worker_env(), capture_output=True, text=True, timeout=600)
        assert done.returncode == 0, done.stderr[-4000:]
        return json.loads(next(out.rglob("privacy_report.json")).read_text())

    single = run()
    double = run("--trainer.strategy", "dp_ddp", "--trainer.devices", "2", "--trainer.accelerator", "cpu")
    for key in ("epsilon", "steps", "sample_rate", "noise_multiplier"):
        assert double[key] == single[key], key
    assert "test_accuracy" in double


@pytest.mark.slow
def test_virtual_batching_under_ddp_equals_unsplit_single_process(ddp_results):
    out, load = ddp_results
    torch.manual_seed(0)
    single = TinyModule(n=64, batch_size=64)
    make_trainer(DPStrategy(noise_multiplier=0.0, max_grad_norm=0.1, seed=0), max_epochs=3).fit(single)
    ddp_state = torch.load(out / "virtual.pt", weights_only=True)
    for key, value in single.state_dict().items():
        torch.testing.assert_close(ddp_state[key], value, rtol=1e-5, atol=1e-6)
    assert [r["max_chunk"] for r in load("virtual")] == [5, 5]
    assert [r["steps"] for r in load("virtual")] == [3, 3]


@pytest.mark.slow
def test_bf16_under_ddp_keeps_every_contribution_below_c(ddp_results):
    _, load = ddp_results
    for rank in load("bf16"):
        assert 0 < rank["max_contribution"] <= 0.05
        assert "torch.bfloat16" in rank["dtypes"]


@pytest.mark.slow
def test_resume_under_ddp_continues_streams_and_epsilon(ddp_results):
    out, load = ddp_results
    for rank in load("resume"):
        assert rank["steps"] == 8
        assert rank["same_as_straight"]
        assert rank["epsilon"] == pytest.approx(
            compute_epsilon(noise_multiplier=1.0, sample_rate=0.25, steps=8, delta=1e-5)
        )
    saved = torch.load(out / "ddp.ckpt", weights_only=True)["lightning_dp"]
    assert saved["world_size"] == 2
    assert len(saved["ranks"]) == 2
    assert not torch.equal(saved["ranks"][0]["noise_generator"], saved["ranks"][1]["noise_generator"])


@pytest.mark.slow
def test_resume_with_another_world_size_is_refused(ddp_results):
    from lightning_dp import DPConfigurationError

    out, _ = ddp_results
    with pytest.raises(DPConfigurationError, match="written by 2 processes"):
        make_trainer(DPStrategy(noise_multiplier=1.0, seed=7), max_epochs=2).fit(
            TinyModule(n=128, batch_size=32), ckpt_path=out / "ddp.ckpt"
        )


@pytest.mark.slow
def test_adaclip_under_ddp_equals_single_process(ddp_results):
    """The AdaCliP statistics are updated from the all-reduced release: identical on every rank and
    equal to the single-process run."""
    from lightning_dp import AdaCliP

    out, load = ddp_results
    torch.manual_seed(0)
    single = TinyModule(n=64, batch_size=64)
    clip = AdaCliP(h2=1.0)
    make_trainer(DPStrategy(noise_multiplier=0.0, clipping=clip, seed=0), max_epochs=3).fit(single)
    ddp = torch.load(out / "adaclip.pt", weights_only=True)
    for key, value in single.state_dict().items():
        torch.testing.assert_close(ddp["model"][key], value, rtol=1e-5, atol=1e-6)
    for a, b in zip(ddp["s"] + ddp["m"], clip.s + clip.m, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-7)
    ranks = load("adaclip")
    assert ranks[0]["s_sum"] == ranks[1]["s_sum"]


@pytest.mark.slow
def test_quantile_clipping_under_ddp_moves_c_alike_on_every_rank(ddp_results):
    """σ = 0: the count over both ranks' shares gives the single-process trajectory and weights; σ = 1: the
    noisy count (each rank's share noised) is all-reduced, so both ranks still hold one C."""
    from lightning_dp import QuantileClipping

    out, load = ddp_results
    torch.manual_seed(0)
    single = TinyModule(n=64, batch_size=64)
    clip = QuantileClipping(initial_norm=0.5, seed=1)
    make_trainer(DPStrategy(noise_multiplier=0.0, clipping=clip, seed=0), max_epochs=3).fit(single)
    exact, noisy = load("quantile_exact"), load("quantile_noisy")
    assert exact[0]["norm"] == exact[1]["norm"] == pytest.approx(clip.norm, rel=1e-9)
    assert clip.norm != 0.5
    state = torch.load(out / "quantile_exact.pt", weights_only=True)
    for key, value in single.state_dict().items():
        torch.testing.assert_close(state[key], value, rtol=1e-5, atol=1e-6)
    assert noisy[0]["norm"] == noisy[1]["norm"] != exact[0]["norm"]
    assert noisy[0]["norm_range"] == noisy[1]["norm_range"]


def test_dpis_under_ddp_releases_once_and_keeps_ranks_in_lock_step(ddp_results):
    """Candidates split across ranks; N~, K~, σ_G and the ledger identical on both; ε meets the target."""
    _, load = ddp_results
    rank0, rank1 = load("dpis")
    assert rank0["share"] == rank1["share"] == 128
    assert rank0["steps"] == rank1["steps"] == 2 * 16
    assert rank0["epochs"] == rank1["epochs"]
    assert len(rank0["epochs"]) == 2
    assert rank0["history"] == rank1["history"]
    assert 0.99 <= rank0["epsilon"] == rank1["epsilon"] <= 1.0


def test_ranks_with_different_data_set_sizes_are_refused_on_every_rank(ddp_results):
    """Rank 1's data set is half rank 0's: it would sample at twice rank 0's q, unpriced by rank 0's ledger."""
    _, load = ddp_results
    for record in load("unequal"):
        assert "rank 1 has 32, rank 0 has 64" in record["refusal"]
        assert "'N (training examples)'" in record["refusal"]
        assert record["steps"] == 0


@pytest.mark.slow
def test_a_check_refusing_on_one_rank_stops_every_rank_before_the_release(ddp_results):
    _, load = ddp_results
    r0, r1 = load("mixing_one_rank")
    assert "Sensitivity check failed" in r1["refusal"]
    assert r0["refusal"].startswith("Rank 1 refused this step before its release: Sensitivity check failed")
    assert r0["steps"] == r1["steps"] == 0


@pytest.mark.slow
def test_an_unseeded_ddp_runs_files_hold_no_seed_generator_state_or_private_statistic(ddp_results):
    """Issue #35 under DPDDPStrategy: both ranks' os.urandom draws, every file the two runs wrote."""
    from secret_scan import Secrets, UrandomDraws, scan_files

    out, load = ddp_results
    draws = UrandomDraws()
    for rank in load("secrets"):
        draws.add_hex(rank["draws"])
    assert len(draws.draws) >= 4  # each rank seeded its own sampling and noise streams
    found, files = scan_files(out / "secrets", Secrets(draws, 211))
    for name in ("dpsgd", "dpis"):
        checkpoints = [p for p in files if p.suffix == ".ckpt" and name in p.parts]
        assert len(checkpoints) >= 3
        state = torch.load(checkpoints[0], weights_only=True)["lightning_dp"]
        assert state["world_size"] == 2
        assert len(state["ranks"]) == 2
    assert any(p.name == "privacy_report.json" for p in files)
    assert not found, "\n".join(found)


# -- user-level DP under DDP (issue #38, spec §5.7 test 7): ddp_worker.py's scenario 12 ------------------------
def single_process_user_run(name: str):
    """``user_runs.RUNS[name]`` on one process: (the trained module, its strategy)."""
    from user_runs import RUNS, UserRows, batch_size

    args, fit = RUNS[name]
    torch.manual_seed(0)
    module = UserRows(batch_size(name))
    strategy = DPStrategy(**args)
    make_trainer(strategy, **fit).fit(module)
    return module, strategy


def users_by_step(ranks: list[dict]) -> list[list[list[int]]]:
    """For each rank, each step's sampled users (relabelled indices, sorted), read from its drawn rows."""
    from user_runs import relabel, user_ids

    owner = relabel(user_ids())
    return [[sorted({int(owner[i]) for i in rows}) for rows in rank["draws"]] for rank in ranks]


@pytest.mark.slow
@pytest.mark.parametrize("name", ["exact", "clipped"])
def test_user_level_ddp_releases_the_single_process_gradient(ddp_results, name):
    """σ = 0, q_u = 1, k = max n_u: the two ranks' users together are the one-process batch, so every released
    (all-reduced) gradient and the weights equal one process's: no user split over ranks (its halves would be
    clipped, or averaged, apart), the divisor B_u over all ranks. ``clipped``: C binds, summed units, chunks."""
    from user_runs import NUM_USERS

    out, load = ddp_results
    single, strategy = single_process_user_run(name)
    ddp_state = torch.load(out / f"users_{name}.pt", weights_only=True)
    for key, value in single.state_dict().items():
        torch.testing.assert_close(ddp_state[key], value, rtol=1e-5, atol=1e-6)
    ranks = load(f"users_{name}")
    assert [r["steps"] for r in ranks] == [strategy.engine.steps] * 2
    for step, (zero, one) in enumerate(zip(*users_by_step(ranks), strict=True)):
        assert sorted(zero + one) == list(range(NUM_USERS)), step  # every user once, on one rank
    if name == "clipped":
        assert max(len(rows) for r in ranks for rows in r["rows"]) <= 5  # physical chunks of ≤ 5 rows


@pytest.mark.slow
def test_user_level_ddp_ranks_sample_disjoint_users_at_the_single_process_rate_and_epsilon(ddp_results):
    """q_u = 8/40, k = 2, 50 steps, σ calibrated to ε = 4. Each rank samples only its own users (u ≡ r mod 2),
    each with min(n_u, k) of their own rows, and trains on exactly the rows it drew; the union of the ranks'
    draws is Poisson over all U users at q_u (loose: 4 s.e. on the total, 4.5 s.e. per user, Bonferroni over
    40 users, at a fixed seed); U, q_u, σ, the steps and ε equal the one-process run's."""
    from user_runs import COUNTS, NUM_USERS, relabel, user_ids

    _, load = ddp_results
    ranks = load("users_sampled")
    owner = relabel(user_ids())
    _, single = single_process_user_run("sampled")
    q, steps, k = 8 / NUM_USERS, 50, 2
    assert single.engine.steps == steps
    for rank, record in enumerate(ranks):
        assert (record["num_units"], record["sample_rate"]) == (NUM_USERS, q)
        assert (record["steps"], record["sigma"], record["epsilon"]) == (
            single.engine.steps, single.engine.noise_multiplier(), single.epsilon,
        )  # fmt: skip
        assert len(record["draws"]) == steps  # one draw per step, empty or not
        assert [i for rows in record["rows"] for i in rows] == [i for rows in record["draws"] for i in rows]
        for rows in record["draws"]:
            assert len(rows) == len(set(rows))  # no example twice in a step
            per_user = Counter(int(owner[i]) for i in rows)
            assert all(u % 2 == rank for u in per_user)  # this rank's share only
            assert all(n == min(int(COUNTS[u]), k) for u, n in per_user.items())
    assert single.epsilon == pytest.approx(
        compute_epsilon(
            noise_multiplier=single.engine.noise_multiplier(), sample_rate=q, steps=steps, delta=1e-5
        )
    )
    assert 3.9 < single.epsilon <= 4.0
    zero, one = users_by_step(ranks)
    assert all(not set(a) & set(b) for a, b in zip(zero, one, strict=True))
    union = Counter(u for a, b in zip(zero, one, strict=True) for u in a + b)
    total, expected = sum(union.values()), NUM_USERS * q * steps
    assert abs(total - expected) < 4 * math.sqrt(expected * (1 - q))
    for user in range(NUM_USERS):
        assert abs(union[user] / steps - q) < 4.5 * math.sqrt(q * (1 - q) / steps), user


# -- secure noise under DDP (issue #50): ddp_worker.py's scenario 13 ------------------------------------------------


@pytest.mark.slow
def test_secure_integer_sums_add_exactly_over_ranks_and_each_rank_adds_a_share(ddp_results):
    """σ = 0: both ranks release the very integers one process sums (int64, exact in any split); σ = 2:
    each rank's discrete Gaussian share is σΔ/√2 and the ledger prices 2 shares (Kairouz et al. 2021)."""
    from neighbour import released_sum

    _, load = ddp_results
    exact = load("secure_exact")
    assert exact[0]["dtype"] == "torch.int64"
    assert exact[0]["integers"] == exact[1]["integers"]
    module = TinyModule(n=64, batch_size=64)
    torch.manual_seed(0)
    single = released_sum(
        TinyModule(n=64, batch_size=64),
        torch.utils.data.TensorDataset(module.x, module.y),
        lambda: DPStrategy(noise_multiplier=0.0, max_grad_norm=0.1, seed=0, secure=True),
    )
    assert single.sums is not None
    assert exact[0]["integers"][0] == [
        int(v) for v in torch.cat([s.reshape(-1) for s in single.sums]).tolist()
    ]
    noisy = load("secure_noise")
    assert [r["ranks"] for r in noisy] == [2, 2]
    assert noisy[0]["share_scale"] == pytest.approx(2.0 * noisy[0]["sensitivity"] / math.sqrt(2))
    assert noisy[0]["integers"] == noisy[1]["integers"]


# -- user code's collectives (issue #48): ddp_worker.py's scenarios 3 and 15-17 -------------------------------------


@pytest.mark.slow
def test_sync_dist_logs_meet_under_tiny_q_and_average_the_ranks_with_data(ddp_results):
    """Most local batches are empty: that rank's placeholder call makes the same all-reduce as the other's
    ``self.log(..., sync_dist=True)`` (no hang), and what both log is the mean and max of the ranks with data,
    never a placeholder's value; the epoch's value is the mean over every real call."""
    from sync_logs import check_synced

    ranks = load_ranks(ddp_results, "tiny_q")
    assert check_synced(ranks) > 10  # steps where one rank had no example
    assert all(r["placeholders"] > 10 for r in ranks)


@pytest.mark.slow
def test_sync_dist_logs_meet_under_virtual_batching_with_unequal_chunks(ddp_results):
    from sync_logs import check_synced

    ranks = load_ranks(ddp_results, "sync_chunks")
    counts = [Counter(c[0] for c in r["calls"]) for r in ranks]
    assert any(counts[0][s] != counts[1][s] for s in counts[0] | counts[1])  # unequal numbers of chunks
    assert all(r["placeholders"] > 0 for r in ranks)
    check_synced(ranks)
    assert ranks[0]["steps"] == ranks[1]["steps"] == 8


@pytest.mark.slow
def test_manual_optimization_with_an_empty_local_batch_keeps_the_ranks_in_step(ddp_results):
    """Under manual optimization the placeholder call is the user's step with nothing of its own: its release
    (noise alone) meets the other rank's, and its optimizer and scheduler steps are real, so both ranks hold
    the same weights, learning rate, step counts and ε."""
    from sync_logs import check_synced

    r0, r1 = ranks = load_ranks(ddp_results, "sync_manual")
    assert min(r0["placeholders"], r1["placeholders"]) > 0
    assert r0["steps"] == r1["steps"] == 100
    assert r0["global_step"] == r1["global_step"]
    assert r0["lr"] == r1["lr"] < 0.1
    assert r0["weights"] == r1["weights"]
    assert (
        r0["epsilon"]
        == r1["epsilon"]
        == pytest.approx(compute_epsilon(noise_multiplier=1.0, sample_rate=0.01, steps=100, delta=1e-5))
    )
    check_synced(ranks)


@pytest.mark.slow
@pytest.mark.parametrize("size", [8, 1024])
def test_the_ordinary_step_logs_synced_values_at_any_batch_size(ddp_results, size):
    from sync_logs import check_synced

    ranks = load_ranks(ddp_results, f"sync_b{size}")
    assert [r["steps"] for r in ranks] == [2, 2]
    check_synced(ranks)


@pytest.mark.slow
@pytest.mark.parametrize(
    ("name", "says"),
    [("gathers", "self.all_gather was called inside training_step"), ("product", "reduce_op='product'")],
)
def test_a_collective_that_cannot_be_matched_is_refused_on_every_rank_before_any_release(
    ddp_results, name, says
):
    for record in load_ranks(ddp_results, f"refuse_{name}"):
        assert says in record["refusal"]
        assert record["steps"] == 0


def load_ranks(results, name: str) -> list[dict]:
    _, load = results
    return load(name)
