"""Gangs: several trials trained in lockstep on one device, their rollouts decoded together by the batched backend
(the backends themselves: tests/training/test_rollouts.py).

What must hold: each trial samples from its own stream (its completions and its trained weights do not depend on who
shares its gang); a gang is deterministic; a failing member fails alone; and the study around it (pruning, ops, crash
and rerun) works as for trials trained one at a time."""

import json
import os

import optuna
import pytest
import torch
from peft import get_peft_model
from transformers import AutoModelForCausalLM, AutoTokenizer

import rfopt
from rfopt.storage import schema
from rfopt.chunks import ChunkPlan, trial_schedule
from rfopt.training.evaluation import EvalPrompts, evaluate_runners
from rfopt.training.gang import Gang, GangMember
from rfopt.training.models import ModelPool
from rfopt.training.rollouts import Sampling
from rfopt.training.runner import TrialRunner
from rfopt.engine.planning.scheduler import LiveTrial, next_gang
from rfopt_testkit import (lora_config, prompts_dataset, record_gang_modes, reward_len, reward_raises, reward_vowels,
                           trial_config)
from scripted_runner import ScriptedRunner


# ---------------------------------------------------------------------- gangs of runners
def _train(tiny_model, members, chunks=2, training="sequential", **grpo):
    """Train `members` ((trial number, learning rate, extra GRPO settings)) together for `chunks` chunks; their
    adapters' weights and per-chunk metrics."""
    dataset = prompts_dataset(8)
    plan = ChunkPlan.build(len(dataset), 2, seed=0)
    pool = ModelPool("cpu")
    runners = []
    for number, lr, extra in members:
        config = trial_config(tiny_model, learning_rate=lr, **{**grpo, **extra})
        runners.append(TrialRunner(number, config, plan, trial_schedule(plan, config.args), dataset, pool,
                                   "/tmp/rfopt-test-gang"))
    for runner in runners:
        runner.setup()
    backend = runners[0].rollout_backend("batched")
    metrics = {r.number: [] for r in runners}
    decodes = 0
    for _ in range(chunks):
        gang = Gang(backend, [GangMember(r) for r in runners], training)
        gang.train()
        decodes += gang.decodes
        for member in gang.members:
            assert member.error is None, member.error
            metrics[member.number].append({k: v for k, v in member.result.values.items() if "time" not in k})
    return {r.number: r.trainable_weights() for r in runners}, metrics, decodes


def _same(a, b):
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


@pytest.mark.slow
@pytest.mark.e2e
def test_a_trial_trains_the_same_alone_and_beside_any_partners(tiny_model):
    trio, trio_metrics, decodes = _train(tiny_model, [(0, 5e-3, {}), (1, 1e-2, {}), (2, 2e-3, {})])
    again, again_metrics, _ = _train(tiny_model, [(0, 5e-3, {}), (1, 1e-2, {}), (2, 2e-3, {})])
    alone, _, _ = _train(tiny_model, [(1, 1e-2, {})])
    others, _, _ = _train(tiny_model, [(1, 1e-2, {}), (7, 3e-2, {"temperature": 0.5, "max_completion_length": 5})])
    assert all(_same(trio[n], again[n]) for n in trio) and trio_metrics == again_metrics  # deterministic
    assert _same(trio[1], alone[1]) and _same(trio[1], others[1])
    assert not _same(trio[0], trio[1])  # the learning rates do differ
    # 2 chunks of 4 steps (one prompt x 4 completions a step), one generation per step: one batched decode per step
    # for the whole gang, not one per member.
    assert decodes == 8


@pytest.mark.slow
@pytest.mark.e2e
def test_gang_members_keep_their_own_gradient_accumulation_and_temperature(tiny_model):
    """Each trainer's accelerate gradient state, fused LM head (temperature) and RNG are its own while it runs."""
    mixed, _, _ = _train(tiny_model, [(0, 5e-3, {"gradient_accumulation_steps": 2, "temperature": 0.7}),
                                      (1, 1e-2, {"gradient_accumulation_steps": 1, "temperature": 1.2})], chunks=1,
                         per_device_train_batch_size=4)
    first, _, _ = _train(tiny_model, [(0, 5e-3, {"gradient_accumulation_steps": 2, "temperature": 0.7})], chunks=1,
                         per_device_train_batch_size=4)
    second, _, _ = _train(tiny_model, [(1, 1e-2, {"gradient_accumulation_steps": 1, "temperature": 1.2})], chunks=1,
                          per_device_train_batch_size=4)
    assert _same(mixed[0], first[0]) and _same(mixed[1], second[1])


