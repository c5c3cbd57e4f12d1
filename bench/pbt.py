"""Population-based training against successive halving and exhaustive training (issue 15).

On the tiny-model sweeps of ``bench/pruning.py`` (``collapse`` and ``steady``: 12 GRPO learning-rate configs,
full fine-tuning, 8 chunks, sampled evaluation on 32 prompts), for each seed:

(a) EXHAUSTIVE, for real: every config trained to the end (``NopPruner``); the best final value is the target.
(b) SUCCESSIVE HALVING, replayed by ``rfopt.pruning.decide`` on the curves of (a), exactly as ``bench/pruning.py``
    does (its replay matches a real SHA study); its winner's final value is read from (a).
(c) PBT, for real: the same 12 configs as the initial population (``max_concurrent=12``) with
    ``rfopt.PopulationBasedTraining(...)`` as the pruner; its result is the best final value of a COMPLETE trial
    (an initial member or a clone).
(d) PBT with ``explore="sampler"`` (the study's TPE sampler proposes the clones' values), for real.

Compute is counted in chunk units (one chunk of training plus its evaluation), as in bench/pruning.py: (a) trains
12 x 8 = 96 per seed.

PBT settings (the same for every seed; ``seed=`` the seed):

- ``collapse``: ``PopulationBasedTraining(interval=2, quantile=0.25, seed=s)``: every 2 chunks the bottom 3 of 12
  are replaced by warm clones of the top 3 with learning_rate x0.8 / x1.25 (or resampled with p=0.25 within the
  list's range) and lr_scheduler_type resampled with p=0.25. Compute: 96, the same as (a) by construction.
- ``steady``: the same with ``max_units=48`` (half of (a)): the budget stops the bottom without a replacement
  after chunks 2, 4 and 6, leaving 6, then 4, then 2 (24 + 6 x 2 + 4 x 2 + 2 x 2 = 48); at each of these steps the
  bottom 1 of those left is replaced by a clone of their top 1.

    python bench/pbt.py --sweep collapse --threads 1          # 10 seeds, tens of minutes on a busy 2-core machine
    python bench/pbt.py --sweep steady --threads 1
    python bench/pbt.py --sweep collapse --seeds 2 --no-sampler

Results go to ``/tmp/rfopt-bench/pbt-<sweep>.json`` (``--out``), written after every seed; ``--table-only``
prints the table of a saved file.
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "bench"))

import optuna
import pruning as sweeps


@dataclass
class PbtRun:
    best: float
    best_trial: int
    best_lineage: str
    units: int
    clones: int
    wall_s: float


@dataclass
class SeedResult:
    seed: int
    order: list[str]
    full_curves: dict[str, list[float]]
    full_units: int
    full_wall_s: float
    sha_winner: str
    sha_units: int
    pbt: PbtRun
    sampler: PbtRun | None


def pbt_pruner(sweep: str, seed: int, explore: str) -> Any:
    import rfopt

    budget = 48 if sweep == "steady" else None
    return rfopt.PopulationBasedTraining(interval=2, quantile=0.25, seed=seed, explore=explore, max_units=budget)


def lineage_of(study: Any, number: int, order: list[str]) -> str:
    """``lr=0.02 const <- #3 (lr 0.02 -> 0.016)``: the best trial's ancestry back to an initial config."""
    from rfopt.storage.schema import TrialRecord

    trials = study.optuna.get_trials(deepcopy=False)
    steps = []
    while True:
        lineage = TrialRecord(trials[number]).lineage
        if lineage is None:
            return " <- ".join([order[number], *reversed(steps)])
        changed = ", ".join(f"{k}={v:.3g}" if isinstance(v, float) else f"{k}={v}"
                            for k, v in lineage.overrides.items())
        steps.append(f"@{lineage.start_unit}" + (f" {changed}" if changed else ""))
        number = lineage.parent


