"""bench --spec on CPU at a tiny shape: the JSON's rows for every draft kind
and k, tokens identical to the baseline on the reference path, the oracle's
drafts all accepted and the adversarial's none (drafting paused after two
such rounds), verify costs for 2-4
positions and the projection computed from them."""

from __future__ import annotations

import json

import pytest

from bench import spec
from mlx_lily.mtp_decode import ROUND_PARTS


def test_spec_bench_writes_its_rows(tmp_path):
    from mlx_lily.random_checkpoints import make_checkpoint

    model = make_checkpoint(tmp_path / "head", mtp=True)
    assert spec.main(["--model", str(model), "--context", "16", "--decode-steps", "6", "--reps", "1",
                      "--rounds", "2", "--out", str(tmp_path)]) == 0
    (file,) = tmp_path.glob("spec-*.json")
    data = json.loads(file.read_text())
    rows = {(r["draft"], r["k"]): r for r in data["summary"]}
    assert set(rows) == {(d, k) for d in spec.DRAFTS for k in (1, 2, 3)}
    for row in rows.values():
        assert set(row) >= {"draft", "k", "decode_tps", "baseline_decode_tps", "speedup", "tokens_identical"}
        assert row["tokens_identical"] is True and row["decode_tps"] > 0
        # Two passes, each row's ratio to its own pass's baseline; the row's speedup their median.
        assert len(row["speedups"]) == 2 and all(r > 0 for r in row["speedups"])
        assert abs(row["speedup"] - sum(row["speedups"]) / 2) < 1e-3
        # The host's time per round, by part; "other" only where every
        # token came from a round.
        parts = set(row["round_ms"])
        assert {"draft", "verify_build", "wait", "accept"} <= parts <= set(ROUND_PARTS) | {"other"}
        assert ("other" in parts) == (row["plain"] == 0)
        if row["draft"] == "oracle":  # every round kept its drafts: each next one was built ahead
            assert "submit" in parts
        assert all(ms >= 0 for part, ms in row["round_ms"].items() if part != "other")
        assert sum(row["round_ms"].values()) > 0
        # The same parts pass by pass ("other" is the row's only), whose
        # rounds add up to the row's figure, and each pass's baseline.
        by_pass = row["round_ms_by_pass"]
        assert len(by_pass) == 2 and all(set(p) == parts - {"other"} for p in by_pass)
        assert len(row["baseline_around_by_pass"]) == 2
        for part in parts - {"other"}:
            assert min(p[part] for p in by_pass) - 1e-3 <= row["round_ms"][part] <= max(p[part] for p in by_pass) + 1e-3
    for k in (1, 2, 3):
        adversarial = rows[("adversarial", k)]
        assert adversarial["accepted"] == 0
        # 6 tokens a pass: the prompt's, 2 rounds that keep nothing, then
        # drafting pauses; the counts are summed over the two passes.
        assert adversarial["plain"] > 0 and adversarial["rounds"] + adversarial["plain"] == 2 * 5
        # Each plain token's time from the token before, set beside the baseline's.
        assert adversarial["plain_token_ms"] > 0
        oracle = rows[("oracle", k)]
        assert oracle["rounds"] > 0 and oracle["accepted"] == oracle["rounds"] * k and oracle["plain"] == 0
        assert oracle["plain_token_ms"] is None
    # Each pass: a baseline run, then each row followed by one; a row's ratio
    # is against the two baseline runs around it (their mean time per token).
    bases = data["baseline_decode_tps_runs"]
    assert data["rounds"] == 2 and len(bases) == 2 * (1 + len(rows))
    for j, row in enumerate(data["summary"]):
        for pass_, (tps, ratio) in enumerate(zip(row["decode_tps_by_pass"], row["speedups"])):
            at = pass_ * (1 + len(rows)) + j
            around = 2 / (1 / bases[at] + 1 / bases[at + 1])
            assert ratio == pytest.approx(tps / around, rel=2e-3)
            assert row["baseline_around_by_pass"][pass_] == pytest.approx(around, rel=2e-3)
    costs = {r["positions"]: r for r in data["verify_cost"]}
    assert set(costs) == {2, 3, 4} and all(r["ratio"] > 0 for r in costs.values())
    at = next(r for r in data["projected"] if r["acceptance"] == 0.85 and r["k"] == 1)
    assert abs(at["speedup"] - (1 + 0.85) / costs[2]["ratio"]) < 1e-3
    assert data["projected_at_0.85_k1"] == at["speedup"]
    # No --profile: no kernel profile.
    assert data["profile"] is None


