"""The batched training step of a gang (``gang_training="batched"``): one forward of the shared base for every member's
rows, each row through its own adapter, and one backward of the members' losses.

What must hold: each member gets the gradient it gets alone (float32, relative difference <= 1e-5 per parameter
tensor), whatever its rank, alpha, learning rate, temperature, beta or completion length; while a member clips and
steps it sees only its own gradients; a member that fails (a raising reward, a NaN loss) fails alone; and a member the
batched forward cannot serve trains its own steps inside the gang, exactly as in the sequential mode."""

import math

import pytest
import torch
from peft import get_peft_model
from transformers import AutoModelForCausalLM, TrainerCallback

from rfopt.chunks import ChunkPlan, trial_schedule
from rfopt.training import gang as gang_module
from rfopt.training.batched_step import (BatchedBackbone, ForwardRequest, adapter_parameters,
                                         shared_prompts, shares_prompts, unservable)
from rfopt.training.gang import Gang, GangMember
from rfopt.training.models import ModelPool, adapter_name
from rfopt.training.runner import TrialRunner
from rfopt_testkit import (lora_config, prompts_dataset, record_gang_modes, reward_len, reward_raises, saved_bytes,
                           trial_config)

TOLERANCE = 1e-5


def _relative(a, b):
    return ((a - b).norm() / b.norm().clamp(min=1e-30)).item()


# ---------------------------------------------------------------------- the batched backbone itself
def _rows(rows, length, pads, seed):
    """Token ids and a mask: `pads` left pads on the first row, one right pad on the last, as TRL's batches have."""
    ids = torch.randint(3, 50, (rows, length), generator=torch.Generator().manual_seed(seed))
    mask = torch.ones_like(ids)
    mask[0, :pads] = 0
    mask[-1, -1] = 0
    return ids, mask


def _two_adapters(tiny_model, **lora):
    from peft import LoraConfig

    model = get_peft_model(AutoModelForCausalLM.from_pretrained(tiny_model),
                           LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], init_lora_weights=False,
                                      **lora), adapter_name="t1")
    model.add_adapter("t2", LoraConfig(r=8, lora_alpha=4, target_modules=["q_proj", "v_proj", "o_proj", "up_proj"],
                                       init_lora_weights=False, **lora))
    return model


def _batched_as_alone(model, batches, loss_of):
    """Each of `batches` (adapter or None, a reference forward: its ids and mask) through the backbone alone and then
    all through one `BatchedBackbone` forward, `loss_of(hidden, mask)` backward: each row group's hidden states (where
    attended) and its adapter's gradients match alone within `TOLERANCE`. Returns the batched backbone."""
    backbone = model.get_base_model().base_model

    def trainable(*adapters):
        for adapter in adapters:
            for p in adapter_parameters(model, adapter):
                p.requires_grad_(True)

    alone = {}
    for adapter, (ids, mask) in batches.items():
        model.zero_grad(set_to_none=True)
        if adapter is None:
            with model.disable_adapter(), torch.no_grad():
                alone[adapter] = (backbone(input_ids=ids, attention_mask=mask, use_cache=False).last_hidden_state, {})
            continue
        model.set_adapter(adapter)
        trainable(adapter)
        hidden = backbone(input_ids=ids, attention_mask=mask, use_cache=False).last_hidden_state
        loss_of(hidden, mask).backward()
        alone[adapter] = (hidden.detach(), {id(p): p.grad.clone() for p in adapter_parameters(model, adapter)})
    model.zero_grad(set_to_none=True)
    trainable(*(adapter for adapter in batches if adapter is not None))

    batched = BatchedBackbone(backbone)
    hidden = batched.forward([ForwardRequest(adapter, ids, mask, grad=True) for adapter, (ids, mask) in batches.items()])
    torch.autograd.backward([loss_of(h, batches[a][1]) for h, a in zip(hidden, batches) if a is not None])

    for h, (adapter, (_, mask)) in zip(hidden, batches.items()):
        real = mask.bool()
        assert h.shape == alone[adapter][0].shape
        assert _relative(h.detach()[real], alone[adapter][0][real]) <= TOLERANCE
        for p in adapter_parameters(model, adapter) if adapter else ():
            assert _relative(p.grad, alone[adapter][1][id(p)]) <= TOLERANCE
    return batched