@pytest.mark.slow
@pytest.mark.e2e
def test_a_gangs_evaluation_scores_each_member_as_its_own_evaluation_does(tiny_model):
    from rfopt.config.settings import EvalSettings
    from rfopt.training.evaluation import evaluate_members

    dataset = prompts_dataset(8)
    plan = ChunkPlan.build(len(dataset), 2, seed=0)
    pool = ModelPool("cpu")
    runners = []
    for number, lr in enumerate((5e-3, 3e-2, 1e-2)):
        config = trial_config(tiny_model, learning_rate=lr)
        runners.append(TrialRunner(number, config, plan, trial_schedule(plan, config.args), dataset, pool,
                                   "/tmp/rfopt-test-gang"))
    for runner in runners:
        runner.setup()
    backend = runners[0].rollout_backend("batched")
    Gang(backend, [GangMember(r) for r in runners]).train()  # the adapters differ after a chunk
    evals = prompts_dataset(5, "E")
    for settings in (EvalSettings(batch_size=2, num_samples=5), EvalSettings(temperature=0.8, batch_size=2)):
        together = evaluate_members(backend, runners[0].model, runners[0].tokenizer,
                                    [r.eval_member() for r in runners], evals, settings)
        for runner, result in zip(runners, together):
            alone = runner.evaluate(evals, settings)
            if settings.temperature == 0:  # greedy: the same completions, scores and samples
                assert result.metrics == alone.metrics and result.samples == alone.samples
            else:  # sampled from each member's own stream: scored the same way, on other draws
                assert result.metrics.keys() == alone.metrics.keys()


@pytest.mark.slow
@pytest.mark.e2e
def test_a_gang_samples_with_the_models_own_generation_config_and_its_evaluation_completes(tiny_model, tmp_path):
    """The model's ``generation_config`` fills what TRL's leaves unset, as plain TRL's ``generate`` fills it: here
    ``no_repeat_ngram_size=1``, which the batched sampler lacks, so the members' rollouts are decoded through
    ``generate`` (never dropped), and the gang's evaluation completes for every member."""
    from rfopt.config.settings import EvalSettings
    from rfopt_testkit import tiny_model_with_generation_config

    path = tiny_model_with_generation_config(tiny_model, tmp_path / "ngram", no_repeat_ngram_size=1)
    dataset = prompts_dataset(8)
    plan = ChunkPlan.build(len(dataset), 2, seed=0)
    pool = ModelPool("cpu")
    runners = []
    for number, lr in enumerate((5e-3, 2e-2)):
        config = trial_config(path, learning_rate=lr)
        runners.append(TrialRunner(number, config, plan, trial_schedule(plan, config.args), dataset, pool,
                                   "/tmp/rfopt-test-gang"))
        runners[-1].setup()
    backend = runners[0].rollout_backend("batched")
    rollouts = []
    generate = backend.generate
    backend.generate = lambda requests, **kw: rollouts.append((requests, generate(requests, **kw))) or rollouts[-1][1]
    gang = Gang(backend, [GangMember(r) for r in runners])
    gang.train()
    assert [m.error for m in gang.members] == [None, None]
    assert len(rollouts) == 4 and all(r.sampling is None for requests, _ in rollouts for r in requests)
    for requests, outs in rollouts:
        for request, out in zip(requests, outs):
            for prompt, completion in zip(request.prompt_ids, out.token_ids):  # no token twice
                assert len(set(prompt + completion)) == len(set(prompt)) + len(completion)
    backend.generate = generate
    results = evaluate_runners(backend, runners, prompts_dataset(3, "E"), EvalSettings())
    assert not any(isinstance(r, Exception) for r in results), results


