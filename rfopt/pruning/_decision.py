"""The record of one pruning decision and where it lives on the trial: both owned by `rfopt.storage.schema`."""

from rfopt.storage.schema import DECISION_ATTR_PREFIX, PruneDecision, decision_key, load_decision

__all__ = ["DECISION_ATTR_PREFIX", "PruneDecision", "decision_key", "load_decision"]
