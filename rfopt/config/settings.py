"""The settings every trial of a study shares, so that their values compare: the chunk plan's size and seed, the
objective, and how each chunk's evaluation generates (`StudySettings`, `EvalSettings`).

A study's settings are fixed when it is first planned (`rfopt.create_study`, or its first `optimize`) and read back
from storage afterwards: a later call that leaves one out gets the stored value, and one that gives another value is
refused, naming it.

    >>> given = StudySettings(num_chunks=8)
    >>> given.resolved(StudySettings()).num_chunks, given.resolved(StudySettings()).objective
    (8, 'reward')
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, ClassVar

from rfopt.errors import Refusal, TypeRefusal
from rfopt.values import is_finite_number, is_int, is_number


@dataclass(frozen=True)
class EvalSettings:
    """How each chunk's evaluation generates. Same for every trial of a study, so values compare."""

    max_new_tokens: int | None = None
    """Completion budget; default: the trial's ``max_completion_length``."""
    temperature: float = 0.0
    """0 means greedy decoding."""
    top_p: float = 1.0
    batch_size: int = 16
    seed: int = 0
    num_samples: int = 4
    """Completions kept per evaluation (stored on the trial for inspection): the first prompts', the last swapped for
    the best-scoring prompt's where none of them scores best (a right answer beside typical ones)."""

    def __post_init__(self) -> None:
        problems = []
        if self.max_new_tokens is not None and (not is_int(self.max_new_tokens) or self.max_new_tokens < 1):
            problems.append(f"max_new_tokens={self.max_new_tokens!r}: give a whole number >= 1, or None for the "
                            "trial's max_completion_length")
        if not is_finite_number(self.temperature) or self.temperature < 0:
            problems.append(f"temperature={self.temperature!r}: give a number >= 0 (0 decodes greedily)")
        if not is_number(self.top_p) or not 0 < self.top_p <= 1:
            problems.append(f"top_p={self.top_p!r}: give a number in (0, 1]")
        if not is_int(self.batch_size) or self.batch_size < 1:
            problems.append(f"batch_size={self.batch_size!r}: give a whole number >= 1 (prompts generated at once)")
        if not is_int(self.seed):
            problems.append(f"seed={self.seed!r}: give a whole number")
        if not is_int(self.num_samples) or self.num_samples < 0:
            problems.append(f"num_samples={self.num_samples!r}: give a whole number >= 0 (completions kept)")
        if problems:
            raise Refusal("EvalSettings: " + "; ".join(problems))




@dataclass(frozen=True)
class StudySettings:
    """A study's settings; a field left None is not given (`resolved` takes the stored value, else the default)."""

    num_chunks: int | None = None
    """Chunks that one pass over the train set is split into (default 4): a trial reports after each."""
    chunk_seed: int | None = None
    """Seeds the split of the train set into chunks, the same for every trial (default 0)."""
    objective: str | None = None
    """What each chunk's evaluation reports to Optuna: ``"reward"`` (the mean weighted total reward on the eval set,
    the default) or a reward function's name."""
    eval_settings: EvalSettings | None = None
    """How each chunk's evaluation generates (default `EvalSettings()`: greedy)."""

    DEFAULTS: ClassVar[dict[str, Any]] = {"num_chunks": 4, "chunk_seed": 0, "objective": "reward",
                                          "eval_settings": EvalSettings()}

    def __post_init__(self) -> None:
        if self.num_chunks is not None and (not is_int(self.num_chunks) or self.num_chunks < 1):
            raise Refusal(f"num_chunks must be a whole number >= 1, got {self.num_chunks!r}")
        if self.chunk_seed is not None and not is_int(self.chunk_seed):
            raise Refusal(f"chunk_seed must be a whole number, got {self.chunk_seed!r}")
        if self.objective is not None and not isinstance(self.objective, str):
            raise TypeRefusal(f"objective must be 'reward' or a reward function's name, got {self.objective!r}")
        if self.eval_settings is not None and not isinstance(self.eval_settings, EvalSettings):
            raise TypeRefusal(f"eval_settings must be an rfopt.EvalSettings, got {type(self.eval_settings).__name__}")

    def given(self) -> dict[str, Any]:
        """The settings this holds (not None), by name."""
        return {f.name: getattr(self, f.name) for f in dataclasses.fields(self) if getattr(self, f.name) is not None}

    def resolved(self, stored: StudySettings, study_name: str = "") -> StudySettings:
        """Every setting: the `stored` one, else the one given here, else the default. A given value that differs from
        the stored one is refused (a `Refusal`, naming it): a study's settings are fixed so that its trials compare."""
        kept = stored.given()
        for name, value in self.given().items():
            if name in kept and kept[name] != value:
                raise Refusal(
                    f"study {study_name!r} was planned with {name}={_shown(kept[name])}, and this call gives "
                    f"{name}={_shown(value)}; a study's {name} is fixed when it is first planned, so that its trials "
                    f"compare. Leave {name} out to use the stored one, or use a new study name"
                )
        given = self.given()
        return StudySettings(**{name: kept.get(name, given.get(name, default))
                                for name, default in self.DEFAULTS.items()})

    def to_attrs(self) -> dict[str, Any]:
        """The settings held, as the study stores them (`rfopt.storage.schema.write_settings`)."""
        return {name: dataclasses.asdict(value) if isinstance(value, EvalSettings) else value
                for name, value in self.given().items()}

    @classmethod
    def from_attrs(cls, stored: Mapping[str, Any], plan: Any = None) -> StudySettings:
        """The settings a study stored (`StudyRecord.settings`); a study planned before they were stored one by one
        has its chunk count and seed in its chunk `plan`."""
        values = {name: stored[name] for name in cls.DEFAULTS if name in stored}
        if "eval_settings" in values:
            values["eval_settings"] = EvalSettings(**values["eval_settings"])
        if plan is not None:
            values.setdefault("num_chunks", plan.num_chunks)
            values.setdefault("chunk_seed", plan.seed)
        return cls(**values)


def _shown(value: Any) -> str:
    return repr(value) if isinstance(value, str) else str(value)