@pytest.mark.slow
@pytest.mark.e2e
def test_an_evaluation_changes_nothing_in_the_state_a_checkpoint_stores(tiny_model):
    """The engine writes a unit's checkpoint from the state taken before its evaluation, while the evaluation runs
    (`rfopt.engine.running.unit._Staging`): an evaluation through either backend, sampling (the RNG drawn from),
    must leave that state (weights, optimizer, scheduler, counters, RNG states) exactly as it was."""
    from rfopt.config.settings import EvalSettings
    from rfopt.storage.state import to_tensors

    dataset = prompts_dataset(8)
    plan = ChunkPlan.build(len(dataset), 2, seed=0)
    pool = ModelPool("cpu")
    runners = []
    for number, lr in enumerate((5e-3, 2e-2)):
        config = trial_config(tiny_model, learning_rate=lr, beta=0.04, peft=lora_config(lora_dropout=0.1))
        runners.append(TrialRunner(number, config, plan, trial_schedule(plan, config.args), dataset, pool,
                                   "/tmp/rfopt-test-gang"))
        runners[-1].setup()
    Gang(runners[0].rollout_backend("batched"), [GangMember(r) for r in runners], training="batched").train()

    def stored(runner):
        tensors, meta = to_tensors(runner.state())
        return {key: value.clone() for key, value in tensors.items()}, json.dumps(meta, sort_keys=True)

    before = [stored(r) for r in runners]
    sampling = EvalSettings(temperature=1.0, num_samples=2)
    results = evaluate_runners(runners[0].rollout_backend("batched"), runners, prompts_dataset(3, "E"), sampling)
    for runner in runners:
        results += evaluate_runners(runner.rollout_backend("exact"), [runner], prompts_dataset(3, "E"), sampling)
    assert not any(isinstance(r, Exception) for r in results), results
    for (tensors, meta), (tensors_after, meta_after) in zip(before, [stored(r) for r in runners]):
        assert meta_after == meta
        assert tensors_after.keys() == tensors.keys()
        for key, value in tensors.items():
            assert torch.equal(tensors_after[key], value), key
    assert any(key.startswith("optimizer.") for key in before[0][0])  # the optimizer's tensors were compared too


@pytest.mark.e2e
def test_the_rollout_hook_gets_the_generation_batch_and_the_model_is_put_back(tiny_model):
    dataset = prompts_dataset(8)
    plan = ChunkPlan.build(len(dataset), 2, seed=0)
    pool = ModelPool("cpu")
    config = trial_config(tiny_model)
    runner = TrialRunner(0, config, plan, trial_schedule(plan, config.args), dataset, pool, "/tmp/rfopt-test-gang")
    runner.setup()
    backend = runner.rollout_backend("batched")
    seen = []
    generate = backend.generate
    backend.generate = lambda requests, **kw: seen.append([len(r.prompt_ids) for r in requests]) or generate(requests,
                                                                                                             **kw)
    model = backend.model
    base = model.get_base_model()
    Gang(backend, [GangMember(runner)]).train()
    # One chunk of 4 steps: a request per step of per_device_train_batch_size (4) completions.
    assert seen == [[4]] * 4
    assert "forward" not in vars(base) and "forward" not in vars(model)  # no trainer's fused LM head is left


# ---------------------------------------------------------------------- choosing gangs
def test_gangs_are_trials_at_the_same_progress_on_one_base_model_split_evenly():
    def trial(number, done=0, key="m", gang="k"):
        return LiveTrial(number, done, 4, key, gang_key=gang)

    seven = [trial(n) for n in range(7)]
    assert [t.number for t in next_gang(seven, 4)] == [0, 1, 2, 3]
    assert [t.number for t in next_gang(seven[4:], 4)] == [4, 5, 6]
    assert [t.number for t in next_gang([trial(n) for n in range(5)], 4)] == [0, 1, 2]  # 3 + 2, not 4 + 1
    mixed = [trial(0, done=1), trial(1), trial(2, gang="other"), trial(3), trial(4, gang=None)]
    assert [t.number for t in next_gang(mixed, 4)] == [1, 3]
    assert [t.number for t in next_gang([trial(4, gang=None), trial(5)], 4)] == [4]  # trains alone
    assert [t.number for t in next_gang(seven, 4, planned={0: (0, 5, 6)})] == [0, 5, 6]  # stored before a crash
    assert [t.number for t in next_gang(seven, 1)] == [0]


# ---------------------------------------------------------------------- studies in gangs
def _study(tmp_path, name="gang", num_chunks=2):
    tmp_path.mkdir(parents=True, exist_ok=True)
    return rfopt.create_study(study_name=name, storage=f"sqlite:///{tmp_path / 'gang.db'}", num_chunks=num_chunks,
                              checkpoint_dir=tmp_path / "ck")


