"""Base models kept resident on a device so that trials share one copy (`ModelPool`), and where and in what precision
they train (`Placement`). Loading one is `rfopt.training.loading`'s; what it needs in memory `rfopt.training.memory`'s.

Trials whose configs name the same base model (same id, loading kwargs and tokenizer: `TrialConfig.model_key`)
share one resident copy; each such trial is one PEFT adapter on it, named ``trial-<number>``. A full fine-tuning
trial (``peft_config=None``), and an adapter whose initialization rewrites the base weights (PiSSA, OLoRA, CorDA,
LoftQ: `owns_base`), gets its own copy of the base model as it was loaded: never one with another trial's
adapter layers or its trained ``modules_to_save`` copies in it (`pristine`).
"""

from __future__ import annotations

import contextlib
import copy
import logging
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

from rfopt.config.trial import TrialConfig
from rfopt.errors import Refusal

from .batched_step import shares_prompts
from .loading import load_model, rewrites_base
from .memory import GIB, GangMemory, free_bytes, gang_memory, model_bytes
from .rollouts import BATCHED, EXACT, KINDS, RolloutBackend, make_backend

logger = logging.getLogger("rfopt")


def adapter_name(trial_number: int) -> str:
    return f"trial-{trial_number}"


ROOM_MARGIN = 1.2
"""`ModelPool.check_room` refuses base models whose weights, times this, exceed the GPU's free memory."""


@dataclass(frozen=True)
class GangRoom:
    """What of a gang fits in a device's memory (`ModelPool.gang_room`): how many of its members, whether they take a
    batched training step, and the message that says what was changed to fit (None: nothing)."""

    size: int
    batched: bool
    message: str | None = None
    fallback: bool = False
    """The gang was to take a batched step and takes its members' steps one after another instead, to fit."""


def _bind_device(device: str) -> str:
    """Check `device` and, for a CUDA device, make it this process's current one; returns it.

    In a single process, accelerate (and so TRL's trainer) puts its work on the *current* CUDA device
    (``torch.device("cuda")``), and a trial's first trainer moves the model there. A pool on ``cuda:1`` in a process
    whose current device is still ``cuda:0`` would have its model moved to ``cuda:0`` and every worker training on
    the same GPU. rfopt runs one device per process (one worker each), so the pool's device becomes the current one.
    """
    import torch

    try:
        where = torch.device(device)
    except (RuntimeError, TypeError) as exc:
        raise Refusal(f"device {device!r}: not a device torch knows ({exc}); use 'cpu', 'cuda' or 'cuda:N'") from exc
    if where.type != "cuda":
        return device
    if not torch.cuda.is_available():
        why = "this torch is a CPU build" if torch.version.cuda is None else "no GPU is visible"
        raise Refusal(f"device {device!r}: CUDA is not available here ({why}); train on 'cpu' instead")
    if where.index is not None:
        count = torch.cuda.device_count()
        if where.index >= count:
            raise Refusal(f"device {device!r}: this machine has {count} CUDA device(s), cuda:0 to cuda:{count - 1}")
        torch.cuda.set_device(where.index)
    return device


@dataclass(frozen=True)
class Placement:
    """Where and in what precision every chunk of a trial trains: decided by the device, never by the trial's config.

    A study file written for the CPU (``use_cpu=True, bf16=False``) runs on ``--device cuda`` with the model on the
    GPU, and one written for a GPU runs on the CPU: `TrialRunner` applies these fields to the `GRPOConfig` of every
    chunk. ``precision="auto"`` is fp32 on the CPU (bf16 autocast there is slower, and TRL refuses it without
    ``use_cpu``) and bf16 on a CUDA device that supports it (else fp32).
    """

    device: str
    use_cpu: bool
    bf16: bool
    fp16: bool

    @classmethod
    def of(cls, device: str, precision: str = "auto") -> Placement:
        import torch

        if precision not in PRECISIONS:
            raise Refusal(f"precision {precision!r}: use one of {', '.join(PRECISIONS)}")
        cuda = torch.device(device).type == "cuda"
        if precision == "auto":
            precision = "bf16" if cuda and _bf16_supported() else "fp32"
        if precision == "fp16" and not cuda:
            raise Refusal(f"precision 'fp16' needs a CUDA device; this study runs on {device!r}")
        return cls(device=device, use_cpu=not cuda, bf16=precision == "bf16", fp16=precision == "fp16")

    def args(self) -> dict[str, bool]:
        """The `GRPOConfig` fields this placement sets."""
        return {"use_cpu": self.use_cpu, "bf16": self.bf16, "fp16": self.fp16}

    def compute_dtype(self) -> Any:
        """The dtype mixed precision computes in (bf16 or fp16), or None (the model's own: fp32)."""
        import torch

        return torch.bfloat16 if self.bf16 else torch.float16 if self.fp16 else None


