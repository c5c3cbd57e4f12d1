"""Shared pieces of the engine tests: tiny datasets, trial configs on the tiny model, reward functions.

Reward functions live here (not in a test module) so that configs holding them can be stored by
import path and loaded again, as a real study's would.
"""

from __future__ import annotations

import math
import os
import tempfile

from datasets import Dataset


def reward_len(completions, **kwargs):
    """Rewards longer completions, up to 8 characters: the tiny model can learn it."""
    return [min(len(_text(c)), 8) / 8 for c in completions]


def reward_vowels(completions, **kwargs):
    return [sum(ch in "aeiou" for ch in _text(c)) / 4 for c in completions]


def reward_raises(completions, **kwargs):
    raise RuntimeError("reward server unreachable")


def reward_exits(completions, **kwargs):
    """A bug in one config's reward: it ends the process."""
    import sys

    sys.exit(3)


def reward_wrong_length(completions, **kwargs):
    return [0.0] * (len(completions) - 1)


def reward_nan(completions, **kwargs):
    return [math.nan] * len(completions)


def reward_none(completions, **kwargs):
    return None


def reward_text(completions, **kwargs):
    return ["good"] * len(completions)


def reward_inf(completions, **kwargs):
    return [math.inf] * len(completions)


def reward_reads_solution(completions, **kwargs):
    """Reads a column no test dataset has, through ``kwargs``."""
    return [float(kwargs["solution"][i] == _text(c)) for i, c in enumerate(completions)]


def reward_answer(completions, answer, **kwargs):
    """Takes the ``answer`` column as a parameter, as TRL passes it."""
    return [float(a in _text(c)) for c, a in zip(completions, answer)]


def reward_step(completions, trainer_state, **kwargs):
    """The trainer's global step: what a reward that shapes itself over training reads."""
    return [float(trainer_state.global_step)] * len(completions)


async def reward_len_async(completions, **kwargs):
    return reward_len(completions, **kwargs)


def _text(completion):
    return completion[0]["content"] if isinstance(completion, list) else completion


def prompts_dataset(n: int, prefix: str = "Q", conversational: bool = False) -> Dataset:
    rows = []
    for i in range(n):
        question = f"{prefix}{i}: add {i} and {i % 7}"
        prompt = [{"role": "user", "content": question}] if conversational else question
        rows.append({"prompt": prompt, "answer": str(i + i % 7)})
    return Dataset.from_list(rows)


def grpo_config(**overrides):
    from trl import GRPOConfig

    settings = dict(
        output_dir=os.path.join(tempfile.gettempdir(), "rfopt-tests-trainer"),
        save_strategy="no",
        report_to=[],
        learning_rate=5e-3,
        per_device_train_batch_size=4,
        num_generations=4,
        max_completion_length=8,
        num_train_epochs=1,
        bf16=False,
        use_cpu=True,
        gradient_checkpointing=False,
        seed=7,
    )
    settings.update(overrides)
    return GRPOConfig(**settings)


def lora_config(**overrides):
    from peft import LoraConfig

    settings = dict(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], lora_dropout=0.0)
    settings.update(overrides)
    return LoraConfig(**settings)


def trial_config(model_path, rewards=(reward_len, reward_vowels), peft=None, **grpo_overrides):
    """A config on the tiny model: `rewards` are its reward_funcs, `peft` its peft_config (default `lora_config()`),
    `grpo_overrides` change `grpo_config()` (its args)."""
    import rfopt

    return rfopt.TrialConfig(
        model=str(model_path),
        reward_funcs=list(rewards),
        args=grpo_config(**grpo_overrides),
        peft_config=peft if peft is not None else lora_config(),
    )


def tiny_model_with_generation_config(tiny_model, path, **settings):
    """A copy of the tiny model at `path` whose own ``generation_config`` sets `settings` (``min_p``,
    ``no_repeat_ngram_size``, ...): transformers' ``generate`` fills the fields its caller leaves unset from them."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(tiny_model)
    for key, value in settings.items():
        setattr(model.generation_config, key, value)
    model.save_pretrained(path)
    AutoTokenizer.from_pretrained(tiny_model).save_pretrained(path)
    return path


def tiny_model_factory():
    """A user function returning (model, tokenizer), as TrialConfig.model accepts; the path comes from the test."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    path = os.environ["RFOPT_TEST_TINY_MODEL"]
    return AutoModelForCausalLM.from_pretrained(path), AutoTokenizer.from_pretrained(path)