def test_a_gang_study_run_twice_ends_identically_and_stores_who_trained_together(scripted_or_trl, tiny_model, tmp_path,
                                                                                monkeypatch):
    """With rfopt's defaults (``gang_training="batched"``): through TRL, the members' forwards are batched, and a
    batched gang is deterministic, so the second run's values and weights equal the first's bit for bit."""
    from rfopt.training.batched_step import BatchedBackbone

    forwards = []
    forward = BatchedBackbone.forward
    monkeypatch.setattr(BatchedBackbone, "forward",
                        lambda self, requests: forwards.append(len(requests)) or forward(self, requests))
    configs = rfopt.grid(trial_config(tiny_model), learning_rate=[1e-3, 5e-3, 1e-2])
    train, test = prompts_dataset(8), prompts_dataset(2, "E")
    first, second = _study(tmp_path / "a"), _study(tmp_path / "b")
    first.optimize(configs, train, test, gang_size=3, show_progress_bar=False)
    second.optimize(configs, train, test, gang_size=3, show_progress_bar=False)
    if scripted_or_trl is None:  # through TRL: the default gang shared its forwards (scripted runners have none)
        assert forwards and max(forwards) == 3
    for a, b in zip(first.trials, second.trials):
        assert a.state == b.state == optuna.trial.TrialState.COMPLETE
        assert a.intermediate_values == b.intermediate_values
    for a, b in zip(first.trials, second.trials):
        assert _same(_adapter(first, a.number), _adapter(second, b.number))
    plans = {schema.gang_plan(t, 0).numbers for t in first.trials}
    assert plans == {(0, 1, 2)}
    # The study page's card of each trial says whom it trained with.
    from rfopt.dashboard.pages import _render_trial
    from rfopt.dashboard.views import TrialView

    card = _render_trial(first.optuna._study_id, TrialView.of(first.trials[1]), steerable=False)
    assert "trained together with trials 0, 2 (chunks 1, 2)" in card


def _adapter(study, number):
    from safetensors.torch import load_file

    path = schema.TrialRecord(study.trials[number]).adapter
    return load_file(f"{path}/adapter_model.safetensors")


def test_a_member_whose_reward_raises_fails_alone_and_the_gang_goes_on(scripted, tiny_model, tmp_path):
    configs = [trial_config(tiny_model), trial_config(tiny_model, learning_rate=1e-2),
               trial_config(tiny_model, rewards=(reward_len, reward_raises))]
    study = _study(tmp_path)
    study.optimize(configs, prompts_dataset(8), prompts_dataset(2, "E"), gang_size=3, show_progress_bar=False)
    states = [t.state.name for t in study.trials]
    assert states == ["COMPLETE", "COMPLETE", "FAIL"]
    reason = schema.TrialRecord(study.trials[2]).fail_reason
    assert "reward_raises" in reason and "reward server unreachable" in reason


def test_pruning_and_trials_that_cannot_gang_work_beside_gangs(scripted, tiny_model, tmp_path):
    configs = [trial_config(tiny_model, learning_rate=lr) for lr in (1e-3, 5e-3, 1e-2)] + [
        rfopt.TrialConfig(model=str(tiny_model), reward_funcs=[reward_len, reward_vowels],
                          args=trial_config(tiny_model).args, peft_config=None)]
    study = rfopt.create_study(study_name="gang", storage=f"sqlite:///{tmp_path / 'gang.db'}", num_chunks=2,
                               checkpoint_dir=tmp_path / "ck",
                               pruner=optuna.pruners.SuccessiveHalvingPruner(min_resource=1, reduction_factor=2))
    study.optimize(configs, prompts_dataset(8), prompts_dataset(2, "E"), gang_size=4, show_progress_bar=False)
    states = sorted(t.state.name for t in study.trials)
    assert states.count("COMPLETE") == 2 and states.count("PRUNED") == 2
    assert schema.gang_plan(study.trials[3], 0) is None  # full fine-tuning trains alone
    assert schema.gang_plan(study.trials[0], 0).numbers == (0, 1, 2)


def test_gang_size_must_be_a_whole_number(tiny_model, tmp_path):
    study = _study(tmp_path)
    with pytest.raises(ValueError, match="gang_size=0"):
        study.optimize([trial_config(tiny_model)], prompts_dataset(8), prompts_dataset(2), gang_size=0)



# ---------------------------------------------------------------------- memory is planned
def test_the_memory_estimate_counts_each_adapter_and_the_base_model_as_built(tiny_model):
    from rfopt.training.memory import gang_memory, model_bytes

    configs = [trial_config(tiny_model), trial_config(tiny_model, peft=lora_config(r=8, target_modules="all-linear"))]
    estimate = gang_memory(configs, prompt_tokens=20)
    built = [get_peft_model(AutoModelForCausalLM.from_pretrained(tiny_model), c.peft_config) for c in configs]
    lora = [sum(p.numel() for n, p in m.named_parameters() if "lora_" in n) for m in built]
    assert estimate.members == tuple(16 * n for n in lora)  # fp32 weight, gradient and two AdamW moments
    assert estimate.base == model_bytes(configs[0])
    assert estimate.step > 0 and len(estimate.decode) == 2 and estimate.total > estimate.base


