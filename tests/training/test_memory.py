"""Memory planned for what a gang really holds (`rfopt.training.memory.gang_memory`): each part of the estimate against
the tensors the batched decoder keeps after a gang's rollout and evaluation decodes (its LoRA bank, its bf16 copy,
its buckets' caches and buffers), on the tiny model."""

import copy
import dataclasses

import pytest
import torch
from peft import get_peft_model
from transformers import AutoModelForCausalLM, AutoTokenizer

from rfopt.training.memory import gang_memory
from rfopt.training.rollouts import BatchedBackend, GenerationRequest, Sampling
from rfopt_testkit import lora_config, trial_config

EVAL_ROWS = 5


def _tensors(obj, seen):
    """Every tensor reachable from `obj` (dataclass fields, lists, dicts, a cache's layers), each storage once."""
    if isinstance(obj, torch.Tensor):
        key = obj.untyped_storage().data_ptr()
        if key not in seen:
            seen[key] = obj.untyped_storage().nbytes()
        return
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        for f in dataclasses.fields(obj):
            _tensors(getattr(obj, f.name), seen)
    elif isinstance(obj, (list, tuple)):
        for item in obj:
            _tensors(item, seen)
    elif isinstance(obj, dict):
        for item in obj.values():
            _tensors(item, seen)
    elif hasattr(obj, "layers"):  # a transformers cache
        for layer in obj.layers:
            _tensors([getattr(layer, "keys", None), getattr(layer, "values", None)], seen)


def _held(backend, model):
    """Bytes the backend holds of its own: the bank, the buckets, and its view's weights that are not the model's."""
    seen: dict[int, int] = {}
    theirs = {p.untyped_storage().data_ptr() for p in model.parameters()}
    own = {p.untyped_storage().data_ptr(): p.untyped_storage().nbytes() for p in backend._view.parameters()
           if p.untyped_storage().data_ptr() not in theirs}
    bank = {}
    _tensors([vars(e) for e in backend._bank.entries.values()], bank)
    buckets: dict[int, int] = {}
    _tensors(list(backend._buckets.values()), buckets)
    seen.update(bank)
    return sum(own.values()), sum(bank.values()), sum(v for k, v in buckets.items() if k not in bank)


@pytest.fixture(scope="module")
def gang(tiny_model):
    configs = [trial_config(tiny_model, peft=lora_config(r=8, target_modules="all-linear"), max_completion_length=12),
               trial_config(tiny_model, peft=lora_config(r=4, target_modules="all-linear"), max_completion_length=12)]
    # Copies, as the model pool adds them: PEFT rewrites a config's target modules.
    model = get_peft_model(AutoModelForCausalLM.from_pretrained(tiny_model), copy.deepcopy(configs[0].peft_config),
                           adapter_name="t0")
    model.add_adapter("t1", copy.deepcopy(configs[1].peft_config))
    tokenizer = AutoTokenizer.from_pretrained(tiny_model)
    prompt = tokenizer("add 2 and 3, then 7")["input_ids"]
    return configs, model, tokenizer, prompt


def _decode_like_a_gang(backend, configs, tokenizer, prompt):
    """A rollout decode (each member's batch of completions) and an evaluation decode (`EVAL_ROWS` prompts each)."""
    for rows in (configs[0].args.per_device_train_batch_size, EVAL_ROWS):
        sampling = Sampling(max_new_tokens=configs[0].args.max_completion_length, eos_token_ids=(-1,),
                            pad_token_id=tokenizer.pad_token_id)
        backend.generate([GenerationRequest(f"t{i}", [prompt] * rows, sampling, seed=i) for i in range(len(configs))])


@pytest.mark.parametrize("dtype", [None, torch.bfloat16], ids=["model-dtype", "bf16-copy"])
def test_the_estimate_counts_the_batched_decoders_bank_copy_and_buckets(gang, dtype):
    configs, model, tokenizer, prompt = gang
    backend = BatchedBackend(model, mode="eager", dtype=dtype)
    _decode_like_a_gang(backend, configs, tokenizer, prompt)
    copy, bank, buckets = _held(backend, model)
    estimate = gang_memory(configs, len(prompt), eval_rows=EVAL_ROWS,
                           compute_width=None if dtype is None else dtype.itemsize)
    held = copy + bank + buckets
    assert (copy > 0) == (dtype is not None)
    # What the decoder keeps whatever the gang's size (bank, copy) is planned, and not far above what it holds.
    assert copy + bank <= estimate.decoder <= 1.5 * (copy + bank)
    # With each member's share (its rows' caches and buffers, and the sampler's scratch of one step): all it holds.
    assert buckets <= sum(estimate.decode)
    assert held <= estimate.decoder + sum(estimate.decode) <= 1.5 * held

