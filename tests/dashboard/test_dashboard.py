"""rfopt dashboard: control routes over real HTTP, access checks, artifacts, and the page in headless Chromium.

The study is built synthetically (optuna plus the attrs the engine writes), so no model trains here; a live study
on the tiny model is tests/dashboard/test_dashboard_live.py.
"""

from __future__ import annotations

import json
import re
import shutil
import threading
import urllib.error
import urllib.request
from contextlib import contextmanager

import optuna
import pytest
from optuna.trial import TrialState
from rfopt_testkit import CHROMEDRIVER, CHROMIUM, chromium, trial_config

import rfopt
from rfopt.engine.trials import clones, ops
from rfopt.storage import schema
from rfopt.engine.outputs.artifacts import CHART_ARTIFACT, SAMPLES_ARTIFACT, publish_chunk
from rfopt.reports.charts import colour, comparison
from rfopt.reports.lead import best_trial
from rfopt.chunks import ChunkPlan, TrialSchedule
from rfopt.cli import main as cli
from rfopt.dashboard import make_server, resolve_token
from rfopt.storage.schema import StepColumns, TrialRecord, metrics_key, samples_key, steps_key
from rfopt.storage.schema import trial_attrs


# ---------------------------------------------------------------------- a study as the engine leaves it
@pytest.fixture(scope="module")
def template(tmp_path_factory):
    """Trial 0 COMPLETE (2 chunks), trial 1 RUNNING and paused (1 chunk), trial 2 RUNNING (1 chunk): built once."""
    path = tmp_path_factory.mktemp("template") / "study.db"
    opt = optuna.create_study(study_name="demo", storage=f"sqlite:///{path}", direction="maximize",
                              sampler=optuna.samplers.RandomSampler(seed=0))
    schema.write_plan(opt, ChunkPlan.build(16, 2, 0))
    schema.write_settings(opt, {"objective": "reward"})
    config = trial_config("tiny-model-not-loaded-here").to_json()
    for number, units in enumerate([2, 1, 1]):
        trial = opt.ask()
        trial.suggest_float("learning_rate", 1e-4, 1e-1, log=True)
        ref = _ref(trial)
        schema.write_config(ref, config)
        schema.write_schedule(ref, TrialSchedule(prompts_per_chunk=8, steps_per_chunk=8, num_epochs=1, num_chunks=2))
        for unit in range(units):
            _commit_chunk(trial, unit, reward=0.2 * (number + 1) + 0.1 * unit)
        if number == 0:
            opt.tell(trial, 0.3)
        if number == 1:
            request = schema.TrialRequest(op="pause", by="me@host", at="t", id="1")
            schema.write_paused(ref, True)
            schema.write_request(ref, request)
            schema.write_applied(ref, [schema.AppliedOp(op="pause", by="me@host", requested_at="t", applied_at="t",
                                                        id="1")])
    return path


def _ref(trial):
    return schema.TrialRef(trial.storage, trial._trial_id, trial.number)


@pytest.fixture
def study(template, tmp_path):
    """A fresh copy of the template study, with its own checkpoint directory, as the study's first run records it."""
    shutil.copy(template, tmp_path / "study.db")
    study = rfopt.load_study("demo", f"sqlite:///{tmp_path / 'study.db'}")
    schema.write_identity(study.optuna, "0123456789abcdef", str(tmp_path / "checkpoints"))
    return study


def _commit_chunk(trial, unit, reward):
    """What `Study` stores after a chunk: metrics (a NaN comes as a string), samples, pruning decision, report."""
    train = {
        "reward": reward + 0.05, "rewards/reward_len/mean": reward, "rewards/reward_vowels/mean": 0.05,
        "kl": 0.01 * (unit + 1), "entropy": 4.6 - 0.1 * unit, "completions/mean_length": 7.5 + unit, "loss": "nan",
    }
    evaluation = {"reward": reward, "rewards/reward_len/mean": reward, "rewards/reward_vowels/mean": 0.0,
                  "completions/mean_length": 8.0}
    samples = [{"prompt": f"E{i}: add {i} and {i}", "completion": "0" * (unit + 4), "reward": reward,
                "reward_len": reward} for i in range(2)]
    # TRL's per-step logs: 4 optimizer steps a chunk, on the trial's global step.
    steps = [{"step": 4 * unit + i + 1, "reward": reward + 0.01 * i, "rewards/reward_len/mean": reward,
              "rewards/reward_vowels/mean": 0.05, "reward_std": 0.1, "entropy": 4.6 - 0.01 * i, "loss": 0.0,
              "completions/mean_length": 7.5} for i in range(4)]
    schema.write_unit(_ref(trial), unit, {"chunk": unit, "train": train, "eval": evaluation}, samples, steps)
    schema.write_decision(_ref(trial), schema.PruneDecision(trial.number, unit, False, "kept", (0,), "MedianPruner"))
    trial.report(reward, step=unit)


def _trials(study):
    return optuna.load_study(study_name=study.study_name, storage=study.optuna._storage).get_trials()


def _snapshot(study):
    return [(t.state, t.params, t.user_attrs, trial_attrs(t)) for t in _trials(study)]


# ---------------------------------------------------------------------- real HTTP
@contextmanager
def running(server):
    thread = threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True)
    thread.start()
    try:
        yield server
    finally:
        server.shutdown()
        server.server_close()


def serving(storage, **kwargs):
    return running(make_server(storage, host=kwargs.pop("host", "127.0.0.1"), port=0, **kwargs))


def call(server, method, path, body=None, headers=None, raw=None):
    """(status, decoded JSON body or text, response headers); never raises on an HTTP error status."""
    data = raw if raw is not None else (json.dumps(body).encode() if body is not None else None)
    headers = dict(headers or {})
    if body is not None:
        headers.setdefault("Content-Type", "application/json")
    url = f"http://127.0.0.1:{server.server_port}{path}"
    opener = urllib.request.build_opener(_NoRedirect)
    try:
        with opener.open(urllib.request.Request(url, data=data, method=method, headers=headers), timeout=30) as r:
            status, text, response_headers = r.status, r.read().decode(), r.headers
    except urllib.error.HTTPError as exc:
        status, text, response_headers = exc.code, exc.read().decode(), exc.headers
    try:
        return status, json.loads(text), response_headers
    except ValueError:
        return status, text, response_headers


class _NoRedirect(urllib.request.HTTPRedirectHandler):
    def redirect_request(self, *args, **kwargs):
        return None


def api(study, number, op):
    return f"/rfopt/api/studies/{study.optuna._study_id}/trials/{number}/{op}"


# ---------------------------------------------------------------------- control routes
def test_pause_resume_stop_and_clone_routes_store_requests_the_engine_applies(study):
    with serving(study.optuna._storage) as server:
        status, body, _ = call(server, "POST", api(study, 2, "pause"), {})
        assert status == 200 and "next chunk boundary" in body["message"]
        assert call(server, "POST", api(study, 1, "resume"), {})[0] == 200
        status, body, _ = call(server, "POST", api(study, 1, "clone"), {"set": ["learning_rate=0.004"]})
        assert status == 200 and body["trial"] == 3, body
        assert body["message"] == "trial 3: clone of trial 1 with learning_rate=0.004 enqueued"
        assert body["overrides"] == {"learning_rate": 0.004}
        assert call(server, "POST", api(study, 2, "stop"), {})[0] == 200

    trials = _trials(study)
    resumed, stopped, clone = trials[1], trials[2], trials[3]
    assert [r.op for r in TrialRecord(resumed).pending] == ["resume"]
    assert [(r.op, r.by) for r in TrialRecord(stopped).pending] == [("pause", "dashboard (127.0.0.1)"),
                                                                    ("stop", "dashboard (127.0.0.1)")]
    assert clone.state == TrialState.WAITING
    assert clone.params == {"learning_rate": 0.004}
    assert trial_attrs(clone)["rfopt:clone"]["parent"] == 1 and trial_attrs(clone)["rfopt:clone"]["warm_start"] is False
    assert rfopt.TrialConfig.from_json(trial_attrs(clone)["rfopt:config"]).args.learning_rate == 0.004