def _three_configs_and_their_gang_memory(tiny_model):
    """Three LoRA configs of the tiny model, 8 training prompts, and the gang memory plan of the three."""
    from rfopt.training import memory

    configs = rfopt.grid(trial_config(tiny_model), learning_rate=[1e-3, 5e-3, 1e-2])
    train = prompts_dataset(8)
    tokenizer = AutoTokenizer.from_pretrained(tiny_model)
    longest = max(map(len, EvalPrompts.of(train, tokenizer).token_ids(tokenizer)))
    return configs, train, memory.gang_memory(configs, longest, eval_rows=2)


def test_a_gang_that_would_not_fit_is_made_smaller_with_a_message(scripted, tiny_model, tmp_path, monkeypatch, caplog):
    from rfopt.training import models

    configs, train, estimate = _three_configs_and_their_gang_memory(tiny_model)
    # Room for two members taking their steps one after another beside the (resident) base model, not three.
    room = estimate.need(2, with_base=False) * 1.21
    monkeypatch.setattr(models, "free_bytes", lambda device: int(room))
    study = _study(tmp_path)
    with caplog.at_level("WARNING", logger="rfopt"):
        study.optimize(configs, train, prompts_dataset(2, "E"), gang_size=3, gang_training="sequential",
                       show_progress_bar=False)
    assert all(t.state == optuna.trial.TrialState.COMPLETE for t in study.trials)
    sizes = {len(schema.gang_plan(t, 0).numbers) for t in study.trials}
    assert max(sizes) < 3
    assert "a gang of" in caplog.text and "training" in caplog.text and "at once instead" in caplog.text


def test_a_batched_gang_that_would_not_fit_trains_sequentially_and_says_so_once(scripted, tiny_model, tmp_path,
                                                                                monkeypatch, caplog):
    from rfopt.training import models

    configs, train, estimate = _three_configs_and_their_gang_memory(tiny_model)
    # Room for the three taking their steps one after another, beside the (resident) base model; not batched.
    room = estimate.need(3, with_base=False) * 1.21
    assert room < estimate.need(3, with_base=False, batched=True) * 1.2
    monkeypatch.setattr(models, "free_bytes", lambda device: int(room))
    modes = record_gang_modes(monkeypatch)
    study = _study(tmp_path)
    with caplog.at_level("WARNING", logger="rfopt"):
        study.optimize(configs, train, prompts_dataset(2, "E"), gang_size=3, gang_training="batched",
                       show_progress_bar=False)
    assert all(t.state == optuna.trial.TrialState.COMPLETE for t in study.trials)
    assert {len(schema.gang_plan(t, unit).numbers) for t in study.trials for unit in (0, 1)} == {3}  # not smaller
    assert modes and set(modes) == {(3, "sequential")}
    assert caplog.text.count("one after another instead") == 1


# ---------------------------------------------------------------------- ops and population-based training mid-gang
def _gang_optimize(study, configs, on_unit=None, num_chunks=3, **kwargs):
    study.optimize(configs, prompts_dataset(12), prompts_dataset(2, "E"), num_chunks=num_chunks, gang_size=3,
                   show_progress_bar=False, on_unit=on_unit, **kwargs)


def _close(a, b, tolerance=1e-5):
    """Adapters equal within `tolerance` (relative, per tensor): a batched step's rounding depends on who shares it."""
    return a.keys() == b.keys() and all(
        ((a[k] - b[k]).norm() / b[k].norm().clamp(min=1e-30)).item() <= tolerance for k in a)


@pytest.mark.parametrize("training", ["sequential", "batched"])
def test_a_trial_paused_out_of_its_gang_resumes_where_it_was_and_its_partners_go_on(
        scripted_or_trl, tiny_model, tmp_path, training):
    configs = rfopt.grid(trial_config(tiny_model), learning_rate=[1e-3, 5e-3, 1e-2])
    reference = _study(tmp_path / "ref", num_chunks=3)
    _gang_optimize(reference, configs, gang_training=training)
    study = _study(tmp_path / "paused", num_chunks=3)

    def on_unit(number, step, value):
        if (number, step) == (1, 0):
            study.pause_trial(1)
        if (number, step) == (0, 1):
            study.resume_trial(1)
        if (number, step) == (2, 1):
            study.stop_trial(2)

    _gang_optimize(study, configs, on_unit, gang_training=training)
    trials = study.trials
    assert [t.state.name for t in trials] == ["COMPLETE", "COMPLETE", "PRUNED"]
    assert schema.gang_plan(trials[0], 1).numbers == (0, 2)  # trial 1 sat out chunk 1 (paused)
    assert schema.gang_plan(trials[1], 1).numbers == (1,)  # and caught up alone
    assert schema.gang_plan(trials[0], 2).numbers == (0, 1)  # then rejoined; trial 2 was stopped
    for number in (0, 1):  # on the tiny model a trial's numerics do not depend on its partners
        if training == "sequential" or scripted_or_trl is not None:
            assert trials[number].intermediate_values == reference.trials[number].intermediate_values
            assert _same(_adapter(study, number), _adapter(reference, number))
        else:  # up to the rounding of a batched step, whose shapes depend on who shares it
            assert trials[number].intermediate_values == pytest.approx(reference.trials[number].intermediate_values,
                                                                       rel=1e-4)
            assert _close(_adapter(study, number), _adapter(reference, number))