def test_a_smaller_gang_needs_less_and_a_resident_base_model_is_not_counted_again(gang):
    configs, *_ = gang
    estimate = gang_memory(configs, 20, eval_rows=EVAL_ROWS)
    assert estimate.total == estimate.need(2) > estimate.need(1) > estimate.need(1, with_base=False)
    assert estimate.need(2) - estimate.need(2, with_base=False) == estimate.base
    without_eval = gang_memory(configs, 20)
    assert sum(without_eval.decode) < sum(estimate.decode)  # the evaluation's bucket is planned too
    assert without_eval.decoder == estimate.decoder



# ---------------------------------------------------------------------- a batched gang's step
def test_a_batched_gang_plans_every_members_step_activations_at_once(tiny_model):
    """``gang_training="batched"``: one forward of every member's rows and one backward, so a gang holds all its
    members' step activations at once (each at the gang's longest sequence), where members taking their steps one
    after another hold the largest member's."""
    configs = [trial_config(tiny_model, max_completion_length=length) for length in (8, 16, 12)]
    estimate = gang_memory(configs, 20, eval_rows=EVAL_ROWS)
    alone = [gang_memory([c], 20).step for c in configs]
    assert estimate.step == max(alone)
    assert all(s >= own for s, own in zip(estimate.steps, alone))  # padded to the longest member's 36 tokens
    assert estimate.need(3, batched=True) - estimate.need(3) == sum(estimate.steps) - estimate.step
    assert estimate.need(2, batched=True) - estimate.need(2) == sum(estimate.steps[:2]) - estimate.step
    assert estimate.need(1, batched=True) == estimate.need(1)  # one member takes its own steps


def _outputs(tiny_model, targets):
    """Output features of the tiny model's Linears named `targets`, summed over its layers (from its config)."""
    from transformers import AutoConfig

    c = AutoConfig.from_pretrained(tiny_model)
    kv = c.num_key_value_heads * (getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads)
    width = {"q_proj": c.hidden_size, "k_proj": kv, "v_proj": kv, "o_proj": c.hidden_size,
             "gate_proj": c.intermediate_size, "up_proj": c.intermediate_size, "down_proj": c.hidden_size}
    return c.num_hidden_layers * sum(width[t] for t in targets)


def test_the_batched_step_counts_every_adapted_linears_outputs_at_the_gangs_padded_length(tiny_model):
    """The batched view's forward allocates, at every Linear some member adapts, the base output for all rows and the
    members' pieces before they are concatenated (freed as it goes; the CPU's heap keeps them through the step: on
    SmolLM2 the resident set grew by twice the graph's saved tensors, BENCHMARKS.md). The plan counts twice those
    outputs per member, at the gang's longest sequence, over the union of the members' adapted Linears."""
    prompt, rows = 20, 4

    def steps(targets, lengths):
        configs = [trial_config(tiny_model, peft=lora_config(target_modules=t), max_completion_length=n,
                                per_device_train_batch_size=rows, num_generations=rows)
                   for t, n in zip(targets, lengths)]
        return gang_memory(configs, prompt).steps

    qv, mlp = ["q_proj", "v_proj"], ["gate_proj", "up_proj", "down_proj"]
    narrow, wide = steps([qv, qv], (8, 4)), steps([qv, mlp], (8, 4))
    # The second member's MLP Linears are GangLinears for both members' rows: each member's step grows by them.
    for a, b in zip(narrow, wide):
        assert b - a == 2 * rows * (prompt + 8) * _outputs(tiny_model, mlp) * 4
    # At the gang's longest sequence: a longer second member pads the first member's rows too.
    longer = steps([qv, mlp], (8, 16))
    assert longer[0] > wide[0] and longer[1] > wide[1]
    assert steps([qv, mlp], (8, 8)) == (wide[0], wide[0])
    # A third member adds its own step, and its adapted Linears to the others'.
    three = steps([qv, mlp, ["o_proj"]], (8, 4, 4))
    assert three[0] - wide[0] == 2 * rows * (prompt + 8) * _outputs(tiny_model, ["o_proj"]) * 4
    assert sum(three) > sum(wide)