@pytest.mark.parametrize(
    "number, op, body, status, message",
    [
        (0, "pause", {}, 400, "trial 0 is COMPLETE; only a RUNNING trial can be paused"),
        (99, "stop", {}, 400, "has no trial 99"),
        (2, "resume", {}, 400, "trial 2 is not paused"),
        (1, "clone", {"set": ["nope=1"]}, 400, "nope: unknown field"),
        (1, "clone", {"overrides": {"learning_rate": "fast"}}, 400, "learning_rate: expected a number"),
        (1, "clone", {"set": ["learning_rate"]}, 400, "expected FIELD=VALUE"),
        (1, "clone", {"overrides": ["learning_rate", 1]}, 400, "overrides must be a JSON object"),
        (1, "clone", {"set": [], "warm_start": "yes"}, 400, "warm_start must be true or false"),
        (1, "clone", {"set": [], "warm_start": True}, 400, "trial 1 has no checkpoint yet"),
        (1, "clone", {"lr": 1}, 400, "unknown fields ['lr']"),
    ],
)
def test_refused_op_answers_400_with_the_reason_and_changes_nothing(study, number, op, body, status, message):
    before = _snapshot(study)
    with serving(study.optuna._storage) as server:
        got, answer, _ = call(server, "POST", api(study, number, op), body)
    assert got == status
    assert message in answer["error"]
    assert _snapshot(study) == before


@pytest.mark.parametrize("assignment, message", [
    ("learning_rate=1e400", "learning_rate: '1e400' is not a finite number (it reads as inf)"),
    ("learning_rate=nan", "learning_rate: 'nan' is not a finite number"),
    ("per_device_train_batch_size=0", "per_device_train_batch_size=0: each must be a whole number, 1 or more"),
    ("gradient_accumulation_steps=0", "gradient_accumulation_steps=0"),
    ("deepspeed=missing.json", "deepspeed: DeepSpeed is not supported yet"),
    ("fsdp=full_shard", "fsdp: FSDP is not supported yet"),
    ("max_completion_length=0", "args.max_completion_length: 0; a completion needs at least one token"),
    ("num_iterations=0", "num_iterations=0: each must be a whole number, 1 or more"),
    ("loss_type=bogus", "args.loss_type: 'bogus' is not a loss GRPOTrainer computes; use one of 'grpo'"),
    ("lora_r=0", "PEFT refuses this adapter on"),
    ('peft_config.target_modules=["nope"]', "Target modules {'nope'} not found in the base model"),
    # Issue 41 item 11: accepted, and such a clone trained nothing, backwards, or held the study in a baseline.
    ("learning_rate=0", "args.learning_rate: 0.0; give a number > 0"),
    ("lora_alpha=-3", "peft_config.lora_alpha: -3; give a number > 0"),
    ("epsilon=-1", "args.epsilon: -1.0; the clipping range is a number >= 0"),
    ("max_completion_length=100000", "args.max_completion_length: 100000 tokens, and"),
])
@pytest.mark.parametrize("check_only", [True, False])
def test_a_clone_that_its_first_chunk_would_refuse_is_answered_400_by_check_and_clone_alike(
        study, tiny_model, assignment, message, check_only):
    """Issue 35: ``1e400``/``NaN`` got "'<=' not supported" under a ``grpo:`` label; a batch size or gradient
    accumulation of 0 and a missing DeepSpeed file answered 500; Check accepted what failed at the clone's first chunk.
    Check builds what the first chunk builds (its GRPOConfig with the plan's max_steps, its adapter on the model's
    shape on the meta device)."""
    schema.write_config(_ref_of(study, 2), trial_config(tiny_model).to_json())  # a model whose shape can be read
    before = _snapshot(study)
    with serving(study.optuna._storage) as server:
        status, answer, _ = call(server, "POST", api(study, 2, "clone"), {"set": [assignment], "check_only": check_only})
    assert status == 400, answer
    assert message in answer["error"] and answer["error"].startswith("clone of trial 2: ")
    assert _snapshot(study) == before


def test_check_says_what_it_checked_and_what_only_training_checks(study, tiny_model):
    schema.write_config(_ref_of(study, 2), trial_config(tiny_model).to_json())
    with serving(study.optuna._storage) as server:
        status, answer, _ = call(server, "POST", api(study, 2, "clone"), {"set": ["lora_r=8"], "check_only": True})
    assert status == 200, answer
    assert "would be accepted (nothing written): its config, chunk plan, first chunk's GRPOConfig and adapter" in (
        answer["message"])
    assert "not checked until it trains: its model's weights, generation and reward scores" in answer["message"]


def test_a_study_id_past_sqls_integers_is_not_found(study):
    """Issue 35: a huge study id in a URL answered 500 (OverflowError: Python int too large to convert to SQLite
    INTEGER)."""
    huge = 10**30
    with serving(study.optuna._storage) as server:
        for path in (f"/rfopt/studies/{huge}", f"/rfopt/api/studies/{huge}/page", f"/rfopt/api/studies/{huge}/trials",
                     f"/rfopt/api/studies/{huge}/trials/0/config"):
            assert call(server, "GET", path)[0] == 404, path
        assert call(server, "POST", f"/rfopt/api/studies/{huge}/trials/0/pause", {})[0] == 404


def _ref_of(study, number):
    frozen = _trials(study)[number]
    return schema.TrialRef(study.optuna._storage, frozen._trial_id, frozen.number)


def test_only_rfopts_refusals_are_answered_as_the_users_mistake(study, monkeypatch):
    """A clone refused by rfopt answers 400 with the reason; a ValueError from anywhere else is a bug (500), not a
    message telling the user what to fix."""
    def broken(*args, **kwargs):
        raise ValueError("an internal bug")

    monkeypatch.setattr(clones, "clone_in_study", broken)
    with serving(study.optuna._storage) as server:
        status, answer, _ = call(server, "POST", api(study, 1, "clone"), {"set": ["learning_rate=0.004"]})
        refused, reason, _ = call(server, "POST", api(study, 1, "clone"), {"set": ["learning_rate"]})
    assert status == 500 and "an internal bug" not in str(answer)
    assert refused == 400 and "expected FIELD=VALUE" in reason["error"]


@pytest.mark.parametrize("breakage, says", [("raise RuntimeError('boom')", "RuntimeError: boom (line 3)"),
                                            ("import sys\nsys.exit(3)", "it called sys.exit(3) (line 4)"),
                                            ("1 / 0", "ZeroDivisionError: division by zero (line 3)")])
def test_a_clone_of_a_study_whose_file_broke_is_made_with_a_note_not_a_500(study, tmp_path, breakage, says):
    """Issue 35: once a study's file broke (any exception, or sys.exit, as it is imported), the dashboard's clone
    answered 500 and ``rfopt clone`` printed only "boom": the note held for ImportError only."""
    from rfopt import compat

    study_file = tmp_path / "broken_study.py"
    study_file.write_text(f"def correctness(completions, **kwargs):\n    return [0.0] * len(completions)\n{breakage}\n")
    config = json.loads(trial_attrs(_trials(study)[2])["rfopt:config"])
    config["reward_funcs"] = [f"{study_file}:correctness"]
    storage = compat.storage_of(study.optuna)
    storage.set_trial_system_attr(compat.trial_id_of(_trials(study)[2]), "rfopt:config", json.dumps(config))
    with serving(storage) as server:
        status, body, _ = call(server, "POST", api(study, 2, "clone"), {"set": ["learning_rate=0.004"]})
    assert status == 200 and body["trial"] == 3, body
    assert "cannot be imported here" in body["notes"][0] and "broken_study.py" in body["notes"][0]
    assert says in body["notes"][0]


