"""QLoRA and bitsandbytes' optimizers on the CPU, with the real bitsandbytes (the ``qlora`` extra): a base loaded in
4 bits once per device and kept apart from its full-precision copy, gangs decoding through the quantized layers,
8-bit optimizer state carried across swaps and checkpoints bit for bit, the memory estimate of a 4-bit base, and the
refusals when bitsandbytes is missing (rfopt/training/quantization.py, rollouts/bank.py, storage/state.py).

The models here are the tiny model's kind at hidden size 128 (`wide_model`): 4-bit blocks are 64 weights wide."""

import importlib.util

import pytest
import torch
from peft import get_peft_model_state_dict
from transformers import AutoTokenizer, BitsAndBytesConfig
from trl import GRPOTrainer

import rfopt
from rfopt.chunks import ChunkPlan, trial_schedule
from rfopt.errors import ConfigError
from rfopt.training.models import ModelPool
from rfopt.training.runner import TrialRunner
from rfopt_testkit import grpo_config, lora_config, prompts_dataset, reward_len, reward_vowels, trial_config

pytest.importorskip("bitsandbytes")

NF4 = dict(load_in_4bit=True, bnb_4bit_quant_type="nf4")


def qlora_config(model, optim="adamw_torch", r=32, **grpo):
    """A QLoRA trial on `model`: nf4 base, LoRA of rank `r` on every linear layer (rank 32 on a 128-wide layer makes
    tensors of 4096 weights, the smallest whose optimizer state bitsandbytes keeps in 8 bits)."""
    rewards = grpo.pop("rewards", (reward_len,))
    return rfopt.TrialConfig(model=str(model), reward_funcs=list(rewards), args=grpo_config(optim=optim, **grpo),
                             peft_config=lora_config(r=r, lora_alpha=2 * r, target_modules="all-linear"),
                             quantization_config=BitsAndBytesConfig(**NF4))


# ---------------------------------------------------------------------- loading and the pool
def test_a_quantized_base_loads_on_the_cpu_once_and_apart_from_its_full_precision_copy(wide_model):
    import bitsandbytes as bnb

    pool = ModelPool("cpu")
    quantized, plain = qlora_config(wide_model), trial_config(wide_model)
    a, b = pool.acquire(0, quantized), pool.acquire(1, qlora_config(wide_model, learning_rate=1e-2))
    c = pool.acquire(2, plain)
    assert a is b and c is not a  # one quantized copy for both QLoRA trials; the full-precision trial has its own
    assert quantized.model_key != plain.model_key
    q_proj = a.get_base_model().model.layers[0].self_attn.q_proj
    assert isinstance(q_proj.base_layer, bnb.nn.Linear4bit) and q_proj.base_layer.weight.quant_state.quant_type == "nf4"
    assert type(c.get_base_model().model.layers[0].self_attn.q_proj.base_layer) is torch.nn.Linear


def test_without_bitsandbytes_a_trial_that_needs_it_is_refused_with_the_install_command(wide_model, monkeypatch):
    from rfopt.training.loading import load_model

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "bitsandbytes" else real(name, *a))
    with pytest.raises(ConfigError, match=r"quantization_config needs bitsandbytes, which is not installed here: "
                                          r"pip install 'rfopt\[qlora\]'"):
        load_model(qlora_config(wide_model), "cpu")
    with pytest.raises(ConfigError, match=r"args.optim='paged_adamw_8bit' needs bitsandbytes.*rfopt\[qlora\]"):
        load_model(trial_config(wide_model, optim="paged_adamw_8bit"), "cpu")


def test_a_study_refuses_a_qlora_config_up_front_where_bitsandbytes_is_missing(scripted, wide_model, tmp_path,
                                                                                 monkeypatch):
    """Before anything is stored or trained, with the config named (the run's up-front checks)."""
    import optuna

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "bitsandbytes" else real(name, *a))
    study = rfopt.create_study(study_name="q", storage=f"sqlite:///{tmp_path / 'q.db'}", checkpoint_dir=tmp_path / "ck")
    with pytest.raises(ConfigError, match=r"quantization_config needs bitsandbytes.*rfopt\[qlora\]") as refused:
        study.optimize([trial_config(wide_model), qlora_config(wide_model)], prompts_dataset(8),
                       prompts_dataset(2, "E"), num_chunks=2, show_progress_bar=False)
    assert "in configs[1]" in refused.value.__notes__
    assert optuna.load_study(study_name="q", storage=f"sqlite:///{tmp_path / 'q.db'}").trials == []


def test_a_device_bitsandbytes_does_not_serve_is_refused_by_name(wide_model):
    from rfopt.training.quantization import bitsandbytes_refusal

    assert bitsandbytes_refusal(qlora_config(wide_model), "cpu") is None
    assert bitsandbytes_refusal(trial_config(wide_model), "meta") is None  # no bitsandbytes: nothing to refuse
    assert "serves cpu, cuda" in bitsandbytes_refusal(qlora_config(wide_model), "meta")


