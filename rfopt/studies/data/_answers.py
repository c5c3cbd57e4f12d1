"""Gold final answers pulled out of worked solutions."""

from __future__ import annotations


def gsm8k_final_answer(solution: str) -> str | None:
    """The text after the last ``####`` of a GSM8K-style solution, commas removed; None if absent.

    >>> gsm8k_final_answer("3 * 400 = 1,200 cakes\\n#### 1,200")
    '1200'
    """
    if "####" not in solution:
        return None
    return solution.rsplit("####", 1)[1].replace(",", "").strip()


def last_boxed(text: str) -> str:
    """The content of the last ``\\boxed{...}`` in ``text`` (nested braces kept), or ``""``.

    >>> last_boxed(r"so $x = \\boxed{\\frac{1}{2}}$")
    '\\\\frac{1}{2}'
    """
    start = text.rfind("\\boxed")
    while start != -1:
        i = start + len("\\boxed")
        while i < len(text) and text[i] == " ":
            i += 1
        if i < len(text) and text[i] == "{":
            depth = 0
            for j in range(i, len(text)):
                if text[j] == "{":
                    depth += 1
                elif text[j] == "}":
                    depth -= 1
                    if depth == 0:
                        return text[i + 1 : j].strip()
        # Unbalanced or brace-less ("\boxed 5"): try the previous occurrence.
        start = text.rfind("\\boxed", 0, start)
    return ""