def test_a_clone_of_a_study_whose_code_the_dashboard_cannot_import_is_checked_in_every_other_way(study):
    """The study's reward functions live in a study file this process cannot import: the clone is still made, the
    reply says what could not be checked here, and a bad override is still refused."""
    from rfopt import compat

    config = json.loads(trial_attrs(_trials(study)[2])["rfopt:config"])
    config["reward_funcs"] = ["/home/someone/studies/my_study.py:correctness"]
    storage = compat.storage_of(study.optuna)
    storage.set_trial_system_attr(compat.trial_id_of(_trials(study)[2]), "rfopt:config", json.dumps(config))
    with serving(storage) as server:
        refused = call(server, "POST", api(study, 2, "clone"), {"set": ["learning_rate=-1"]})
        before = _snapshot(study)
        status, body, _ = call(server, "POST", api(study, 2, "clone"), {"set": ["learning_rate=0.004"]})
    assert refused[0] == 400 and "Invalid learning rate: -1" in refused[1]["error"]
    assert status == 200 and body["trial"] == 3, body
    assert "cannot be imported here" in body["message"] and "my_study.py" in body["notes"][0]
    clone = _trials(study)[3]
    assert len(before) == 3 and json.loads(trial_attrs(clone)["rfopt:config"])["reward_funcs"] == config["reward_funcs"]
    assert json.loads(trial_attrs(clone)["rfopt:config"])["args"]["learning_rate"] == 0.004


def test_malformed_requests_are_refused_and_change_nothing(study):
    before = _snapshot(study)
    with serving(study.optuna._storage) as server:
        status, body, _ = call(server, "POST", api(study, 2, "pause"), raw=b"{not json", headers={"Content-Type": "application/json"})
        assert status == 400 and "not valid JSON" in body["error"]
        # A cross-site HTML form can post urlencoded bodies without a preflight: refused.
        status, body, _ = call(server, "POST", api(study, 2, "stop"), raw=b"x=1",
                               headers={"Content-Type": "application/x-www-form-urlencoded"})
        assert status == 415
        status, body, _ = call(server, "POST", "/rfopt/api/studies/42/trials/0/stop", {})
        assert status == 404 and "no study with id 42" in body["error"]
    assert _snapshot(study) == before


def test_trial_failed_with_the_dashboards_own_button_takes_no_more_ops(study):
    trial_id = _trials(study)[2]._trial_id
    with serving(study.optuna._storage) as server:
        assert call(server, "POST", f"/api/trials/{trial_id}/tell", {"state": "Fail"})[0] == 204
        status, body, _ = call(server, "POST", api(study, 2, "stop"), {})
    assert status == 400 and "trial 2 is FAIL" in body["error"]


# ---------------------------------------------------------------------- access
def test_with_a_token_every_request_needs_it_and_a_refused_one_changes_nothing(study):
    before = _snapshot(study)
    sid = study.optuna._study_id
    with serving(study.optuna._storage, token="s3cret") as server:
        assert call(server, "POST", api(study, 2, "stop"), {})[0] == 401
        assert call(server, "POST", api(study, 2, "stop"), {}, {"Authorization": "Bearer wrong"})[0] == 403
        assert call(server, "GET", f"/api/studies/{sid}")[0] == 401  # optuna-dashboard's own API too
        assert call(server, "DELETE", f"/api/studies/{sid}", headers={"Authorization": "Bearer nope"})[0] == 403
        assert call(server, "GET", "/rfopt?token=wrong")[0] == 403
        assert _snapshot(study) == before

        # A browser opens the printed link once: the token moves into a cookie and out of the address.
        status, _, headers = call(server, "GET", "/rfopt?token=s3cret")
        assert status == 303 and headers["Location"] == "/rfopt"
        cookie = headers["Set-Cookie"].split(";")[0]
        assert "HttpOnly" in headers["Set-Cookie"]
        assert call(server, "GET", f"/rfopt/studies/{sid}", headers={"Cookie": cookie})[0] == 200
        assert call(server, "POST", api(study, 2, "stop"), {}, {"Cookie": cookie})[0] == 200
    assert TrialRecord(_trials(study)[2]).pending[-1].op == "stop"


def test_a_non_local_bind_always_requires_a_token(study, monkeypatch):
    monkeypatch.delenv("RFOPT_DASHBOARD_TOKEN", raising=False)
    assert resolve_token("127.0.0.1") == (None, False)
    token, generated = resolve_token("0.0.0.0")
    assert generated and len(token) >= 24
    monkeypatch.setenv("RFOPT_DASHBOARD_TOKEN", "from-env")
    assert resolve_token("0.0.0.0") == ("from-env", False)
    monkeypatch.delenv("RFOPT_DASHBOARD_TOKEN")

    with serving(study.optuna._storage, host="0.0.0.0") as server:
        assert server.token and server.token in server.url(with_token=True)
        assert call(server, "POST", api(study, 2, "pause"), {})[0] == 401
        assert call(server, "POST", api(study, 2, "pause"), {}, {"Authorization": f"Bearer {server.token}"})[0] == 200


def test_a_local_bind_refuses_other_host_names_and_cross_origin_writes(study):
    before = _snapshot(study)
    with serving(study.optuna._storage) as server:
        # DNS rebinding: a page on evil.example resolved to 127.0.0.1 still sends its own Host.
        assert call(server, "GET", "/rfopt", headers={"Host": "evil.example"})[0] == 403
        assert call(server, "POST", api(study, 2, "stop"), {}, {"Origin": "http://evil.example"})[0] == 403
        assert call(server, "GET", "/rfopt", headers={"Host": "localhost"})[0] == 200
    assert _snapshot(study) == before


# ---------------------------------------------------------------------- artifacts and plain optuna-dashboard
def test_publish_chunk_keeps_one_chart_and_one_samples_file_per_trial(study):
    opt = study.optuna
    frozen = _trials(study)[2]
    trial = optuna.trial.Trial(opt, frozen._trial_id)
    publish_chunk(trial)
    _commit_chunk(trial, 1, reward=0.9)
    publish_chunk(trial)

    metas = {m.filename: m for m in optuna.artifacts.get_all_artifact_meta(trial)}
    assert sorted(metas) == [CHART_ARTIFACT, SAMPLES_ARTIFACT]
    with serving(opt._storage) as server:
        base = f"/artifacts/{opt._study_id}/{frozen._trial_id}"
        status, samples, _ = call(server, "GET", f"{base}/{metas[SAMPLES_ARTIFACT].artifact_id}")
        status_svg, svg, headers = call(server, "GET", f"{base}/{metas[CHART_ARTIFACT].artifact_id}")
    rows = [json.loads(line) for line in samples.splitlines()]
    assert status == 200 and [r["step"] for r in rows] == [0, 0, 1, 1] and rows[-1]["reward"] == 0.9
    assert status_svg == 200 and headers["Content-Type"] == "image/svg+xml"
    assert 'data-title="eval reward" data-points="6"' in svg  # total and 2 reward functions, 2 chunks


def test_publish_chunk_never_fails_the_trial(study, caplog):
    finished = optuna.trial.Trial(study.optuna, _trials(study)[0]._trial_id)
    publish_chunk(finished)  # optuna refuses artifacts on a finished trial
    assert "trial 0: could not publish its chunk artifacts" in caplog.text


