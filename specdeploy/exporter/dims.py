"""The sizes a model family reads off its config (``Architecture.dims``), which the graph writers and the manifest
take from it. A leaf: the families, the writers and the registry import it, it imports none of them."""

from __future__ import annotations

from dataclasses import dataclass

from ..contract import StateSpec


@dataclass(frozen=True)
class Dims:
    """A model's sizes: layers, attention heads (query and key/value), head dim, vocabulary, where the config
    says, the most positions it was trained for (None: no limit given), and the recurrent states a hybrid's layers
    keep instead of K/V (``contract.StateSpec``; none in a plain transformer)."""

    num_layers: int
    num_heads: int
    kv_heads: int
    head_dim: int
    vocab_size: int
    max_positions: int | None = None
    states: tuple[StateSpec, ...] = ()

    def spec_fields(self) -> dict:
        """The ``ModelSpec`` fields these sizes fill: num_layers, num_heads, kv_heads, head_dim, vocab_size, states."""
        return {"num_layers": self.num_layers, "num_heads": self.num_heads, "kv_heads": self.kv_heads,
                "head_dim": self.head_dim, "vocab_size": self.vocab_size, "states": self.states}
