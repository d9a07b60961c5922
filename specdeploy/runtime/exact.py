"""Exact mode (``GenerationConfig.exact``): the check of whether a target can give it.

Exact mode pads every target call to an even number of tokens a row (``engines.even.EvenTokens``), so that greedy
speculative output is exact-mode plain output bit for bit. Its calls cost otherwise (a plain step is a two-token call),
so its requests' policies price by a cost table of their own, remembered across processes beside the default's
(``calibration.Calibration``). A target whose provider computes a position alike in calls of any size
(``Engine.rows_alike``: OpenVINO's CPU kernels at FP32) has nothing to pad: there exact mode runs the target as it is,
at the default's cost, and the default mode's greedy output is already exact (docs/results/openvino/).
"""

from __future__ import annotations

from .config import ConfigError


def check_exact(spec) -> None:
    """Refuse exact mode on a target whose graph cannot give it: an explicit graph without ``slot_attention`` (exported
    before it, or imported) scores the keys of a call's own tokens apart from the cache's, so a position's logits
    depend on which of its keys came in the same call (docs/results/exactness/)."""
    if spec.graph != "fused" and not spec.slot_attention:
        origin = "an imported" if spec.imported is not None else "an older exporter's"
        raise ConfigError(f"exact: the target's graph is {origin} explicit form, whose attention scores a call's own keys "
                          "apart from the cache's; exact mode needs slot attention or the fused form: re-export it")