# Grouped: every row group's delta added in place (`GroupedLoRA`); PEFT's modules: with dropout (compared in eval mode,
# where it draws nothing) or a ``lora_bias``, each group goes through its own ``lora_A``/``lora_B`` as PEFT runs them.
@pytest.mark.parametrize("lora, training", [({}, True), ({"lora_dropout": 0.1}, False), ({"lora_bias": True}, True)],
                         ids=["grouped", "peft-modules-dropout", "peft-modules-bias"])
def test_the_batched_backbone_gives_each_row_group_the_hidden_states_and_gradient_it_gets_alone(tiny_model, lora,
                                                                                               training):
    model = _two_adapters(tiny_model, **lora)
    model.train(training)
    backbone = model.get_base_model().base_model
    # Different row counts and lengths; None is a reference forward (adapters disabled).
    batches = {"t1": _rows(2, 9, 2, 1), "t2": _rows(3, 13, 4, 2), None: _rows(2, 6, 1, 3)}
    weights = torch.randn(model.config.hidden_size, generator=torch.Generator().manual_seed(5))
    _batched_as_alone(model, batches, lambda hidden, mask: (hidden @ weights).pow(2).mean())
    assert "forward" not in vars(backbone)  # the shared model is untouched: the view is a copy of its own


def _grpo_rows(prompts, per_prompt, prompt_length, completion_length, seed):
    """A GRPO batch: `per_prompt` completions of each of `prompts` prompts (left-padded alike: each prompt's pads
    differ), the completions right-padded after their ends."""
    g = torch.Generator().manual_seed(seed)
    ids, mask = [], []
    for p in range(prompts):
        prompt = torch.randint(3, 50, (prompt_length,), generator=g)
        pads = p + 1
        for c in range(per_prompt):
            completion = torch.randint(3, 50, (completion_length,), generator=g)
            row_mask = torch.ones(prompt_length + completion_length, dtype=torch.long)
            row_mask[:pads] = 0
            row_mask[prompt_length + completion_length - c:] = 0  # shorter completions, padded on the right
            ids.append(torch.cat([prompt, completion]))
            mask.append(row_mask)
    return torch.stack(ids), torch.stack(mask)


def test_rows_that_share_a_prompt_have_it_computed_once_and_each_row_group_gets_the_gradient_it_gets_alone(tiny_model):
    model = _two_adapters(tiny_model)
    model.train(True)
    # t1: 2 prompts x 3 completions; t2: 4 completions of one prompt, longer; a reference forward of 2 x 2.
    batches = {"t1": _grpo_rows(2, 3, 10, 6, 1), "t2": _grpo_rows(1, 4, 14, 7, 2), None: _grpo_rows(2, 2, 10, 6, 3)}
    weights = torch.randn(model.config.hidden_size, generator=torch.Generator().manual_seed(5))
    batched = _batched_as_alone(model, batches, lambda hidden, mask: ((hidden @ weights) * mask).pow(2).mean())
    # Each batch's prompts were computed once: (6 - 2) + (4 - 1) + (4 - 2) rows did not compute the shared columns.
    assert batched.shared_tokens >= 9 * 10


def test_the_backbone_call_of_a_causal_lm_adapters_model_is_served_and_a_call_the_batch_cannot_serve_is_named():
    ids = torch.ones((2, 3), dtype=torch.long)
    # What PEFT's PeftModelForCausalLM (task_type="CAUSAL_LM", as TRL's examples configure LoRA) passes on.
    peft_causal_lm = dict(input_ids=ids, attention_mask=ids, inputs_embeds=None, output_attentions=None,
                          output_hidden_states=None, return_dict=None, use_cache=False)
    assert unservable((), peft_causal_lm) is None
    assert unservable((), dict(input_ids=ids, attention_mask=ids, use_cache=False)) is None
    for key, value in [("output_hidden_states", True), ("inputs_embeds", torch.zeros(2, 3, 4)), ("pixel_values", None)]:
        call = peft_causal_lm | {key: value}
        assert unservable((), call) == f"the arguments {key}"
    assert unservable((), peft_causal_lm | {"use_cache": True}) == "use_cache=True"
    assert unservable((ids,), {}) == "1 positional arguments"


