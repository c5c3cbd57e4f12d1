"""bench/gpu.py's CPU dry run, so that the GPU benchmark cannot rot between the runs on a GPU machine."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]


@pytest.mark.e2e
@pytest.mark.subprocess
@pytest.mark.slow
def test_gpu_benchmark_dry_run_prints_the_table_and_writes_every_figure(tmp_path):
    out = tmp_path / "gpu.json"
    # Every part: one worker count (2) keeps it short; the full sweep is the same code with more counts. The
    # data-parallel trial runs as two CPU processes, Ray as a local cluster of one CPU worker.
    run = subprocess.run(
        [sys.executable, str(REPO / "bench" / "gpu.py"), "--dry-run", "--only", "all", "--workers", "2",
         "--data-parallel", "2", "--ray", "1", "--gangs", "2", "--gang-repeats", "1", "--decode-gangs", "1,2",
         "--big-gang", "4", "--out", str(out)],
        cwd=tmp_path, capture_output=True, text=True, timeout=600, check=False,
    )
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    table = run.stdout
    for row in ("wall ratio b/a (model loading excluded)", "swap, median", "checkpoint save per unit, median",
                "peak GPU memory, round-robin (b)", "GPU busy during (b)", "exactness, chunks vs straight",
                "sweep with 2 worker(s) sharing the device, wall", "sweep with 4 worker(s) sharing the device, wall",
                "sweep with 2 devices per trial, wall (1 device)", "Ray start-up alone (init, one actor, shutdown)",
                "sweep on a local Ray cluster, 1 worker(s), wall", "decode, batched (eager), 2 trial(s) x 4 rows",
                "decode, model.generate eager, dynamic cache", "decode, greedy tokens equal to model.generate's"):
        assert row in table, row
    assert "n/a (cpu)" in table
    record = json.loads(out.read_text())
    rr = record["round_robin"]
    assert record["device"] == "cpu" and record["dry_run"] is True
    assert rr["ratio_wall"] > 0 and rr["swap_ms_median"] > 0 and rr["checkpoint_ms_per_unit_median"] > 0
    assert rr["peak_gpu_bytes_round_robin"] is None and rr["gpu_busy_fraction"] is None
    assert rr["adapter_bytes_per_trial"] > 0
    # On the CPU, chunked training is bit-identical to straight through, and rfopt trains what plain TRL trains.
    assert record["exactness"]["max_abs_diff"] == 0.0
    assert rr["max_abs_weight_diff_a_vs_b"] == 0.0
    assert set(record["workers"]) == {"2"} and record["workers"]["2"]["wall_s"] > 0
    # Two devices per trial (each half of the batch; rollouts sampled per row) end with one device's values.
    parallel = record["data_parallel"]["2"]
    assert parallel["wall_s"] > 0 and parallel["wall_s_one_device"] > 0 and parallel["max_abs_value_diff"] == 0.0
    assert record["ray"]["startup_s"] > 0 and record["ray"]["1"]["wall_s"] > 0

    # Gangs: the full study in gangs of 2 against plain TRL, by part, in both gang training modes (issue 42).
    for mode in ("sequential", "batched"):
        assert f"full study in gangs of 2, {mode}, wall ratio to plain TRL" in table, mode
    gangs = record["gangs"]
    assert gangs["plain_wall_s"] > 0 and set(gangs["runs"]) == {"G2", "G2-batched"}
    for key, runs in gangs["runs"].items():
        assert runs[0]["ratio_wall"] > 0 and runs[0]["parts_s"]["rollout_decode"] > 0, key
        assert runs[0]["estimate_bytes"] > 0 and runs[0]["gang_training"] in ("sequential", "batched"), key
    # The members' training time per gang step in each mode against one member's step alone.
    steps = record["steps"]["runs"]
    assert set(steps) == {"alone", "G4-sequential", "G4-batched"}
    assert steps["alone"]["gang_size"] == 1 and steps["alone"]["gang_steps"] == steps["alone"]["member_steps"] > 0
    for key in ("G4-sequential", "G4-batched"):
        run = steps[key]
        assert run["training"] == key.split("-")[1] and run["gang_steps"] * 4 == run["member_steps"], key
        assert run["training_s"] > 0 and run["ratio_to_one_member_alone"] == pytest.approx(
            run["training_s_per_gang_step"] / steps["alone"]["training_s_per_gang_step"]), key
        assert f"members' training per gang step, {key}, x one member alone" in table
    # The study's decode in the model's own weights and in the bf16 copy, each at G = 1 and 2.
    study_decode = record["study_decode"]
    measured = {(r["dtype"], r["gang_size"]) for r in study_decode["results"] if "error" not in r}
    assert measured == {(None, 1), (None, 2), ("bfloat16", 1), ("bfloat16", 2)}, study_decode["results"]
    assert study_decode["rows_per_trial"] == 4 and study_decode["new_tokens"] == 8
    assert "study decode, bf16 copy, 2 trials x 4 rows" in table
    # The big gang (here 4 configs at G=4, batched) against plain TRL's 4 configs of the gangs part, scaled.
    big = record["big_gang"]
    assert big["plain_wall_s_given"] and big["plain_wall_s"] == pytest.approx(gangs["plain_wall_s"])
    assert set(big["runs"]) == {"G4-batched"} and big["runs"]["G4-batched"]["ratio_wall"] > 0
    assert "full study in gangs of 4, batched, wall ratio to plain TRL (each run)" in table
    # Decoding: the batched backend per iteration at each G, model.generate, and greedy agreement with it.
    decoded = {(r["what"], r.get("gang_size")) for r in record["decode"]["results"]}
    assert {("batched", 1), ("batched", 2), ("generate", 1), ("agreement", None)} <= decoded
    agreement = next(r for r in record["decode"]["results"] if r["what"] == "agreement")
    assert agreement["tokens_equal_before_first_difference"] == [64] * 4


def test_gpu_benchmark_default_run_is_the_study_decode_the_study_and_the_steps_and_parts_are_checked():
    sys.path.insert(0, str(REPO / "bench"))
    try:
        import gpu
    finally:
        sys.path.remove(str(REPO / "bench"))
    default = gpu.parse_args([])
    assert default.only == ["study_decode", "gangs", "steps"]
    assert default.gang_training == ("sequential", "batched") and default.big_gang_training == ("batched",)
    assert gpu.parse_args(["--only", "all"]).only == list(gpu.PARTS)
    with pytest.raises(SystemExit):
        gpu.parse_args(["--only", "decode,nonsense"])
    with pytest.raises(SystemExit):
        gpu.parse_args(["--gang-training", "sequential,fused"])
    with pytest.raises(SystemExit):
        gpu.parse_args(["--big-gang", "1"])


def test_gpu_benchmark_measures_what_the_machine_can_run_unless_told():
    sys.path.insert(0, str(REPO / "bench"))
    try:
        import gpu
    finally:
        sys.path.remove(str(REPO / "bench"))
    plain = gpu.parse_args([])
    assert gpu.default_counts(plain, gpu.GPU, gpus=1, has_ray=True) == ([], [1])  # 2 per trial needs 2 GPUs
    assert gpu.default_counts(plain, gpu.GPU, gpus=2, has_ray=False) == ([2], [])
    assert gpu.default_counts(gpu.parse_args(["--dry-run"]), gpu.DRY, gpus=0, has_ray=True) == ([], [])
    assert gpu.default_counts(gpu.parse_args(["--data-parallel", "none", "--ray", "none"]), gpu.GPU, 4, True) == ([], [])
    with pytest.raises(SystemExit, match="this machine has 1 GPU"):
        gpu.default_counts(gpu.parse_args(["--data-parallel", "2"]), gpu.GPU, gpus=1, has_ray=True)
    with pytest.raises(SystemExit):
        gpu.parse_args(["--data-parallel", "1"])  # one device per trial is the reference, always run


def test_big_gang_learning_rates_are_each_configs_own_between_the_benchmarks_extremes():
    sys.path.insert(0, str(REPO / "bench"))
    try:
        import gpu
    finally:
        sys.path.remove(str(REPO / "bench"))
    rates = gpu.big_gang_learning_rates(gpu.GPU, 16)
    assert len(set(rates)) == 16 and rates == tuple(sorted(rates))
    assert rates[0] == pytest.approx(min(gpu.GPU.learning_rates)) and rates[-1] == pytest.approx(
        max(gpu.GPU.learning_rates))


def test_a_gang_side_that_fails_is_recorded_and_the_other_sides_and_plain_trl_still_run(monkeypatch, tmp_path):
    sys.path.insert(0, str(REPO / "bench"))
    try:
        import gang as gang_bench
        import gpu
    finally:
        sys.path.remove(str(REPO / "bench"))

    def run_gang_study(setup, out_dir, size, prompt_tokens, training="sequential"):
        if training == "batched":
            raise RuntimeError("CUDA error: out of memory")
        return {"wall_s": 5.0, "parts_s": {"rollout_decode": 1.0}, "peak_bytes": None, "estimate_bytes": None}

    monkeypatch.setattr(gang_bench, "run_gang_study", run_gang_study)
    monkeypatch.setattr(gang_bench, "run_plain_side", lambda setup, out_dir: {"wall_s": 20.0, "evaluation_s": 2.0})
    monkeypatch.setattr(gpu, "_prompt_tokens", lambda setup: 10)
    record = gpu.measure_gangs(None, tmp_path, [4], 2, modes=("sequential", "batched"))
    assert [r["ratio_wall"] for r in record["runs"]["G4"]] == [0.25, 0.25]
    assert [r["error"] for r in record["runs"]["G4-batched"]] == ["RuntimeError: CUDA error: out of memory"] * 2
    assert record["plain_wall_s"] == 20.0 and record["median_ratio_wall"] == {"G4": 0.25}
    rows = dict(gpu._gang_rows("G4-batched", record["runs"]["G4-batched"], None))
    assert rows["  gangs of 4, batched: a run"].startswith("FAILED: RuntimeError: CUDA error: out of memory")
