"""bench --spec on CPU at a tiny shape: the JSON's rows for every draft kind
and k, tokens identical to the baseline on the reference path, the oracle's
drafts all accepted and the adversarial's none (drafting paused after two
such rounds), verify costs for 2-4
positions and the projection computed from them."""

from __future__ import annotations

import json

from bench import spec


def test_spec_bench_writes_its_rows(tmp_path):
    from mlx_lily.random_checkpoints import make_checkpoint

    model = make_checkpoint(tmp_path / "head", mtp=True)
    assert spec.main(["--model", str(model), "--context", "16", "--decode-steps", "6", "--reps", "1",
                      "--out", str(tmp_path)]) == 0
    (file,) = tmp_path.glob("spec-*.json")
    data = json.loads(file.read_text())
    rows = {(r["draft"], r["k"]): r for r in data["summary"]}
    assert set(rows) == {(d, k) for d in spec.DRAFTS for k in (1, 2, 3)}
    for row in rows.values():
        assert set(row) >= {"draft", "k", "decode_tps", "baseline_decode_tps", "speedup", "tokens_identical"}
        assert row["tokens_identical"] is True and row["decode_tps"] > 0
        assert abs(row["speedup"] - row["decode_tps"] / row["baseline_decode_tps"]) < 1e-2 * row["speedup"] + 1e-3
        # The host's time per round, by part.
        assert set(row["round_ms"]) == {"draft", "verify_build", "wait", "accept"}
        assert all(ms >= 0 for ms in row["round_ms"].values()) and sum(row["round_ms"].values()) > 0
    for k in (1, 2, 3):
        adversarial = rows[("adversarial", k)]
        assert adversarial["accepted"] == 0
        # 6 tokens: the prompt's, 2 rounds that keep nothing, then drafting pauses.
        assert adversarial["plain"] > 0 and adversarial["rounds"] + adversarial["plain"] == 5
        oracle = rows[("oracle", k)]
        assert oracle["rounds"] > 0 and oracle["accepted"] == oracle["rounds"] * k and oracle["plain"] == 0
    costs = {r["positions"]: r for r in data["verify_cost"]}
    assert set(costs) == {2, 3, 4} and all(r["ratio"] > 0 for r in costs.values())
    at = next(r for r in data["projected"] if r["acceptance"] == 0.85 and r["k"] == 1)
    assert abs(at["speedup"] - (1 + 0.85) / costs[2]["ratio"]) < 1e-3
    assert data["projected_at_0.85_k1"] == at["speedup"]