def test_plain_optuna_dashboard_shows_an_rfopt_study_without_rfopts_records_and_names_its_metric(study):
    """rfopt's records are system attrs, which optuna-dashboard does not list: its trial table and trial pages show
    the user's attrs only, and its study page no rfopt plan. The value is named after the objective."""
    from wsgiref.simple_server import make_server as wsgiref_server

    import optuna_dashboard

    schema.write_settings(study.optuna, {"objective": "reward"})  # what the study's first plan writes
    with running(wsgiref_server("127.0.0.1", 0, optuna_dashboard.wsgi(study.optuna._storage))) as server:
        status, detail, _ = call(server, "GET", f"/api/studies/{study.optuna._study_id}")
    assert status == 200
    assert [t["state"] for t in detail["trials"]] == ["Complete", "Running", "Running"]
    assert [t["user_attrs"] for t in detail["trials"]] == [[], [], []]
    assert detail["union_user_attrs"] == [] and detail["user_attrs"] == []
    assert detail["objective_names"] == ["reward"]  # "reward", not "Objective 0"


# ---------------------------------------------------------------------- the comparison charts
def _figures(trials, direction=optuna.study.StudyDirection.MAXIMIZE):
    """The metric charts (the "why it wins" figures apart)."""
    return {f.key: f for f in comparison(trials, direction, "reward").figures if f.section == "charts"}


def _by_role(figure, role):
    return [t for t in figure.data if t["meta"]["role"] == role]


def test_every_metric_gets_one_chart_overlaying_every_trial_in_one_colour_each(study):
    trials = _trials(study)
    figures = _figures(trials)
    assert list(figures) == ["objective", "reward", "rewards/reward_len/mean", "rewards/reward_vowels/mean",
                             "reward_std", "entropy", "completions/mean_length", "loss"]  # no KL: none logged
    for figure in figures.values():
        assert [t["meta"]["trial"] for t in _by_role(figure, "series")] == [0, 1, 2]
        assert {t["meta"]["trial"]: t["line"]["color"] for t in _by_role(figure, "series")} == {
            n: colour(n) for n in range(3)}
    assert len({colour(n) for n in range(40)}) == 40  # distinct well past 10 trials
    objective = figures["objective"]
    assert [t["x"] for t in _by_role(objective, "series")] == [[1, 2], [1], [1]]  # x: chunks trained, from 1
    assert objective.layout["xaxis"]["dtick"] == 1 and objective.layout["xaxis"]["tickformat"] == "d"
    # Per-step charts: TRL's global step, a boundary where the second chunk (steps 5-8) starts, and each chunk's
    # evaluation at its last step.
    reward = figures["reward"]
    assert _by_role(reward, "series")[0]["x"] == [1, 2, 3, 4, 5, 6, 7, 8]
    assert [shape["x0"] for shape in reward.layout["shapes"]] == [4.5]
    assert [a["text"] for a in reward.layout["annotations"]] == ["chunk 2"]
    assert reward.layout["xaxis"]["tickformat"] == "d" and isinstance(reward.layout["xaxis"]["dtick"], int)
    assert [(t["meta"]["trial"], t["x"]) for t in _by_role(reward, "eval")] == [(0, [4, 8]), (1, [4]), (2, [4])]
    # Hover: the trial, its params and the value; series named by the trial and the params that differ.
    hover = _by_role(reward, "series")[1]["hovertemplate"]
    params = _trials(study)[1].params
    assert hover.startswith(f"<b>trial 1</b> · RUNNING<br>learning_rate={params['learning_rate']:.4g}<br>step %{{x}}")
    assert _by_role(reward, "series")[1]["name"] == f"t1 lr={params['learning_rate']:.4g}"
    # One legend entry per trial: the star, the ends and the evals are not listed.
    for figure in figures.values():
        listed = [t["name"] for t in figure.data if t.get("showlegend", True)]
        assert len(listed) == len(set(listed)) == len({t["meta"]["trial"] for t in figure.data})


def test_the_best_trial_is_marked_in_every_chart_and_a_leader_while_none_is_complete(study):
    trials = _trials(study)
    assert best_trial(trials, optuna.study.StudyDirection.MAXIMIZE) == (0, "best")  # the only COMPLETE one
    running = [t for t in trials if t.state == TrialState.RUNNING]
    assert best_trial(running, optuna.study.StudyDirection.MAXIMIZE) == (2, "leading")  # 0.6 beats 0.4
    assert TrialRecord(trials[1]).paused  # trial 1 (0.4) is paused: only a live trial leads
    assert best_trial(running, optuna.study.StudyDirection.MINIMIZE) == (2, "leading")
    schema.write_paused(schema.TrialRef.of(study.optuna, trials[1]), False)
    assert best_trial(_trials(study)[1:], optuna.study.StudyDirection.MINIMIZE) == (1, "leading")
    assert best_trial(trials, None) == (None, "")  # multi-objective: no single best
    for figure in _figures(trials).values():
        [star] = _by_role(figure, "best")
        assert star["meta"]["trial"] == 0 and star["x"] == _by_role(figure, "series")[0]["x"][-1:]
        assert _by_role(figure, "series")[0]["line"]["width"] > _by_role(figure, "series")[1]["line"]["width"]


def test_a_pruned_trials_lines_end_where_it_ended_with_the_reason_on_hover(study):
    storage = study.optuna._storage
    frozen = _trials(study)[2]
    reason = "best value 0.6 up to chunk 0 is below the median 0.7 of 2 peers at chunk 0 <b>"
    storage.set_trial_system_attr(frozen._trial_id, "rfopt:pruning:0", {"prune": True, "reason": reason, "peers": [0, 1],
                                                                      "pruner": "MedianPruner"})
    storage.set_trial_state_values(frozen._trial_id, TrialState.PRUNED)
    for figure in _figures(_trials(study)).values():
        [end] = _by_role(figure, "end")
        line = next(t for t in _by_role(figure, "series") if t["meta"]["trial"] == 2)
        assert end["meta"]["trial"] == 2 and end["x"] == line["x"][-1:] and end["y"] == line["y"][-1:]
        assert "ended here: best value 0.6 up to chunk 0 is below the median 0.7 of 2 peers at chunk 0 &lt;b&gt;" in (
            end["hovertemplate"])  # escaped: Plotly renders tags in hover text


def test_kl_gets_a_chart_only_when_some_trial_logged_it(study):
    frozen = _trials(study)[1]
    storage = study.optuna._storage
    steps = [{"step": 1, "reward": 0.1, "kl": 0.02}, {"step": 2, "reward": 0.2, "kl": 0.03}]
    storage.set_trial_system_attr(frozen._trial_id, steps_key(0), StepColumns.encode(steps))
    kl = _figures(_trials(study))["kl"]
    assert [(t["meta"]["trial"], t["y"]) for t in _by_role(kl, "series")] == [(1, [0.02, 0.03])]


# ---------------------------------------------------------------------- the study page over HTTP
def test_leaderboard_lists_the_best_trial_first_with_its_params_and_eval_rewards(study):
    with serving(study.optuna._storage) as server:
        status, page, headers = call(server, "GET", f"/rfopt/studies/{study.optuna._study_id}")
    assert status == 200 and "script-src 'self'" in headers["Content-Security-Policy"]
    board = page[page.index("<table class='leaderboard'>"):page.index("</table>", page.index("leaderboard"))]
    assert re.findall(r"<tr data-trial='(\d+)'>", board) == ["0", "2", "1"]  # best, then by value
    for head in ("value", "learning_rate", "eval reward_len", "eval reward_vowels", "why it ended"):
        assert f">{head.replace('_', '_<wbr>')}</th>" in board  # a long name may break after an underscore
    assert "★ best" in board