def test_gradient_checkpointing_shrinks_a_sequential_step_and_not_a_batched_one(tiny_model):
    """The batched view runs without gradient checkpointing (it keeps its activations); a member's own step keeps
    only each layer's input with it."""
    plain, checkpointed = (gang_memory([trial_config(tiny_model, gradient_checkpointing=on)] * 2, 20)
                           for on in (False, True))
    assert checkpointed.step < plain.step
    assert checkpointed.steps == plain.steps
    assert checkpointed.need(2, batched=True) == plain.need(2, batched=True)


def _pool_with_free(monkeypatch, free):
    from rfopt.training import models

    monkeypatch.setattr(models, "free_bytes", lambda device: int(free))
    return models.ModelPool("cpu")


def test_a_batched_gang_that_does_not_fit_takes_its_steps_one_after_another_rather_than_shrink(tiny_model, monkeypatch):
    from rfopt.training.models import ROOM_MARGIN

    configs = [trial_config(tiny_model, learning_rate=lr) for lr in (1e-3, 5e-3, 1e-2)]
    estimate = gang_memory(configs, 20, eval_rows=EVAL_ROWS, shared_prompts=True)  # the pool's CPU shares prompts
    sequential, batched = estimate.need(3) * ROOM_MARGIN, estimate.need(3, batched=True) * ROOM_MARGIN
    assert batched > sequential

    room = _pool_with_free(monkeypatch, batched * 1.01).gang_room(configs, 20, EVAL_ROWS, batched=True)
    assert (room.size, room.batched, room.message) == (3, True, None)

    room = _pool_with_free(monkeypatch, (sequential + batched) / 2).gang_room(configs, 20, EVAL_ROWS, batched=True)
    assert (room.size, room.batched, room.fallback) == (3, False, True)
    assert "batched training step" in room.message and "one after another instead" in room.message

    # Room for two members taking their steps one after another, and for one batched: two, sequentially.
    two = estimate.need(2) * ROOM_MARGIN * 1.01
    assert two < estimate.need(2, batched=True) * ROOM_MARGIN
    room = _pool_with_free(monkeypatch, two).gang_room(configs, 20, EVAL_ROWS, batched=True)
    assert (room.size, room.batched, room.fallback) == (2, False, True) and "for 2 at once" in room.message

    # A sequential gang is only ever made smaller.
    room = _pool_with_free(monkeypatch, two).gang_room(configs, 20, EVAL_ROWS)
    assert (room.size, room.batched, room.fallback) == (2, False, False) and "training 2 at once" in room.message


def test_the_batched_views_own_activations_are_planned_beyond_its_members_own(tiny_model):
    """The batched view keeps more than its members' own forwards would where it pads a member's rows to the longest
    (keys and values repeated to every head for attention with an explicit mask, and the mask): the plan counts that
    beyond each member's own step, checked on the autograd graph of one batched backbone forward against each member's
    forward alone."""
    from rfopt.training.batched_step import BatchedBackbone, ForwardRequest, adapter_parameters
    from rfopt_testkit import saved_bytes

    prompt = 20
    configs = [trial_config(tiny_model, peft=lora_config(r=r, target_modules="all-linear"), max_completion_length=n)
               for r, n in ((4, 12), (8, 4))]
    model = get_peft_model(AutoModelForCausalLM.from_pretrained(tiny_model), copy.deepcopy(configs[0].peft_config),
                           adapter_name="t0")
    model.add_adapter("t1", copy.deepcopy(configs[1].peft_config))
    model.train()
    weights = {p.untyped_storage().data_ptr() for p in model.parameters()}
    backbone = model.get_base_model().base_model
    batches = {}
    for adapter, config in zip(("t0", "t1"), configs):
        shape = (config.args.per_device_train_batch_size, prompt + config.args.max_completion_length)
        batches[adapter] = torch.randint(3, 50, shape, generator=torch.Generator().manual_seed(0))
    alone = 0
    for adapter, ids in batches.items():
        model.set_adapter(adapter)
        hidden = backbone(input_ids=ids, attention_mask=torch.ones_like(ids), use_cache=False).last_hidden_state
        alone += saved_bytes([hidden], weights)
    for adapter in batches:
        for p in adapter_parameters(model, adapter):
            p.requires_grad_(True)
    outs = BatchedBackbone(backbone).forward([ForwardRequest(a, ids, torch.ones_like(ids), grad=True)
                                              for a, ids in batches.items()])
    batched = saved_bytes(outs, weights)
    estimate = gang_memory(configs, prompt)
    beyond = sum(estimate.steps) - sum(gang_memory([c], prompt).step for c in configs)
    # Less what the forward allocates beyond its saved tensors at every adapted Linear (its outputs twice: the test
    # above), which the graph does not show.
    rows = sum(c.args.per_device_train_batch_size for c in configs)
    longest = prompt + max(c.args.max_completion_length for c in configs)
    every = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
    beyond -= 2 * rows * longest * _outputs(tiny_model, every) * 4
    assert batched > alone
    assert batched - alone <= beyond <= 1.5 * (batched - alone)