@pytest.mark.slow
@pytest.mark.e2e
@pytest.mark.parametrize("pruner", ["successive-halving", "population-based-training"])
def test_a_batched_gang_study_prunes_and_clones_as_the_sequential_one_does(tiny_model, tmp_path, pruner, monkeypatch):
    """Pruned members leave their gang, warm clones of the winners join one (their parent's weights copied into a new
    member of a batched gang), a full fine-tune trains alone beside the gangs: the batched study makes the sequential
    one's decisions, with its values and weights up to a batched step's rounding."""
    from rfopt.training.batched_step import BatchedBackbone

    forwards = []
    forward = BatchedBackbone.forward
    monkeypatch.setattr(BatchedBackbone, "forward",
                        lambda self, requests: forwards.append(len(requests)) or forward(self, requests))
    configs = rfopt.grid(trial_config(tiny_model), learning_rate=[2e-3, 5e-3, 1e-2, 3e-3])
    if pruner == "successive-halving":
        configs.append(rfopt.TrialConfig(model=str(tiny_model), reward_funcs=[reward_len, reward_vowels],
                                         args=trial_config(tiny_model).args, peft_config=None))
    studies = {}
    for training in ("sequential", "batched"):
        where = tmp_path / training
        where.mkdir()
        made = (optuna.pruners.SuccessiveHalvingPruner(min_resource=1, reduction_factor=2)
                if pruner == "successive-halving" else
                rfopt.PopulationBasedTraining(interval=1, quantile=0.25, resample_probability=0.0, seed=0))
        studies[training] = rfopt.create_study(study_name="p", storage=f"sqlite:///{where / 'p.db'}", pruner=made,
                                               checkpoint_dir=where / "ck")
        studies[training].optimize(configs, prompts_dataset(12), prompts_dataset(2, "E"), num_chunks=3, gang_size=4,
                                   gang_training=training, show_progress_bar=False)
    sequential, batched = studies["sequential"].trials, studies["batched"].trials
    assert max(forwards) > 1  # the batched study's members did share their forwards
    assert [t.state for t in batched] == [t.state for t in sequential]
    assert {t.state.name for t in batched} >= {"COMPLETE", "PRUNED"}
    lineage = [schema.TrialRecord(t).lineage for t in batched]

    def who(line):  # the decision, not when it was made
        return None if line is None else (line.parent, line.overrides, line.warm_start, line.start_unit, line.by)

    assert list(map(who, lineage)) == [who(schema.TrialRecord(t).lineage) for t in sequential]
    if pruner == "population-based-training":
        clones = [t for t, line in zip(batched, lineage) if line is not None]
        assert clones and all(schema.TrialRecord(c).lineage.warm_start for c in clones)
        start = schema.TrialRecord(clones[0]).start_unit
        assert len(schema.gang_plan(clones[0], start).numbers) > 1  # it joined a (batched) gang
    for a, b in zip(batched, sequential):
        assert a.intermediate_values == pytest.approx(b.intermediate_values, rel=1e-4)
        adapter = schema.TrialRecord(a).adapter
        if adapter is not None and os.path.exists(os.path.join(adapter, "adapter_model.safetensors")):  # not full FT
            assert _close(_adapter(studies["batched"], a.number), _adapter(studies["sequential"], b.number), 1e-4)