def test_a_user_attr_named_like_an_rfopt_record_leaves_every_page_readable(study, tmp_path):
    """Issue 35: ``rfopt:stopped = True`` as a user attr made the study's pages answer 500 (read as an earlier rfopt's
    stop record). On a trial this rfopt configured it is the user's; on one an earlier rfopt configured, a record of
    another shape is skipped."""
    storage, sid = study.optuna._storage, study.optuna._study_id
    storage.set_trial_user_attr(_trials(study)[2]._trial_id, "rfopt:stopped", True)
    config = trial_config("tiny-model-not-loaded-here").to_json()
    study.optuna.add_trial(optuna.trial.create_trial(state=TrialState.PRUNED, intermediate_values={0: 0.1},
                                                     user_attrs={"rfopt:config": config, "rfopt:stopped": True}))
    study.optuna.set_user_attr("rfopt:halt", "now")
    with serving(storage) as server:
        for path in (f"/rfopt/studies/{sid}", f"/rfopt/api/studies/{sid}/page", f"/rfopt/api/studies/{sid}/trials",
                     "/rfopt", f"/rfopt/studies/{sid}/compare", f"/rfopt/api/studies/{sid}/trials/3/config"):
            assert call(server, "GET", path)[0] == 200, path
    assert cli(["status", "--storage", f"sqlite:///{tmp_path / 'study.db'}", "--study", "demo"]) == 0


def test_a_sqlite_file_this_user_cannot_write_is_shown_read_only_and_the_buttons_say_so(study, tmp_path):
    """Issue 35: ``rfopt dashboard`` refused to start on a read-only SQLite file, so a shared, finished study could not
    be looked at. It opens the file read-only; a button answers "read-only database", promising nothing."""
    import os
    import subprocess

    path = tmp_path / "study.db"
    if subprocess.run(["chattr", "+i", str(path)], capture_output=True).returncode != 0:
        pytest.skip("chattr +i (an immutable file, read-only even for root) is not available here")
    try:
        assert not os.access(path, os.W_OK)
        before = _snapshot(study)
        with serving(f"sqlite:///{path}") as server:
            assert call(server, "GET", f"/rfopt/studies/{study.optuna._study_id}")[0] == 200
            assert call(server, "GET", f"/rfopt/api/studies/{study.optuna._study_id}/trials")[0] == 200
            status, answer, _ = call(server, "POST", api(study, 2, "pause"), {})
            checked = call(server, "POST", api(study, 2, "clone"), {"set": ["learning_rate=0.004"], "check_only": True})
        assert status == 409 and answer["error"].startswith("read-only database: ") and "continue" not in answer["error"]
        assert checked[0] == 200  # a check writes nothing
        assert _snapshot(study) == before
    finally:
        subprocess.run(["chattr", "-i", str(path)], check=True)


def test_plotly_js_and_the_pages_files_are_served_locally_with_caching_headers(study):
    import gzip

    import plotly
    from plotly.offline import get_plotlyjs

    with serving(study.optuna._storage) as server:
        page = call(server, "GET", f"/rfopt/studies/{study.optuna._study_id}")[1]
        path = f"/rfopt/static/plotly-{plotly.__version__}.min.js"
        assert f"src='{path}'" in page and "https://" not in page
        request = urllib.request.Request(f"http://127.0.0.1:{server.server_port}{path}",
                                         headers={"Accept-Encoding": "gzip"})
        with urllib.request.urlopen(request, timeout=30) as response:
            body, headers = response.read(), response.headers
        assert headers["Content-Encoding"] == "gzip" and "immutable" in headers["Cache-Control"]
        assert gzip.decompress(body).decode() == get_plotlyjs()
        assert call(server, "GET", "/rfopt/static/plotly-0.0.1.min.js")[0] == 404
        for name in ("rfopt.js", "rfopt.css"):
            status, text, headers = call(server, "GET", f"/rfopt/static/{name}")
            assert status == 200 and text and headers["Cache-Control"] == "no-cache"


def test_samples_show_each_reward_functions_score_escaped(study):
    frozen = _trials(study)[2]
    study.optuna._storage.set_trial_system_attr(frozen._trial_id, samples_key(0), [
        {"prompt": "E0: <script>alert(1)</script>", "completion": "aei", "reward": 0.75, "reward_len": 0.375,
         "reward_vowels": float("nan")}])
    with serving(study.optuna._storage) as server:
        page = call(server, "GET", f"/rfopt/studies/{study.optuna._study_id}")[1]
        status, part, _ = call(server, "GET", f"/rfopt/studies/{study.optuna._study_id}/trials/2/samples")
        assert call(server, "GET", f"/rfopt/studies/{study.optuna._study_id}/trials/9/samples")[0] == 404
    assert "/trials/2/samples" in page and "(1 chunk)" in page
    assert status == 200
    assert re.findall(r"<th>([^<]+)</th>", part) == ["#", "prompt", "completion", "reward (total)", "reward_len",
                                                     "reward_vowels"]
    assert "&lt;script&gt;alert(1)&lt;/script&gt;" in part and "<script>" not in part
    assert "<td class='score'>0.75</td><td class='score'>0.375</td>" in part and "not scored" in part


def test_cancel_route_takes_a_waiting_clone_out_of_the_queue_and_refuses_anything_else(study):
    with serving(study.optuna._storage) as server:
        assert call(server, "POST", api(study, 1, "clone"), {"set": ["learning_rate=0.004"]})[0] == 200
        before = _snapshot(study)
        status, body, _ = call(server, "POST", api(study, 2, "cancel"), {})
        assert status == 400 and "only a WAITING clone that has not started can be cancelled" in body["error"]
        assert _snapshot(study) == before
        page = call(server, "GET", f"/rfopt/studies/{study.optuna._study_id}")[1]
        assert "data-op='cancel' data-url='" + api(study, 3, "cancel") + "'" in page
        status, body, _ = call(server, "POST", api(study, 3, "cancel"), {})
        assert status == 200 and body["message"].startswith("trial 3: cancelled by dashboard (127.0.0.1)")
        assert call(server, "POST", api(study, 3, "cancel"), {})[0] == 400
        page = call(server, "GET", f"/rfopt/studies/{study.optuna._study_id}")[1]
    clone = _trials(study)[3]
    assert clone.state == TrialState.FAIL and TrialRecord(clone).cancelled.by == "dashboard (127.0.0.1)"
    assert "data-trial='3' data-state='CANCELLED'" in page and api(study, 3, "cancel") not in page
    board = page[page.index("<table class='leaderboard'>"):page.index("</table>", page.index("leaderboard"))]
    assert f"{TrialRecord(clone).cancelled.reason}</td>" in board  # why it ended: who cancelled it, and when


def test_withdraw_route_takes_back_a_pending_request_once(study):
    with serving(study.optuna._storage) as server:
        assert call(server, "POST", api(study, 2, "stop"), {})[0] == 200
        page = call(server, "GET", f"/rfopt/studies/{study.optuna._study_id}")[1]
        assert "data-op='withdraw' data-what='stop'" in page
        trials = call(server, "GET", f"/rfopt/api/studies/{study.optuna._study_id}/trials")[1]["trials"]
        assert [(t["number"], t["pending"], t["controls"]) for t in trials if t["number"] == 2] == [(2, ["stop"], ["clone"])]
        status, body, _ = call(server, "POST", api(study, 2, "withdraw"), {"op": "stop"})
        assert status == 200 and body["message"] == "trial 2: stop request withdrawn; it will not apply"
        status, body, _ = call(server, "POST", api(study, 2, "withdraw"), {"op": "stop"})
        assert status == 400 and "has no pending stop request" in body["error"]
        assert call(server, "POST", api(study, 2, "withdraw"), {"what": "stop"})[0] == 400
    record = TrialRecord(_trials(study)[2])
    assert record.pending == [] and [(w.request.op, w.by) for w in record.withdrawn] == [("stop", "dashboard (127.0.0.1)")]


