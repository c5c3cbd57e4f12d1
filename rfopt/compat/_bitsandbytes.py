"""bitsandbytes' internals that rfopt relies on: QLoRA on the CPU, quiet and trainable.

``bitsandbytes_cpu_kernel_warning``  `quiet_bitsandbytes` drops one log record of bitsandbytes' CPU backend (logger
    ``bitsandbytes.backends.cpu.ops``): when it is imported on a CPU with AVX512-BF16, bitsandbytes 0.50 tries to fetch
    a faster 4-bit kernel through the Hub's ``kernels`` package and, where that package is missing, warns "Failed to
    load CPU gemm_4bit_forward from kernels-community", then uses its own kernel. PEFT imports bitsandbytes whenever
    it is installed (``peft/helpers.py``), so every run would print it, QLoRA or not. Buys: a quiet start where the
    ``qlora`` extra is installed (nothing changes in what trains).
``bitsandbytes_trainable_4bit``  `keep_4bit_trainable` sets ``support_avx512bf16_for_cpu = False`` on every
    bitsandbytes ``Linear4bit`` of a loaded model (bitsandbytes 0.50, ``nn/modules.py``): on a CPU with AVX512-BF16,
    the first forward in eval mode without gradients (an evaluation's ``generate``, the batched decoder's view) repacks
    the layer's weight in place into a CPU inference layout, and every forward after it, training included, goes
    through ``gemv_4bit``, which has no autograd kernel ("an autograd kernel was not registered ... silently
    incorrect"): the gradients of the adapters below it would be wrong. Buys: QLoRA trials that evaluate (or decode in
    a gang) between training steps train correctly on the CPU (the dequantizing path, a little slower to decode).
"""

from __future__ import annotations

from typing import Any


BITSANDBYTES_CPU_KERNEL_WARNING = "Failed to load CPU gemm_4bit_forward from kernels-community"
"""The start of the warning `quiet_bitsandbytes` drops (bitsandbytes 0.50, ``backends/cpu/ops.py``)."""


def quiet_bitsandbytes() -> None:
    """Keep bitsandbytes' warning about the optional CPU kernel it could not fetch from users (entry
    ``bitsandbytes_cpu_kernel_warning``): a filter on its logger, set before bitsandbytes is imported (it warns while
    it is imported). Imports nothing; idempotent."""
    import logging

    logger = logging.getLogger("bitsandbytes.backends.cpu.ops")
    if not any(isinstance(f, _DropCpuKernelWarning) for f in logger.filters):
        logger.addFilter(_DropCpuKernelWarning())


def keep_4bit_trainable(model: Any) -> None:
    """Keep every bitsandbytes 4-bit Linear of `model` on its trainable path (entry ``bitsandbytes_trainable_4bit``):
    never repacked for CPU inference by an eval-mode forward."""
    for module in model.modules():
        if hasattr(module, "support_avx512bf16_for_cpu"):
            module.support_avx512bf16_for_cpu = False


class _DropCpuKernelWarning:
    def filter(self, record: Any) -> bool:
        return not str(record.msg).startswith(BITSANDBYTES_CPU_KERNEL_WARNING)