def test_population_based_training_replaces_members_of_a_gang_with_warm_clones(scripted, tiny_model, tmp_path):
    configs = rfopt.grid(trial_config(tiny_model), learning_rate=[2e-3, 5e-3, 1e-2, 3e-3])
    pbt = rfopt.PopulationBasedTraining(interval=1, quantile=0.25, resample_probability=0.0, seed=0)
    tmp_path.mkdir(parents=True, exist_ok=True)
    study = rfopt.create_study(study_name="pbt", storage=f"sqlite:///{tmp_path / 'pbt.db'}", pruner=pbt,
                               checkpoint_dir=tmp_path / "ck")
    study.optimize(configs, prompts_dataset(12), prompts_dataset(2, "E"), num_chunks=3, gang_size=4,
                   show_progress_bar=False)
    trials = study.trials
    clones = [t for t in trials if schema.TrialRecord(t).lineage is not None]
    assert clones and all(schema.TrialRecord(c).lineage.warm_start for c in clones)
    assert sum(t.state == optuna.trial.TrialState.COMPLETE for t in trials) == 4
    # A clone trains in a gang with the members it joins at its parent's progress.
    first_clone = clones[0]
    start = schema.TrialRecord(first_clone).start_unit
    assert len(schema.gang_plan(first_clone, start).numbers) > 1


def test_output_flags_in_a_models_generation_config_do_not_make_its_evaluation_leave_the_batch():
    """SmolLM2 loaded from its GGUF file carries ``output_attentions=False, output_hidden_states=False``; they change
    no decoded token, so the batched backend takes the config."""
    from transformers import GenerationConfig

    config = GenerationConfig(max_new_tokens=4, eos_token_id=2, pad_token_id=2, output_attentions=False,
                              output_hidden_states=False)
    assert Sampling.of(config) == Sampling(max_new_tokens=4, eos_token_ids=(2,), pad_token_id=2, do_sample=False)


@pytest.mark.parametrize("runner_class", [ScriptedRunner, pytest.param(TrialRunner, marks=(pytest.mark.e2e,
                                                                                       pytest.mark.slow))])
def test_a_ctrl_c_inside_one_member_stops_the_whole_gang_and_fails_no_member(tiny_model, runner_class):
    """Members run in the caller's thread, so a Ctrl-C lands in whichever member runs: the gang stops every member
    at its next step (the one waiting for rollouts hears `DecodeAborted`), then lets the KeyboardInterrupt through."""
    from rfopt.training.rollouts import DecodeAborted
    from rfopt.training.runner import ChunkAborted
    from rfopt_testkit import reward_interrupted

    dataset = prompts_dataset(8)
    plan = ChunkPlan.build(len(dataset), 2, seed=0)
    pool = ModelPool("cpu")
    runners = []
    for number, rewards in enumerate([(reward_len,), (reward_len, reward_interrupted), (reward_len,)]):
        config = trial_config(tiny_model, learning_rate=5e-3, rewards=rewards)
        runners.append(runner_class(number, config, plan, trial_schedule(plan, config.args), dataset, pool,
                                    "/tmp/rfopt-test-gang"))
    for runner in runners:
        runner.setup()
    gang = Gang(runners[0].rollout_backend("batched"), [GangMember(r) for r in runners])
    with pytest.raises(KeyboardInterrupt):
        gang.train()
    assert isinstance(gang.members[1].error, DecodeAborted)
    # stopped: at its next step (ChunkAborted), or while waiting for rollouts (DecodeAborted); none failed of its own
    assert all(isinstance(m.error, (DecodeAborted, ChunkAborted)) for m in gang.members), [m.error for m in gang.members]
    assert all(turn.greenlet.dead for turn in gang._turns)  # no member is left suspended


def test_a_run_that_names_no_gang_size_trains_in_gangs_of_the_default(scripted, tiny_model, tmp_path):
    from rfopt.training.gang import DEFAULT_GANG_SIZE

    configs = rfopt.grid(trial_config(tiny_model), learning_rate=[1e-3, 5e-3, 1e-2, 2e-3, 3e-3])
    study = _study(tmp_path, num_chunks=1)
    study.optimize(configs, prompts_dataset(8), prompts_dataset(2, "E"), show_progress_bar=False)
    gangs = {tuple(map(tuple, t.system_attrs[k]["members"])) for t in study.trials for k in t.system_attrs
             if k.startswith("rfopt:gang:")}
    assert DEFAULT_GANG_SIZE == 4 and sorted(map(len, gangs)) == [2, 3]  # 5 trials, at most 4 at once, split evenly


