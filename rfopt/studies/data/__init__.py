"""Dataset loaders for rfopt studies.

Every loader returns ``Splits(train, test)`` (unpack it as a pair) of `datasets.Dataset`s
whose ``prompt`` column is a conversation (system prompt, then the user's question) and whose
``answer`` column is the gold final answer as a string; other columns a reward may need
(``solution``, ``final_answer``, ...) are kept. Hub loaders take ``source=``, a Hub id or a
local copy in the same format, and raise `DatasetUnavailableError` when neither can be read.

>>> from rfopt.studies.data import load_arithmetic
>>> train, test = load_arithmetic(n_train=8, n_test=4)
>>> train[0]["prompt"][1]["role"], train[0]["answer"].isdigit()
('user', True)
"""

from ._answers import gsm8k_final_answer, last_boxed
from ._arithmetic import load_arithmetic
from ._deepmath import load_deepmath
from ._gsm8k import load_gsm8k
from ._numina_tir import load_numina_tir
from ._prompts import BOXED_SYSTEM_PROMPT, REASONING_SYSTEM_PROMPT, THINK_SYSTEM_PROMPT
from rfopt.errors import DatasetUnavailableError
from ._source import Source, Splits

__all__ = [
    "BOXED_SYSTEM_PROMPT",
    "DatasetUnavailableError",
    "REASONING_SYSTEM_PROMPT",
    "Source",
    "Splits",
    "THINK_SYSTEM_PROMPT",
    "gsm8k_final_answer",
    "last_boxed",
    "load_arithmetic",
    "load_deepmath",
    "load_gsm8k",
    "load_numina_tir",
]