def test_spec_bench_runs_with_module_constants_set_and_restores_them(tmp_path, monkeypatch):
    # --set MODULE.NAME=VALUE: the run under that constant (recorded in the
    # JSON), the constant back afterwards; a bad setting is refused by name.
    from mlx_lily.kernels.moe import decode
    from mlx_lily.random_checkpoints import make_checkpoint

    default, seen, real = decode.ROUTED_MAX_ROWS, [], spec.verify_costs

    def verify_costs(*args, **kwargs):
        seen.append(decode.ROUTED_MAX_ROWS)
        return real(*args, **kwargs)

    monkeypatch.setattr(spec, "verify_costs", verify_costs)
    model = make_checkpoint(tmp_path / "head", mtp=True)
    assert spec.main(["--model", str(model), "--context", "16", "--decode-steps", "3", "--reps", "1", "--k", "1",
                      "--rounds", "1", "--set", "mlx_lily.kernels.moe.decode.ROUTED_MAX_ROWS=4",
                      "--out", str(tmp_path)]) == 0
    assert seen == [4] and decode.ROUTED_MAX_ROWS == default
    (file,) = tmp_path.glob("spec-*.json")
    assert json.loads(file.read_text())["settings"] == {"mlx_lily.kernels.moe.decode.ROUTED_MAX_ROWS": "4"}
    for bad in ("mlx_lily.kernels.moe.decode.NOT_THERE=1", "mlx_lily.kernels.moe.decode.ROUTED_MAX_ROWS=four",
                "ROUTED_MAX_ROWS=4"):
        with pytest.raises(SystemExit):
            spec.main(["--set", bad])


def test_plain_token_ms_is_the_median_gap_over_passes():
    passes = [([], 1.0, {"plain_gaps_s": [0.001, 0.004]}, 1.0), ([], 1.0, {"plain_gaps_s": [0.002]}, 1.0)]
    assert spec._plain_token_ms(passes) == 2.0
    assert spec._plain_token_ms([([], 1.0, {"plain_gaps_s": []}, 1.0)]) is None


def test_spec_profile_tallies_launches_per_unit():
    kernels = {"custom_kernel_gate_up_" + "x" * 80: [10.0, 12.0, 14.0, 16.0], "copy": [1.0, 1.0]}
    got = spec._tally(kernels, 2)
    assert got["kernels"] == 3.0 and got["gpu_ms"] == pytest.approx(0.027)
    name = ("custom_kernel_gate_up_" + "x" * 80)[: spec.NAME_CHARS]
    assert got["by_kernel"] == {name: 2.0, "copy": 1.0} and list(got["by_kernel"]) == [name, "copy"]


def test_spec_profile_rows_per_token_round_and_adversarial_token(tmp_path, monkeypatch):
    # The profile's rows with the recorder replaced by one that counts a
    # kernel per model call: a plain token, an oracle round at each k, and
    # the adversarial draft per emitted token at the first k (its rounds
    # and plain tokens recorded).
    import mlx.core as mx

    import mlx_lily
    from bench import gpu_time
    from mlx_lily.random_checkpoints import make_checkpoint

    model, _ = mlx_lily.load(str(make_checkpoint(tmp_path / "head", mtp=True)))
    vocab = model.language_model.args.vocab_size
    prompt = mx.array(spec.prompt_ids(16, vocab))
    want, _ = spec.baseline(model, prompt, 9)
    monkeypatch.setattr(gpu_time, "why_unavailable", lambda: None)
    monkeypatch.setattr(gpu_time, "kernel_times", lambda run: (run(), {"step": [2.0] * 6})[1])
    rows = spec.gpu_profile(model, prompt, 6, [1, 2], want, vocab)["rows"]
    assert [(r["draft"], r["k"], r["per"]) for r in rows] == [
        ("none", 0, "token"), ("oracle", 1, "round"), ("oracle", 2, "round"), ("adversarial", 1, "token")]
    adversarial = rows[-1]
    assert adversarial["rounds"] >= 2 and adversarial["plain"] > 0
    assert adversarial["kernels"] == 1.0 and adversarial["gpu_ms"] == pytest.approx(0.002)


def test_spec_profile_says_why_not_without_a_gpu(tmp_path):
    import mlx.core as mx

    if mx.default_device() == mx.gpu:
        pytest.skip("this machine has a GPU: the profile would run")
    from mlx_lily.random_checkpoints import make_checkpoint

    model = make_checkpoint(tmp_path / "head", mtp=True)
    assert spec.main(["--model", str(model), "--context", "16", "--decode-steps", "3", "--reps", "1", "--k", "1",
                      "--rounds", "1", "--profile", "--out", str(tmp_path)]) == 0
    (file,) = tmp_path.glob("spec-*.json")
    assert json.loads(file.read_text())["profile"] == {"note": "no GPU"}
