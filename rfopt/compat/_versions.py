"""The versions each patched library was checked against (`TESTED`), and the checks every patch makes of its
library: in its range (`check_version`, warning once outside it), its target still there (`require`).
"""

from __future__ import annotations

import functools
import importlib.metadata
import warnings
from typing import Any

from rfopt.errors import CompatError


TESTED: dict[str, str] = {
    "transformers": "~=5.23.0",
    "trl": "~=1.16.0",
    "peft": "~=0.21.0",
    "accelerate": "~=1.15.0",
    "optuna": "~=5.0.0",
    "optuna-dashboard": "~=0.21.0",
    "torch": ">=2.4,<2.15",
    "trackio": "~=0.43.0",
}
"""The versions each patched library was checked against (compatible-release ranges, as pinned in pyproject.toml)."""


class CompatWarning(UserWarning):
    """A patched library is outside the versions rfopt was tested with."""


@functools.cache
def check_version(package: str) -> bool:
    """Whether `package` is in its `TESTED` range; warns once if not."""
    from packaging.specifiers import SpecifierSet
    from packaging.version import Version

    installed = importlib.metadata.version(package)
    if Version(installed) in SpecifierSet(TESTED[package]):
        return True
    warnings.warn(
        f"rfopt was tested with {package}{TESTED[package]}; {installed} is installed. Its patches of {package}'s "
        f"internals may no longer apply (see rfopt/compat/); if training fails or differs, "
        f"pip install '{package}{TESTED[package]}'",
        CompatWarning,
        stacklevel=3,
    )
    return False


def require(owner: Any, name: str, entry: str) -> None:
    if not hasattr(owner, name):
        raise CompatError(
            f"{entry}: {getattr(owner, '__qualname__', owner)}.{name} is gone; this rfopt does not support the installed "
            f"version (tested: {', '.join(f'{k}{v}' for k, v in TESTED.items())})"
        )
