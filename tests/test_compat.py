"""Canaries for rfopt/compat.py: each fails loudly when the library symbol, or the call site, that one of rfopt's
patches of another library's internals relies on is gone, so an upgrade cannot leave a patch silently doing nothing."""

import inspect
import os
import warnings

import optuna
import pytest
from optuna.trial import TrialState

from rfopt import compat
from rfopt_testkit import prompts_dataset, trial_config


# ---------------------------------------------------------------------- carried_trainer_state, kl_reference_base_model,
#                                                                          telemetry_once
def test_the_training_loop_calls_init_training_state_before_it_reads_the_step_it_logs_from():
    from transformers import Trainer

    loop = inspect.getsource(Trainer._inner_training_loop)
    assert "self._init_training_state(" in loop
    assert loop.index("self._init_training_state(") < loop.index("self._globalstep_last_logged = self.state.global_step")


def test_grpo_reads_its_beta_attribute_when_it_trains_and_pings_telemetry_from_its_constructor():
    from trl import GRPOTrainer

    scoring = inspect.getsource(GRPOTrainer._generate_and_score_completions)
    assert "if self.beta != 0.0:" in scoring and "use_adapter(" in scoring  # the base model, adapter disabled
    assert "self.beta" in inspect.getsource(GRPOTrainer._compute_loss)
    constructors = "".join(inspect.getsource(c.__init__) for c in GRPOTrainer.__mro__
                           if "__init__" in vars(c) and inspect.isfunction(c.__init__))
    assert "self._send_telemetry()" in constructors


@pytest.mark.e2e
def test_a_chunk_trainer_continues_at_the_carried_step_with_the_beta_it_is_given(tiny_model, tmp_path, monkeypatch):
    """Behaviour, not source: built with beta=0 and given 0.04, it logs a KL; started at step 3 of 4, its one step
    is step 4; it pings TRL's telemetry only as a trial's first chunk."""
    import dataclasses

    from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback
    from trl import GRPOTrainer

    from rfopt_testkit import lora_config

    pings = []
    monkeypatch.setattr(GRPOTrainer, "_send_telemetry", lambda self: pings.append(1))

    class Logs(TrainerCallback):
        seen = []

        def on_log(self, args, state, control, logs=None, **kwargs):
            self.seen.append((state.global_step, dict(logs or {})))

    from peft import get_peft_model

    config = trial_config(tiny_model)
    model = get_peft_model(AutoModelForCausalLM.from_pretrained(tiny_model), lora_config())
    tokenizer = AutoTokenizer.from_pretrained(tiny_model)
    tokenizer.padding_side = "left"
    args = dataclasses.replace(config.args, output_dir=str(tmp_path), max_steps=4, beta=0.0, logging_steps=1,
                               report_to=[], generation_batch_size=None)
    trainer_class = compat.chunk_trainer_class()
    with compat.restore_shared_model(model, args):
        trainer = trainer_class(model=model, reward_funcs=list(config.reward_funcs), args=args,
                                train_dataset=prompts_dataset(4), processing_class=tokenizer, callbacks=[Logs()],
                                start_step=3, tokens_seen=100, first_chunk=False, beta=0.04)
        trainer.train()
    assert trainer.state.global_step == 4 and pings == []
    step, logs = next((step, logs) for step, logs in Logs.seen if "loss" in logs)
    assert step == 4 and "kl" in logs
    assert trainer.state.num_input_tokens_seen > 100
    trainer_class(model=model, reward_funcs=list(config.reward_funcs), args=args, train_dataset=prompts_dataset(4),
                  processing_class=tokenizer, start_step=0, tokens_seen=0, first_chunk=True, beta=0.0)
    assert pings == [1]


# ---------------------------------------------------------------------- shared_model_restored
def test_the_input_require_grads_hook_is_where_the_shared_model_restore_removes_it(tiny_model):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny_model)
    model.enable_input_require_grads()
    assert getattr(model, "_require_grads_hook", None) is not None
    model.disable_input_require_grads()


