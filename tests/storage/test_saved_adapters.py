"""A trial's best and final adapters as the checkpoint store writes them: the tokenizer's files beside each, the tokenizer
serialized once per tokenizer (not at every save), and again when it changed."""

from pathlib import Path

import torch
from safetensors.torch import save_file
from transformers import AutoTokenizer

from rfopt.storage.checkpoints import CheckpointStore


class _Model:
    """What the store saves an adapter from (as PEFT's ``save_pretrained`` does, with one tensor)."""

    def save_pretrained(self, path: str, selected_adapters: list[str] | None = None) -> None:
        save_file({"w": torch.ones(2)}, f"{path}/adapter_model.safetensors")


def _counted(tokenizer):
    """`tokenizer`, its ``save_pretrained`` calls counted in ``tokenizer.saves``."""
    original = tokenizer.save_pretrained
    tokenizer.saves = 0

    def save_pretrained(*args, **kwargs):
        tokenizer.saves += 1
        return original(*args, **kwargs)

    tokenizer.save_pretrained = save_pretrained
    return tokenizer


def _files(folder: Path) -> dict[str, bytes]:
    return {str(p.relative_to(folder)): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}


def test_the_tokenizer_is_serialized_once_and_written_beside_every_best_and_final_adapter(tiny_model, tmp_path):
    tokenizer = _counted(AutoTokenizer.from_pretrained(str(tiny_model)))
    (tmp_path / "reference").mkdir()
    AutoTokenizer.from_pretrained(str(tiny_model)).save_pretrained(str(tmp_path / "reference"))
    reference = _files(tmp_path / "reference")
    store = CheckpointStore(tmp_path / "ck")

    saved = [store.save_best(number, _Model(), "default", tokenizer) for number in (0, 1) for _ in range(3)]
    saved += [store.save_adapter(number, _Model(), "default", tokenizer) for number in (0, 1)]

    assert tokenizer.saves == 1
    for folder in map(Path, saved):  # what a reader loads: the adapter and the tokenizer, as save_pretrained wrote it
        files = _files(folder)
        assert {name: files[name] for name in reference} == reference
        assert "adapter_model.safetensors" in files
        assert AutoTokenizer.from_pretrained(str(folder)).get_vocab() == tokenizer.get_vocab()


def test_a_tokenizer_changed_after_a_save_is_serialized_again(tiny_model, tmp_path):
    tokenizer = _counted(AutoTokenizer.from_pretrained(str(tiny_model)))
    store = CheckpointStore(tmp_path / "ck")
    store.save_best(0, _Model(), "default", tokenizer)
    tokenizer.add_tokens(["<added-after-the-save>"])

    best = Path(store.save_best(0, _Model(), "default", tokenizer))

    assert tokenizer.saves == 2
    assert "<added-after-the-save>" in AutoTokenizer.from_pretrained(str(best)).get_vocab()


def test_a_second_tokenizer_is_serialized_for_itself(tiny_model, tmp_path):
    first, second = (_counted(AutoTokenizer.from_pretrained(str(tiny_model))) for _ in range(2))
    store = CheckpointStore(tmp_path / "ck")
    for _ in range(2):
        store.save_best(0, _Model(), "default", first)
        store.save_best(1, _Model(), "default", second)

    assert (first.saves, second.saves) == (1, 1)