def test_the_pages_data_answers_not_modified_until_the_stored_data_changes(study):
    url = f"/rfopt/api/studies/{study.optuna._study_id}/page"
    with serving(study.optuna._storage) as server:
        status, data, headers = call(server, "GET", url)
        etag = headers["ETag"]
        assert status == 200 and etag == f'"{data["version"]}"' and data["running"] is False and data["refresh"] is None
        assert set(data["parts"]) == {"facts", "liveness", "now", "warnings", "leaderboard", "why", "versus"}
        assert [c["trial"] for c in data["cards"]] == [0, 2, 1]  # in leaderboard order: best, then by value
        assert call(server, "GET", url, headers={"If-None-Match": etag})[0] == 304
        frozen = _trials(study)[2]
        ref = schema.TrialRef(study.optuna._storage, frozen._trial_id, 2)
        schema.write_progress(ref, schema.ProgressRecord(
            unit=1, num_units=2, phase="training", step=1, steps=8, global_step=5, started=1.0, updated=2.0,
            step_seconds=1.0, logs=StepColumns.encode([{"step": 5, "reward": 0.9}])))
        status, fresh, headers = call(server, "GET", url, headers={"If-None-Match": etag})
    assert status == 200 and headers["ETag"] != etag
    reward = next(f for f in fresh["figures"] if f["key"] == "reward")
    [flight] = [t for t in reward["data"] if t["meta"]["role"] == "in-flight"]
    assert flight["meta"]["trial"] == 2 and flight["x"] == [4, 5] and flight["line"]["dash"] == "dash"


def test_root_leads_to_rfopts_index_which_lists_each_study_and_optuna_dashboard_links_back(study):
    with serving(study.optuna._storage) as server:
        status, _, headers = call(server, "GET", "/")
        assert status == 302 and headers["Location"].endswith("/rfopt")
        index = call(server, "GET", "/rfopt")[1]
        status, page, headers = call(server, "GET", f"/dashboard/studies/{study.optuna._study_id}")
    row = index[index.index(f"<tr data-study='{study.optuna._study_id}'>"):]
    # What each trial is doing, in the page's words: nobody runs the study, so its RUNNING trials are interrupted
    # (the paused one stays paused), never "running" beside "idle".
    assert " running" not in row.split("</tr>")[0].split("<td")[3]
    assert "1 paused, 1 interrupted, 1 complete" in row and "0.3 (trial 0)" in row and ">idle<" in row
    assert status == 200 and "id='rfopt-backlink'" in page and "/rfopt/static/backlink.js" in page
    assert int(headers["Content-Length"]) == len(page.encode())


def test_the_clone_forms_fields_are_the_trials_config_typed_and_say_whether_a_warm_start_is_possible(study, tmp_path):
    from rfopt.storage.checkpoints import CheckpointStore
    from rfopt.storage.state import TrialSnapshot as State

    with serving(study.optuna._storage) as server:
        status, form, _ = call(server, "GET", api(study, 2, "config"))
        fields = {f["name"]: f for f in form["fields"]}
        assert status == 200 and form["warm_start"]["available"] is False
        # The searched params first, under the leaderboard's names; then what the trial sets; the rest folded.
        assert form["fields"][0] == {**fields["learning_rate"], "kind": "float", "value": 5e-3, "group": "searched",
                                     "label": "learning_rate"}
        set_here = [f["name"] for f in form["fields"] if f["group"] == "set"]
        assert "per_device_train_batch_size" in set_here and len(set_here) < 12
        assert fields["accelerator_config"]["group"] == fields["debug"]["group"] == "more"  # filled in by TRL itself
        assert fields["peft_config.r"]["kind"] == "int" and fields["peft_config.r"]["value"] == 4
        assert fields["lr_scheduler_type"]["kind"] == "choice" and "cosine" in fields["lr_scheduler_type"]["choices"]
        assert fields["reward_funcs"]["value"] == ["rfopt_testkit:reward_len", "rfopt_testkit:reward_vowels"]
        assert "use_cpu" not in fields and "output_dir" not in fields  # the device's, and rfopt's own
        # With its checkpoint in the store, a warm start is offered.
        CheckpointStore(tmp_path / "checkpoints").save(2, State(units_done=1, global_step=8, tokens_seen=0, weights={},
                                                                optimizer=None, scheduler=None, rng=None))
        form = call(server, "GET", api(study, 2, "config"))[1]
        assert form["warm_start"] == {"available": True, "why": "from its checkpoint after chunk 1", "after_chunk": 1}
        # A chunk checkpointed before its value is committed: the label names the checkpoint a clone would use.
        CheckpointStore(tmp_path / "checkpoints").save(2, State(units_done=2, global_step=16, tokens_seen=0,
                                                                weights={}, optimizer=None, scheduler=None, rng=None))
        assert call(server, "GET", api(study, 2, "config"))[1]["warm_start"]["why"] == (
            "its checkpoint is after its last chunk (2): a warm clone would have nothing left to train")
        assert call(server, "GET", api(study, 0, "config"))[1]["warm_start"]["available"] is False  # complete
        assert call(server, "GET", api(study, 9, "config"))[0] == 404


def test_the_side_by_side_view_shows_each_trials_completion_of_one_eval_prompt_with_each_reward(study):
    with serving(study.optuna._storage) as server:
        status, part, _ = call(server, "GET", f"/rfopt/studies/{study.optuna._study_id}/compare")
    assert status == 200 and "<select class='prompt-picker'>" in part
    first = part[part.index("<section class='prompt' data-prompt='0'>"):part.index("</section>")]
    assert "E0: add 0 and 0" in first
    assert re.findall(r"<tr data-trial='(\d+)'>", first) == ["2", "1", "0"]  # best total first
    assert "<th>reward_len</th>" in first


def test_trials_whose_objectives_weigh_rewards_differently_are_flagged(study):
    config = json.loads(trial_attrs(_trials(study)[1])["rfopt:config"])
    config["args"]["reward_weights"] = [2.0, 1.0]
    study.optuna._storage.set_trial_system_attr(_trials(study)[1]._trial_id, "rfopt:config", json.dumps(config))
    with serving(study.optuna._storage) as server:
        page = call(server, "GET", f"/rfopt/studies/{study.optuna._study_id}")[1]
    warning = page[page.index("id='weights-warning'"):]
    assert "do not compare" in warning
    assert "trials 0, 2: reward_len × 1, reward_vowels × 1" in warning and "trials 1: reward_len × 2" in warning


def test_the_confirm_button_enqueues_replicates_of_the_best_configs_and_a_bad_count_changes_nothing(study):
    sid = study.optuna._study_id
    with serving(study.optuna._storage) as server:
        page = call(server, "GET", f"/rfopt/studies/{sid}")[1]
        before = _snapshot(study)
        for body in ({"top": 0, "seeds": 2}, {"top": 1}, {"top": 1, "seeds": 2, "prune": "yes"}):
            status, said, _ = call(server, "POST", f"/rfopt/api/studies/{sid}/confirm", body)
            assert status == 400 and said["error"], body
        assert _snapshot(study) == before
        status, said, _ = call(server, "POST", f"/rfopt/api/studies/{sid}/confirm", {"top": 1, "seeds": 2})
    assert re.search(r"<button[^>]*id='confirm'[^>]*data-op='confirm'[^>]*>Confirm the best configs…</button>", page)
    assert status == 200 and said["trials"] == [3, 4], said
    assert said["message"].startswith("trial 3: replicate of trial 0 with seed 8 enqueued; trial 4: replicate of "
                                      "trial 0 with seed 9 enqueued")
    trials = _trials(study)
    assert [TrialRecord(t).replicate.of for t in trials[3:]] == [0, 0]
    assert all(t.state == optuna.trial.TrialState.WAITING and t.params == trials[0].params for t in trials[3:])