def test_a_grpo_trainer_wraps_the_model_forward_on_the_instance_and_the_restore_takes_it_off(tiny_model, tmp_path):
    import dataclasses

    from peft import get_peft_model
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from trl import GRPOTrainer

    from rfopt_testkit import lora_config

    config = trial_config(tiny_model)
    model = get_peft_model(AutoModelForCausalLM.from_pretrained(tiny_model), lora_config())
    base = model.get_base_model()
    args = dataclasses.replace(config.args, output_dir=str(tmp_path), report_to=[], generation_batch_size=None)
    with compat.restore_shared_model(model, args):
        GRPOTrainer(model=model, reward_funcs=list(config.reward_funcs), args=args, train_dataset=prompts_dataset(4),
                    processing_class=AutoTokenizer.from_pretrained(tiny_model))
        assert "forward" in vars(model) or "forward" in vars(base)  # what the restore exists for
    assert "forward" not in vars(model) and "forward" not in vars(base)


# ---------------------------------------------------------------------- trl_model_loading
def test_grpo_trainer_loads_a_string_model_and_its_processing_class_the_way_rfopt_copies():
    """rfopt loads a string model as GRPOTrainer.__init__ does: create_model_from_path with args.model_init_kwargs
    (quantization_config and trust_remote_code added), and with no processing_class an AutoProcessor padded and
    truncated on the left (rfopt.training.loading.load_model)."""
    from trl import GRPOTrainer
    from trl.trainer.utils import create_model_from_path

    assert list(inspect.signature(create_model_from_path).parameters) == ["model_id", "architecture", "kwargs"]
    init = inspect.getsource(GRPOTrainer.__init__)
    loading = init[init.index("if isinstance(model, str):"): init.index("# Processing class")]
    assert 'model_init_kwargs["quantization_config"] = quantization_config' in loading
    assert 'model_init_kwargs.setdefault("trust_remote_code", args.trust_remote_code)' in loading
    assert "create_model_from_path(model, **model_init_kwargs)" in loading
    processing = init[init.index("if processing_class is None:"):]
    processing = processing[: processing.index("\n\n")]
    assert "AutoProcessor.from_pretrained(" in processing
    assert 'truncation_side="left"' in processing and 'padding_side="left"' in processing


def test_trls_model_loader_defaults_to_float32_reads_dtype_names_and_places_on_the_device_map(tiny_model, tmp_path):
    import torch
    from transformers import AutoModelForCausalLM

    AutoModelForCausalLM.from_pretrained(tiny_model, dtype=torch.bfloat16).save_pretrained(tmp_path / "bf16")
    assert AutoModelForCausalLM.from_pretrained(tmp_path / "bf16").dtype == torch.bfloat16  # transformers: "auto"
    assert compat.create_model(str(tmp_path / "bf16")).dtype == torch.float32  # TRL: float32 unless told
    loaded = compat.create_model(str(tiny_model), dtype="bfloat16", device_map={"": "cpu"})
    assert loaded.dtype == torch.bfloat16 and loaded.device == torch.device("cpu")
    with pytest.raises(ValueError, match="Invalid `dtype`"):
        compat.create_model(str(tiny_model), dtype="int3")


# ---------------------------------------------------------------------- plain_object_state
def test_trls_factory_rewards_are_plain_objects_whose_state_is_their_arguments():
    import functools

    import trl.rewards
    from rfopt_callbacks import RecordingCallback
    from rfopt_testkit import reward_len

    for reward, arguments in ((trl.rewards.get_soft_overlong_punishment(8, 4), {"max_completion_len": 8,
                                                                                "soft_punish_cache": 4}),
                              (trl.rewards.get_repetition_penalty_reward(2, -0.5), {"ngram_size": 2,
                                                                                    "max_penalty": -0.5})):
        assert compat.object_state(reward) == arguments
        again = compat.object_from_state(type(reward), compat.object_state(reward))
        assert again(completion_ids=[[1, 2, 1, 2, 1], [3]]) == reward(completion_ids=[[1, 2, 1, 2, 1], [3]])
    callback = RecordingCallback()
    callback.tag = "x"
    assert compat.object_state(callback) == {"tag": "x"}
    for not_plain in (reward_len, RecordingCallback, functools.partial(reward_len), print, 3, "text"):
        assert compat.object_state(not_plain) is None