def test_an_eval_mode_forward_changes_nothing_in_how_a_4bit_base_trains(wide_model):
    """bitsandbytes repacks a 4-bit weight for CPU inference at its first eval-mode forward without gradients (an
    evaluation), and its packed kernel has no backward (rfopt.compat ``bitsandbytes_trainable_4bit``)."""
    pool = ModelPool("cpu")
    model = pool.acquire(0, qlora_config(wide_model))
    torch.manual_seed(0)
    with torch.no_grad():  # LoRA B starts at zero: no gradient would reach the layers below
        for name, parameter in model.named_parameters():
            if "lora_B" in name:
                parameter.normal_(0, 0.05)
    lowest = model.get_base_model().model.layers[0].self_attn.q_proj

    def gradient():
        model.zero_grad()
        model(input_ids=torch.tensor([[5, 6, 7, 8]])).logits.square().sum().backward()
        return lowest.lora_A[model.active_adapter].weight.grad.clone()

    before = gradient()
    model.eval()
    with torch.no_grad():
        model(input_ids=torch.tensor([[5, 6, 7]]))
    model.train()
    assert not getattr(lowest.base_layer.weight.quant_state, "packing_format_for_cpu", False)
    assert before.abs().sum() > 0 and torch.equal(gradient(), before)


# ---------------------------------------------------------------------- the batched decoder on a quantized base
def test_the_batched_decoder_serves_each_member_through_the_quantized_layers(wide_model):
    """Each group's logits from the bank's view equal PEFT's forward of that trial's adapter on the 4-bit base."""
    from rfopt.training.rollouts.bank import LoraBank, adapter_refusal, decode_view

    pool = ModelPool("cpu")
    model = pool.acquire(0, qlora_config(wide_model, r=4))
    pool.acquire(1, qlora_config(wide_model, r=8, learning_rate=1e-2))
    with torch.no_grad():  # adapters that are not the identity (LoRA B starts at zero)
        for name, parameter in model.named_parameters():
            if "lora_B" in name:
                parameter.normal_(0, 0.05)
    assert adapter_refusal(model, "trial-0") is None
    bank = LoraBank.fitting(model, 2, None)
    bank.load(["trial-0", "trial-1"])
    view = decode_view(model, bank)
    ids = torch.tensor([[5, 6, 7, 8], [9, 10, 11, 12]])
    with torch.no_grad():
        batched = view(input_ids=ids).logits
        for row, name in enumerate(["trial-0", "trial-1"]):
            model.set_adapter(name)
            alone = model(input_ids=ids[row:row + 1]).logits[0]
            assert torch.allclose(batched[row], alone, atol=1e-2), (name, (batched[row] - alone).abs().max())
    assert not torch.allclose(batched[0], batched[1])


def test_the_batched_training_forward_gives_each_member_on_a_4bit_base_the_gradient_it_gets_alone(wide_model):
    """``gang_training="batched"``: every member's rows through the 4-bit base at once, each through its own adapter
    (rfopt.training.batched_step), as each gets them alone."""
    from rfopt.training.batched_step import BatchedBackbone, ForwardRequest, adapter_parameters

    pool = ModelPool("cpu")
    model = pool.acquire(0, qlora_config(wide_model, r=4))
    pool.acquire(1, qlora_config(wide_model, r=8, learning_rate=1e-2))
    torch.manual_seed(0)
    with torch.no_grad():  # adapters that are not the identity (LoRA B starts at zero)
        for name, parameter in model.named_parameters():
            if "lora_B" in name:
                parameter.normal_(0, 0.05)
    model.train()
    backbone = model.get_base_model().base_model
    batches = {"trial-0": torch.randint(3, 90, (2, 7)), "trial-1": torch.randint(3, 90, (3, 5))}
    alone = {}
    for adapter, ids in batches.items():
        model.set_adapter(adapter)
        model.zero_grad(set_to_none=True)
        hidden = backbone(input_ids=ids, attention_mask=torch.ones_like(ids), use_cache=False).last_hidden_state
        hidden.square().mean().backward()
        alone[adapter] = (hidden.detach(), [p.grad.clone() for p in adapter_parameters(model, adapter)])
    model.zero_grad(set_to_none=True)
    for adapter in batches:
        for p in adapter_parameters(model, adapter):
            p.requires_grad_(True)
    hidden = BatchedBackbone(backbone).forward(
        [ForwardRequest(adapter, ids, torch.ones_like(ids), grad=True) for adapter, ids in batches.items()])
    torch.autograd.backward([h.square().mean() for h in hidden])
    for h, adapter in zip(hidden, batches):
        assert torch.allclose(h.detach(), alone[adapter][0], atol=1e-4)
        for p, expected in zip(adapter_parameters(model, adapter), alone[adapter][1]):
            assert ((p.grad - expected).norm() / expected.norm()).item() <= 1e-3  # rounding: shapes change


