"""The version guard of rfopt/compat/_versions.py: a patched library outside the range it was checked against warns
once, and what is installed is what was tested."""

import warnings

import pytest

from rfopt import compat


# ---------------------------------------------------------------------- TESTED, check_version
def test_a_patched_library_outside_its_tested_range_warns_once(monkeypatch):
    import importlib.metadata

    compat.check_version.cache_clear()
    real = importlib.metadata.version
    monkeypatch.setattr(importlib.metadata, "version", lambda name: "99.0.0" if name == "trl" else real(name))
    with pytest.warns(compat.CompatWarning, match=r"rfopt was tested with trl~=1.16.0; 99.0.0 is installed"):
        assert compat.check_version("trl") is False
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        compat.check_version("trl")  # once
    monkeypatch.undo()
    compat.check_version.cache_clear()
    assert all(compat.check_version(package) for package in compat.TESTED)  # what is installed is what was tested
