"""Canaries for rfopt/compat/_bitsandbytes.py (bitsandbytes): each fails loudly when the library symbol, or the call
site, that one of rfopt's patches of its internals relies on is gone, so an upgrade cannot leave a patch silently
doing nothing."""

import inspect

import pytest

from rfopt import compat


# ---------------------------------------------------------------------- bitsandbytes_cpu_kernel_warning
def test_bitsandbytes_warns_about_its_cpu_kernel_on_its_own_logger_and_rfopt_drops_only_that_record(caplog):
    pytest.importorskip("bitsandbytes")
    import logging

    from bitsandbytes.backends.cpu import ops

    source = inspect.getsource(ops)
    assert "logger = logging.getLogger(__name__)" in source and compat.BITSANDBYTES_CPU_KERNEL_WARNING in source
    assert ops.logger.name == "bitsandbytes.backends.cpu.ops"
    compat.quiet_bitsandbytes()
    compat.quiet_bitsandbytes()  # idempotent: one filter
    assert len(ops.logger.filters) == 1
    with caplog.at_level(logging.WARNING, logger=ops.logger.name):
        ops.logger.warning(compat.BITSANDBYTES_CPU_KERNEL_WARNING + ": No module named 'kernels'")
        ops.logger.warning("something else")
    assert [r.getMessage() for r in caplog.records if r.name == ops.logger.name] == ["something else"]


# ---------------------------------------------------------------------- bitsandbytes_trainable_4bit
def test_bitsandbytes_repacks_a_4bit_weight_for_cpu_inference_only_where_its_flag_allows():
    pytest.importorskip("bitsandbytes")
    from bitsandbytes.nn import Linear4bit

    forward = inspect.getsource(Linear4bit.forward)
    assert "self.support_avx512bf16_for_cpu" in forward and "not self.training" in forward
    assert "_convert_weight_packed_for_cpu(" in forward
    assert "self.support_avx512bf16_for_cpu" in inspect.getsource(Linear4bit.__init__)
