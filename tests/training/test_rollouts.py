"""Rollout backends (`rfopt.training.rollouts`): the conformance suite every backend passes, the batched backend's
parts (the vectorized sampler, the LoRA bank, the graph-safe step), and who may share a batch (`refusal`).

What every backend promises: greedy completions through an adapter are ``model.generate``'s through that adapter,
token for token, whoever shares the call; a request's samples depend on its seed, not on its partners; a partner
whose adapter emits one token changes no other completion; a request whose logits cannot be sampled fails alone;
``should_stop`` stops between two tokens."""

import contextlib
import math

import pytest
import torch
from peft import LoraConfig, get_peft_model
from transformers import AutoModelForCausalLM, AutoTokenizer

import rfopt
from rfopt.training.rollouts import (
    DecodeAborted,
    Decoded,
    BatchedBackend,
    ExactBackend,
    GenerationRequest,
    Sampling,
    Ungangable,
)
from rfopt.training.rollouts.bank import adapter_refusal
from rfopt.training.rollouts.sampler import Features, RowSettings, row_key, sample, uniform_noise
from rfopt_testkit import lora_config, reward_len, trial_config

QUESTIONS = ["What is 2+3?", "Tell me a story about a cat", "hi", "Count: 1 2 3"]


@pytest.fixture(scope="module")
def adapters(tiny_model):
    """The tiny model with three random LoRA adapters of different ranks and targets, and its tokenizer."""
    tokenizer = AutoTokenizer.from_pretrained(tiny_model)
    torch.manual_seed(0)
    model = get_peft_model(AutoModelForCausalLM.from_pretrained(tiny_model),
                           LoraConfig(r=8, lora_alpha=16, target_modules="all-linear", init_lora_weights=False),
                           adapter_name="a")
    model.add_adapter("b", LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], init_lora_weights=False))
    model.add_adapter("c", LoraConfig(r=16, lora_alpha=8, target_modules="all-linear", init_lora_weights=False))
    return model, tokenizer


BACKENDS = {
    "exact": ExactBackend,
    "batched": lambda model: BatchedBackend(model, mode="eager"),
}
if torch.cuda.is_available():  # the captured step; the CPU proves it capturable by compiling it (below)
    BACKENDS["batched-graph"] = lambda model: BatchedBackend(model, mode="graph")


@pytest.fixture(params=sorted(BACKENDS))
def backend_of(request):
    return BACKENDS[request.param]


def _ids(tokenizer, questions=QUESTIONS):
    return [tokenizer.apply_chat_template([{"role": "user", "content": q}], add_generation_prompt=True,
                                          tokenize=True, return_dict=True)["input_ids"] for q in questions]


def _sampling(tokenizer, **kw):
    return Sampling(**{"max_new_tokens": 16, "eos_token_ids": (tokenizer.eos_token_id,),
                       "pad_token_id": tokenizer.pad_token_id, **kw})


def _generate_alone(model, tokenizer, adapter, rows, max_new_tokens=16):
    """What ``model.generate`` decodes greedily through one adapter, cut after the first EOS."""
    model.set_adapter(adapter)
    model.eval()
    width = max(map(len, rows))
    ids = torch.tensor([[tokenizer.pad_token_id] * (width - len(r)) + r for r in rows])
    mask = torch.tensor([[0] * (width - len(r)) + [1] * len(r) for r in rows])
    with torch.no_grad():
        out = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=max_new_tokens, do_sample=False,
                             pad_token_id=tokenizer.pad_token_id, eos_token_id=tokenizer.eos_token_id)
    completions = []
    for row in out[:, width:].tolist():
        end = row.index(tokenizer.eos_token_id) + 1 if tokenizer.eos_token_id in row else len(row)
        completions.append(row[:end])
    return completions


@contextlib.contextmanager
def _nan_adapter(model, target_modules):
    """An adapter named ``nan`` on `model` whose LoRA A weights are all NaN (its logits cannot be sampled), deleted
    afterwards."""
    model.add_adapter("nan", LoraConfig(r=2, lora_alpha=2, target_modules=target_modules, init_lora_weights=False))
    try:
        for module in model.modules():
            if hasattr(module, "lora_A") and "nan" in module.lora_A:
                with torch.no_grad():
                    module.lora_A["nan"].weight.fill_(math.nan)
        yield
    finally:
        model.delete_adapter("nan")