PRECISIONS = ("auto", "fp32", "bf16", "fp16")


def _bf16_supported() -> bool:
    import torch

    try:
        return bool(torch.cuda.is_bf16_supported())
    except (AssertionError, RuntimeError):  # a CUDA device torch cannot query
        return False


def pristine(model: Any, trainable: set[str]) -> Any:
    """The base model under `model` (a PeftModel, or a model PEFT injected adapters into), as it was loaded: every
    adapter layer replaced by the layer it wraps, every ``modules_to_save`` (and trainable-tokens) wrapper by the
    module it wraps, in place, and the parameters named in `trainable` trainable again (PEFT froze them).

    Not PEFT's ``unload()``: it keeps the active adapter's trained ``modules_to_save`` copy in the model (its trained
    ``lm_head``, say), which another trial must never see."""
    from peft import PeftModel
    from peft.tuners.tuners_utils import BaseTunerLayer
    from peft.utils import AuxiliaryTrainingWrapper

    base = model.get_base_model() if isinstance(model, PeftModel) else model

    def wrapped(module: Any) -> Any:
        if isinstance(module, AuxiliaryTrainingWrapper):
            return module.original_module
        return module.get_base_layer() if isinstance(module, BaseTunerLayer) else None

    while found := [(name, module) for name, module in base.named_modules() if name and wrapped(module) is not None]:
        outer = [(name, module) for name, module in found  # wrappers inside another are replaced in the next pass
                 if not any(name.startswith(f"{other}.") for other, _ in found)]
        for name, module in outer:
            parent, _, leaf = name.rpartition(".")
            setattr(base.get_submodule(parent), leaf, wrapped(module))
    if hasattr(base, "peft_config"):  # PEFT names its config on the model it injects into (as unload() does)
        del base.peft_config
    for name, parameter in base.named_parameters():
        parameter.requires_grad_(name in trainable)
    return base


def owns_base(config: TrialConfig) -> bool:
    """Whether `config`'s trial trains on a copy of its base model of its own instead of the shared one: full
    fine-tuning, and an adapter whose initialization rewrites the base weights (PiSSA, OLoRA, CorDA, LoftQ:
    `rfopt.training.loading.rewrites_base`), which on the shared base would change every co-resident trial."""
    return config.peft_config is None or rewrites_base(config.peft_config) is not None


@dataclass
class _Resident:
    base: Any
    tokenizer: Any
    trainable: set[str] = field(default_factory=set)
    """The base model's parameters that were trainable before PEFT froze them to add the first adapter."""
    peft_model: Any = None
    adapters: set[str] = field(default_factory=set)
    batched: RolloutBackend | None = None
    """The batched backend of this base model (`ModelPool.backend`), once a gang asked for it."""


