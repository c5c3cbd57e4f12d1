"""Successive halving under rfopt against training every configuration to the end (issue 3).

For each seed, a sweep of 12 GRPO configurations of the tiny model (`rfopt.tiny`) is trained

(a) ALL TO THE END, for real: ``rfopt.create_study(..., pruner=NopPruner())`` and
    ``study.optimize(configs, ...)``; every trial's value after every chunk is recorded. The best
    final value names the true winner.
(b) WITH SUCCESSIVE HALVING, for real: the same configs, seeds and chunk plan in a second study
    with ``SuccessiveHalvingPruner(min_resource=1, reduction_factor=2)``; the engine prunes at
    rungs (rfopt.pruning), and its winner is the best COMPLETE trial.
(c) REPLAYED: the SHA decisions made again by ``rfopt.pruning.decide`` on the curves recorded in
    (a), in a synthetic in-memory Optuna study (all trials asked up front; each step, every live
    trial reports its recorded value, in an order shuffled by the seed; then ``decide``; pruned
    trials are told PRUNED). No training. With ``--replay-only`` only (c) runs, on curves saved by
    an earlier run; otherwise the script checks that (c) made exactly the decisions (b) made and
    that the trials (b) kept have the same curves as in (a) (chunked training is exact on the CPU).

Compute is counted in chunk units (one chunk of training plus its evaluation): (b) trains
``sum over trials of chunks trained`` units, (a) ``12 x chunks``. Wall time of (a) and (b) is
printed too (it includes model loading, evaluation, checkpoints and SQLite).

What a seed changes: the GRPO training seed of every config (sampling of completions), the chunk
plan (which prompts are in which chunk, ``chunk_seed``) and the order in which the configs become
trials (trial numbers, hence SHA's tie-breaks). So every seed has its own curves, its own true
ranking and possibly its own winner. The evaluation set and its sampling seed stay the same.

Both sweeps: full fine-tuning of the tiny model (a LoRA cannot sharpen its sampled output; see
tests/pruning/test_pruning_e2e.py), reward ``reward_vowel_variety`` (distinct lowercase vowels in 8
characters, / 5), sampled evaluation (temperature 1) on 32 prompts, 8 chunks of 2 optimizer steps
of 4 prompts x 4 completions, 12 configs live at once (``max_concurrent=12``).

``--sweep collapse`` (default): learning rates 0.005 to 0.3, constant or linearly decaying. Large
ones lead early, then collapse onto one or two vowels (a variety of 0.2-0.4); the best config is
usually lr=0.02 constant, which starts slowly: a hard case for any early stopping.
``--sweep steady``: learning rates 0.002 to 0.015, below the collapse: faster is better from
start to end, up to evaluation noise in the first chunks.

After the main table, other pruner settings are judged by replay (c) alone on the same curves.

    python bench/pruning.py                  # 10 seeds, (a) + (b) + (c): 15-25 min on 2 busy cores
    python bench/pruning.py --sweep steady
    python bench/pruning.py --seeds 2 --show-curves
    python bench/pruning.py --replay-only    # (c) only, on the curves saved by the last run
    python bench/pruning.py --replay-only --sweep steady
    python bench/pruning.py --curves bench/curves-smollm2-arithmetic.json   # real SmolLM2 curves (issue 15)

Results go to ``/tmp/rfopt-bench/pruning-<sweep>.json`` (``--out``); ``--replay-only`` reads it.
``--curves PATH`` replays on curves recorded elsewhere in the same layout, every seed the file holds: the
SmolLM2-135M-Instruct sweep in ``bench/curves-smollm2-arithmetic.json`` (``bench/record_smollm2.py``).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import resource
import sys
import tempfile
import time
import warnings
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
warnings.filterwarnings("ignore")

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tests"))  # rfopt_testkit: the test suite's GRPOConfig and prompts

import optuna  # noqa: E402
from optuna.trial import TrialState  # noqa: E402

from rfopt.pruning import decide  # noqa: E402

optuna.logging.set_verbosity(optuna.logging.WARNING)

def _sweep(rates: tuple[float, ...], schedules: tuple[str, ...]) -> list[tuple[str, dict]]:
    short = {"constant": "const", "linear": "linear"}
    return [(f"lr={lr:g} {short[s]}", {"learning_rate": lr, "lr_scheduler_type": s})
            for s in schedules for lr in rates]


#: (label, GRPOConfig overrides) per sweep. Labels name configs across seeds; trial numbers do not.
SWEEPS: dict[str, list[tuple[str, dict[str, Any]]]] = {
    # Learning rates up to 0.3: the large ones lead early, then collapse onto one or two vowels.
    "collapse": _sweep((0.005, 0.01, 0.02, 0.03, 0.05, 0.1, 0.3), ("constant",))
    + _sweep((0.02, 0.03, 0.05, 0.1, 0.3), ("linear",)),
    # Learning rates up to 0.015, below the collapse: faster is better for the whole budget.
    "steady": _sweep((0.002, 0.003, 0.005, 0.007, 0.01, 0.015), ("constant", "linear")),
}


def reward_vowel_variety(completions, **kwargs):
    """Distinct lowercase vowels in the completion, / 5: one repeated vowel scores only 0.2."""
    texts = [c[0]["content"] if isinstance(c, list) else c for c in completions]
    return [len({ch for ch in t if ch in "aeiou"}) / 5 for t in texts]


@dataclass
class Run:
    """One real study: what each config reported, and what it cost."""

    curves: dict[str, list[float]]
    states: dict[str, str]
    #: The config of ``study.best_trial`` (best COMPLETE value; Optuna picks among ties).
    best: str
    units: int
    wall_s: float
    cpu_s: float


@dataclass
class SeedResult:
    seed: int
    order: list[str]
    full: Run
    sha: Run | None
    replay_pruned_at: dict[str, int | None]
    replay_units: int
    winner_full: list[str]  # every config tied for the best final value
    winner_sha: str
    replay_matches_sha_run: bool | None = None
    sha_curves_match_full: bool | None = None
    notes: list[str] = field(default_factory=list)


# ---------------------------------------------------------------------- real training
def make_configs(model_path: Path, seed: int, order: list[str], sweep: str) -> list[Any]:
    from rfopt.config.trial import TrialConfig
    from rfopt_testkit import grpo_config

    specs = dict(SWEEPS[sweep])
    return [
        TrialConfig(
            model=str(model_path),
            reward_funcs=[reward_vowel_variety],
            args=grpo_config(
                per_device_train_batch_size=16,  # 4 prompts x 4 completions per step
                num_generations=4,
                max_completion_length=8,
                seed=seed,
                **specs[label],
            ),
            peft_config=None,
        )
        for label in order
    ]


def train(model_path: Path, seed: int, order: list[str], pruner: optuna.pruners.BasePruner,
          args: argparse.Namespace, workdir: Path, name: str) -> Run:
    import rfopt
    from rfopt_testkit import prompts_dataset

    study = rfopt.create_study(
        study_name=name, storage=f"sqlite:///{workdir / name}.db", pruner=pruner,
        checkpoint_dir=workdir / f"{name}-ck",
    )
    units = [0]
    wall, cpu = time.perf_counter(), _cpu()
    study.optimize(
        make_configs(model_path, seed, order, args.sweep),
        prompts_dataset(args.chunks * args.rows_per_chunk),
        prompts_dataset(args.eval_prompts, prefix="E"),
        num_chunks=args.chunks,
        chunk_seed=seed,
        max_concurrent=len(order),  # every config live at once: synchronous rungs
        eval_settings=rfopt.EvalSettings(temperature=1.0),
        show_progress_bar=False,
        on_unit=lambda number, step, value: units.__setitem__(0, units[0] + 1),
    )
    wall, cpu = time.perf_counter() - wall, _cpu() - cpu
    trials = study.optuna.get_trials(deepcopy=False)
    curves = {order[t.number]: [t.intermediate_values[s] for s in sorted(t.intermediate_values)]
              for t in trials}
    states = {order[t.number]: t.state.name for t in trials}
    best = order[study.optuna.best_trial.number]
    return Run(curves=curves, states=states, best=best, units=units[0], wall_s=wall, cpu_s=cpu)


def _cpu() -> float:
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


# ---------------------------------------------------------------------- replay
def replay(curves: dict[str, list[float]], order: list[str], seed: int,
           pruner: optuna.pruners.BasePruner) -> tuple[dict[str, int | None], int, str]:
    """SHA decisions by rfopt.pruning.decide on recorded curves: (pruned at step, units, winner)."""
    n_steps = len(next(iter(curves.values())))
    study = optuna.create_study(storage=optuna.storages.InMemoryStorage(), direction="maximize",
                                study_name=f"replay-{seed}")
    trials = [study.ask() for _ in order]  # trial number i is config order[i], as in the real run
    rng = random.Random(seed)
    live = list(range(len(order)))
    pruned_at: dict[str, int | None] = {label: None for label in order}
    units = 0
    for step in range(n_steps):
        rng.shuffle(live)  # report order does not matter to rung decisions; show it
        for number in live:
            trials[number].report(curves[order[number]][step], step)
            units += 1
        if step == n_steps - 1:
            break  # the engine finishes trials at their last chunk; nothing is judged there
        for d in decide(study, live, step, pruner, n_steps=n_steps):
            if d.prune:
                study.tell(d.trial_number, state=TrialState.PRUNED)
                pruned_at[order[d.trial_number]] = step
        live = [n for n in live if pruned_at[order[n]] is None]
    for number in live:
        study.tell(number, curves[order[number]][-1])
    return pruned_at, units, order[study.best_trial.number]


def pruned_at_of(run: Run) -> dict[str, int | None]:
    return {label: (len(c) - 1 if run.states[label] == "PRUNED" else None)
            for label, c in run.curves.items()}


def best_labels(curves: dict[str, list[float]]) -> list[str]:
    best = max(c[-1] for c in curves.values())
    return sorted(label for label, c in curves.items() if c[-1] == best)


# ---------------------------------------------------------------------- main
def sha_pruner(args: argparse.Namespace) -> optuna.pruners.SuccessiveHalvingPruner:
    return optuna.pruners.SuccessiveHalvingPruner(
        min_resource=args.min_resource, reduction_factor=args.reduction_factor
    )


def run_seed(seed: int, args: argparse.Namespace, model_path: Path | None,
             saved: dict[str, Any] | None) -> SeedResult:
    if saved is not None:
        order = saved["order"]
        full = Run(**saved["full"])
        sha = None
    else:
        order = [label for label, _ in SWEEPS[args.sweep]]
        random.Random(seed).shuffle(order)
        with tempfile.TemporaryDirectory(prefix="rfopt-bench-pruning-") as tmp:
            work = Path(tmp)
            full = train(model_path, seed, order, optuna.pruners.NopPruner(), args, work, "full")
            sha = None if args.no_sha_run else train(
                model_path, seed, order, sha_pruner(args), args, work, "sha")
    pruned_at, units, winner = replay(full.curves, order, seed, sha_pruner(args))
    result = SeedResult(
        seed=seed, order=order, full=full, sha=sha, replay_pruned_at=pruned_at,
        replay_units=units, winner_full=best_labels(full.curves),
        winner_sha=winner if sha is None else sha.best,
    )
    if sha is not None:
        result.replay_matches_sha_run = pruned_at == pruned_at_of(sha) and units == sha.units
        result.sha_curves_match_full = all(
            c == full.curves[label][: len(c)] for label, c in sha.curves.items())
    if len(result.winner_full) > 1:
        result.notes.append(f"seed {seed}: tie for the best final value: {result.winner_full}")
    return result


def rank_in_full(r: SeedResult, label: str) -> int:
    """1 + the number of configs with a strictly better final value in the full run."""
    final = r.full.curves[label][-1]
    return 1 + sum(c[-1] > final for c in r.full.curves.values())


def print_table(results: list[SeedResult], args: argparse.Namespace) -> None:
    n, chunks = len(results[0].order), args.chunks
    print(f"\nsweep {args.sweep!r}: {n} configs x {chunks} chunks of {args.rows_per_chunk} "
          "prompts; "
          f"SuccessiveHalvingPruner(min_resource={args.min_resource}, "
          f"reduction_factor={args.reduction_factor}); torch threads: {args.threads}")
    real_sha = any(r.sha is not None for r in results)
    print("units SHA and winner SHA: "
          + ("real SHA study (b)" if real_sha else "replay (c) on the recorded curves")
          + "; units all and winner full: real training of every config to the end (a)")
    print("rank: the SHA winner's place in the full run's final ranking; gap: best final value "
          "minus the SHA winner's final value, both from (a)")
    header = (f"{'seed':>4} {'units SHA':>9} {'units all':>9} {'fraction':>8}  "
              f"{'winner SHA':<22} {'winner full':<22} {'same?':<5} {'rank':>4} {'gap':>6}")
    if real_sha:
        header += f"  {'replay=real':<11} {'wall SHA s':>10} {'wall all s':>10}"
    print(header)
    for r in results:
        sha_units = r.sha.units if r.sha is not None else r.replay_units
        same = r.winner_sha in r.winner_full
        full_final = r.full.curves[r.winner_full[0]][-1]
        sha_final = r.full.curves[r.winner_sha][-1]
        line = (f"{r.seed:>4} {sha_units:>9} {r.full.units:>9} {sha_units / r.full.units:>8.3f}  "
                f"{r.winner_sha + f' {sha_final:.3f}':<22} "
                f"{r.winner_full[0] + f' {full_final:.3f}':<22} {'yes' if same else 'NO':<5} "
                f"{rank_in_full(r, r.winner_sha):>4} {full_final - sha_final:>6.3f}")
        if r.sha is not None:
            ok = r.replay_matches_sha_run and r.sha_curves_match_full
            line += f"  {'yes' if ok else 'NO':<11} {r.sha.wall_s:>10.1f} {r.full.wall_s:>10.1f}"
        print(line)
    units_sha = sum(r.sha.units if r.sha else r.replay_units for r in results)
    units_all = sum(r.full.units for r in results)
    same = sum(r.winner_sha in r.winner_full for r in results)
    print(f"total: {units_sha} / {units_all} units = {units_sha / units_all:.3f} of the compute; "
          f"same winner in {same} of {len(results)} seeds")
    if real_sha:
        wall_sha = sum(r.sha.wall_s for r in results if r.sha)
        wall_all = sum(r.full.wall_s for r in results)
        print(f"wall time: SHA {wall_sha:.0f} s, all to the end {wall_all:.0f} s "
              f"({wall_sha / wall_all:.3f}); CPU time: SHA "
              f"{sum(r.sha.cpu_s for r in results if r.sha):.0f} s, all "
              f"{sum(r.full.cpu_s for r in results):.0f} s")
    for r in results:
        for note in r.notes:
            print("note:", note)
        if r.sha is not None and not (r.replay_matches_sha_run and r.sha_curves_match_full):
            print(f"seed {r.seed}: replay differs from the real SHA run: "
                  f"replay {r.replay_pruned_at} "
                  f"real {pruned_at_of(r.sha)}; curves match: {r.sha_curves_match_full}")


#: Other pruner settings, judged by replay (c) only on the same recorded curves.
SETTINGS: list[tuple[str, Any]] = [
    ("SHA min_resource=1 eta=2", lambda: optuna.pruners.SuccessiveHalvingPruner(
        min_resource=1, reduction_factor=2)),
    ("SHA min_resource=1 eta=3", lambda: optuna.pruners.SuccessiveHalvingPruner(
        min_resource=1, reduction_factor=3)),
    ("SHA min_resource=1 eta=4", lambda: optuna.pruners.SuccessiveHalvingPruner(
        min_resource=1, reduction_factor=4)),
    ("SHA min_resource=2 eta=2", lambda: optuna.pruners.SuccessiveHalvingPruner(
        min_resource=2, reduction_factor=2)),
    ("SHA min_resource=2 eta=4", lambda: optuna.pruners.SuccessiveHalvingPruner(
        min_resource=2, reduction_factor=4)),
    ("Median (defaults)", lambda: optuna.pruners.MedianPruner()),
    ("Median n_warmup_steps=2", lambda: optuna.pruners.MedianPruner(n_warmup_steps=2)),
    ("Percentile 25 n_startup=3", lambda: optuna.pruners.PercentilePruner(
        25.0, n_startup_trials=3)),
    ("Patient(Median) patience=1", lambda: optuna.pruners.PatientPruner(
        optuna.pruners.MedianPruner(), patience=1)),
    ("Nop (sanity)", lambda: optuna.pruners.NopPruner()),
]


def print_settings(results: list[SeedResult]) -> None:
    print("\nother pruner settings, REPLAYED (c) on the same recorded curves (no training):")
    print(f"{'pruner':<28} {'fraction':>8} {'same winner':>11} {'mean gap':>8} {'max gap':>8} "
          f"{'mean rank':>9}")
    for name, make in SETTINGS:
        units = same = 0
        gaps, ranks = [], []
        for r in results:
            _, u, winner = replay(r.full.curves, r.order, r.seed, make())
            units += u
            same += winner in r.winner_full
            gaps.append(r.full.curves[r.winner_full[0]][-1] - r.full.curves[winner][-1])
            ranks.append(rank_in_full(r, winner))
        total = sum(r.full.units for r in results)
        print(f"{name:<28} {units / total:>8.3f} {f'{same} of {len(results)}':>11} "
              f"{sum(gaps) / len(gaps):>8.3f} {max(gaps):>8.3f} {sum(ranks) / len(ranks):>9.1f}")


def print_curves(result: SeedResult) -> None:
    print(f"\nseed {result.seed}: values after each chunk (trained to the end, real); "
          "| marks where SHA pruned")
    for label in sorted(result.full.curves, key=lambda k: -result.full.curves[k][-1]):
        at = result.replay_pruned_at[label]
        curve = result.full.curves[label]
        values = [f"{v:.3f}" + ("|" if at == s else " ") for s, v in enumerate(curve)]
        print(f"  {label:<16} {' '.join(values)}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sweep", choices=sorted(SWEEPS), default="collapse")
    parser.add_argument("--seeds", type=int, default=10, help="seeds 0..N-1")
    parser.add_argument("--chunks", type=int, default=8)
    parser.add_argument("--rows-per-chunk", type=int, default=8, help="2 steps of 4 prompts")
    parser.add_argument("--eval-prompts", type=int, default=32)
    parser.add_argument("--min-resource", type=int, default=1)
    parser.add_argument("--reduction-factor", type=int, default=2)
    parser.add_argument("--threads", type=int, default=1,
                        help="torch threads; 1 is fastest for the tiny model on a shared machine")
    parser.add_argument("--no-sha-run", action="store_true",
                        help="skip the real SHA study (b); SHA figures come from the replay (c)")
    parser.add_argument("--replay-only", action="store_true",
                        help="no training: replay (c) on the curves an earlier run saved in --out")
    parser.add_argument("--show-curves", action="store_true")
    parser.add_argument("--out", help="default: /tmp/rfopt-bench/pruning-<sweep>.json")
    parser.add_argument("--curves", help="replay only, on every seed of this file (e.g. "
                        "bench/curves-smollm2-arithmetic.json); implies --replay-only")
    args = parser.parse_args()
    if args.curves:
        args.replay_only, args.out = True, args.curves

    out = Path(args.out or f"/tmp/rfopt-bench/pruning-{args.sweep}.json")
    saved: dict[int, Any] = {}
    model_path = None
    if args.replay_only:
        data = json.loads(out.read_text())
        saved = {r["seed"]: r for r in data["results"]}
        args.chunks = data["args"]["chunks"]
        args.rows_per_chunk = data["args"]["rows_per_chunk"]
        args.threads = data["args"]["threads"]
        args.sweep = data["args"].get("sweep", "collapse")
        if args.curves:
            args.seeds = len(saved)
            if "what" in data:
                print(f"curves: {data['what']}")
    else:
        import torch

        from rfopt.tiny import build_tiny_model

        torch.set_num_threads(args.threads)
        model_path = build_tiny_model(Path(tempfile.gettempdir()) / "rfopt-bench-tiny")
    results = []
    for seed in (sorted(saved) if args.curves else range(args.seeds)):
        if args.replay_only and seed not in saved:
            raise SystemExit(f"{out} has no curves for seed {seed}; run without --replay-only")
        started = time.perf_counter()
        result = run_seed(seed, args, model_path, saved.get(seed))
        results.append(result)
        if not args.replay_only:
            print(f"seed {seed} done in {time.perf_counter() - started:.0f} s", flush=True)
        if args.show_curves:
            print_curves(result)
    print_table(results, args)
    print_settings(results)
    if not args.replay_only:
        out.parent.mkdir(parents=True, exist_ok=True)
        data = {"args": vars(args), "results": [asdict(r) for r in results]}
        out.write_text(json.dumps(data, indent=1))
        print(f"written: {out}")


if __name__ == "__main__":
    main()