def _tokens(outcomes):
    return [o.token_ids if not isinstance(o, Exception) else o for o in outcomes]


# ---------------------------------------------------------------------- conformance: every backend
def test_greedy_rows_are_generates_rows_through_their_own_adapter_whoever_shares_the_call(adapters, backend_of):
    model, tokenizer = adapters
    rows = _ids(tokenizer)
    greedy = _sampling(tokenizer, do_sample=False)
    backend = backend_of(model)
    together = _tokens(backend.generate([GenerationRequest(name, rows, greedy) for name in "abc"]))
    for name, got in zip("abc", together):
        assert got == _generate_alone(model, tokenizer, name, rows), name
    # alone, and beside other partners, in another order, and with its rows split into batches
    assert _tokens(backend.generate([GenerationRequest("b", rows, greedy)])) == [together[1]]
    assert _tokens(backend.generate([GenerationRequest("c", rows[:1], greedy), GenerationRequest("b", rows, greedy)])
                   )[1] == together[1]
    assert _tokens(backend.generate([GenerationRequest("b", rows, greedy, batch_rows=3)])) == [together[1]]
    assert together[0] != together[1] != together[2]  # the adapters do differ


def test_a_requests_samples_depend_on_its_seed_not_on_its_partners(adapters, backend_of):
    model, tokenizer = adapters
    rows = _ids(tokenizer)
    sampling = _sampling(tokenizer, temperature=0.9, top_k=20, top_p=0.95, repetition_penalty=1.1)
    backend = backend_of(model)
    alone = _tokens(backend.generate([GenerationRequest("a", rows, sampling, seed=5)]))[0]
    partnered = _tokens(backend.generate([
        GenerationRequest("b", rows[:2], _sampling(tokenizer, temperature=1.3), seed=9),
        GenerationRequest("a", rows, sampling, seed=5), GenerationRequest("c", rows[1:], sampling, seed=5)]))
    assert partnered[1] == alone
    assert _tokens(backend.generate([GenerationRequest("a", rows, sampling, seed=6)]))[0] != alone


def test_a_partner_whose_adapter_emits_one_token_changes_no_other_completion(adapters, backend_of):
    model, tokenizer = adapters
    rows = _ids(tokenizer)
    model.add_adapter("eos", LoraConfig(r=2, lora_alpha=2, target_modules=["lm_head"], lora_bias=True))
    try:
        for module in model.modules():
            if hasattr(module, "lora_B") and "eos" in module.lora_B:
                with torch.no_grad():
                    module.lora_B["eos"].bias.zero_()
                    module.lora_B["eos"].bias[tokenizer.eos_token_id] = 1e4
        sampling = _sampling(tokenizer)
        backend = backend_of(model)
        with_plain = _tokens(backend.generate([GenerationRequest("b", rows, sampling, seed=3),
                                               GenerationRequest("a", rows, sampling, seed=3)]))
        with_eos = _tokens(backend.generate([GenerationRequest("eos", rows, sampling, seed=3),
                                             GenerationRequest("a", rows, sampling, seed=3)]))
    finally:
        model.delete_adapter("eos")
    assert with_eos[0] == [[tokenizer.eos_token_id]] * len(rows)  # one token each
    assert with_eos[1] == with_plain[1]


def test_a_request_whose_logits_cannot_be_sampled_fails_alone(adapters, backend_of):
    model, tokenizer = adapters
    rows = _ids(tokenizer)
    with _nan_adapter(model, ["q_proj"]):
        sampling = _sampling(tokenizer)
        backend = backend_of(model)
        out = backend.generate([GenerationRequest("nan", rows, sampling, seed=1),
                                GenerationRequest("a", rows, sampling, seed=3)])
        alone = backend.generate([GenerationRequest("a", rows, sampling, seed=3)])[0]
    assert isinstance(out[0], RuntimeError)
    assert out[1].token_ids == alone.token_ids


