"""The two test tiers cannot drift apart from what a test does (issue 40, point 4): a test that trains through TRL or
starts a Python process is in the slow tier whatever its author wrote, and a misspelt marker is an error."""

from pathlib import Path

import pytest

CONFTEST = Path(__file__).resolve().parents[1] / "conftest.py"
MARKERS = """
[pytest]
addopts = --strict-markers -p no:cacheprovider
markers =
    e2e: trains through TRL
    subprocess: starts processes
    slow: the slow tier
"""


def test_no_test_selected_for_the_fast_tier_is_marked_as_training_or_starting_processes(request):
    if request.config.getoption("markexpr") != "not slow":
        pytest.skip("a check of the fast tier's selection (make test: -m 'not slow')")
    heavy = [item.nodeid for item in request.session.items
             if item.get_closest_marker("e2e") or item.get_closest_marker("subprocess")]
    assert heavy == []


def test_an_unmarked_test_that_trains_or_starts_python_fails_naming_the_marker_to_add(pytester):
    pytester.makeini(MARKERS)
    pytester.makeconftest(CONFTEST.read_text())
    pytester.makepyfile(test_drift="""
        import subprocess, sys
        import pytest
        import transformers

        def test_trains_quietly():
            try:  # rfopt catches a trial's failure: the test must fail all the same
                transformers.Trainer.train(object())
            except Exception:
                pass

        def test_starts_python():
            subprocess.run([sys.executable, "-c", "pass"], check=True)

        def test_starts_a_tool():
            assert subprocess.run(["true"]).returncode == 0

        @pytest.mark.e2e
        def test_marked_e2e():
            pass

        @pytest.mark.subprocess
        def test_marked_subprocess():
            pass
    """)
    fast = pytester.runpytest("-m", "not slow")
    fast.assert_outcomes(passed=2, failed=1, errors=1, deselected=2)  # the quiet one errors at teardown
    fast.stdout.fnmatch_lines(["*test_trains_quietly trains through TRL: mark it @pytest.mark.e2e*",
                               "*test_starts_python starts a Python process*mark it @pytest.mark.subprocess*"])
    slow = pytester.runpytest("-m", "slow")
    slow.assert_outcomes(passed=2, deselected=3)


def test_a_misspelt_marker_is_an_error_not_an_unmarked_test(pytester):
    pytester.makeini(MARKERS)
    pytester.makepyfile(test_typo="""
        import pytest

        @pytest.mark.sloww
        def test_typo():
            pass
    """)
    result = pytester.runpytest()
    assert result.ret != 0
    result.stdout.fnmatch_lines(["*'sloww' not found in `markers` configuration option*"])