def test_a_quantized_base_decodes_eagerly_by_default_even_on_a_gpu(wide_model, monkeypatch):
    from rfopt.training.rollouts import BATCHED
    from rfopt.training.rollouts.batched import default_mode

    monkeypatch.delenv("RFOPT_DECODE", raising=False)
    assert (default_mode("cuda"), default_mode("cuda", quantized=True)) == ("graph", "eager")
    pool = ModelPool("cpu")
    pool.acquire(0, qlora_config(wide_model))
    backend = pool.backend(BATCHED, 0, qlora_config(wide_model))
    assert backend.refusal(qlora_config(wide_model)) is None
    assert type(backend).__name__ == "BatchedBackend" and backend.mode == "eager"


# ---------------------------------------------------------------------- memory
def test_the_memory_estimate_counts_a_4bit_base_and_8bit_moments(wide_model):
    from rfopt.training.memory import gang_memory, model_bytes

    quantized = qlora_config(wide_model, optim="adamw_bnb_8bit")
    plain = trial_config(wide_model, peft=lora_config(r=32, target_modules="all-linear"))
    pool = ModelPool("cpu")
    model = pool.acquire(0, quantized).get_base_model()
    weights = [p for name, p in model.named_parameters() if "lora_" not in name]
    absmax = [p.quant_state.absmax for p in weights if getattr(p, "quant_state", None) is not None]
    loaded = sum(t.numel() * t.element_size() for t in weights + absmax)  # what is in memory, as loaded
    assert model_bytes(quantized) == pytest.approx(loaded, rel=0.02)
    assert model_bytes(quantized) < 0.75 * model_bytes(plain)  # the embedding stays fp32; every Linear is 4-bit
    q, p = gang_memory([quantized], 16), gang_memory([plain], 16)
    shapes = [(m.in_features, m.out_features) for n, m in model.named_modules() if n.endswith("_proj")
              and hasattr(m, "base_layer")]
    sizes = [n for i, o in shapes for n in (32 * i, o * 32)]  # rank 32: A is r x in, B out x r
    assert p.members[0] == 16 * sum(sizes)  # fp32 weight, gradient and two AdamW moments
    # bf16 weight and gradient, and 8-bit moments (fp32 ones for a tensor under 4096 weights: k_proj's and v_proj's B)
    assert q.members[0] == sum(n * (4 + (2 if n >= 4096 else 8)) for n in sizes) < p.members[0] / 2


# ---------------------------------------------------------------------- 8-bit optimizers: state bit for bit
def test_an_8bit_optimizers_state_survives_a_checkpoint_bit_for_bit(tmp_path):
    import bitsandbytes as bnb

    from rfopt.storage.checkpoints import CheckpointStore
    from rfopt.storage.state import TrialSnapshot

    def stepped(optimizer, params, n):
        for i in range(n):
            for p in params:
                p.grad = torch.sin(p.detach() * (i + 1))
            optimizer.step()

    torch.manual_seed(0)
    # Two tensors with 8-bit state (their quantization maps are one tensor) and one with 32-bit state.
    params = [torch.nn.Parameter(torch.randn(64, 64)), torch.nn.Parameter(torch.randn(64, 64)),
              torch.nn.Parameter(torch.randn(8, 8))]
    optimizer = bnb.optim.AdamW8bit(params, lr=1e-2)
    stepped(optimizer, params, 2)
    state = optimizer.state_dict()
    assert state["state"][0]  # bitsandbytes nests its quantized state in the entry
    store = CheckpointStore(tmp_path / "ck")
    store.save(0, TrialSnapshot(units_done=1, global_step=2, tokens_seen=0, weights={"w": params[0].detach()},
                                optimizer=state, scheduler=None, rng=None))
    copies = [torch.nn.Parameter(p.detach().clone()) for p in params]
    restored = bnb.optim.AdamW8bit(copies, lr=1e-2)
    restored.load_state_dict(store.load(0).optimizer)
    stepped(optimizer, params, 2)
    stepped(restored, copies, 2)
    for a, b in zip(params, copies):
        assert torch.equal(a, b)