def test_a_request_decoded_where_a_nan_adapters_rows_were_is_not_contaminated_by_them(adapters, backend_of):
    """`[a, nan]` then `[a, b]`: b's rows are the NaN adapter's rows of the same decode shape, whose cache columns past
    the prompts held NaN keys and values (masked, but a masked NaN times a weight of 0 is still NaN)."""
    model, tokenizer = adapters
    rows = _ids(tokenizer)
    with _nan_adapter(model, ["q_proj", "v_proj"]):
        sampling = _sampling(tokenizer)
        backend = backend_of(model)
        fresh = backend_of(model).generate([GenerationRequest("a", rows, sampling, seed=3),
                                            GenerationRequest("b", rows, sampling, seed=4)])
        failed = backend.generate([GenerationRequest("a", rows, sampling, seed=3),
                                   GenerationRequest("nan", rows, sampling, seed=1)])
        after = backend.generate([GenerationRequest("a", rows, sampling, seed=3),
                                  GenerationRequest("b", rows, sampling, seed=4)])
    assert isinstance(failed[1], RuntimeError) and failed[0].token_ids == fresh[0].token_ids
    assert not any(isinstance(o, Exception) for o in after), after
    assert _tokens(after) == _tokens(fresh)


def test_should_stop_stops_decoding_between_two_tokens(adapters, backend_of):
    model, tokenizer = adapters
    rows = _ids(tokenizer)
    asked = []

    def should_stop():
        asked.append(1)
        return len(asked) > 3

    backend = backend_of(model)
    with pytest.raises(DecodeAborted):
        backend.generate([GenerationRequest("a", rows, _sampling(tokenizer, max_new_tokens=64)),
                          GenerationRequest("b", rows, _sampling(tokenizer, max_new_tokens=64))], should_stop)
    assert len(asked) < 16  # it stopped after a few tokens, not at the end


def test_progress_hears_the_tokens_so_far_and_each_batch_of_rows_done_and_changes_no_completion(adapters,
                                                                                              backend_of):
    model, tokenizer = adapters
    rows = _ids(tokenizer)
    greedy = _sampling(tokenizer, do_sample=False)
    sampled = _sampling(tokenizer, temperature=0.9, max_new_tokens=12)
    requests = [GenerationRequest("a", rows, greedy, batch_rows=2), GenerationRequest("b", rows[:3], sampled, seed=4)]
    backend = backend_of(model)
    quiet = _tokens(backend.generate(requests))
    heard: list[Decoded] = []
    assert _tokens(backend.generate(requests, progress=heard.append)) == quiet  # a display's hook changes nothing
    assert heard and all(d.rows == (4, 3) for d in heard)
    assert heard[-1].rows_done == (4, 3)  # every row of both requests
    # Rows are done batch by batch (request a in batches of 2), never all at once from the start, never backwards.
    assert any(d.rows_done[0] == 2 for d in heard)
    assert all(x <= y for before, after in zip(heard, heard[1:]) for x, y in zip(before.rows_done, after.rows_done))
    # Tokens so far, of the most the batch may decode, counted up within a batch.
    decoding = [d for d in heard if d.tokens]
    assert decoding and all(0 < d.tokens <= d.max_tokens <= 16 for d in decoding)
    assert max(d.tokens for d in decoding) >= 4 and all(d.seconds >= 0 for d in decoding)
    assert any(d.rate is not None and d.rate > 0 for d in decoding)


def test_a_progress_callback_that_raises_fails_no_decode(adapters, backend_of):
    model, tokenizer = adapters
    rows = _ids(tokenizer)

    def broken(decoded):
        raise RuntimeError("the display broke")

    backend = backend_of(model)
    request = GenerationRequest("a", rows, _sampling(tokenizer, do_sample=False))
    assert _tokens(backend.generate([request], progress=broken)) == _tokens(backend.generate([request]))