# ---------------------------------------------------------------------- Optuna: optimize_loop, finished_trial_cache,
#                                                                          optuna_ids
def test_study_stop_works_inside_the_optimize_loop_marker_only():
    study = optuna.create_study()
    with pytest.raises(RuntimeError):
        study.stop()  # outside optimize(): Optuna refuses
    with compat.optimize_loop(study):
        study.stop()
        assert compat.stop_requested(study)
    assert not study._thread_local.in_optimize_loop


def test_optuna_puts_its_cache_of_finished_trials_in_front_of_an_rdb_storage(tmp_path):
    rdb = optuna.storages.RDBStorage(f"sqlite:///{tmp_path / 'c.db'}")
    cached = compat.cached(rdb)
    assert cached is not rdb and isinstance(cached, optuna.storages.BaseStorage)
    study = optuna.create_study(storage=cached, study_name="c")
    study.optimize(lambda trial: trial.suggest_float("x", 0, 1), n_trials=2)
    assert len(optuna.load_study(study_name="c", storage=rdb).trials) == 2


def test_optuna_objects_keep_their_storage_and_ids_where_rfopt_reads_them():
    study = optuna.create_study(study_name="ids")
    study.ask()
    frozen = study.trials[0]
    storage = compat.storage_of(study)
    assert storage.get_trial(compat.trial_id_of(frozen)).number == 0
    summary = next(s for s in storage.get_all_studies() if s.study_name == "ids")
    assert compat.study_id_of(summary) == storage.get_study_id_from_name("ids") == compat.study_id_of(study)


# ---------------------------------------------------------------------- pruner_settings
@pytest.mark.parametrize(
    "pruner, expected",
    [
        (optuna.pruners.MedianPruner(n_startup_trials=3, n_warmup_steps=2, interval_steps=4, n_min_trials=5),
         {"percentile": 50.0, "n_startup_trials": 3, "n_warmup_steps": 2, "interval_steps": 4, "n_min_trials": 5}),
        (optuna.pruners.ThresholdPruner(lower=0.1, upper=0.9, n_warmup_steps=1, interval_steps=2),
         {"lower": 0.1, "upper": 0.9, "n_warmup_steps": 1, "interval_steps": 2}),
        (optuna.pruners.SuccessiveHalvingPruner(min_resource=2, reduction_factor=3, min_early_stopping_rate=1,
                                                bootstrap_count=0),
         {"min_resource": 2, "reduction_factor": 3, "min_early_stopping_rate": 1, "bootstrap_count": 0}),
        (optuna.pruners.HyperbandPruner(min_resource=1, max_resource=8, reduction_factor=2),
         {"min_resource": 1, "max_resource": 8, "reduction_factor": 2, "bootstrap_count": 0}),
        (optuna.pruners.WilcoxonPruner(p_threshold=0.2, n_startup_steps=3), {"p_threshold": 0.2, "n_startup_steps": 3}),
    ],
)
def test_pruners_keep_their_constructor_arguments_where_rfopt_reads_them(pruner, expected):
    assert compat.pruner_settings(pruner) == expected


def test_a_patient_pruner_without_its_wrapped_pruner_is_the_patience_test_alone():
    inner = optuna.pruners.NopPruner()
    pruner = optuna.pruners.PatientPruner(inner, patience=1, min_delta=0.0)
    assert compat.pruner_settings(pruner) == {"wrapped_pruner": inner, "patience": 1, "min_delta": 0.0}
    study = optuna.create_study(direction="maximize")
    trial = study.ask()
    for step, value in enumerate([1.0, 0.5, 0.4]):  # no improvement for two steps
        trial.report(value, step)
    frozen = study.trials[0]
    assert compat.patience_gate(pruner).prune(study, frozen) is True  # Nop alone would never prune
    assert pruner.prune(study, frozen) is False


