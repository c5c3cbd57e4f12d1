"""One meaning per name (issue 40 point 5): a name rfopt uses for one thing is not another module's name for another."""

import importlib
import inspect
import pkgutil

import rfopt
import rfopt.errors


def test_refusal_is_the_exception_everywhere():
    # the database's diagnosis of a call it refuses is a PersistentFault, not a second `Refusal`
    from rfopt.storage import database

    assert getattr(database, "Refusal", rfopt.errors.Refusal) is rfopt.errors.Refusal
    fault = database.PersistentFault("read-only", "the database is read-only", "point --storage at a writable one")
    assert not isinstance(fault, BaseException) and database.persistent_fault(ValueError("x")) is None


def test_the_two_stops_are_named_for_what_they_stop():
    from rfopt.training import rollouts
    from rfopt.training.runner import ChunkAborted

    assert not hasattr(rollouts, "Aborted")
    assert rollouts.DecodeAborted is not ChunkAborted and issubclass(rollouts.DecodeAborted, rfopt.RfoptError)


def test_no_two_rfopt_classes_share_a_name_with_the_errors():
    """A class named as one of `rfopt.errors`' exceptions is that exception, wherever a module holds the name."""
    clashes = []
    for info in pkgutil.walk_packages(rfopt.__path__, "rfopt."):
        if info.name.startswith("rfopt.studies."):
            continue
        module = importlib.import_module(info.name)
        for name, cls in inspect.getmembers(module, inspect.isclass):
            if name in rfopt.errors.__all__ and cls is not getattr(rfopt.errors, name):
                clashes.append(f"{info.name}.{name}")
    assert clashes == []
