import doctest
import importlib

import pytest


@pytest.mark.parametrize("module", ["rewards", "extract", "answers", "formats", "math_answers", "length"])
def test_docstring_examples_give_what_they_show(module):
    name = "rfopt.rewards" if module == "rewards" else f"rfopt.rewards.{module}"
    result = doctest.testmod(importlib.import_module(name))
    assert result.failed == 0
    assert result.attempted > 0