def test_stopping_the_study_is_refused_when_nobody_runs_it(study):
    with serving(study.optuna._storage) as server:
        status, body, _ = call(server, "POST", f"/rfopt/api/studies/{study.optuna._study_id}/halt", {})
    assert status == 400 and "nobody is running this study" in body["error"]
    assert schema.study_record(study.optuna).halt is None


def test_page_says_nobody_runs_a_study_that_never_ran_here(study):
    with serving(study.optuna._storage) as server:
        page = call(server, "GET", f"/rfopt/studies/{study.optuna._study_id}")[1]
    assert "id='liveness' class='notice idle' data-running='false'>nobody is running this study" in page


def test_feedback_that_clears_the_stop_button_the_leader_and_the_lines_honour_an_interrupted_study(study):
    from rfopt.storage.leases import Presence

    # A study of two RUNNING trials after their first chunk (none COMPLETE: trial 1 leads).
    opt = optuna.create_study(study_name="leading", storage=study.optuna._storage, direction="maximize")
    schema.write_plan(opt, ChunkPlan.build(16, 2, 0))
    schema.write_settings(opt, {"objective": "reward"})
    for number in range(2):
        trial = opt.ask()
        trial.suggest_float("learning_rate", 1e-4, 1e-1, log=True)
        schema.write_config(_ref(trial), trial_config("tiny-model-not-loaded-here").to_json())
        schema.write_schedule(_ref(trial), TrialSchedule(prompts_per_chunk=8, steps_per_chunk=8, num_epochs=1,
                                                         num_chunks=2))
        _commit_chunk(trial, 0, reward=0.2 * (number + 1))
    sid = opt._study_id
    with serving(study.optuna._storage) as server:
        with Presence(opt, "run"):
            running = call(server, "GET", f"/rfopt/studies/{sid}")[1]
            index = call(server, "GET", "/rfopt")[1]
        idle = call(server, "GET", f"/rfopt/studies/{sid}")[1]
        idle_index = call(server, "GET", "/rfopt")[1]
    # The study's stop button acts only while a process runs the study.
    assert re.search(r"<button[^>]*id='halt'[^>]*>", running).group(0).count("disabled") == 0
    assert ("data-url='/rfopt/api/studies/%d/halt' disabled title='nobody is running this study: there is nothing to "
            "stop'>" % sid) in idle
    # Nothing trains the leading trial once nobody runs the study: said, on the leaderboard and in "why it wins".
    assert "<span class='best'>★ leading</span>" in running
    assert "<span class='best'>★ leading, interrupted</span>" in idle
    assert re.search(r'data-trial="1"[^>]*><title>[^<]*· training ·', running)
    assert re.search(r'data-trial="1"[^>]*><title>[^<]*· interrupted ·', idle)
    # The index refreshes itself while a study runs, and says so; not once nothing runs.
    assert "<meta http-equiv='refresh' content='5'>" in index and "refreshes every 5 s while a study runs" in index
    assert "http-equiv='refresh'" not in idle_index


# ---------------------------------------------------------------------- the page in a browser
@pytest.fixture
def browser(tmp_path):
    pytest.importorskip("selenium.webdriver", reason="needs selenium (pip install selenium)")
    driver = chromium(tmp_path / "chromium")
    if driver is None:
        pytest.skip(f"needs Debian's chromium and chromium-driver ({CHROMIUM}, {CHROMEDRIVER}): "
                    "apt-get install chromium chromium-driver")
    driver.implicitly_wait(5)
    try:
        yield driver
    finally:
        driver.quit()


@pytest.mark.slow
def test_page_draws_overlaid_charts_and_answers_each_op_next_to_its_trial(study, browser, tmp_path):
    from selenium.common.exceptions import StaleElementReferenceException
    from selenium.webdriver.common.by import By
    from selenium.webdriver.support.ui import WebDriverWait

    # The page redraws its trial list when it refreshes: an element found just before a redraw is gone by the time
    # its text is read, and the wait looks again.
    wait = WebDriverWait(browser, 15, ignored_exceptions=(StaleElementReferenceException,))

    def card(number):
        return browser.find_element(By.CSS_SELECTOR, f"section[data-trial='{number}']")

    with serving(study.optuna._storage) as server:
        browser.get(server.url(f"/rfopt/studies/{study.optuna._study_id}"))
        # Plotly drew the overlaid charts from the plotly.js the server sends: one series per trial.
        series = wait.until(lambda d: d.execute_script(
            "const el = document.getElementById('chart-rewards-reward-len-mean');"
            "return el && el.data && el.data.filter(t => t.meta.role === 'series').map(t => t.meta.trial)"))
        assert sorted(series) == [0, 1, 2]
        assert browser.find_element(By.CSS_SELECTOR, "#chart-objective .main-svg")  # drawn, not only data
        assert browser.find_elements(By.ID, "chart-kl") == []  # no trial logged KL: no empty box
        assert [b.get_attribute("data-op") for b in card(1).find_elements(By.CSS_SELECTOR, "button.op")] == [
            "resume", "stop"]
        browser.save_screenshot(str(tmp_path / "rfopt-dashboard.png"))

        # The clone form is the trial's whole config, typed and pre-filled.
        card(1).find_element(By.CSS_SELECTOR, "details.clone summary").click()
        field = lambda name: card(1).find_element(By.CSS_SELECTOR, f"form.clone-form .field[data-name='{name}'] "  # noqa: E731
                                                  "input, form.clone-form .field[data-name='" + name + "'] select, "
                                                  f"form.clone-form .field[data-name='{name}'] textarea")
        wait.until(lambda d: field("learning_rate"))
        assert float(field("learning_rate").get_attribute("value")) == 5e-3  # the config's (trial_config's)
        assert field("learning_rate").get_attribute("type") == "number"
        assert field("peft_config.lora_alpha").get_attribute("value") == "8"
        assert field("gradient_checkpointing").get_attribute("type") == "checkbox"
        assert field("lr_scheduler_type").tag_name == "select"
        assert field("reward_funcs").tag_name == "textarea"
        assert "no warm start: its checkpoint is not in" in card(1).find_element(By.CSS_SELECTOR, "p.warm").text

        # It stays open, with what is typed in it, while the page refreshes (something changed: a user attr of trial 2).
        field("learning_rate").clear()
        field("learning_rate").send_keys("-1")
        study.optuna._storage.set_trial_user_attr(_trials(study)[2]._trial_id, "mine", "changed")
        browser.execute_async_script("window.rfoptRefresh().then(arguments[0])")
        assert card(1).find_element(By.CSS_SELECTOR, "details.clone").get_attribute("open") is not None
        assert field("learning_rate").get_attribute("value") == "-1"

        # A value the server refuses: the reason under the form, the field marked, nothing written; then a good clone.
        card(1).find_element(By.CSS_SELECTOR, "button.clone").click()
        error = wait.until(lambda d: card(1).find_element(By.CSS_SELECTOR, ".form-error").text)
        assert error.startswith("clone of trial 1: ") and "Invalid learning rate: -1" in error
        field("learning_rate").clear()
        field("learning_rate").send_keys("0.004")
        card(1).find_element(By.CSS_SELECTOR, "details.all-fields summary").click()  # every other GRPOConfig field
        field("reward_weights").clear()
        field("reward_weights").send_keys('"oops"')
        card(1).find_element(By.CSS_SELECTOR, "button.clone").click()
        wait.until(lambda d: "reward_weights" in card(1).find_element(By.CSS_SELECTOR, ".form-error").text)
        assert "invalid" in card(1).find_element(By.CSS_SELECTOR, ".field[data-name='reward_weights']").get_attribute(
            "class")  # the field the server named
        assert len(_trials(study)) == 3
        field("reward_weights").clear()
        field("reward_weights").send_keys("null")
        field("peft_config.lora_alpha").clear()
        field("peft_config.lora_alpha").send_keys("16")
        card(1).find_element(By.CSS_SELECTOR, "button.check").click()
        wait.until(lambda d: "would be accepted" in card(1).find_element(By.CSS_SELECTOR, ".checking").text)
        assert len(_trials(study)) == 3  # checked, nothing written
        card(1).find_element(By.CSS_SELECTOR, "button.clone").click()
        wait.until(lambda d: "trial 3: clone of trial 1" in card(1).find_element(By.CSS_SELECTOR, ".feedback").text)
        assert "clone of trial 1" in card(3).find_element(By.CSS_SELECTOR, ".feedback").text
        assert card(3).get_attribute("data-state") == "WAITING"

        # Stop trial 2 (the page asks first), then withdraw the request from its card.
        card(2).find_element(By.CSS_SELECTOR, "button.stop").click()
        wait.until(lambda d: _alert(d)).accept()
        wait.until(lambda d: "trial 2: stop requested" in card(2).find_element(By.CSS_SELECTOR, ".feedback").text)
        wait.until(lambda d: card(2).find_elements(By.CSS_SELECTOR, "button.withdraw"))
        browser.implicitly_wait(0)
        assert card(2).find_elements(By.CSS_SELECTOR, "button.stop") == []
        assert TrialRecord(_trials(study)[2]).pending[-1].op == "stop"
        card(2).find_element(By.CSS_SELECTOR, "button.withdraw").click()
        wait.until(lambda d: "stop request withdrawn" in card(2).find_element(By.CSS_SELECTOR, ".feedback").text)
        wait.until(lambda d: card(2).find_elements(By.CSS_SELECTOR, "button.stop"))

        # A request is said on its card until it applies: pause trial 2 (its one undo is "Withdraw pause", no
        # Resume beside it), then the process running the study applies it at the chunk boundary.
        card(2).find_element(By.CSS_SELECTOR, "button.pause").click()
        wait.until(lambda d: "trial 2: pause requested" in card(2).find_element(By.CSS_SELECTOR, ".feedback").text)
        wait.until(lambda d: card(2).find_elements(By.CSS_SELECTOR, "button.withdraw"))
        assert [b.get_attribute("data-op") for b in card(2).find_elements(By.CSS_SELECTOR, "button.op")] == [
            "withdraw", "stop"]
        ops.apply_requests(schema.TrialRef.of(study.optuna, _trials(study)[2]), TrialRecord(_trials(study)[2]),
                           after_chunk=0)
        browser.execute_async_script("window.rfoptRefresh().then(arguments[0])")
        wait.until(lambda d: card(2).get_attribute("data-situation") == "paused")
        assert card(2).find_element(By.CSS_SELECTOR, ".feedback").text == ""  # applied: nothing left to say
        assert [b.get_attribute("data-op") for b in card(2).find_elements(By.CSS_SELECTOR, "button.op")] == [
            "resume", "stop"]
        browser.save_screenshot(str(tmp_path / "rfopt-dashboard-after-ops.png"))

    trials = _trials(study)
    assert len(trials) == 4
    clone = trials[3]
    assert trial_attrs(clone)["rfopt:clone"]["overrides"] == {"learning_rate": 0.004, "peft_config.lora_alpha": 16}
    assert rfopt.TrialConfig.from_json(trial_attrs(clone)["rfopt:config"]).peft_config.lora_alpha == 16
    assert TrialRecord(trials[2]).pending == []
    assert [w.request.op for w in TrialRecord(trials[2]).withdrawn] == ["stop"]


