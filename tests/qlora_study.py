"""A study file of QLoRA trials beside a full-precision one, on the wide test model (its directory in
``RFOPT_TEST_WIDE_MODEL``; hidden size 128, wide enough for bitsandbytes' 4-bit blocks): two trials on the base loaded
in 4 bits (nf4), with 8-bit optimizers, trained in one gang; a LoRA trial on the same model in full precision, on a
base copy of its own. Needs bitsandbytes (``pip install 'rfopt[qlora]'``)."""

import os

from peft import LoraConfig
from transformers import BitsAndBytesConfig

import rfopt
from rfopt_testkit import grpo_config, prompts_dataset, reward_len, reward_vowels

CHUNKS = 2


def space():
    model = os.environ["RFOPT_TEST_WIDE_MODEL"]
    qlora = [
        rfopt.TrialConfig(model=model, reward_funcs=[reward_len, reward_vowels],
                          args=grpo_config(learning_rate=rate, optim=optim),
                          peft_config=LoraConfig(r=32, lora_alpha=64, target_modules="all-linear"),
                          quantization_config=BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4"))
        for rate, optim in ((5e-3, "adamw_bnb_8bit"), (1e-2, "paged_adamw_8bit"))
    ]
    full = rfopt.TrialConfig(model=model, reward_funcs=[reward_len, reward_vowels], args=grpo_config(),
                             peft_config=LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"]))
    return [*qlora, full]


def datasets():
    return prompts_dataset(4 * CHUNKS), prompts_dataset(2, "E")


STUDY = rfopt.StudySpec(name="qlora", configs=space, datasets=datasets, num_chunks=CHUNKS, max_concurrent=3,
                        gang_size=2)
