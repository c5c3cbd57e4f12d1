"""End to end: real GRPO on the tiny model, trials that cannot learn pruned at the first rung (and the same study on
scripted runners, whose trials with a learning rate of 0 cannot learn either, in the fast tier).

Four configurations of the tiny model, trained round-robin by `Study.optimize` over 3 chunks:
two cannot learn (``learning_rate=0.0``: their weights never move, so every evaluation gives the
same value) and two can (learning rates 0.05 and 0.1). Trial numbers 0 and 2 are the non-learners,
1 and 3 the learners, so neither kind reports first.

Why this setup is reliable (measured on this machine over 11 training seeds; the test uses 7):

- ``reward_len`` from the testkit cannot be the contrast: the random tiny model almost never
  emits its end token, so nearly every completion is already 8 characters long and scores 1.0
  before any training. ``reward_lowercase`` below (the fraction of lowercase letters) starts at
  about 0.22 and has variance within a GRPO group, so GRPO has something to learn.
- Full fine-tuning, not LoRA: the tiny model ties its LM head to the input embeddings and ends
  in an RMSNorm, so a LoRA on the linear layers can rotate the last hidden state but cannot make
  the output distribution sharper; under sampling its reward barely moves. Full fine-tuning can.
- Evaluation samples (``EvalSettings(temperature=1.0)``, fixed seed) on 32 prompts: greedy decoding
  of the random model flips between degenerate outputs from one step to the next, so greedy
  values were a lottery at these learning rates; the sampled value rises steadily.
- One chunk is 4 optimizer steps of 4 prompts x 4 completions at a constant learning rate. After
  it, the value at step 0 was at least 0.38 for lr 0.05 (seeds 1-5 and 7-12) and at least 0.60
  for lr 0.1 (seeds 7-12), against 0.221 for lr=0 (seed 7 with 2 torch threads: the same values).

So the evidence is there at step 0, the first step any pruner can judge, and the two pruners are
set so that they may judge there: ``MedianPruner(n_startup_trials=3)`` (each trial has 3 peers at
step 0; the default 5 would never be met with 4 trials) and
``SuccessiveHalvingPruner(min_resource=1, reduction_factor=2)`` (first rung after 1 chunk, i.e.
step 0). Both prune the non-learners at step 0.

A module fixture runs torch on one thread: the tiny model gains nothing from two, and on a shared
machine two OpenMP threads spin against other processes (a unit took 10x longer under load).
"""

from __future__ import annotations

import string

import optuna
import pytest
from optuna.trial import TrialState

import rfopt
from rfopt.pruning import decision_key, load_decision
from rfopt_testkit import grpo_config, prompts_dataset
from rfopt.storage.schema import trial_attrs

optuna.logging.set_verbosity(optuna.logging.WARNING)

LEARNING_RATES = (0.0, 0.05, 0.0, 0.1)
NON_LEARNERS = (0, 2)
LEARNERS = (1, 3)
NUM_CHUNKS = 3


def reward_lowercase(completions, **kwargs):
    """Fraction of lowercase letters in the completion: about 0.22 for the untrained tiny model."""
    texts = [c[0]["content"] if isinstance(c, list) else c for c in completions]
    return [sum(ch in string.ascii_lowercase for ch in t) / max(1, len(t)) for t in texts]


@pytest.fixture(scope="module", autouse=True)
def one_torch_thread():
    import torch

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def configs(model_path) -> list[rfopt.TrialConfig]:
    return [
        rfopt.TrialConfig(
            model=str(model_path),
            reward_funcs=[reward_lowercase],
            args=grpo_config(
                learning_rate=lr,
                lr_scheduler_type="constant",
                per_device_train_batch_size=16,  # 4 prompts x num_generations=4 per step
                max_completion_length=8,
            ),
            peft_config=None,  # full fine-tuning: see the module docstring
        )
        for lr in LEARNING_RATES
    ]


def run_study(tiny_model, storage: str, tmp_path, pruner: optuna.pruners.BasePruner):
    study = rfopt.create_study(
        study_name="e2e", storage=storage, pruner=pruner, checkpoint_dir=tmp_path / "ck"
    )
    units: list[tuple[int, int]] = []
    study.optimize(
        configs(tiny_model),
        prompts_dataset(16 * NUM_CHUNKS),  # 16 prompts a chunk: 4 steps of 4 prompts
        prompts_dataset(32, prefix="E"),
        num_chunks=NUM_CHUNKS,
        eval_settings=rfopt.EvalSettings(temperature=1.0),
        show_progress_bar=False,
        on_unit=lambda number, step, value: units.append((number, step)),
    )
    # Read everything back from storage, as the dashboard or another process would.
    trials = optuna.load_study(study_name="e2e", storage=storage).trials
    assert [t.params["learning_rate"] for t in trials] == list(LEARNING_RATES)
    value0 = {t.number: t.intermediate_values[0] for t in trials}
    # Precondition, not the behaviour under test: if this fails, the learners did not learn
    # (a change in TRL or torch?) and the pruning assertions below would mean nothing.
    assert value0[0] == value0[2] < min(value0[1], value0[3]), value0
    return trials, units