def test_a_shared_prompt_is_found_where_it_saves_tokens_and_never_across_requests():
    ids, mask = _grpo_rows(2, 4, 12, 4, 7)
    shared = shared_prompts(ids, mask, [(0, 8)])
    assert shared is not None and shared.width >= 12  # the prompts (and any completion start they share)
    assert shared.counts == [2] and shared.source.tolist() == [0] * 4 + [1] * 4
    # The same rows as two requests (two adapters) share within each, never across.
    same = torch.cat([ids[:4], ids[:4]]), torch.cat([mask[:4], mask[:4]])
    split = shared_prompts(*same, [(0, 4), (4, 8)])
    assert split.counts == [1, 1] and set(split.source.tolist()) == {0, 1}
    # Rows that share nothing, or too little to pay for a second forward: one forward as before.
    distinct = torch.arange(40).view(4, 10) + 3
    assert shared_prompts(distinct, torch.ones_like(distinct), [(0, 4)]) is None
    little = distinct.clone()
    little[:, 0] = 3  # one column of ten shared
    assert shared_prompts(little, torch.ones_like(little), [(0, 4)]) is None
    # The mask is part of the prefix: the same ids padded differently are different prompts.
    padded = mask.clone()
    padded[0, :3] = 0
    assert shared_prompts(ids, padded, [(0, 8)]).counts == [3]


def _graph(output):
    """The names of the autograd nodes behind `output`."""
    seen, names, todo = set(), [], [output.grad_fn]
    while todo:
        node = todo.pop()
        if node is None or node in seen:
            continue
        seen.add(node)
        names.append(type(node).__name__)
        todo.extend(next_node for next_node, _ in node.next_functions)
    return names


def test_the_batched_forward_adds_each_groups_lora_in_place_without_copying_the_rows_per_group(tiny_model):
    """The batched step's own cost (issue 42 point 2): no concatenation of every LoRA layer's output from its row
    groups, no slice of the input per group (whose backward makes a zero-filled gradient of the whole input, once per
    group and layer): one grouped node per LoRA layer."""
    model = _two_adapters(tiny_model)
    model.train()
    backbone = model.get_base_model().base_model
    for adapter in ("t1", "t2"):
        for p in adapter_parameters(model, adapter):
            p.requires_grad_(True)
    batches = {"t1": _rows(2, 9, 2, 1), "t2": _rows(3, 13, 4, 2), None: _rows(2, 6, 1, 3)}
    hidden = BatchedBackbone(backbone).forward([ForwardRequest(adapter, ids, mask, grad=True)
                                                for adapter, (ids, mask) in batches.items()])
    names = _graph(hidden[0].sum() + hidden[1].sum())
    model.set_adapter("t2")
    ids, mask = batches["t2"]
    alone = _graph(backbone(input_ids=ids, attention_mask=mask, use_cache=False).last_hidden_state.sum())
    layers = model.config.num_hidden_layers * 4  # t2's q, v, o and up projections (t1's are among them)
    assert names.count("GroupedLoRABackward") == layers
    assert names.count("CatBackward0") == alone.count("CatBackward0")  # the model's own (rotary halves), no more
    assert names.count("SliceBackward0") <= alone.count("SliceBackward0") + 2 * 2  # and each member's hidden states


def test_under_autocast_the_batched_forward_takes_peft_modules(tiny_model):
    """Autocast would cast the grouped products but not the output they are added to in place: under it each group
    goes through PEFT's own modules, as a member alone does (here a bfloat16 model, every dtype alike)."""
    model = _two_adapters(tiny_model).to(torch.bfloat16)
    model.train()
    backbone = model.get_base_model().base_model
    for adapter in ("t1", "t2"):
        for p in adapter_parameters(model, adapter):
            p.requires_grad_(True)
    batches = {"t1": _rows(2, 9, 2, 1), "t2": _rows(3, 13, 4, 2)}
    requests = [ForwardRequest(adapter, ids, mask, grad=True) for adapter, (ids, mask) in batches.items()]
    step = BatchedBackbone(backbone)
    assert "GroupedLoRABackward" in _graph(sum(h.float().sum() for h in step.forward(requests)))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        hidden = step.forward(requests)
    names = _graph(sum(h.float().sum() for h in hidden))
    assert "GroupedLoRABackward" not in names and "CatBackward0" in names


# ---------------------------------------------------------------------- a gang's steps through TRL
class _Gradients(TrainerCallback):
    """The gradients a member's optimizer is about to step with (after its clipping), by parameter name."""

    def __init__(self):
        self.steps = []

    def on_pre_optimizer_step(self, args, state, control, model=None, **kwargs):
        self.steps.append({n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None})