def test_optunas_percentile_helpers_compute_what_the_median_pruner_compares():
    best_over_steps, percentile_over_trials, first_in_interval = compat.percentile_helpers()
    study = optuna.create_study(direction="maximize")
    for values in ([0.1, 0.4], [0.2, 0.8], [0.3, 0.6]):
        trial = study.ask()
        for step, value in enumerate(values):
            trial.report(value, step)
        study.tell(trial, values[-1])
    trials = study.trials
    assert best_over_steps(trials[0], study.direction) == 0.4
    assert percentile_over_trials(trials, study.direction, 1, 50.0, 1) == 0.6
    assert first_in_interval(1, [0, 1], 0, 1) is True


def test_a_study_view_serves_optunas_public_reads_from_its_list():
    class View(compat.StudyView):
        def _best_of(self, deepcopy):
            return self._view_trials[-1]

    study = optuna.create_study()
    for x in (1.0, 2.0):
        trial = study.ask()
        study.tell(trial, x)
    view = View("v", [optuna.study.StudyDirection.MINIMIZE], list(reversed(study.trials)))
    assert [t.number for t in view.trials] == [0, 1]
    assert [t.number for t in view.get_trials(states=(TrialState.COMPLETE,))] == [0, 1]
    assert view.best_trial.number == 1 and view.direction == optuna.study.StudyDirection.MINIMIZE


# ---------------------------------------------------------------------- version guard
def test_a_patched_library_outside_its_tested_range_warns_once(monkeypatch):
    import importlib.metadata

    compat.check_version.cache_clear()
    real = importlib.metadata.version
    monkeypatch.setattr(importlib.metadata, "version", lambda name: "99.0.0" if name == "trl" else real(name))
    with pytest.warns(compat.CompatWarning, match=r"rfopt was tested with trl~=1.16.0; 99.0.0 is installed"):
        assert compat.check_version("trl") is False
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        compat.check_version("trl")  # once
    monkeypatch.undo()
    compat.check_version.cache_clear()
    assert all(compat.check_version(package) for package in compat.TESTED)  # what is installed is what was tested


# ---------------------------------------------------------------------- enqueued_params
def test_an_enqueued_trial_holds_its_params_in_the_fixed_params_system_attr_which_suggest_reads():
    study = optuna.create_study()
    study.enqueue_trial({"x": 0.25})
    assert study.get_trials()[0].system_attrs["fixed_params"] == {"x": 0.25}  # what compat.enqueue_trial writes
    compat.enqueue_trial(study, {"x": 0.5}, {"rfopt:list_index": 1})
    waiting = study.get_trials()[1]
    assert waiting.state == TrialState.WAITING and waiting.user_attrs == {}
    assert waiting.system_attrs == {"rfopt:list_index": 1, "fixed_params": {"x": 0.5}}
    study.ask()
    trial = study.ask()
    assert trial.suggest_float("x", 0, 1) == 0.5 and trial.number == 1


# ---------------------------------------------------------------------- dashboard_backlink
def test_optuna_dashboards_page_has_a_body_end_where_the_link_to_rfopt_goes():
    from pathlib import Path

    import optuna_dashboard

    page = (Path(optuna_dashboard.__file__).parent / "index.html").read_bytes()
    linked = compat.with_backlink(page, b"<a id='x'></a>")
    assert linked is not None and linked.count(b"<a id='x'></a></body>") == 1
    assert compat.with_backlink(b"<html>no end</html>", b"<a></a>") is None