def train_pbt(model_path: Path, seed: int, order: list[str], args: argparse.Namespace, workdir: Path,
              explore: str) -> PbtRun:
    from rfopt_testkit import prompts_dataset

    import rfopt

    name = f"pbt-{explore}"
    sampler = optuna.samplers.TPESampler(seed=seed) if explore == "sampler" else None
    study = rfopt.create_study(study_name=name, storage=f"sqlite:///{workdir / name}.db",
                               pruner=pbt_pruner(args.sweep, seed, explore), sampler=sampler,
                               checkpoint_dir=workdir / f"{name}-ck")
    units = [0]
    wall = time.perf_counter()
    study.optimize(
        sweeps.make_configs(model_path, seed, order, args.sweep),
        prompts_dataset(args.chunks * args.rows_per_chunk),
        prompts_dataset(args.eval_prompts, prefix="E"),
        num_chunks=args.chunks, chunk_seed=seed, max_concurrent=len(order),
        eval_settings=rfopt.EvalSettings(temperature=1.0), show_progress_bar=False,
        on_unit=lambda number, step, value: units.__setitem__(0, units[0] + 1),
    )
    wall = time.perf_counter() - wall
    best = study.optuna.best_trial
    clones = sum(1 for t in study.optuna.get_trials(deepcopy=False) if t.number >= len(order))
    return PbtRun(best=best.value, best_trial=best.number, best_lineage=lineage_of(study, best.number, order),
                  units=units[0], clones=clones, wall_s=wall)


def run_seed(seed: int, args: argparse.Namespace, model_path: Path) -> SeedResult:
    order = [label for label, _ in sweeps.SWEEPS[args.sweep]]
    random.Random(seed).shuffle(order)
    with tempfile.TemporaryDirectory(prefix="rfopt-bench-pbt-") as tmp:
        work = Path(tmp)
        full = sweeps.train(model_path, seed, order, optuna.pruners.NopPruner(), args, work, "full")
        pbt = train_pbt(model_path, seed, order, args, work, "perturb")
        sampler = None if args.no_sampler else train_pbt(model_path, seed, order, args, work, "sampler")
    _, sha_units, sha_winner = sweeps.replay(full.curves, order, seed, sweeps.sha_pruner(args))
    return SeedResult(seed=seed, order=order, full_curves=full.curves, full_units=full.units, full_wall_s=full.wall_s,
                      sha_winner=sha_winner, sha_units=sha_units, pbt=pbt, sampler=sampler)


def print_table(results: list[SeedResult], sweep: str) -> None:
    print(f"\nsweep {sweep!r}: 12 configs x 8 chunks; PBT: {pbt_pruner(sweep, 0, 'perturb')!r} (seed = the seed)")
    print("best: the best final value each method found (exhaustive: the true best; SHA: its winner's final value in "
          "the exhaustive run); units: chunk units trained")
    head = (f"{'seed':>4} {'exhaustive':>10} {'units':>5}  {'SHA':>6} {'units':>5}  {'PBT':>6} {'units':>5} "
            f"{'>=exh':>5} {'>=SHA':>5}")
    sampler = any(r.sampler is not None for r in results)
    if sampler:
        head += f"  {'PBT-TPE':>7} {'units':>5} {'>=exh':>5} {'>=SHA':>5}"
    print(head + "  PBT's best trial: lineage")
    counts = {"pbt_exh": 0, "pbt_sha": 0, "tpe_exh": 0, "tpe_sha": 0}
    for r in results:
        exh = max(c[-1] for c in r.full_curves.values())
        sha = r.full_curves[r.sha_winner][-1]
        line = (f"{r.seed:>4} {exh:>10.3f} {r.full_units:>5}  {sha:>6.3f} {r.sha_units:>5}  {r.pbt.best:>6.3f} "
                f"{r.pbt.units:>5} {_yes(_at_least(r.pbt.best, exh)):>5} {_yes(_at_least(r.pbt.best, sha)):>5}")
        counts["pbt_exh"] += _at_least(r.pbt.best, exh)
        counts["pbt_sha"] += _at_least(r.pbt.best, sha)
        if sampler:
            s = r.sampler
            line += f"  {s.best:>7.3f} {s.units:>5} {_yes(_at_least(s.best, exh)):>5} {_yes(_at_least(s.best, sha)):>5}"
            counts["tpe_exh"] += _at_least(s.best, exh)
            counts["tpe_sha"] += _at_least(s.best, sha)
        print(line + f"  #{r.pbt.best_trial}: {r.pbt.best_lineage}")
    n = len(results)
    total = sum(r.full_units for r in results)
    above = sum(r.pbt.best > max(c[-1] for c in r.full_curves.values()) + TIE for r in results)
    print(f"PBT (perturb): >= exhaustive best in {counts['pbt_exh']} of {n} seeds (above it, by a clone whose values "
          f"changed mid-run, in {above}), >= SHA's winner in "
          f"{counts['pbt_sha']} of {n}; compute {sum(r.pbt.units for r in results) / total:.3f} of exhaustive "
          f"(SHA {sum(r.sha_units for r in results) / total:.3f}); mean best: exhaustive "
          f"{_mean(max(c[-1] for c in r.full_curves.values()) for r in results):.3f}, SHA "
          f"{_mean(r.full_curves[r.sha_winner][-1] for r in results):.3f}, PBT {_mean(r.pbt.best for r in results):.3f}")
    if sampler:
        done = [r for r in results if r.sampler is not None]
        print(f"PBT (sampler, TPE): >= exhaustive best in {counts['tpe_exh']} of {len(done)} seeds, >= SHA's winner "
              f"in {counts['tpe_sha']} of {len(done)}; compute "
              f"{sum(r.sampler.units for r in done) / sum(r.full_units for r in done):.3f} of exhaustive; mean best "
              f"{_mean(r.sampler.best for r in done):.3f}")
    print(f"wall: exhaustive {sum(r.full_wall_s for r in results):.0f} s, PBT {sum(r.pbt.wall_s for r in results):.0f} s"
          + (f", PBT-TPE {sum(r.sampler.wall_s for r in results if r.sampler):.0f} s" if sampler else ""))


