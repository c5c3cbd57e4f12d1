"""A tiny random Llama-style chat model built offline, for tests, benchmarks and quick experiments.

The tokenizer is character level (printable ASCII plus the ChatML markers), so any text round-trips
and no download is needed. The model is random: it learns, but says nothing sensible.

    >>> from rfopt.tiny import build_tiny_model
    >>> path = build_tiny_model("/tmp/tiny-llama")      # doctest: +SKIP
    >>> rfopt.TrialConfig(model=str(path), ...)          # doctest: +SKIP
"""

from __future__ import annotations

import os
import string
import tempfile
from pathlib import Path

CHATML_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)

_SPECIAL_TOKENS = ["<pad>", "<unk>", "<|im_start|>", "<|im_end|>"]


def _build_tokenizer():
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    chars = sorted(set(string.printable))
    vocab = {token: i for i, token in enumerate(_SPECIAL_TOKENS + chars)}
    # A BPE model without merges is a character-level tokenizer that still understands added tokens.
    core = Tokenizer(models.BPE(vocab=vocab, merges=[], unk_token="<unk>"))
    core.pre_tokenizer = pre_tokenizers.Split(pattern="", behavior="isolated")
    core.decoder = decoders.Fuse()
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=core,
        pad_token="<pad>",
        unk_token="<unk>",
        bos_token="<|im_start|>",
        eos_token="<|im_end|>",
        additional_special_tokens=["<|im_start|>", "<|im_end|>"],
    )
    tokenizer.chat_template = CHATML_TEMPLATE
    tokenizer.padding_side = "left"
    return tokenizer


def build_tiny_model(path: str | os.PathLike, *, hidden_size: int = 32, num_layers: int = 2, seed: int = 0) -> Path:
    """Write a tiny random Llama chat model and its tokenizer to `path` (reused if already there).

    The directory loads with `AutoModelForCausalLM.from_pretrained` and `AutoTokenizer.from_pretrained`.
    """
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    path = Path(path)
    if (path / "config.json").exists() and (path / "tokenizer.json").exists():
        return path
    tokenizer = _build_tokenizer()
    config = LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=hidden_size,
        intermediate_size=hidden_size * 2,
        num_hidden_layers=num_layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=1024,
        pad_token_id=tokenizer.pad_token_id,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        tie_word_embeddings=True,
    )
    with torch.random.fork_rng():
        torch.manual_seed(seed)
        model = LlamaForCausalLM(config)
    model.generation_config.pad_token_id = tokenizer.pad_token_id
    model.generation_config.eos_token_id = tokenizer.eos_token_id
    path.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{path.name}.", dir=path.parent))
    model.save_pretrained(staging)
    tokenizer.save_pretrained(staging)
    try:
        os.replace(staging, path)
    except OSError:  # another process built it first
        import shutil

        shutil.rmtree(staging, ignore_errors=True)
    return path