# ---------------------------------------------------------------------- trainer_generate_call, ddp_ignored_parameters
def test_grpo_generates_on_the_unwrapped_model_with_a_generation_config_and_custom_processors_come_before_warpers():
    from transformers import GenerationMixin
    from trl import GRPOTrainer

    generating = inspect.getsource(GRPOTrainer._generate_single_turn)
    assert "unwrapped_model.generate(" in generating and "generation_config=self.generation_config" in generating
    assert "logits_processor" not in generating  # rfopt's processor is the only custom one
    processors = inspect.getsource(GenerationMixin._get_logits_processor)
    assert processors.index("_merge_criteria_processor_list(processors, logits_processor)") < processors.index(
        "TemperatureLogitsWarper(")


def test_an_extra_logits_processor_decides_what_generate_samples_and_comes_off_after(tiny_model):
    import torch
    from transformers import AutoModelForCausalLM, GenerationConfig

    model = AutoModelForCausalLM.from_pretrained(tiny_model)
    inputs = torch.tensor([[1, 2, 3], [1, 2, 4]])

    class Only7:
        def __call__(self, input_ids, scores):
            return torch.full_like(scores, float("-inf")).index_fill_(1, torch.tensor([7]), 0.0)

    seen = []
    with compat.extra_logits_processor(model, lambda config, rows: seen.append(rows) or Only7()):
        out = model.generate(input_ids=inputs, generation_config=GenerationConfig(
            do_sample=True, max_new_tokens=3, temperature=0.5, top_k=5, pad_token_id=0))
    assert seen == [2] and out[:, 3:].eq(7).all()
    assert "generate" not in vars(model)  # the class's method again


def test_ddp_reads_the_parameters_to_ignore_from_the_attribute_rfopt_sets():
    import torch
    from torch.nn.parallel import DistributedDataParallel

    module = torch.nn.Linear(2, 2)
    DistributedDataParallel._set_params_and_buffers_to_ignore_for_model(module, ["bias"])
    assert module._ddp_params_and_buffers_to_ignore == ["bias"]
    assert "_ddp_params_and_buffers_to_ignore" in inspect.getsource(DistributedDataParallel.__init__)


def test_a_module_view_shares_the_weights_keeps_no_hook_or_instance_forward_and_leaves_the_model_alone(tiny_model):
    """Canary of ``module_view``: torch keeps a module's children in ``_modules`` and its hooks in the dicts the view
    empties; a view computes what the model computes, with a hook and a trainer's ``forward`` wrapper left behind."""
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny_model)
    ids = torch.tensor([[3, 4, 5]])
    with torch.no_grad():
        expected = model(input_ids=ids).logits
    calls = []
    hook = model.model.layers[0].register_forward_hook(lambda *args: calls.append(1))
    model.forward = lambda *a, **k: (_ for _ in ()).throw(AssertionError("the instance forward ran"))
    replaced = []

    def replace(module, view_of):
        if module is model.lm_head:
            replaced.append(module)
        return None

    view = compat.module_view(model, replace)
    with torch.no_grad():
        got = view(input_ids=ids).logits
    assert torch.equal(got, expected) and calls == [] and replaced == [model.lm_head]
    assert view.lm_head.weight is model.lm_head.weight and view.model.layers[0] is not model.model.layers[0]
    assert "forward" in vars(model) and len(model.model.layers[0]._forward_hooks) == 1  # the model keeps its own
    hook.remove()


def test_a_models_config_says_which_attention_it_was_loaded_with(tiny_model):
    """Canary of ``attention_implementation``."""
    from transformers import AutoModelForCausalLM

    assert compat.attention_implementation(AutoModelForCausalLM.from_pretrained(tiny_model).config) == "sdpa"
    eager = AutoModelForCausalLM.from_pretrained(tiny_model, attn_implementation="eager")
    assert compat.attention_implementation(eager.config) == "eager"


