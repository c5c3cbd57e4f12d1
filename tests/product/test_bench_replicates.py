"""bench/replicates.py's quick run on the tiny model, so that the seed-variance benchmark cannot rot between its runs
on SmolLM2: a sweep of two configs, `study.confirm` with new seeds, and the figures read back from the stored study."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]


@pytest.mark.e2e
@pytest.mark.subprocess
@pytest.mark.slow
def test_the_replicates_benchmark_sweeps_confirms_and_reports_each_configs_seed_variance(tmp_path):
    out = tmp_path / "replicates.json"
    run = subprocess.run([sys.executable, str(REPO / "bench" / "replicates.py"), "--quick", "--out", str(out)],
                         cwd=tmp_path, capture_output=True, text=True, timeout=600, check=False)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    result = json.loads(out.read_text())
    assert result["model"] == "tiny" and result["replicates"] == 4  # two configs, two new seeds each
    assert [len(c["runs"]) for c in result["configs"]] == [3, 3]
    for config in result["configs"]:
        best = [r["best"] for r in config["runs"]]
        assert config["mean"] == pytest.approx(sum(best) / 3)
        assert len({r["seed"] for r in config["runs"]}) == 3
    assert result["single_seed_sweeps"] == 9 and 0 <= result["single_seed_crowns_the_loser"] <= 9
    assert "single-seed sweeps (one run of each config) that crown the config losing across seeds" in run.stdout
    assert result["verdict"].startswith("across seeds, ")
