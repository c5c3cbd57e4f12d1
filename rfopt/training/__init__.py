"""Training a trial's chunk on one device with TRL's `GRPOTrainer`, exactly, and evaluating it.

| module | owns |
|---|---|
| `loading` | a base model and its tokenizer loaded as TRL loads them; its adapter checked on the meta device |
| `memory` | what a base model and a gang need in memory (estimated without loading weights), what a device has free |
| `quantization` | bitsandbytes in a trial (QLoRA, 8-bit and paged optimizers): what it needs, what it holds in memory |
| `models` | resident base models per device, adapters on them, placement and precision; each rollout backend asked of a kind (`ModelPool.backend`) |
| `runner` | `Runner`, the protocol the engine, a gang and evaluation use of a trial's runner; `TrialRunner`: one trial's `GRPOTrainer`, trained one chunk at a time, bit-identical to training straight through |
| `evaluation` | each chunk's evaluation: fixed decoding, the trial's own reward functions; a unit's members through the rollout backend its plan chose (`evaluate_runners`) |
| `diversity` | whether an evaluation's completions still depend on the prompt: diversity measures, the collapse verdict |
| `baseline` | a base model evaluated with no adapter, as its trials are: the study's reference |
| `gang` | one or several trials' chunks in lockstep, their rollouts through one rollout backend |
| `rollouts` | the rollout backends (exact; batched: a static cache, a LoRA bank, a captured step), built in one place by kind (`make_backend`); what a backend must implement, who calls each member and when; who may share a batch (the batched backend's `refusal`) |
| `parallel` | one trial's chunk as a data-parallel job over several devices |
| `progress` | a chunk's progress while it trains, and what it does within its phase, published to the study (throttled) |
| `trackers` | each trial's run in the user's experiment tracker (TensorBoard, wandb, MLflow, ...) |
"""