# ---------------------------------------------------------------------- generation_defaults
def test_generation_settings_are_what_generate_decodes_with_the_models_own_config_filling_what_trl_leaves_unset(
        tiny_model, tmp_path):
    """Canary of ``generation_defaults``: `generation_settings` merges a caller's config (or keyword arguments) with the
    model's ``generation_config`` and transformers' defaults exactly as ``generate`` does before it decodes."""
    from transformers import AutoModelForCausalLM, GenerationConfig

    from rfopt.training.rollouts import generation_settings

    model = AutoModelForCausalLM.from_pretrained(tiny_model)
    model.generation_config.min_p = 0.05
    model.generation_config.no_repeat_ngram_size = 3
    model.generation_config.top_k = 20
    # What GRPOTrainer hands generate: top_k=0 set, min_p left None, no_repeat_ngram_size not named.
    trl = GenerationConfig(max_new_tokens=8, do_sample=True, pad_token_id=0, bos_token_id=2, eos_token_id=[3],
                           temperature=0.9, top_p=1.0, top_k=0, min_p=None, repetition_penalty=1.0,
                           cache_implementation=None, disable_compile=True)
    merged = generation_settings(model.generation_config, trl)
    assert merged.to_dict() == model._prepare_generation_config(trl)[0].to_dict()
    assert (merged.min_p, merged.no_repeat_ngram_size, merged.top_k, merged.num_beams) == (0.05, 3, 0, 1)
    kwargs = dict(max_new_tokens=4, do_sample=False, temperature=None, top_k=None, pad_token_id=0, eos_token_id=[3])
    assert (generation_settings(model.generation_config, **kwargs).to_dict()
            == model._prepare_generation_config(None, **kwargs)[0].to_dict())
    assert {"top_k", "num_beams", "no_repeat_ngram_size", "do_sample"} <= compat.generation_defaults().keys()


# ---------------------------------------------------------------------- trackio_run_per_trial, trackio_flush
def test_trackio_runs_opened_one_after_another_all_stay_open_and_a_flush_writes_what_they_logged():
    """trackio.init finishes the current run (a ContextVar); opened in a context of their own, two runs both log."""
    pytest.importorskip("trackio", reason="trackio is not installed: pip install -e '.[trackers]'")
    from trackio.sqlite_storage import SQLiteStorage

    project = f"canary-{os.getpid()}"
    a = compat.trackio_run(project=project, name="a", auto_log_cpu=False, auto_log_gpu=False)
    b = compat.trackio_run(project=project, name="b", auto_log_cpu=False, auto_log_gpu=False)
    assert not a._stop_flag.is_set()  # opening b did not finish a (trackio.init alone would have)
    a.log({"x": 1.0}, step=1)
    b.log({"x": 2.0}, step=1)
    compat.trackio_flush(a)
    compat.trackio_flush(b)
    assert [log["x"] for log in SQLiteStorage.get_logs(project, "a")] == [1.0]  # on disk before any finish
    assert [log["x"] for log in SQLiteStorage.get_logs(project, "b")] == [2.0]
    a.finish()
    b.finish()


def test_the_loss_types_rfopt_accepts_are_the_ones_trls_grpo_trainer_computes():
    """Canary for `compat.GRPO_LOSS_TYPES`: GRPOConfig takes any text as loss_type, and GRPOTrainer raises "Unknown
    loss type" at the first step for one it does not compute."""
    import inspect
    import re

    import trl.trainer.grpo_trainer as grpo

    source = inspect.getsource(grpo)
    assert "Unknown loss type" in source
    named = set(re.findall(r'loss_type (?:==|in) \[?"([a-z_]+)"', source)) | set(
        re.findall(r'"([a-z_]+)"', " ".join(re.findall(r"loss_type in \[([^\]]+)\]", source))))
    assert named == set(compat.GRPO_LOSS_TYPES), named ^ set(compat.GRPO_LOSS_TYPES)


