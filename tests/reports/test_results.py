"""The result types a user receives have one public home, `rfopt.reports.results`, and the leaderboard's rows are built
in one place, `rfopt.reports.leaderboard` (issue 40 point 5)."""

import ast
import typing
from pathlib import Path

import rfopt
from rfopt.reports import results

RESULT_TYPES = ("LeaderboardRow", "StudyOutcome", "TrialOutcome", "Recommendation", "Rival", "MissingBest")


def test_the_result_types_a_study_returns_are_defined_in_one_module_users_import():
    for name in RESULT_TYPES:
        assert getattr(results, name).__module__ == "rfopt.reports.results"
    assert rfopt.LeaderboardRow is results.LeaderboardRow
    hints = {name: typing.get_type_hints(getattr(rfopt.Study, name))["return"]
             for name in ("leaderboard", "outcome", "recommendation")}
    assert hints == {"leaderboard": list[results.LeaderboardRow], "outcome": results.StudyOutcome,
                     "recommendation": results.Recommendation | None}


def test_no_other_module_defines_a_result_type_or_builds_a_leaderboard_row():
    package = Path(rfopt.__file__).parent
    defined, built = [], []
    for path in sorted(package.rglob("*.py")):
        where = path.relative_to(package.parent).as_posix()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ClassDef) and node.name in RESULT_TYPES:
                defined.append(where)
            if isinstance(node, ast.Call) and getattr(node.func, "id", None) == "LeaderboardRow":
                built.append(where)
    assert set(defined) == {"rfopt/reports/results.py"} and len(defined) == len(RESULT_TYPES)
    assert built == ["rfopt/reports/leaderboard.py"]