def test_the_backend_hears_of_every_members_optimizer_step_and_loaded_weights(scripted, tiny_model, tmp_path):
    """A backend that holds its own copy of the weights (a vLLM engine) must reload an adapter after each optimizer
    step and after its weights are loaded, or it decodes a stale adapter: the recording backend hears each."""
    study = _study(tmp_path)
    configs = [trial_config(tiny_model, learning_rate=lr) for lr in (1e-3, 5e-3)]
    study.optimize(configs, prompts_dataset(8), prompts_dataset(2, "E"), gang_size=2, show_progress_bar=False)
    steps = schema.TrialRecord(study.trials[0]).schedule.steps_per_chunk
    units = schema.TrialRecord(study.trials[0]).num_units
    # Each unit: both members' adapters as loaded, then each member's adapter after each of its steps.
    assert scripted.adapters_changed == units * ([["trial-0", "trial-1"]] + [["trial-0"], ["trial-1"]] * steps)


# ---------------------------------------------------------------------- what a gang says it does (issue 44)
def _scripted_gang(tiny_model, numbers=(3, 4, 5)):
    dataset = prompts_dataset(8)
    plan = ChunkPlan.build(len(dataset), 2, seed=0)
    runners = []
    for number in numbers:
        config = trial_config(tiny_model, learning_rate=5e-3)
        runners.append(ScriptedRunner(number, config, plan, trial_schedule(plan, config.args), dataset, None,
                                      "/tmp/rfopt-test-gang"))
    return runners


def test_a_gang_says_whose_turn_it_is_and_how_far_its_rollouts_are_decoded(tiny_model, monkeypatch):
    import rfopt.training.gang

    monkeypatch.setattr(rfopt.training.gang, "TOKENS_SECONDS", 0.0)  # every token told (a scripted decode is instant)
    runners = _scripted_gang(tiny_model)
    heard = []
    gang = Gang(runners[0].rollout_backend("batched"), [GangMember(r) for r in runners], on_activity=heard.append)
    gang.train()
    assert all(m.error is None for m in gang.members)
    turns = [(a.done, a.total, a.trial) for a in heard if a.what == "member"]
    # Each member in order, numbered k of 3 and named by its trial, once per round of the gang's steps.
    assert turns[:3] == [(1, 3, 3), (2, 3, 4), (3, 3, 5)] and len(turns) == 3 * (gang.decodes + 1)
    # Between the rounds, the gang's one decode: the tokens so far of the most new tokens, counting up.
    decodes: list[list] = []  # each decode's run of events, between the members' turns
    for before, a in zip([None, *heard], heard):
        if a.what == "decoding":
            if before is None or before.what != "decoding":
                decodes.append([])
            decodes[-1].append(a)
    assert len(decodes) == gang.decodes
    for said in decodes:
        tokens = [a.done for a in said]
        assert tokens[0] == 0 and tokens == sorted(tokens) and tokens[-1] == said[-1].total > 1
        assert {a.total for a in said[1:]} == {said[-1].total}


def test_a_trial_alone_says_nothing_finer_than_its_steps(tiny_model):
    [runner] = _scripted_gang(tiny_model, numbers=(3,))
    heard = []
    gang = Gang(runner.rollout_backend("exact"), [GangMember(runner)], on_activity=heard.append)
    gang.train()
    assert gang.members[0].error is None and heard == []


@pytest.mark.slow
@pytest.mark.e2e
@pytest.mark.parametrize("training", ["sequential", "batched"])
def test_a_gang_of_the_tiny_model_says_its_turns_its_decodes_and_in_the_batched_mode_its_one_step(tiny_model,
                                                                                                  training,
                                                                                                  monkeypatch):
    import rfopt.training.gang

    monkeypatch.setattr(rfopt.training.gang, "TOKENS_SECONDS", 0.0)  # every token told (the tiny model's are fast)
    dataset = prompts_dataset(8)
    plan = ChunkPlan.build(len(dataset), 2, seed=0)
    pool = ModelPool("cpu")
    runners = []
    for number in (0, 1):
        config = trial_config(tiny_model, learning_rate=5e-3)
        runners.append(TrialRunner(number, config, plan, trial_schedule(plan, config.args), dataset, pool,
                                   "/tmp/rfopt-test-gang"))
    for runner in runners:
        runner.setup()
    heard = []
    gang = Gang(runners[0].rollout_backend("batched"), [GangMember(r) for r in runners], training=training,
                on_activity=heard.append)
    gang.train()
    assert all(m.error is None for m in gang.members)
    kinds = {a.what for a in heard}
    assert {"member", "decoding"} <= kinds and ("batched" in kinds) == (training == "batched")
    tokens = [a.done for a in heard if a.what == "decoding"]
    assert max(tokens) > 1 and all(a.total == runners[0].config.args.max_completion_length
                                   for a in heard if a.what == "decoding" and a.done)
    assert {a.total for a in heard if a.what == "batched"} <= {2}
