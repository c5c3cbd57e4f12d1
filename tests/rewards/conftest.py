from collections.abc import Callable

import pytest


@pytest.fixture(params=["plain", "conversational"])
def as_completion(request: pytest.FixtureRequest) -> Callable[[str], object]:
    """Wrap a completion's text the way TRL passes it: as a string, or as one assistant message."""
    if request.param == "plain":
        return lambda text: text
    return lambda text: [{"role": "assistant", "content": text}]