def test_a_batched_step_whose_rows_share_their_prompts_counts_each_prompt_once(tiny_model):
    """Where the batched forward computes a prompt its rows share once (on the CPU: `shares_prompts`), the plan counts
    the prompt's activations once per prompt, and every row's completion attending to it; rows that share no prompt
    (a prompt too short to pay for a second forward) are planned as before."""
    def steps(generations, shared, prompt=60):
        configs = [trial_config(tiny_model, max_completion_length=8, per_device_train_batch_size=4,
                                num_generations=generations)] * 2
        return gang_memory(configs, prompt, shared_prompts=shared).steps

    grpo, own = steps(4, True), steps(4, False)
    assert all(s < o for s, o in zip(grpo, own))
    assert sum(grpo) < 0.6 * sum(own)  # 4 rows of 68 tokens: 60 of them computed once
    assert steps(2, True)[0] > grpo[0]  # two prompts in a batch of four: each once
    # No prompt shared by enough rows to pay for a second forward (a short prompt): as before.
    assert steps(4, True, prompt=2) == steps(4, False, prompt=2)


# ---------------------------------------------------------------------- what the CPU's heap keeps
def _hidden_states_bytes(tiny_model, config, prompt):
    """One layer's hidden states in `config`'s step: rows x tokens x hidden x 4 bytes (the tiny model is float32)."""
    from transformers import AutoConfig

    tokens = prompt + config.args.max_completion_length
    return config.args.per_device_train_batch_size * tokens * AutoConfig.from_pretrained(tiny_model).hidden_size * 4


@pytest.mark.parametrize("completion", [4, 44, 16400], ids=["below-the-heap", "on-the-heap", "mapped-alone"])
def test_a_sequential_gang_on_the_cpu_plans_what_the_heap_keeps_of_the_steps_before(tiny_model, completion):
    """On the CPU, glibc's malloc serves a step's activations of 128 KiB to 32 MiB a tensor from its heap once the first
    such block is freed, and keeps them: a gang whose members take their steps one after another is planned the
    largest step's activations twice where its hidden states fall in that range (`HEAP_KEEPS`), once otherwise; off the
    CPU, once. A batched gang's plan (every member's step at once) is unchanged."""
    from rfopt.training.memory import HEAP_KEEPS

    prompt = 20
    configs = [trial_config(tiny_model, max_completion_length=completion, per_device_train_batch_size=16,
                            num_generations=4, learning_rate=lr) for lr in (1e-3, 5e-3)]
    off, on = (gang_memory(configs, prompt, on_cpu=cpu) for cpu in (False, True))
    heap = HEAP_KEEPS[0] <= _hidden_states_bytes(tiny_model, configs[0], prompt) <= HEAP_KEEPS[1]
    assert heap == (completion == 44)
    assert off.kept == 0 and on.kept == (on.step if heap else 0)
    for n in (1, 2):
        assert on.need(n) - off.need(n) == on.kept
    assert on.need(2, batched=True) == off.need(2, batched=True)
    assert on.need(1, batched=True) == on.need(1)  # one member alone takes its own steps


def test_a_pool_on_the_cpu_makes_a_sequential_gang_smaller_by_what_the_heap_keeps(tiny_model, monkeypatch):
    """`ModelPool.gang_room` on the CPU plans with `GangMemory.kept`: memory that holds a gang's members stepping one
    after another by the plan without it, and not with it, fits one member fewer."""
    from rfopt.training.models import ROOM_MARGIN

    configs = [trial_config(tiny_model, max_completion_length=44, per_device_train_batch_size=16, num_generations=4,
                            learning_rate=lr) for lr in (1e-3, 5e-3)]
    without = gang_memory(configs, 20, eval_rows=EVAL_ROWS).need(2) * ROOM_MARGIN
    heap = gang_memory(configs, 20, eval_rows=EVAL_ROWS, on_cpu=True).need(2) * ROOM_MARGIN
    assert heap > without
    room = _pool_with_free(monkeypatch, (without + heap) / 2).gang_room(configs, 20, EVAL_ROWS)
    assert (room.size, room.batched) == (1, False) and "training 1 at once" in room.message
    room = _pool_with_free(monkeypatch, heap * 1.01).gang_room(configs, 20, EVAL_ROWS)
    assert (room.size, room.message) == (2, None)
