"""GenerationConfig: every decoding option, named like the CLI's, validated on construction."""

from __future__ import annotations

from dataclasses import dataclass, field


class ConfigError(ValueError):
    """A generation option outside its valid range."""


@dataclass(frozen=True)
class GenerationConfig:
    """Decoding options. ``temperature`` 0 means greedy; ``k`` is the (maximum) draft length."""

    max_new_tokens: int = 128
    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    seed: int | None = None
    k: int = 4
    policy: str = "fixed"
    drafter: str = "model"
    stop: tuple[str, ...] = field(default_factory=tuple)
    stop_token_ids: tuple[int, ...] = field(default_factory=tuple)  # stop like EOS, in addition to it
    confidence_threshold: float = 0.4
    ignore_eos: bool = False

    def __post_init__(self):
        def bad(name, expected):
            return ConfigError(f"{name}: got {getattr(self, name)!r}; expected {expected}")

        if not _is_int(self.max_new_tokens) or self.max_new_tokens < 1:
            raise bad("max_new_tokens", "an integer >= 1")
        if not _is_number(self.temperature) or self.temperature < 0:
            raise bad("temperature", "a number >= 0 (0 means greedy)")
        if not _is_int(self.top_k) or self.top_k < 0:
            raise bad("top_k", "an integer >= 0 (0 disables it)")
        if not _is_number(self.top_p) or not 0 < self.top_p <= 1:
            raise bad("top_p", "a number in (0, 1]")
        if not _is_number(self.min_p) or not 0 <= self.min_p < 1:
            raise bad("min_p", "a number in [0, 1)")
        if not _is_number(self.repetition_penalty) or self.repetition_penalty <= 0:
            raise bad("repetition_penalty", "a number > 0 (1 disables it)")
        if self.seed is not None and not _is_int(self.seed):
            raise bad("seed", "an integer or None")
        if not _is_int(self.k) or self.k < 0:
            raise bad("k", "an integer >= 0")
        from .drafters import DRAFTERS  # the registries import this module's type for their signatures
        from .policies import POLICIES

        if self.policy not in POLICIES:
            raise bad("policy", f"one of {', '.join(POLICIES)}")
        if self.drafter not in DRAFTERS:
            raise bad("drafter", f"one of {', '.join(DRAFTERS)}")
        if not 0 < self.confidence_threshold < 1:
            raise bad("confidence_threshold", "a number in (0, 1)")
        stop = (self.stop,) if isinstance(self.stop, str) else tuple(self.stop)
        if any(not isinstance(s, str) or not s for s in stop):
            raise bad("stop", "non-empty strings")
        object.__setattr__(self, "stop", stop)
        ids = tuple(self.stop_token_ids)
        if any(not _is_int(t) or t < 0 for t in ids):
            raise bad("stop_token_ids", "non-negative integers")
        object.__setattr__(self, "stop_token_ids", ids)

    @property
    def greedy(self) -> bool:
        return self.temperature == 0

    @property
    def speculative(self) -> bool:
        return self.drafter != "none" and self.k > 0


def _is_int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_number(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and value == value