def _gang(tiny_model, members, training, spoil=None, stops=None):
    """One chunk of `members` ((trial number, learning rate, peft config, GRPO settings, rewards)) trained as a gang in
    `training` mode (`stops`: a member's `should_stop`, by trial number): each member's gradients per step, weights and
    error, and the gang."""
    dataset = prompts_dataset(8)
    plan = ChunkPlan.build(len(dataset), 2, seed=0)
    pool = ModelPool("cpu")
    runners, seen = [], {}
    for number, lr, peft, grpo, rewards in members:
        config = trial_config(tiny_model, rewards=rewards, learning_rate=lr, peft=peft, **grpo)
        seen[number] = _Gradients()
        config.callbacks = [seen[number]]
        runners.append(TrialRunner(number, config, plan, trial_schedule(plan, config.args), dataset, pool,
                                   "/tmp/rfopt-test-batched-step"))
    for runner in runners:
        runner.setup()
    if spoil is not None:
        spoil(runners)
    gang = Gang(runners[0].rollout_backend("batched"),
                [GangMember(r, should_stop=(stops or {}).get(r.number)) for r in runners], training=training)
    gang.train()
    out = {m.number: (seen[m.number].steps, m.runner.trainable_weights(), m.error) for m in gang.members}
    return out, gang


# Ranks, alphas, target modules, learning rates, temperatures, completion lengths, beta and accumulation all differ.
MEMBERS = [  # the first adapter makes the shared model a PeftModelForCausalLM, whose forward passes more arguments on
    (0, 5e-3, lora_config(task_type="CAUSAL_LM"), {}, (reward_len,)),
    (1, 1e-2, lora_config(r=8, lora_alpha=4, target_modules=["q_proj", "v_proj", "o_proj"]),
     {"max_completion_length": 5, "temperature": 0.7}, (reward_len,)),
    (2, 2e-3, lora_config(r=2, lora_alpha=16), {"beta": 0.1, "gradient_accumulation_steps": 2,
                                               "per_device_train_batch_size": 2}, (reward_len,)),
]


def _own(number, grads):
    return {n for n in grads if adapter_name(number) in n.split(".")}


@pytest.mark.slow
@pytest.mark.e2e
def test_a_batched_gang_step_gives_each_member_the_gradient_it_gets_in_its_own_step(tiny_model, monkeypatch, caplog):
    monkeypatch.setattr(gang_module, "_SAID", set())
    batched, gang = _gang(tiny_model, MEMBERS, "batched")
    sequential, _ = _gang(tiny_model, MEMBERS, "sequential")
    again, _ = _gang(tiny_model, MEMBERS, "batched")
    assert gang.forwards > 0 and gang.backwards > 0  # the steps did run batched
    assert "runs its own forward" not in caplog.text  # every forward did: none went round the batch
    for number, (steps, weights, error) in batched.items():
        alone_steps, alone_weights, _ = sequential[number]
        assert error is None and len(steps) == len(alone_steps) == 4
        for grads, alone in zip(steps, alone_steps):
            # while a member clips and steps, its optimizer sees its own gradients and no other member's
            assert grads.keys() == alone.keys() == _own(number, grads)
            assert max(_relative(grads[n], alone[n]) for n in grads) <= TOLERANCE
        assert all(_relative(weights[k], alone_weights[k]) <= TOLERANCE for k in weights)
        # deterministic within the mode
        assert all(torch.equal(weights[k], again[number][1][k]) for k in weights)


def _spoil_in_training(runners):
    """The last member's adapter turns NaN once its first rollouts are scored: its loss is NaN from then on. (The last:
    the batched rollout decoder then fails the next request in a NaN adapter's rows too, a decoder matter.)"""
    runner = runners[-1]
    first = runner.config.reward_funcs[0]

    def reward_then_nan(completions, **kwargs):
        with torch.no_grad():
            for p in adapter_parameters(runner.model, adapter_name(runner.number)):
                p.fill_(math.nan)
        return first(completions, **kwargs)

    runner.config.reward_funcs = [reward_then_nan]


@pytest.mark.slow
@pytest.mark.e2e
@pytest.mark.parametrize("failure", ["raising reward", "nan loss"])
def test_a_member_that_fails_in_a_batched_step_fails_alone(tiny_model, failure):
    failing = 1 if failure == "raising reward" else 2
    members = [m if m[0] != failing or failure != "raising reward" else (*m[:4], (reward_raises,)) for m in MEMBERS]
    spoil = _spoil_in_training if failure == "nan loss" else None
    batched, _ = _gang(tiny_model, members, "batched", spoil)
    sequential, _ = _gang(tiny_model, members, "sequential", spoil)
    assert batched[failing][2] is not None and type(batched[failing][2]) is type(sequential[failing][2])
    for number in {0, 1, 2} - {failing}:
        steps, weights, error = batched[number]
        assert error is None
        for grads, alone in zip(steps, sequential[number][0], strict=True):
            assert max(_relative(grads[n], alone[n]) for n in grads) <= TOLERANCE