# ---------------------------------------------------------------------- the batched backend's parts
@pytest.mark.slow
def test_the_decode_step_compiles_as_one_graph_with_no_break(adapters):
    """``torch.compile(fullgraph=True)`` refuses a graph break, and a host synchronisation (``.item()``, a
    data-dependent branch) is one: the step that a CUDA graph captures has none, every sampler feature on."""
    import torch._dynamo

    model, tokenizer = adapters
    rows = _ids(tokenizer)
    sampling = _sampling(tokenizer, temperature=0.9, top_k=20, top_p=0.95, min_p=0.01, repetition_penalty=1.1)
    requests = [GenerationRequest("a", rows, sampling, seed=5, logprobs=True),
                GenerationRequest("c", rows, sampling, seed=5)]
    backend = BatchedBackend(model, mode="eager")
    eager = backend.generate(requests)
    torch._dynamo.reset()
    compiled = torch.compile(backend._step, fullgraph=True, backend="eager")
    backend._step = compiled  # the host loop calls the compiled step from now on
    try:
        again = backend.generate(requests)
    finally:
        torch._dynamo.reset()
    assert _tokens(again) == _tokens(eager)
    flat = [lp for row in again[0].logprobs for lp in row]
    assert flat == pytest.approx([lp for row in eager[0].logprobs for lp in row])
    assert all(lp <= 0 for lp in flat) and again[1].logprobs is None  # asked for by the first request only


def test_the_sampler_draws_from_the_softmax_of_the_filtered_logits():
    logits = torch.tensor([[2.0, 1.0, 0.0, -1.0, -30.0]] * 4000)
    keys = torch.tensor([row_key(11, r) for r in range(len(logits))])
    settings = RowSettings.of([Sampling(max_new_tokens=1, eos_token_ids=(), pad_token_id=0, temperature=0.5,
                                        top_k=3)] * len(logits), len(logits), 5, "cpu")
    tokens, _ = sample(logits, settings, Features(sample=True, top_k=True), noise=uniform_noise(keys,
                                                                                                 torch.tensor(0)))
    counts = torch.bincount(tokens, minlength=5).float() / len(logits)
    expected = torch.softmax(torch.tensor([2.0, 1.0, 0.0]) / 0.5, dim=0)
    assert counts[3:].sum() == 0  # filtered by top-k
    assert torch.allclose(counts[:3], expected, atol=0.03), (counts, expected)


def test_a_rows_noise_depends_on_its_seed_row_and_token_only():
    keys = torch.tensor([row_key(7, 0), row_key(7, 1), row_key(8, 0)])
    a = uniform_noise(keys, torch.tensor(3))
    b = uniform_noise(keys[[2, 0]], torch.tensor(3))
    assert a[0] == b[1] and a[2] == b[0]  # its own, wherever it sits in the batch
    assert len({float(x) for x in a}) == 3 and bool(((a > 0) & (a < 1)).all())
    assert uniform_noise(keys, torch.tensor(4))[0] != a[0]


def test_the_bank_refuses_what_it_cannot_serve_and_the_view_leaves_the_model_alone(adapters, tiny_model):
    model, tokenizer = adapters
    assert adapter_refusal(model, "a") is None
    assert "no adapter" in adapter_refusal(model, "zzz")
    model.add_adapter("emb", LoraConfig(r=2, target_modules=["embed_tokens"], init_lora_weights=False))
    try:
        assert "Embedding" in adapter_refusal(model, "emb")
        greedy = _sampling(tokenizer, do_sample=False)
        backend = BatchedBackend(model)
        model.set_adapter("b")
        out = backend.generate([GenerationRequest("emb", _ids(tokenizer)[:2], greedy),
                                GenerationRequest("a", _ids(tokenizer)[:2], greedy)])
        # What it cannot serve is routed to the exact path (never a failure), beside the rows it decodes itself.
        assert out[0].token_ids == _generate_alone(model, tokenizer, "emb", _ids(tokenizer)[:2])
        assert out[1].token_ids == _generate_alone(model, tokenizer, "a", _ids(tokenizer)[:2])
        assert backend.stats.routed == 1
        model.set_adapter("b")
        backend.generate([GenerationRequest("emb", _ids(tokenizer)[:1], greedy)])
        assert model.active_adapter == "b"  # the shared model's active adapter is left as it was
        assert isinstance(backend.generate([GenerationRequest(None, _ids(tokenizer)[:1], greedy)])[0], Ungangable)
    finally:
        model.delete_adapter("emb")
    before = {id(m): dict(vars(m)) for m in model.modules()}
    BatchedBackend(model).generate([GenerationRequest("a", _ids(tokenizer)[:2], _sampling(tokenizer))])
    assert all(dict(vars(m)).keys() == before[id(m)].keys() for m in model.modules())


