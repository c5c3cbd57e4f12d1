"""Pull the text, the answer and the gold out of what TRL hands a reward function.

Every reward in this package reads completions and gold columns through these functions, so the
policies below (which message counts, which ``<answer>`` block counts, what makes two numbers
equal) hold everywhere.
"""

import re
from collections.abc import Mapping, Sequence

from rfopt.errors import Refusal, TypeRefusal

_ANSWER_OPEN = "<answer>"
_ANSWER_CLOSE = "</answer>"

# LaTeX wrappers whose content is the answer itself: \boxed{12}, \text{ dollars}, \mathrm{cm}.
# Only brace-free content matches, so a loop unwraps nested wrappers from the inside out.
_LATEX_WRAPPER = re.compile(r"\\(?:boxed|fbox|text|textrm|textbf|mathrm|mathbf)\s*\{([^{}]*)\}")
# LaTeX spacing commands, as in 1\,234 or 12\ \text{cm}.
_LATEX_SPACE = re.compile(r"\\[,;:! ]")
_DIGIT_COMMA = re.compile(r"(?<=[0-9]),(?=[0-9])")
# A number with an optional sign and currency in front and an optional unit or percent after.
# The unit is letters, spaces and a few unit marks (12 dollars per hour, 5 km/h, 3 m²); a digit or
# an operator after the number ("12 x 3", "12 + y") makes the text no number.
_NUMBER = re.compile(
    r"(?P<sign>[+\-\u2212]?)\s*[€£¥₹]?\s*(?P<sign2>[+\-\u2212]?)"
    r"(?P<int>[0-9]+)?(?:\.(?P<frac>[0-9]+))?"
    r"\s*(?:[%°]|[^\W\d_](?:[^\W\d_]|[\s./'^²³()\-])*)?"
)


def completion_text(completion: object) -> str:
    """Return the text of one completion, plain or conversational; "" for anything else.

    A plain completion is a ``str``. A conversational one is a list of messages; its text is the
    content of the LAST assistant message (with tool calls TRL returns assistant, tool, assistant
    messages, and the final answer is in the last); with no assistant message, of the last
    message that has no role at all.
    Content given as a list of parts (``[{"type": "text", "text": ...}]``) is joined. Malformed
    input (None, numbers, messages without content) gives "" instead of raising.

    >>> completion_text([{"role": "assistant", "content": "<answer>4</answer>"}])
    '<answer>4</answer>'
    """
    if isinstance(completion, str):
        return completion
    if isinstance(completion, Mapping):
        return _content_text(completion.get("content"))
    if isinstance(completion, Sequence):
        messages = [m for m in completion if isinstance(m, Mapping)]
        assistant = [m for m in messages if m.get("role") == "assistant"]
        chosen = assistant or [m for m in messages if "role" not in m]
        return _content_text(chosen[-1].get("content")) if chosen else ""
    return ""


def _content_text(content: object) -> str:
    if isinstance(content, str):
        return content
    if isinstance(content, Sequence):
        parts = [p if isinstance(p, str) else p.get("text") for p in content if isinstance(p, (str, Mapping))]
        return "".join(p for p in parts if isinstance(p, str))
    return ""


def completion_texts(completions: Sequence[object], reward: str) -> list[str]:
    """Return :func:`completion_text` of each completion; raise if ``completions`` is no list.

    ``reward`` names the calling reward function in the error.
    """
    if isinstance(completions, (str, bytes, Mapping)) or not isinstance(completions, Sequence):
        raise TypeRefusal(
            f"reward function '{reward}': completions must be a list (one entry per completion), "
            f"got {type(completions).__name__}"
        )
    return [completion_text(c) for c in completions]


def extract_answer(text: str) -> str | None:
    """Return the stripped content of the LAST ``<answer>...</answer>`` block, or None if none is closed.

    Policy for several answer tags: the block that ends at the last ``</answer>``, opened by the
    last ``<answer>`` before it. Models often restate the format or draft an answer before the
    final one, so the last block is the one they committed to; and for a stray nested opener
    (``<answer>1<answer>2</answer>``) the innermost content ("2") wins. An ``<answer>`` that is
    never closed does not count. Tags are case-sensitive.

    >>> extract_answer("<answer>1</answer> no wait <answer> 2 </answer>")
    '2'
    """
    if not isinstance(text, str):
        return None
    end = text.rfind(_ANSWER_CLOSE)
    if end < 0:
        return None
    start = text.rfind(_ANSWER_OPEN, 0, end)
    if start < 0:
        return None
    return text[start + len(_ANSWER_OPEN) : end].strip()