@pytest.mark.slow
@pytest.mark.e2e
def test_a_member_stopped_midway_leaves_a_batched_gang_and_the_others_steps_are_unchanged(tiny_model):
    """A member's chunk stopped after its first step (its lease lost, `should_stop`) ends with `ChunkAborted`, alone;
    the others go on batched, each with the gradients it gets in the sequential mode."""
    from rfopt.training.runner import ChunkAborted

    def after_first_step():
        calls.append(1)
        return True

    calls = []
    batched, gang = _gang(tiny_model, MEMBERS, "batched", stops={1: after_first_step})
    sequential, _ = _gang(tiny_model, MEMBERS, "sequential", stops={1: lambda: True})
    assert calls and isinstance(batched[1][2], ChunkAborted) and isinstance(sequential[1][2], ChunkAborted)
    assert len(batched[1][0]) == 1  # it took one step, then left
    assert gang.forwards > 0
    for number in (0, 2):
        steps, weights, error = batched[number]
        assert error is None and len(steps) == len(sequential[number][0]) == 4
        for grads, alone in zip(steps, sequential[number][0]):
            assert max(_relative(grads[n], alone[n]) for n in grads) <= TOLERANCE
        assert all(_relative(weights[k], sequential[number][1][k]) <= TOLERANCE for k in weights)


@pytest.mark.slow
@pytest.mark.e2e
def test_a_member_the_batched_forward_cannot_serve_trains_its_own_steps_in_the_gang(tiny_model, monkeypatch, caplog):
    refused = adapter_name(1)
    monkeypatch.setattr(gang_module, "member_refusal",
                        lambda model, adapter, peft: "a test refusal" if adapter == refused else None)
    batched, gang = _gang(tiny_model, MEMBERS, "batched")
    sequential, _ = _gang(tiny_model, MEMBERS, "sequential")
    assert gang.forwards > 0
    steps, weights, error = batched[1]
    assert error is None  # trained as in the sequential mode, bit for bit
    assert all(torch.equal(weights[k], sequential[1][1][k]) for k in weights)
    assert "a test refusal" in caplog.text


# ---------------------------------------------------------------------- memory
@pytest.mark.slow
@pytest.mark.e2e
def test_the_memory_plan_covers_the_activations_a_batched_gang_step_holds(tiny_model, monkeypatch):
    """At each backward, what the graph keeps for it (every waiting member's, in a batched step) against
    `gang_memory`'s count: a batched gang holds every member's step activations at once, and the plan says so."""
    from transformers import AutoTokenizer

    from rfopt.training.memory import gang_memory

    held, weights = [], set()
    original = torch.autograd.backward

    def measured(tensors, *args, **kwargs):
        roots = [tensors] if isinstance(tensors, torch.Tensor) else list(tensors)
        held.append(saved_bytes(roots, weights))
        return original(tensors, *args, **kwargs)

    def note_weights(runners):
        weights.update(p.untyped_storage().data_ptr() for p in runners[0].model.parameters())

    monkeypatch.setattr(torch.autograd, "backward", measured)
    members = [m for m in MEMBERS if m[0] != 2]  # one backward per step each (no accumulation), beta 0
    peak = {}
    for training in ("sequential", "batched"):
        held.clear()
        _gang(tiny_model, members, training, note_weights)
        peak[training] = max(held)
    configs = [trial_config(tiny_model, rewards=rewards, learning_rate=lr, peft=peft, **grpo)
               for _, lr, peft, grpo, rewards in members]
    tokenizer = AutoTokenizer.from_pretrained(tiny_model)
    prompt_tokens = max(len(tokenizer(p)["input_ids"]) for p in prompts_dataset(8)["prompt"])
    estimate = gang_memory(configs, prompt_tokens, shared_prompts=shares_prompts("cpu"))
    print(f"held at a backward: {peak}; planned: step {estimate.step}, batched {sum(estimate.steps)}")
    assert peak["batched"] > 1.3 * peak["sequential"]  # every member's at once (each prompt once: less than the sum)
    # What the graph keeps is a floor of what a step holds (its transients and the allocator's slack are not seen): the
    # plan covers it in both modes, and grows with the members as the batched step does. (Korthikanti's count and the
    # logits' gradient count more than the tiny model keeps: TRL's chunked head recomputes its logits.)
    assert peak["sequential"] <= estimate.step <= 2.5 * peak["sequential"]
    assert peak["batched"] <= sum(estimate.steps) <= 2.5 * peak["batched"]
    assert estimate.need(2, batched=True) - estimate.need(2) == sum(estimate.steps) - estimate.step