def test_median_pruner_stops_the_non_learners_at_step_0_and_keeps_the_learners(
        scripted_or_trl, tiny_model, storage, tmp_path):
    """MedianPruner(n_startup_trials=3), 4 trials, 3 chunks.

    Step 0: a non-learner's value (0.221) is below the median of its 3 peers' values at step 0
    (the other non-learner's 0.221 and the two learners'), which is the lower learner's value:
    pruned. A learner's value is above the median of its peers, which is 0.221: kept. Step 1:
    only the two learners reached it, 1 peer each, fewer than n_startup_trials=3: kept. Step 2 is
    the last chunk: the learners are told COMPLETE, and no decision is stored for it.
    """
    pruner = optuna.pruners.MedianPruner(n_startup_trials=3)
    trials, units = run_study(tiny_model, storage, tmp_path, pruner)

    # The non-learners trained one chunk and stopped; the learners ran all 3.
    learner_units = [(n, s) for n in LEARNERS for s in (1, 2)]
    assert sorted(units) == sorted([(n, 0) for n in range(4)] + learner_units)
    for n in NON_LEARNERS:
        assert trials[n].state == TrialState.PRUNED
        assert sorted(trials[n].intermediate_values) == [0]
        d = load_decision(trials[n], 0)
        assert d.prune and d.pruner == "MedianPruner"
        assert d.peers == tuple(m for m in range(4) if m != n)
        lower_learner = min(trials[m].intermediate_values[0] for m in LEARNERS)
        assert d.reason == (
            f"best value {trials[n].intermediate_values[0]:.4g} up to chunk 1 is below the median "
            f"{lower_learner:.4g} of 3 peers at chunk 1"
        )
    for n in LEARNERS:
        assert trials[n].state == TrialState.COMPLETE
        assert trials[n].value == trials[n].intermediate_values[2]
        d0 = load_decision(trials[n], 0)
        assert not d0.prune
        own = trials[n].intermediate_values[0]
        assert d0.reason.startswith(f"kept: best value {own:.4g} up to chunk 1")
        lr0 = trials[NON_LEARNERS[0]].intermediate_values[0]
        assert d0.reason.endswith(f"is not below the median {lr0:.4g} of 3 peers at chunk 1")
        assert trial_attrs(trials[n])[decision_key(1)] == {
            "prune": False,
            "reason": "kept: 1 peer reached chunk 2; n_startup_trials=3 needs that many",
            "peers": [m for m in LEARNERS if m != n],
            "pruner": "MedianPruner",
        }
        # Step 2 is the trial's last chunk: the trial is told COMPLETE, and nothing is judged.
        assert decision_key(2) not in trials[n].user_attrs

    # What a TPE sampler makes of this study (see /tmp/pruning_readme.md, "What samplers see"):
    # the COMPLETE learners rank before the PRUNED non-learners, whatever their values.
    from optuna.samplers._tpe.sampler import _split_trials

    study = optuna.load_study(study_name="e2e", storage=storage)
    below, above = _split_trials(study, study.trials, n_below=2)
    assert [t.number for t in below] == list(LEARNERS)
    assert [t.number for t in above] == list(NON_LEARNERS)


def test_successive_halving_stops_the_non_learners_at_rung_0_then_halves_the_learners(
        scripted_or_trl, tiny_model, storage, tmp_path):
    """SuccessiveHalvingPruner(min_resource=1, reduction_factor=2), 4 trials, 3 chunks.

    Rungs come after 1 and 2 chunks (steps 0 and 1); the next would come after 4, past the
    plan, and the last chunk (step 2) is the end of the budget, not a rung. Step 0: the 4 trials
    are ranked and the top ceil(4/2)=2 kept: the learners, which are above 0.221; the
    non-learners rank 3 and 4 (tied at 0.221: the lower trial number ranks first) and are
    pruned. Step 1: the 2 learners are ranked and the top 1 kept: successive halving halves the
    learners too; the one with the lower value at step 1 stops, the other runs to the end.
    """
    trials, units = run_study(
        tiny_model,
        storage,
        tmp_path,
        optuna.pruners.SuccessiveHalvingPruner(min_resource=1, reduction_factor=2),
    )

    for n, rank in zip(NON_LEARNERS, (3, 4)):
        assert trials[n].state == TrialState.PRUNED
        assert sorted(trials[n].intermediate_values) == [0]
        assert trial_attrs(trials[n])[decision_key(0)] == {
            "prune": True,
            "reason": f"rank {rank} of 4 at rung 0 (chunk 1; keeps top 2)",
            "peers": [m for m in range(4) if m != n],
            "pruner": "SuccessiveHalvingPruner",
        }
    at_1 = {n: trials[n].intermediate_values[1] for n in LEARNERS}
    winner, loser = sorted(LEARNERS, key=lambda n: (-at_1[n], n))
    for n in LEARNERS:
        d0 = load_decision(trials[n], 0)
        assert not d0.prune
        assert d0.reason.startswith("kept: rank ") and "of 4 at rung 0" in d0.reason
    kept = "rank 1 of 2 at rung 1 (chunk 2; keeps top 1)"
    assert load_decision(trials[winner], 1).reason == f"kept: {kept}"
    assert load_decision(trials[loser], 1).reason == "rank 2 of 2 at rung 1 (chunk 2; keeps top 1)"
    assert trials[loser].state == TrialState.PRUNED
    assert sorted(trials[loser].intermediate_values) == [0, 1]
    assert trials[winner].state == TrialState.COMPLETE
    assert decision_key(2) not in trials[winner].user_attrs  # its last chunk: COMPLETE, not judged
    # 4 + 2 + 1 chunk units instead of 4 x 3: pruned trials train no further.
    assert sorted(units) == sorted(
        [(n, 0) for n in range(4)] + [(n, 1) for n in LEARNERS] + [(winner, 2)]
    )