class ModelPool:
    """Base models resident on one device, shared by the trials that use them.

    >>> pool = ModelPool("cuda:0")                       # doctest: +SKIP
    >>> model = pool.acquire(3, config)                   # the shared PeftModel, trial 3's adapter active
    """

    def __init__(self, device: str = "cpu", precision: str = "auto") -> None:
        self.device = _bind_device(device)
        self.placement = Placement.of(self.device, precision)
        self._resident: dict[str, _Resident] = {}
        self._full: dict[int, Any] = {}
        self._estimates: dict[tuple[Any, ...], tuple[list[TrialConfig], GangMemory | None]] = {}
        """`gang_memory`'s estimates by the gang's configs (their identity) and sizes: `gang_room` is asked before
        every gang's unit, and each estimate builds the base model on the meta device (about 70 ms of CPU for
        SmolLM2)."""

    def check_room(self, configs: list[TrialConfig]) -> None:
        """On a CUDA device, refuse (a `Refusal`, before anything is loaded or stored) base models whose weights
        cannot fit in the device's free memory: this process holds one copy of each base model its trials use, beside
        what other processes on the same GPU hold (several workers per GPU: ``--devices cuda:0,cuda:0``)."""
        import torch

        if torch.device(self.device).type != "cuda":
            return
        models: dict[str, tuple[str, int]] = {}
        for config in configs:
            if config.model_key in models:  # one resident copy per base model: counted once
                continue
            size = model_bytes(config)
            if size is not None:
                models[config.model_key] = (str(config.model), size)
        if not models:
            return
        free, total = torch.cuda.mem_get_info(torch.device(self.device))
        need = sum(size for _, size in models.values())
        if need * ROOM_MARGIN > free:
            names = ", ".join(f"{name} ({size / GIB:.2f} GiB)" for name, size in models.values())
            raise Refusal(
                f"device {self.device!r}: {free / GIB:.2f} GiB of its {total / GIB:.2f} GiB are free, and this worker's "
                f"base model weights need about {need / GIB:.2f} GiB ({names}), {ROOM_MARGIN:.1f}x with room for the "
                "adapters, optimizer states and activations. Each worker process on a GPU holds its own copy: run "
                "fewer workers on this GPU (--devices cuda:0 once, not cuda:0,cuda:0), free the GPU, or use a smaller "
                "model"
            )

    def gang_room(self, configs: list[TrialConfig], prompt_tokens: int, eval_rows: int = 0,
                  batched: bool = False) -> GangRoom:
        """How many of `configs` (a gang, in order, on one base model) fit in the device's free memory (with a margin
        of `ROOM_MARGIN`) by `gang_memory`'s estimate (`eval_rows`: prompts per member in one evaluation decode), in
        which training mode, and the message that says what changed. A resident base model is in use already, so it is
        not counted again. `batched`: the gang would take one batched training step (every member's activations at
        once, `GangMemory.need`); where that does not fit but the members' steps one after another would fit more of
        them, the room says so: the gang trains sequentially (``batched=False``), rather than smaller."""
        dtype = self.placement.compute_dtype()
        width = None if dtype is None else dtype.itemsize
        key = (tuple(map(id, configs)), prompt_tokens, eval_rows, width)
        held = self._estimates.get(key)
        if held is None or any(a is not b for a, b in zip(held[0], configs)):
            # The configs are held beside their estimate, so that their ids name them while it is kept.
            held = self._estimates[key] = (list(configs), gang_memory(
                configs, prompt_tokens, eval_rows=eval_rows, compute_width=width,
                shared_prompts=shares_prompts(self.device), on_cpu=self.placement.use_cpu))
        estimate = held[1]
        free = free_bytes(self.device)
        if estimate is None or free is None:
            return GangRoom(len(configs), batched)
        with_base = not self.has_base(configs[0])

        def need(n: int, batch: bool) -> float:
            return estimate.need(n, with_base, batched=batch) * ROOM_MARGIN

        def fits(batch: bool) -> int:
            n = len(configs)
            while n > 1 and need(n, batch) > free:
                n -= 1
            return n

        n = fits(batched)
        if n == len(configs):
            return GangRoom(n, batched)
        whole = (f"a gang of {len(configs)} trials would need about {need(len(configs), batched) / GIB:.2f} GiB on "
                 f"{self.device} (base model, adapters with their optimizer states, "
                 f"{'every member' if batched else 'one member'}'s step activations, the batched decoder's bank, "
                 f"copies and caches), and {free / GIB:.2f} GiB are free")
        if batched:
            alone = fits(False)
            if alone > n:
                return GangRoom(alone, False, (
                    f"{whole} in a batched training step (gang_training='batched'): its members take their steps one "
                    f"after another instead (gang_training='sequential', about {need(alone, False) / GIB:.2f} GiB"
                    + (f" for {alone} at once" if alone < len(configs) else "") + ")"), fallback=True)
        return GangRoom(n, batched, f"{whole}: training {n} at once instead")

    def tokenizer(self, config: TrialConfig) -> Any:
        return self._load(config).tokenizer

    def has_base(self, config: TrialConfig) -> bool:
        return config.model_key in self._resident

    def acquire(self, trial_number: int, config: TrialConfig) -> Any:
        """The model that trial `trial_number` trains: the shared PeftModel with its adapter, or its own copy.

        A new adapter is initialized right after seeding with ``args.seed``, as TRL does, so a trial's start does
        not depend on which other trials share the model.
        """
        from transformers import set_seed

        resident = self._load(config)
        name = adapter_name(trial_number)
        if owns_base(config):
            if trial_number not in self._full:
                model = copy.deepcopy(resident.base)
                if resident.peft_model is not None:  # it carries other trials' adapters (and modules_to_save copies)
                    model = pristine(model, resident.trainable)
                if config.peft_config is not None:  # an adapter whose initialization rewrites the base it is added to
                    from peft import get_peft_model

                    set_seed(config.args.seed)
                    model = get_peft_model(model, copy.deepcopy(config.peft_config), adapter_name=name)
                self._full[trial_number] = model
            return self._full[trial_number]
        if name not in resident.adapters:
            from peft import get_peft_model

            set_seed(config.args.seed)
            if resident.peft_model is None:  # PEFT freezes the base: what trained as loaded is restored by `pristine`
                resident.trainable = {n for n, p in resident.base.named_parameters() if p.requires_grad}
                resident.peft_model = get_peft_model(resident.base, copy.deepcopy(config.peft_config), adapter_name=name)
            else:
                resident.peft_model.add_adapter(name, copy.deepcopy(config.peft_config))
            resident.adapters.add(name)
        return self.activate(trial_number, config)

    def activate(self, trial_number: int, config: TrialConfig) -> Any:
        """Make trial `trial_number`'s adapter the active and only trainable one (after `acquire`); returns the model."""
        if owns_base(config):
            return self._full[trial_number]
        model = self._resident[config.model_key].peft_model
        name = adapter_name(trial_number)
        if model.active_adapter != name:
            model.set_adapter(name)
        return model

    def backend(self, kind: str, trial_number: int | None, config: TrialConfig) -> RolloutBackend:
        """The rollout backend of kind `kind` (`rfopt.training.rollouts.KINDS`; built by
        `rfopt.training.rollouts.make_backend`, the one place backends are constructed) on the model it decodes:
        `EXACT`, on trial `trial_number`'s model (acquired), or with `trial_number` None on `config`'s base model as
        loaded (a baseline: inside `base_model`, with no adapter in effect); `BATCHED`, the batched backend of
        `config`'s resident base model (one per base model and device, shared by every gang that trains on it; built
        on the base model until an adapter is on it). Ask its `refusal(config)` before a trial trains on it. Both
        compute in the device's mixed precision, so that a study's trials alone and in gangs, and its baselines, are
        evaluated alike."""
        dtype = self.placement.compute_dtype()
        if kind == EXACT:
            if trial_number is None:
                resident = self._load(config)
                model = resident.peft_model if resident.peft_model is not None else resident.base
            else:
                model = self.acquire(trial_number, config) if owns_base(config) else self._resident_model(config)
            return make_backend(EXACT, model, dtype=dtype)
        if kind != BATCHED:
            raise ValueError(f"trial {trial_number}: rollout backend {kind!r}: give one of {', '.join(KINDS)}")
        resident = self._load(config)
        model = resident.peft_model if resident.peft_model is not None else resident.base
        if resident.batched is None or resident.batched.model is not model:
            resident.batched = make_backend(BATCHED, model, dtype=dtype)
        return resident.batched

    @contextlib.contextmanager
    def base_model(self, config: TrialConfig) -> Iterator[Any]:
        """`config`'s base model as loaded, with no trial's adapter in effect: the resident model, or while adapters are
        on it the shared PeftModel with its adapters disabled (PEFT's ``disable_adapter``, as the rollout backends decode
        with them off); they are on again when the block ends."""
        resident = self._load(config)
        if resident.peft_model is None:
            yield resident.base
            return
        with resident.peft_model.disable_adapter():
            yield resident.peft_model

    def _resident_model(self, config: TrialConfig) -> Any:
        resident = self._load(config)
        if resident.peft_model is None:
            raise ValueError(f"no adapter is on {config.model!r} yet: acquire a trial before asking for its backend")
        return resident.peft_model

    def release(self, trial_number: int, config: TrialConfig) -> None:
        """Free what trial `trial_number` holds (its adapter or its model copy)."""
        if owns_base(config):
            self._full.pop(trial_number, None)
            return
        resident = self._resident.get(config.model_key)
        name = adapter_name(trial_number)
        if resident is None or name not in resident.adapters:
            return
        resident.adapters.discard(name)
        if resident.adapters:
            if resident.peft_model.active_adapter == name:
                resident.peft_model.set_adapter(min(resident.adapters))
            resident.peft_model.delete_adapter(name)
        else:
            # The last adapter: take the adapter layers out again, leaving the base model as it was loaded.
            resident.base = pristine(resident.peft_model, resident.trainable)
            resident.peft_model = None

    def _load(self, config: TrialConfig) -> _Resident:
        key = config.model_key
        if key not in self._resident:
            model, tokenizer = load_model(config, self.device)
            self._resident[key] = _Resident(base=model, tokenizer=tokenizer)
        return self._resident[key]

    def close(self) -> None:
        """Drop the resident models and copies."""
        self._resident.clear()
        self._full.clear()