# ---------------------------------------------------------------------- chunked = straight through, with TRL
def _straight_through(model_path, config, plan, schedule, dataset):
    """Plain TRL: one GRPOTrainer loading the model quantized from its path (``model_init_kwargs``), in plan order."""
    rows = [row for unit in range(plan.num_chunks) for row in plan.chunks[unit][: schedule.prompts_per_chunk]]
    tokenizer = AutoTokenizer.from_pretrained(model_path)
    tokenizer.padding_side = "left"
    args = config.args  # after the chunked run: the config is not used again
    args.shuffle_dataset = False
    args.model_init_kwargs = {"quantization_config": config.quantization_config}
    trainer = GRPOTrainer(model=str(model_path), reward_funcs=list(config.reward_funcs), args=args,
                          train_dataset=dataset.select(rows), processing_class=tokenizer,
                          peft_config=config.peft_config)
    trainer.train()
    return get_peft_model_state_dict(trainer.model)


@pytest.mark.slow
@pytest.mark.e2e
@pytest.mark.parametrize("optim", ["adamw_bnb_8bit", "paged_adamw_8bit"])
def test_a_qlora_trial_with_an_8bit_optimizer_trains_in_chunks_with_swaps_and_a_checkpoint_as_straight_through(
        wide_model, tmp_path, optim):
    from rfopt.storage.checkpoints import CheckpointStore

    dataset = prompts_dataset(16)
    config = qlora_config(wide_model, optim=optim, gradient_accumulation_steps=2, lr_scheduler_type="cosine")
    other = qlora_config(wide_model, r=8, rewards=[reward_vowels], learning_rate=1e-3, seed=3)
    plan = ChunkPlan.build(len(dataset), num_chunks=4, seed=0)
    schedule = trial_schedule(plan, config.args)
    pool = ModelPool("cpu")
    runners = [TrialRunner(n, c, plan, trial_schedule(plan, c.args), dataset, pool, tmp_path)
               for n, c in ((0, other), (1, config))]
    for _ in range(2):  # two chunks each, swapped in turn; then trial 1 goes to a checkpoint and a fresh pool
        for runner in runners:
            runner.train_chunk()
    store = CheckpointStore(tmp_path / "ck")
    store.save(1, runners[1].state())
    resumed = TrialRunner(1, config, plan, schedule, dataset, ModelPool("cpu"), tmp_path)
    resumed.load_state(store.load(1))
    while not resumed.finished:
        resumed.train_chunk()
    chunked = resumed.trainable_weights()
    assert type(resumed._optimizer).__module__.startswith("bitsandbytes")

    straight = _straight_through(wide_model, config, plan, schedule, dataset)
    assert chunked.keys() == straight.keys()
    for key, value in straight.items():
        assert torch.equal(chunked[key], value), f"{key} differs by {(chunked[key] - value).abs().max()}"
    assert any(v.abs().sum() > 0 for k, v in chunked.items() if "lora_B" in k)


# ---------------------------------------------------------------------- a study: gangs, a full-precision trial, a crash
@pytest.mark.slow
@pytest.mark.e2e
def test_a_qlora_study_trains_its_gang_beside_a_full_precision_trial_and_a_killed_run_reruns_to_the_same_end(
        dying, wide_model, tmp_path, monkeypatch, caplog):
    """tests/qlora_study.py: two QLoRA trials (8-bit optimizers) in one gang, their rollouts decoded in one batch
    through the 4-bit layers, and a full-precision LoRA trial of the same model on a base of its own; run
    uninterrupted, then killed after the first gang's checkpoints and run again: it ends as the uninterrupted run."""
    import logging
    from pathlib import Path

    from crashkit import adapter, crash_and_rerun_here, trials
    from rfopt.storage import schema

    monkeypatch.setenv("RFOPT_TEST_WIDE_MODEL", str(wide_model))
    study_file = Path(__file__).parent.parent / "qlora_study.py"
    with caplog.at_level(logging.WARNING, logger="rfopt"):
        died_at, _, storage = crash_and_rerun_here(study_file, ["gang-saved:1"], tmp_path, dying, name="qlora")
    assert died_at == ["gang-saved:1"]
    reference = trials(f"sqlite:///{tmp_path / 'ref.db'}", "qlora")
    assert [t.state.name for t in reference] == ["COMPLETE"] * 3
    assert {schema.gang_plan(t, 0).numbers for t in reference[:2]} == {(0, 1)}  # the QLoRA pair trained as one gang
    assert all(len(t.intermediate_values) == 2 for t in reference)
    learned = [adapter(t) for t in reference]
    for weights in learned:  # LoRA B starts at zero: every trial's adapter learned
        assert any(k.endswith("lora_B.weight") and v.abs().max() > 0 for k, v in weights.items())
    assert not torch.equal(*(next(v for k, v in w.items() if k.endswith("lora_B.weight")) for w in learned[:2]))
    assert len(learned[0]) > len(learned[2])  # all-linear on the 4-bit base, q and v on the full-precision one
    assert "one after another" not in caplog.text and "train alone" not in caplog.text