def test_backends_are_built_in_one_place_by_kind(adapters):
    """`make_backend` is the one constructor (the pool's backends, the batched backend's routing): a third kind is
    added there, and every caller that names a kind gets it."""
    import re
    from pathlib import Path

    from rfopt.training.rollouts import BATCHED, EXACT, make_backend

    root = Path(rfopt.__file__).parent
    built = sorted(path.relative_to(root).as_posix() for path in root.rglob("*.py")
                   if re.search(r"^(?!\s*>>>).*\b(Exact|Batched)Backend\(", path.read_text(), re.M))
    assert built == ["training/rollouts/backend.py"]
    model, _ = adapters
    assert type(make_backend(EXACT, model)) is ExactBackend
    assert type(make_backend(BATCHED, model, mode="eager")) is BatchedBackend
    with pytest.raises(ValueError, match="'vllm': give one of exact, batched"):
        make_backend("vllm", model)


def test_who_may_share_a_batch_is_decided_in_one_place_the_backends_gate(adapters, tiny_model):
    from rfopt.training import rollouts

    refusal = BatchedBackend(adapters[0]).refusal
    assert refusal(trial_config(tiny_model)) is None
    assert "num_beams" in refusal(trial_config(tiny_model, generation_kwargs={"num_beams": 2}))
    assert "DoRA" in refusal(trial_config(tiny_model, peft=lora_config(use_dora=True)))
    assert "embedding" in refusal(trial_config(tiny_model, peft=lora_config(target_modules=["q_proj",
                                                                                              "embed_tokens"])))
    assert "full fine-tuning" in refusal(rfopt.TrialConfig(model=str(tiny_model), reward_funcs=[reward_len],
                                                           args=trial_config(tiny_model).args, peft_config=None))
    # no second gate beside the backends' own: a caller asks the backend the plan would use
    assert not hasattr(rollouts, "refusal") and not hasattr(rollouts.backend, "refusal")


def test_the_batched_backends_refusal_is_its_config_gate_and_its_own_check_of_the_model(adapters, tiny_model):
    model, _ = adapters
    backend = BatchedBackend(model)
    assert backend.refusal(trial_config(tiny_model)) is None
    assert "DoRA" in backend.refusal(trial_config(tiny_model, peft=lora_config(use_dora=True)))
    config = model.get_base_model().config
    config.sliding_window, config.use_sliding_window = 4, True
    try:
        assert "sliding-window" in backend.refusal(trial_config(tiny_model))  # the model it serves, its own check
    finally:
        del config.sliding_window, config.use_sliding_window


def test_under_mixed_precision_the_decoder_reads_a_bf16_copy_and_the_trained_weights_stay_float32(adapters):
    """``bf16=True`` trains float32 master weights in bf16: the batched backend decodes through a bf16 copy of the
    (frozen) base and bank, as a vLLM engine beside a trainer does, and never converts the shared model."""
    model, tokenizer = adapters
    rows = _ids(tokenizer)
    before = {name: p.dtype for name, p in model.named_parameters()}
    backend = BatchedBackend(model, dtype=torch.bfloat16)
    greedy = _sampling(tokenizer, do_sample=False)
    out = backend.generate([GenerationRequest("a", rows, greedy), GenerationRequest("b", rows, greedy)])
    assert all(len(row) >= 1 for o in out for row in o.token_ids)
    assert {name: p.dtype for name, p in model.named_parameters()} == before
    assert {p.dtype for p in backend._view.parameters()} == {torch.bfloat16}
    assert backend._view.lm_head.weight is backend._view.model.embed_tokens.weight  # still tied
    assert next(iter(backend._bank.entries.values())).a.dtype == torch.bfloat16