def deepmath_rows(n):
    """`n` rows in DeepMath-103K's format (question, final_answer, difficulty, topic, three R1 solutions)."""
    return [
        {
            "question": f"Evaluate the limit number {i}.",
            "final_answer": f"\\frac{{1}}{{{i + 2}}}",
            "difficulty": 4.5,
            "topic": "Mathematics -> Calculus -> Limits",
            "r1_solution_1": f"... so the limit is \\boxed{{\\frac{{1}}{{{i + 2}}}}}",
            "r1_solution_2": "...",
            "r1_solution_3": "...",
        }
        for i in range(n)
    ]


REWARD_HOOK = None
"""Called (if set) by `reward_len_hooked` before it scores: lets a test act in the middle of a training step."""


def reward_len_hooked(completions, **kwargs):
    """`reward_len`, calling `REWARD_HOOK` first."""
    if REWARD_HOOK is not None:
        REWARD_HOOK()
    return reward_len(completions, **kwargs)



CHROMIUM, CHROMEDRIVER = "/usr/bin/chromium", "/usr/bin/chromedriver"


def chromium(profile_dir, width: int = 1400, height: int = 1000):
    """A headless Chromium driven by selenium (Debian's chromium and chromium-driver), with its profile in
    `profile_dir`; None when either is missing. Quit it when done."""
    import shutil

    if not (shutil.which(CHROMIUM) and shutil.which(CHROMEDRIVER)):
        return None
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service

    options = webdriver.ChromeOptions()
    options.binary_location = CHROMIUM
    for arg in ("--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
                "--disable-background-networking", "--disable-component-update", "--disable-sync",
                "--disable-dev-shm-usage", f"--window-size={width},{height}", f"--user-data-dir={profile_dir}"):
        options.add_argument(arg)
    return webdriver.Chrome(service=Service(CHROMEDRIVER), options=options)


def reward_interrupted(completions, **kwargs):
    """A Ctrl-C arriving while this reward runs."""
    raise KeyboardInterrupt


PEAK_STEP = 4
"""The global step at which `reward_peak` pays its bonus: after the second chunk of a trial of 2 steps a chunk."""


def reward_peak(completions, trainer_state, **kwargs):
    """10 for every completion scored at step `PEAK_STEP`, else 0: the same for every completion of a group (so it never
    changes what training learns), and it makes the evaluation after one chunk the trial's best, whatever came after."""
    return [10.0 if trainer_state.global_step == PEAK_STEP else 0.0] * len(completions)


def reward_agreement(completions, **kwargs):
    """The share of the batch's completions that equal this one: what one text answering every prompt maximizes (a
    reward a collapse satisfies)."""
    texts = [_text(c) for c in completions]
    return [texts.count(t) / len(texts) for t in texts]


def saved_bytes(roots, exclude=frozenset()):
    """Bytes of the tensors the autograd graph behind `roots` keeps for its backward (each storage once; `exclude`:
    storages not to count, the model's weights)."""
    import torch

    seen, stack, visited = {}, [r.grad_fn for r in roots], set()
    while stack:
        node = stack.pop()
        if node is None or node in visited:
            continue
        visited.add(node)
        saved = [getattr(node, name) for name in dir(node) if name.startswith("_saved_")]
        saved += list(getattr(node, "saved_tensors", ()) or ())  # a custom autograd Function's
        for value in saved:
            for t in value if isinstance(value, (tuple, list)) else (value,):
                if isinstance(t, torch.Tensor) and t.device.type != "meta":
                    storage = t.untyped_storage()
                    if storage.data_ptr() not in exclude:
                        seen[storage.data_ptr()] = storage.nbytes()
        stack.extend(fn for fn, _ in node.next_functions)
    return sum(seen.values())


def record_gang_modes(monkeypatch) -> list[tuple[int, str]]:
    """(members, training mode) of every `rfopt.training.gang.Gang` built while the test runs, in order."""
    from rfopt.training import gang as gang_module

    modes: list[tuple[int, str]] = []
    init = gang_module.Gang.__init__

    def recording(self, backend, members, training=gang_module.DEFAULT_GANG_TRAINING, **kwargs):
        modes.append((len(members), training))
        init(self, backend, members, training, **kwargs)

    monkeypatch.setattr(gang_module.Gang, "__init__", recording)
    return modes