def extract_gsm8k_answer(text: str) -> str | None:
    """Return the GSM8K final answer after the last ``####`` (commas removed, stripped), or None.

    >>> extract_gsm8k_answer("She pays 1,000 + 200.\\n#### 1,200")
    '1200'
    """
    if not isinstance(text, str) or "####" not in text:
        return None
    return text.rsplit("####", 1)[1].replace(",", "").strip()


def normalize_number(text: str) -> str | None:
    """Return the canonical decimal form of a number written with decorations, or None if no number.

    Accepted: thousands commas ("1,234"), a sign, currency in front ("$12", "-$3", "€5"), a unit
    or percent after ("12 dollars", "5 km/h", "40%"), a trailing period, ``$...$`` math
    delimiters, ``\\boxed{}``, ``\\text{}``, ``\\mathrm{}`` wrappers and LaTeX spacing ("1\\,234").
    Canonical form: no leading zeros, no trailing fractional zeros, no "+", no "-0", so
    "12.0", "012" and "+12" all give "12". Words before the number ("the answer is 12"),
    fractions (``\\frac{1}{2}``, "1/2") and scientific notation are not numbers here: symbolic
    equivalence is math_verify's job (see ``rfopt.rewards.math_answers``). Commas between digits always count
    as thousands separators, so "1,5" reads as 15.

    >>> normalize_number("\\\\boxed{\\\\$1,234.50}")
    '1234.5'
    """
    if not isinstance(text, str):
        return None
    s = text.strip()
    while True:
        unwrapped = _LATEX_WRAPPER.sub(r"\1", s)
        if unwrapped == s:
            break
        s = unwrapped
    s = _LATEX_SPACE.sub("", s).replace("{,}", ",").replace("\\%", "%").replace("\\", "").replace("$", "")
    s = _DIGIT_COMMA.sub("", s).strip().rstrip(".").strip()
    match = _NUMBER.fullmatch(s)
    if match is None or (match["int"] is None and match["frac"] is None):
        return None
    if match["sign"] and match["sign2"]:
        return None
    negative = (match["sign"] or match["sign2"]) in ("-", "\u2212")
    whole = (match["int"] or "").lstrip("0") or "0"
    frac = (match["frac"] or "").rstrip("0")
    canonical = whole + ("." + frac if frac else "")
    return "-" + canonical if negative and canonical != "0" else canonical


def normalize_answer(text: str) -> str:
    """Return the form in which two answers are compared for exact match.

    A number (see :func:`normalize_number`) becomes its canonical form; anything else is kept with
    whitespace collapsed and a trailing period dropped, case-sensitive.

    >>> normalize_answer("12.0 apples") == normalize_answer("12")
    True
    """
    number = normalize_number(text)
    if number is not None:
        return number
    return " ".join(text.split()).rstrip(".").strip() if isinstance(text, str) else ""


def find_gold_column(columns: Mapping[str, object], names: Sequence[str], count: int, reward: str) -> list[object]:
    """Return the first of ``names`` present (not None) in ``columns``, checked to hold ``count`` values.

    Raises ValueError naming the reward function and the fix when no such column exists or its
    length is wrong: both are set-up mistakes, not malformed completions.
    """
    for name in names:
        values = columns.get(name)
        if values is None:
            continue
        if isinstance(values, (str, bytes)) or not hasattr(values, "__len__"):
            raise Refusal(
                f"reward function '{reward}': column '{name}' must hold one gold value per completion, "
                f"got a single {type(values).__name__}"
            )
        if len(values) != count:
            raise Refusal(
                f"reward function '{reward}': column '{name}' has {len(values)} values for {count} completions"
            )
        return list(values)
    trl_keywords = ("trainer_state", "log_extra", "log_metric", "completion_ids", "environments")
    present = sorted(k for k, v in columns.items() if v is not None and k not in trl_keywords)
    raise Refusal(
        f"reward function '{reward}': no gold column; it reads the first of {list(names)}, "
        f"but the columns passed are {present}. Add such a column to the dataset."
    )


def gold_text(value: object) -> str | None:
    """Return a gold value as text (numbers allowed; bools, None and other types give None)."""
    if isinstance(value, str):
        return value
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        return str(value)
    return None