# ---------------------------------------------------------------------- gang_backbone_calls, gang_backward
def test_trls_fused_lm_head_computes_log_probs_through_the_backbone_call_a_gang_routes(tiny_model):
    import torch
    from peft import get_peft_model
    from transformers import AutoModelForCausalLM, Trainer
    from trl import GRPOTrainer
    from trl.trainer import utils

    from rfopt_testkit import lora_config

    head = inspect.getsource(utils.add_fused_lm_head)
    assert 'backbone_attr = "base_model"' in head and "getattr(self, backbone_attr)(*args, **kwargs)" in head
    assert "backbone_outputs.last_hidden_state" in head
    scoring = inspect.getsource(GRPOTrainer._get_per_token_logps_and_entropies)
    assert 'model_inputs = {"input_ids": input_ids_batch, "attention_mask": attention_mask_batch}' in scoring
    assert "self.accelerator.backward(loss" in inspect.getsource(Trainer.training_step)
    # and it does: with the head added, a fused call goes through the routed backbone, which is put back after
    model = get_peft_model(AutoModelForCausalLM.from_pretrained(tiny_model), lora_config())
    utils.add_fused_lm_head(model.get_base_model(), outputs=("log_probs",))
    ids = torch.tensor([[5, 6, 7, 8]])
    calls = []
    try:
        with compat.intercept_backbone(model, lambda original, args, kwargs: calls.append(kwargs) or original(
                *args, **kwargs)) as backbone:
            out = model(input_ids=ids, attention_mask=torch.ones_like(ids), labels=ids, fused_lm_head=True)
    finally:
        vars(model.get_base_model()).pop("forward", None)
    assert out.log_probs.shape == (1, 3) and len(calls) == 1 and set(calls[0]) >= {"input_ids", "attention_mask"}
    assert "forward" not in vars(backbone)


def test_accelerate_divides_the_loss_by_the_accumulation_steps_and_calls_backward_where_rfopt_routes_it():
    from types import SimpleNamespace

    import torch
    from accelerate import Accelerator

    source = inspect.getsource(Accelerator.backward)
    assert "loss = loss / self.gradient_accumulation_steps" in source and "loss.backward(**kwargs)" in source
    accelerator = Accelerator(cpu=True, gradient_accumulation_steps=2)
    routed = []
    assert compat.route_backward(SimpleNamespace(accelerator=accelerator), routed.append)
    accelerator.backward(torch.tensor(3.0))
    assert [float(x) for x in routed] == [1.5]


# ---------------------------------------------------------------------- bitsandbytes_cpu_kernel_warning,
#                                                                          bitsandbytes_trainable_4bit
def test_bitsandbytes_warns_about_its_cpu_kernel_on_its_own_logger_and_rfopt_drops_only_that_record(caplog):
    pytest.importorskip("bitsandbytes")
    import logging

    from bitsandbytes.backends.cpu import ops

    source = inspect.getsource(ops)
    assert "logger = logging.getLogger(__name__)" in source and compat.BITSANDBYTES_CPU_KERNEL_WARNING in source
    assert ops.logger.name == "bitsandbytes.backends.cpu.ops"
    compat.quiet_bitsandbytes()
    compat.quiet_bitsandbytes()  # idempotent: one filter
    assert len(ops.logger.filters) == 1
    with caplog.at_level(logging.WARNING, logger=ops.logger.name):
        ops.logger.warning(compat.BITSANDBYTES_CPU_KERNEL_WARNING + ": No module named 'kernels'")
        ops.logger.warning("something else")
    assert [r.getMessage() for r in caplog.records if r.name == ops.logger.name] == ["something else"]


def test_bitsandbytes_repacks_a_4bit_weight_for_cpu_inference_only_where_its_flag_allows():
    pytest.importorskip("bitsandbytes")
    from bitsandbytes.nn import Linear4bit

    forward = inspect.getsource(Linear4bit.forward)
    assert "self.support_avx512bf16_for_cpu" in forward and "not self.training" in forward
    assert "_convert_weight_packed_for_cpu(" in forward
    assert "self.support_avx512bf16_for_cpu" in inspect.getsource(Linear4bit.__init__)
