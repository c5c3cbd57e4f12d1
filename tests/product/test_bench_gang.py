"""bench/gang.py's quick run on the tiny model (at hidden size 128, for bitsandbytes' 4-bit blocks), so that the gang
benchmark's QLoRA row cannot rot between its runs on SmolLM2: a gang of two on the base loaded in 4 bits (nf4) against
the same gang on the full-precision base, and both against plain TRL."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]


@pytest.mark.e2e
@pytest.mark.subprocess
@pytest.mark.slow
def test_the_gang_benchmark_times_a_gang_on_a_4bit_base_against_the_full_precision_one(tmp_path):
    pytest.importorskip("bitsandbytes")
    out = tmp_path / "gang.json"
    run = subprocess.run(
        [sys.executable, str(REPO / "bench" / "gang.py"), "--model", "tiny", "--configs", "2", "--chunks", "2",
         "--gangs", "2", "--quantization", "none,nf4", "--repeats", "1", "--skip-generation", "--threads", "1",
         "--out", str(out)],
        cwd=tmp_path, capture_output=True, text=True, timeout=600, check=False,
    )
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    record = json.loads(out.read_text())
    assert record["quantization"] == ["none", "nf4"]
    (runs,) = record["repeats"]
    assert set(runs) == {"plain", "G2", "G2-nf4"}
    full, nf4 = runs["G2"], runs["G2-nf4"]
    assert (full["quantization"], nf4["quantization"]) == ("none", "nf4")
    assert nf4["wall_s"] > 0 and nf4["ratio_wall"] > 0 and nf4["parts_s"]["rollout_decode"] > 0
    # The estimate counts the 4-bit base at about half a byte a weight: below the full-precision base's.
    assert 0 < nf4["estimate_parts"]["base"] < full["estimate_parts"]["base"] / 4
    row = record["quantized_vs_full"]["G2-nf4"]
    assert row["against"] == "G2" and row["median_ratio_wall"] == pytest.approx(nf4["wall_s"] / full["wall_s"])
    assert row["estimate_bytes"] == nf4["estimate_bytes"] and row["full_estimate_bytes"] == full["estimate_bytes"]
    # The loaded base's weights: its linear layers packed two weights to a byte.
    assert 0 < row["base_weights_bytes"] == nf4["base_weights_bytes"] < full["base_weights_bytes"] / 2
    assert "4-bit base (nf4)" in run.stdout and "G2-nf4" in run.stdout


def test_a_gang_sides_name_says_its_size_training_and_quantization():
    sys.path.insert(0, str(REPO / "bench"))
    try:
        import gang
    finally:
        sys.path.remove(str(REPO / "bench"))
    args = gang.parse_args(["--gangs", "1,2", "--gang-training", "sequential,batched", "--quantization", "none,nf4"])
    assert args.sides == ["G1", "G1-nf4", "G2", "G2-nf4", "G2-batched", "G2-batched-nf4"]
    assert [gang.parse_side(side) for side in args.sides] == [
        (1, "sequential", "none"), (1, "sequential", "nf4"), (2, "sequential", "none"), (2, "sequential", "nf4"),
        (2, "batched", "none"), (2, "batched", "nf4")]
    with pytest.raises(SystemExit):
        gang.parse_args(["--quantization", "int4"])