# Values are means over the eval prompts' sampled completions: two runs that score the same can differ by the order
# of a float sum (0.7562500000000004 against ...03). Below this, a value counts as equal.
TIE = 1e-9


def _at_least(value: float, target: float) -> bool:
    return value >= target - TIE


def _yes(ok: bool) -> str:
    return "yes" if ok else "no"


def _mean(values: Any) -> float:
    values = list(values)
    return sum(values) / len(values)


def load_results(data: dict[str, Any]) -> list[SeedResult]:
    return [SeedResult(**{**r, "pbt": PbtRun(**r["pbt"]), "sampler": PbtRun(**r["sampler"]) if r["sampler"] else None})
            for r in data["results"]]


SETTINGS = ("sweep", "no_sampler", "chunks", "rows_per_chunk", "eval_prompts", "min_resource", "reduction_factor")


def resumed(out: Path, args: argparse.Namespace) -> list[SeedResult]:
    """The seeds 0..k-1 already in ``out``, if they were run with the same settings; a clear error otherwise."""
    if not out.exists():
        return []
    data = json.loads(out.read_text())
    differ = [k for k in SETTINGS if data["args"].get(k) != getattr(args, k)]
    if differ:
        sys.exit(f"--resume: {out} was run with other settings ({', '.join(differ)}); pass another --out")
    results = load_results(data)[: args.seeds]
    print(f"resuming: seeds {[r.seed for r in results]} from {out}", flush=True)
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sweep", choices=sorted(sweeps.SWEEPS), default="collapse")
    parser.add_argument("--seeds", type=int, default=10, help="seeds 0..N-1")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--no-sampler", action="store_true", help="skip PBT with explore='sampler'")
    parser.add_argument("--table-only", action="store_true", help="print the table of the results in --out")
    parser.add_argument("--resume", action="store_true",
                        help="keep the seeds already in --out (run with the same settings) and run only the rest")
    parser.add_argument("--out", help="default: /tmp/rfopt-bench/pbt-<sweep>.json")
    args = parser.parse_args()
    # bench/pruning.py's fixed settings: 8 chunks of 8 prompts, 32 eval prompts, SHA(min_resource=1, eta=2).
    args.chunks, args.rows_per_chunk, args.eval_prompts, args.min_resource, args.reduction_factor = 8, 8, 32, 1, 2
    out = Path(args.out or f"/tmp/rfopt-bench/pbt-{args.sweep}.json")
    if args.table_only:
        data = json.loads(out.read_text())
        print_table(load_results(data), data["args"]["sweep"])
        return
    import torch

    from rfopt.tiny import build_tiny_model

    torch.set_num_threads(args.threads)
    model_path = build_tiny_model(Path(tempfile.gettempdir()) / "rfopt-bench-tiny")
    results = resumed(out, args) if args.resume else []
    out.parent.mkdir(parents=True, exist_ok=True)
    for seed in range(len(results), args.seeds):
        started = time.perf_counter()
        results.append(run_seed(seed, args, model_path))
        print(f"seed {seed} done in {time.perf_counter() - started:.0f} s", flush=True)
        out.write_text(json.dumps({"args": vars(args), "results": [asdict(r) for r in results]}, indent=1))
    print_table(results, args.sweep)
    print(f"written: {out}")


if __name__ == "__main__":
    main()