# ---------------------------------------------------------------------- settings only generate implements
def test_a_request_whose_settings_only_generate_implements_is_decoded_through_it_beside_the_batch(adapters):
    """A setting the batched sampler lacks (here the model's own ``no_repeat_ngram_size``, which TRL's config leaves
    unset and ``generate`` fills) is never dropped and never fails the request: it is decoded through ``generate``,
    with its adapter, while its partners decode in the batch."""
    from transformers import GenerationConfig

    model, tokenizer = adapters
    rows = _ids(tokenizer)
    config = GenerationConfig(max_new_tokens=16, do_sample=True, temperature=0.9, top_k=0,
                              pad_token_id=tokenizer.pad_token_id, eos_token_id=[tokenizer.eos_token_id],
                              no_repeat_ngram_size=1)
    apart = GenerationRequest("a", rows, None, seed=4, generate_kwargs={"generation_config": config})
    greedy = GenerationRequest("b", rows, _sampling(tokenizer, do_sample=False))
    backend = BatchedBackend(model, mode="eager")
    out = backend.generate([apart, greedy])
    assert _tokens(out) == [_tokens(ExactBackend(model).generate([apart]))[0],
                            _generate_alone(model, tokenizer, "b", rows)]
    for prompt, completion in zip(rows, out[0].token_ids):  # no token twice in prompt and completion
        assert len(completion) > 1 and len(set(prompt + completion)) == len(set(prompt)) + len(completion)
    assert backend.stats.routed == 1


def test_a_requests_sampling_is_the_trainers_config_filled_from_the_models_own_as_generate_fills_it(tiny_model):
    from transformers import AutoModelForCausalLM, GenerationConfig

    from rfopt.training.rollouts import request_sampling

    model = AutoModelForCausalLM.from_pretrained(tiny_model)
    trl = GenerationConfig(max_new_tokens=8, do_sample=True, pad_token_id=0, eos_token_id=[3], temperature=0.9,
                           top_p=1.0, top_k=0, min_p=None, repetition_penalty=1.0, disable_compile=True)
    assert request_sampling(model.generation_config, trl) == Sampling.of(trl)  # the tiny model's adds nothing
    model.generation_config.min_p = 0.05
    assert request_sampling(model.generation_config, trl).min_p == 0.05  # was dropped: min_p=None
    model.generation_config.no_repeat_ngram_size = 2
    assert request_sampling(model.generation_config, trl) is None  # decoded through generate
    with pytest.raises(Ungangable, match="no_repeat_ngram_size"):
        Sampling.of(rfopt.training.rollouts.generation_settings(model.generation_config, trl))


def test_under_mixed_precision_trials_alone_and_routed_requests_are_evaluated_in_the_gangs_precision(adapters,
                                                                                                     tiny_model):
    """In a bf16 study the gang's trials decode from a bf16 copy; a trial alone (the exact backend) and a request the
    batched backend routes to the exact path compute in bf16 too (autocast), not in the float32 master weights."""
    from rfopt.training.models import ModelPool
    from rfopt.training.rollouts import BATCHED, EXACT

    model, tokenizer = adapters
    seen = []
    layer = model.get_base_model().model.layers[0].self_attn.q_proj.base_layer
    handle = layer.register_forward_hook(lambda module, args, out: seen.append(out.dtype))
    greedy = _sampling(tokenizer, do_sample=False)
    try:
        ExactBackend(model, dtype=torch.bfloat16).generate([GenerationRequest("a", _ids(tokenizer)[:2], greedy)])
        assert set(seen) == {torch.bfloat16}
        seen.clear()
        ExactBackend(model).generate([GenerationRequest("a", _ids(tokenizer)[:2], greedy)])
        assert set(seen) == {torch.float32}
        seen.clear()
        routed = GenerationRequest("a", _ids(tokenizer)[:2], None, generate_kwargs=greedy.generate_kwargs())
        BatchedBackend(model, dtype=torch.bfloat16).generate([routed])
        assert set(seen) == {torch.bfloat16}
    finally:
        handle.remove()
    pool = ModelPool("cpu", precision="bf16")
    config = trial_config(tiny_model)
    pool.acquire(0, config)
    assert pool.backend(EXACT, 0, config).dtype == pool.backend(BATCHED, 0, config).dtype == torch.bfloat16
    pool.release(0, config)


