"""What ``import rfopt`` and ``rfopt.errors`` offer: the study API and the config types users write; every exception a
user may catch, by name; and, for one release, each name ``import rfopt`` no longer offers, with a warning naming its
home."""

import importlib
import inspect
import pkgutil
import re
import warnings

import pytest

import rfopt
import rfopt.errors

SURFACE = ["EvalSettings", "LeaderboardRow", "PopulationBasedTraining", "RayCluster", "Refusal", "RfoptError", "Study",
           "StudySpec", "TrialConfig", "create_study", "errors", "grid", "load_study"]

# What `import rfopt` offered in 0.1.0 and no longer does, and where each lives now.
MOVED = {
    "CheckpointError": "rfopt.errors",
    "CheckpointStore": "rfopt.storage.checkpoints",
    "ChunkPlan": "rfopt.chunks",
    "CompatError": "rfopt.errors",
    "ConfigError": "rfopt.errors",
    "EvalResult": "rfopt.training.evaluation",
    "ModelUnavailableError": "rfopt.errors",
    "OpError": "rfopt.errors",
    "PlanError": "rfopt.errors",
    "RewardFunctionError": "rfopt.errors",
    "StorageLocationError": "rfopt.errors",
    "StorageRefusedError": "rfopt.errors",
    "StorageUnavailableError": "rfopt.errors",
    "StudyDeletedError": "rfopt.errors",
    "StudyNameError": "rfopt.errors",
    "TrialDiverged": "rfopt.errors",
    "TrialRunner": "rfopt.training.runner",
    "TrialSchedule": "rfopt.chunks",
    "trial_schedule": "rfopt.chunks",
}

# Each exception `rfopt.errors` offers, with the builtin base users caught it by before it was offered there.
EXCEPTIONS = {
    "RfoptError": Exception,
    "Refusal": ValueError,
    "TypeRefusal": TypeError,
    "MissingPackage": ImportError,
    "MissingFile": FileNotFoundError,
    "NothingToAnswer": LookupError,
    "NoSuchTrial": IndexError,
    "ConfigError": ValueError,
    "PlanError": ValueError,
    "OpError": ValueError,
    "StorageLocationError": ValueError,
    "StudyNameError": ValueError,
    "ClusterStorageError": ValueError,
    "ClusterTooSmallError": ValueError,
    "TrackerRefused": ValueError,
    "StaleRead": ValueError,
    "PopulationBasedTrainingMisplaced": TypeError,
    "CheckpointError": RuntimeError,
    "CompatError": RuntimeError,
    "DatasetUnavailableError": RuntimeError,
    "ModelUnavailableError": RuntimeError,
    "PrunerFailed": RuntimeError,
    "RewardFunctionError": RuntimeError,
    "StorageRefusedError": RuntimeError,
    "StorageUnavailableError": RuntimeError,
    "StorageUnreachableError": RuntimeError,
    "StudyBusyError": RuntimeError,
    "StudyDeletedError": RuntimeError,
    "TrialDiverged": RuntimeError,
}

# The engine's own signals: caught inside rfopt, never a user's to catch.
INTERNAL = {"rfopt.storage.leases.LeaseLost", "rfopt.training.runner.ChunkAborted",
            "rfopt.training.rollouts.backend.DecodeAborted", "rfopt.training.rollouts.sampler.Ungangable",
            "rfopt.engine.running.unit.CallbackFailed"}


def test_import_rfopt_offers_the_study_api_the_config_types_and_errors_only():
    assert sorted(rfopt.__all__) == sorted(SURFACE)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert all(getattr(rfopt, name) is not None for name in SURFACE)
    assert rfopt.errors is importlib.import_module("rfopt.errors")
    assert not set(MOVED) & set(dir(rfopt))


@pytest.mark.parametrize("name", sorted(MOVED))
def test_a_name_import_rfopt_no_longer_offers_still_imports_with_a_warning_naming_its_home(name):
    home = MOVED[name]
    expected = getattr(importlib.import_module(home), name)
    with pytest.warns(DeprecationWarning, match=re.escape(f"rfopt.{name} is deprecated") + ".*" +
                      re.escape(f"use {home}.{name}")):
        assert getattr(rfopt, name) is expected
    with pytest.warns(DeprecationWarning, match=re.escape(f"use {home}.{name}")):
        namespace = {}
        exec(f"from rfopt import {name}", namespace)
    assert namespace[name] is expected


def test_a_name_rfopt_never_offered_is_an_attribute_error():
    with pytest.raises(AttributeError, match="module 'rfopt' has no attribute 'Trial'"):
        rfopt.Trial  # noqa: B018
    with pytest.raises(AttributeError, match="module 'rfopt.errors' has no attribute 'LeaseLost'"):
        rfopt.errors.LeaseLost  # noqa: B018


@pytest.mark.parametrize("name", sorted(EXCEPTIONS))
def test_each_exception_rfopt_errors_offers_is_an_rfopt_error_with_its_builtin_base(name):
    cls = getattr(rfopt.errors, name)
    assert inspect.isclass(cls) and cls.__name__ == name
    assert issubclass(cls, rfopt.RfoptError) and issubclass(cls, EXCEPTIONS[name])
    assert cls is getattr(importlib.import_module(cls.__module__), name)  # the class its module raises, not a copy
    assert name in dir(rfopt.errors)


def test_every_exception_a_user_may_catch_is_offered_by_rfopt_errors():
    assert sorted(rfopt.errors.__all__) == sorted(EXCEPTIONS)
    unoffered = set()
    for info in pkgutil.walk_packages(rfopt.__path__, "rfopt."):
        module = importlib.import_module(info.name)
        for _, cls in inspect.getmembers(module, inspect.isclass):
            if cls.__module__ == info.name and issubclass(cls, BaseException) and not issubclass(cls, Warning):
                if getattr(rfopt.errors, cls.__name__, None) is not cls:
                    unoffered.add(f"{cls.__module__}.{cls.__qualname__}")
    assert unoffered == INTERNAL