# ---------------------------------------------------------------------- choosing the mode
def test_gang_training_is_checked_before_anything_trains(tiny_model, tmp_path, capsys):
    import rfopt
    from rfopt.cli import main

    study = rfopt.create_study(study_name="mode", storage=f"sqlite:///{tmp_path / 'mode.db'}",
                               checkpoint_dir=tmp_path / "ck")
    with pytest.raises(ValueError, match="gang_training='fast': give one of 'batched', 'sequential'"):
        study.optimize([trial_config(tiny_model)], prompts_dataset(8), prompts_dataset(2), gang_training="fast")
    assert study.trials == []
    with pytest.raises(SystemExit) as exit_:
        main(["run", "study.py", "--gang-training", "fast"])
    assert exit_.value.code == 2
    assert "argument --gang-training: invalid choice: 'fast'" in capsys.readouterr().err


@pytest.mark.parametrize(("given", "trained"), [(None, "batched"), ("batched", "batched"),
                                                ("sequential", "sequential")])
def test_every_gang_of_a_run_trains_in_the_mode_the_run_gives(scripted, tiny_model, tmp_path, monkeypatch, given,
                                                               trained):
    import rfopt

    modes = record_gang_modes(monkeypatch)
    study = rfopt.create_study(study_name="mode", storage=f"sqlite:///{tmp_path / 'mode.db'}", num_chunks=2,
                               checkpoint_dir=tmp_path / "ck")
    configs = rfopt.grid(trial_config(tiny_model), learning_rate=[1e-3, 5e-3, 1e-2])
    study.optimize(configs, prompts_dataset(8), prompts_dataset(2, "E"), gang_size=3, gang_training=given,
                   show_progress_bar=False)
    assert {t.state.name for t in study.trials} == {"COMPLETE"}
    assert {mode for size, mode in modes if size > 1} == {trained}


def test_the_command_line_flag_overrides_the_study_files_gang_training():
    import argparse

    from rfopt.cli.training import plan_arguments, run_arguments
    from rfopt.config.studyfile import StudySpec

    parser = argparse.ArgumentParser()
    plan_arguments(parser, max_concurrent="trials")
    parser.add_argument("--precision", default="auto")
    def space(trial):
        return None

    spec = StudySpec(name="s", datasets=lambda: None, space=space, n_trials=1, gang_training="batched")
    assert run_arguments(parser.parse_args([]), spec, space)["gang_training"] == "batched"
    flagged = parser.parse_args(["--gang-training", "sequential"])
    assert run_arguments(flagged, spec, space)["gang_training"] == "sequential"
    plain = StudySpec(name="s", datasets=lambda: None, space=space, n_trials=1)
    assert run_arguments(parser.parse_args([]), plain, space)["gang_training"] is None


@pytest.mark.parametrize(("file_gives", "flags", "trained"), [
    (None, (), "batched"), ("sequential", (), "sequential"), ("sequential", ("--gang-training", "batched"), "batched")])
def test_rfopt_run_trains_its_gangs_batched_unless_the_study_file_or_the_flag_says_otherwise(
        scripted, tiny_model, tmp_path, monkeypatch, file_gives, flags, trained):
    """``rfopt run`` with neither ``--gang-training`` nor a study file's ``gang_training``: rfopt's default, batched
    (`rfopt.training.gang.DEFAULT_GANG_TRAINING`); the study file's choice, then the flag, override it."""
    from crashkit import STUDY_FILE, run_here, trials

    monkeypatch.setenv("RFOPT_TEST_TINY_MODEL", str(tiny_model))
    study_file = tmp_path / "study.py"
    study_file.write_text(STUDY_FILE.read_text().replace(
        "    gang_size=1,\n", f"    gang_size=3,\n    gang_training={file_gives!r},\n"))
    modes = record_gang_modes(monkeypatch)
    storage = f"sqlite:///{tmp_path / 'mode.db'}"
    assert run_here(study_file, storage, tmp_path / "ck", *flags) == 0
    assert {t.state.name for t in trials(storage, "tiny")} == {"COMPLETE"}
    assert modes and {mode for size, mode in modes if size > 1} == {trained}