# ---------------------------------------------------------------------- decode shapes: a ladder, least recently used
def _study_like_decodes(tokenizer):
    """What a 7-trial study in gangs of 4 (4 and 3) asks the decoder over 4 chunks: per gang and chunk, 4 rollout
    decodes (one prompt x 4 generations per member, prompts of any width) and an evaluation of 6 prompts in batches of
    4: 48 decodes. Completions are kept short (the shapes are the point, not the tokens)."""
    import random

    rng = random.Random(0)

    def ids(text):
        return tokenizer.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True,
                                             tokenize=True, return_dict=True)["input_ids"]

    budget = {n: (2, 3, 4)[n % 3] for n in range(7)}
    evals = [ids(f"E{i}: " + "x" * rng.randint(5, 300)) for i in range(6)]
    calls = []
    for chunk in range(4):
        for gang in ((0, 1, 2, 3), (4, 5, 6)):
            for step in range(4):
                calls.append([GenerationRequest(f"t{n}", [ids(f"Q{chunk}{step}{n}: " + "y" * rng.randint(5, 300))] * 4,
                                                _sampling(tokenizer, max_new_tokens=budget[n], temperature=0.9),
                                                seed=100 * n + step) for n in gang])
            calls.append([GenerationRequest(f"t{n}", evals, _sampling(tokenizer, max_new_tokens=budget[n],
                                                                      do_sample=False), batch_rows=4) for n in gang])
    return calls


@pytest.fixture(scope="module")
def seven(tiny_model):
    """The tiny model with seven adapters t0..t6 (a study's trials), and its tokenizer."""
    tokenizer = AutoTokenizer.from_pretrained(tiny_model)
    torch.manual_seed(0)
    model = get_peft_model(AutoModelForCausalLM.from_pretrained(tiny_model),
                           LoraConfig(r=4, target_modules=["q_proj", "v_proj"], init_lora_weights=False),
                           adapter_name="t0")
    for n in range(1, 7):
        model.add_adapter(f"t{n}", LoraConfig(r=4, target_modules=["q_proj", "v_proj"], init_lora_weights=False))
    return model, tokenizer


def test_a_studys_decodes_fall_into_a_few_shapes_each_made_once(seven):
    """Gangs of 4 and 3, prompts of any width, evaluation's last short batch: padded to the ladder (`decode_shape`),
    48 decodes make a handful of shapes (on a GPU: a capture each), none made twice (one per prompt width and gang
    size, the same study made 30 or more, each captured again after the 8th dropped them all)."""
    from rfopt.training.rollouts.batched import MAX_BUCKETS

    model, tokenizer = seven
    backend = BatchedBackend(model, mode="eager")
    for requests in _study_like_decodes(tokenizer):
        assert not any(isinstance(o, Exception) for o in backend.generate(requests))
    assert backend.stats.decodes == 48
    assert backend.stats.shapes <= 6 <= MAX_BUCKETS and len(backend._buckets) == backend.stats.shapes


def test_the_least_recently_used_shape_is_dropped_first(seven, monkeypatch):
    from rfopt.training.rollouts import batched

    model, tokenizer = seven
    monkeypatch.setattr(batched, "MAX_BUCKETS", 2)
    backend = BatchedBackend(model, mode="eager")
    greedy = _sampling(tokenizer, max_new_tokens=2, do_sample=False)
    rows = _ids(tokenizer)
    one, two, four = ([GenerationRequest(f"t{n}", rows, greedy) for n in range(k)] for k in (1, 2, 4))
    shapes = []
    for requests in (one, two, one, four, one):  # shapes A, B, A (used again), C (B goes), A (kept: not made again)
        backend.generate(requests)
        shapes.append(backend.stats.shapes)
    assert shapes == [1, 2, 2, 3, 3]
    assert [key[0] for key in backend._buckets] == [4, 1]  # C, then A (the most recently used last)


def test_padding_to_the_ladder_changes_no_rows_completion(seven, monkeypatch):
    """Three requests of three rows (padded to 4 groups of 4 rows and a longer cache) decode the same tokens, greedy and
    sampled, as in a bucket of exactly their shape."""
    from rfopt.training.rollouts import batched

    model, tokenizer = seven
    rows = _ids(tokenizer)[:3]
    requests = [GenerationRequest("t0", rows, _sampling(tokenizer, do_sample=False)),
                GenerationRequest("t1", rows, _sampling(tokenizer, temperature=0.9, top_p=0.9), seed=3),
                GenerationRequest("t2", rows[:2], _sampling(tokenizer, temperature=1.1, top_k=30), seed=5)]
    padded_backend = BatchedBackend(model, mode="eager")
    padded = _tokens(padded_backend.generate(requests))
    monkeypatch.setattr(batched, "decode_shape", lambda groups, per_group, tokens: (groups, per_group, tokens))
    exact_backend = BatchedBackend(model, mode="eager")
    exact = _tokens(exact_backend.generate(requests))
    assert padded == exact
    (padded_key,), (exact_key,) = padded_backend._buckets, exact_backend._buckets
    assert padded_key[:3] == (4, 4, 64) and exact_key[:2] == (3, 3) and exact_key[2] < 64  # it was padded