@pytest.mark.slow
def test_the_study_stop_is_said_until_it_applied_and_its_button_acts_only_while_a_process_runs_the_study(
        study, browser):
    from selenium.webdriver.common.by import By
    from selenium.webdriver.support.ui import WebDriverWait

    from rfopt.storage.leases import Presence

    wait = WebDriverWait(browser, 15)
    status = lambda: browser.find_element(By.ID, "status").text  # noqa: E731
    halt = lambda: browser.find_element(By.ID, "halt")  # noqa: E731
    presence = Presence(study.optuna, "run")
    with serving(study.optuna._storage) as server:
        presence.__enter__()
        try:
            browser.get(server.url(f"/rfopt/studies/{study.optuna._study_id}"))
            assert halt().is_enabled()
            halt().click()
            wait.until(lambda d: _alert(d)).accept()
            wait.until(lambda d: "stop requested" in status())
            browser.execute_async_script("window.rfoptRefresh().then(arguments[0])")
            assert "stop requested" in status() and halt().is_enabled()  # not applied yet: still said
        finally:
            presence.__exit__(None, None, None)  # the process stops: the halt applied
        browser.execute_async_script("window.rfoptRefresh().then(arguments[0])")
        wait.until(lambda d: status() == "")
        assert not halt().is_enabled() and "nothing to stop" in halt().get_attribute("title")


def _alert(driver):
    from selenium.common.exceptions import NoAlertPresentException

    try:
        return driver.switch_to.alert
    except NoAlertPresentException:
        return False


@pytest.mark.slow
def test_a_wide_leaderboard_fits_a_1400_pixel_page(tmp_path, browser):
    """The demo study's leaderboard (5 reward functions with long names, 4 params, a long reason) wraps its headers
    instead of widening the page past the window."""
    from selenium.webdriver.common.by import By

    opt = optuna.create_study(study_name="wide", storage=f"sqlite:///{tmp_path / 'wide.db'}", direction="maximize",
                              sampler=optuna.samplers.RandomSampler(seed=0))
    schema.write_plan(opt, ChunkPlan.build(16, 2, 0))
    names = ["correctness_reward_func", "int_reward_func", "soft_format_reward_func", "strict_format_reward_func",
             "xmlcount_reward_func"]
    for number in range(3):
        trial = opt.ask()
        trial.suggest_float("learning_rate", 1e-6, 1e-3, log=True)
        trial.suggest_categorical("lora_r", [4, 8, 16])
        trial.suggest_float("beta", 0.0, 0.1)
        trial.suggest_float("temperature", 0.5, 1.2)
        trial.set_user_attr("rfopt:config", trial_config("tiny-model-not-loaded-here").to_json())
        evaluation = {"reward": 1.0 + number, **{f"rewards/{n}/mean": 0.123456 * number for n in names}}
        trial.set_user_attr(metrics_key(0), {"chunk": 0, "train": {"reward": 1.0}, "eval": evaluation})
        trial.report(1.0 + number, step=0)
        if number == 0:
            trial.set_user_attr("rfopt:pruning:0", {"prune": True, "peers": [1, 2], "pruner": "SuccessiveHalvingPruner",
                                                    "reason": "value 1.0 at chunk 0 is not in the top 1 of 3 trials "
                                                              "that reached rung 0 (1.0 < 3.0); 2 trials above it"})
            opt.tell(trial, state=TrialState.PRUNED)
    with serving(opt._storage) as server:
        browser.get(server.url(f"/rfopt/studies/{opt._study_id}"))
        browser.find_element(By.CSS_SELECTOR, "table.leaderboard")
        width, page = browser.execute_script(
            "return [window.innerWidth, Math.max(document.documentElement.scrollWidth, "
            "document.querySelector('table.leaderboard').getBoundingClientRect().right)]")
        wide = browser.execute_script(
            "return [...document.querySelectorAll('body *')].filter(e => e.getBoundingClientRect().right > "
            "window.innerWidth + 1).slice(0, 8).map(e => e.tagName + '.' + e.className + ' ' + "
            "Math.round(e.getBoundingClientRect().right))")
        assert width <= 1400 and page <= width, f"the page is {page} px wide in a {width} px window: {wide}"
        headers = [th.text.replace("\n", "") for th in browser.find_elements(By.CSS_SELECTOR, "table.leaderboard th")]
        assert "eval soft_format_reward_func" in headers  # wrapped, not shortened