def test_a_step_on_the_cpu_attends_only_the_columns_written_and_decodes_the_same_bits(seven, monkeypatch):
    """Run eagerly on the CPU, a decode step attends the cache columns written so far, in whole blocks of
    `LIVE_BLOCK`, not the whole padded cache: the tokens and log-probs are bit for bit those of steps that attend it
    whole (a bucket of 256 columns, of which the first steps use one block)."""
    from rfopt.training.rollouts import batched

    model, tokenizer = seven
    rows = _ids(tokenizer)
    requests = [GenerationRequest("t0", rows, _sampling(tokenizer, do_sample=False, max_new_tokens=150), logprobs=True),
                GenerationRequest("t1", rows, _sampling(tokenizer, temperature=0.9, top_p=0.9, max_new_tokens=150),
                                  seed=3, logprobs=True)]

    def decoded(block):
        monkeypatch.setattr(batched, "LIVE_BLOCK", block)
        backend = BatchedBackend(model, mode="eager")
        out = backend.generate(requests)
        ((groups, per_group, length, *_),) = backend._buckets
        return [(o.token_ids, o.logprobs) for o in out], backend.stats, length

    trimmed, stats, length = decoded(batched.LIVE_BLOCK)
    whole, whole_stats, _ = decoded(None)
    assert trimmed == whole
    assert length == 256 and stats.cached == whole_stats.columns == whole_stats.cached
    assert stats.columns < 0.8 * stats.cached  # it did leave columns out
    assert any(len(ids) > 64 for ids in trimmed[1][0])  # rows ran past the first block


def test_prompts_that_share_a_prefix_have_it_prefilled_once_per_group_and_decode_as_generate_does(adapters):
    """An evaluation's prompts share their chat template's system prompt: the prefill computes it once per group (one
    adapter's keys and values) and each prompt's rest after it. Greedy rows are still ``model.generate``'s through
    each adapter, token for token, and prompts with no such prefix are prefilled whole."""
    from rfopt.training.rollouts.batched import MIN_PREFIX, shared_prefix

    model, tokenizer = adapters
    system = {"role": "system", "content": "Answer in one short sentence, and show the arithmetic you did first."}
    rows = [tokenizer.apply_chat_template([system, {"role": "user", "content": q}], add_generation_prompt=True,
                                          tokenize=True, return_dict=True)["input_ids"] for q in QUESTIONS]
    assert shared_prefix(rows) >= MIN_PREFIX
    greedy = _sampling(tokenizer, do_sample=False)
    backend = BatchedBackend(model, mode="eager")
    together = _tokens(backend.generate([GenerationRequest(name, rows, greedy) for name in "abc"]))
    assert backend.stats.prefix_tokens == shared_prefix(rows) * (len(rows) - 1) * 3
    for name, got in zip("abc", together):
        assert got == _generate_alone(model, tokenizer, name, rows), name
    plain = _ids(tokenizer)
    assert shared_prefix(plain) < MIN_PREFIX
    backend.generate([GenerationRequest("a", plain, greedy)])
    assert backend.stats.prefix_tokens == shared_prefix(rows) * (len(rows) - 1) * 3  # nothing shared this time


def test_a_shared_prefix_leaves_every_prompt_its_last_token():
    from rfopt.training.rollouts.batched import shared_prefix

    assert shared_prefix([[1, 2, 3], [1, 2, 3]]) == 2
    assert shared_prefix([[1, 2, 3, 4], [1, 2, 3]]) == 2
    assert shared_prefix([[5, 2], [1, 2]]) == 0
    assert shared_prefix([[7]]) == 0
