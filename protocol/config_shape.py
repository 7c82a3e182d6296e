"""A decoder's shape from its Hugging Face ``config.json``: layers, widths, heads, vocabulary,
and the weights they make (what a layer split and a split forward's work list count)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class ConfigShape:
    """A decoder-only (Llama-style) model's shape, as its ``config.json`` gives it: what
    the pipeline's layer split and Ghidorah's work list need of it."""

    layers: int
    hidden: int
    heads: int
    kv_heads: int
    head_dim: int
    intermediate: int
    vocab: int

    @classmethod
    def from_config(cls, config: dict) -> ConfigShape:
        """From a Hugging Face ``config.json``'s fields (a Llama-style model)."""
        heads = config["num_attention_heads"]
        hidden = config["hidden_size"]
        return cls(
            layers=config["num_hidden_layers"],
            hidden=hidden,
            heads=heads,
            kv_heads=config.get("num_key_value_heads") or heads,
            head_dim=config.get("head_dim") or hidden // heads,
            intermediate=config["intermediate_size"],
            vocab=config["vocab_size"],
        )

    @property
    def parameters(self) -> int:
        """Weights a forward reads once (the linears and the output head)."""
        attention = self.hidden * self.head_dim * (2 * self.heads + 2 * self.kv_heads)
        mlp = 3 * self.hidden * self.intermediate
        return self.layers * (attention + mlp) + self.hidden * self.vocab

    def half_weights(self) -> list[int]:
        """Parameters of each half-layer (what one row's compute there scales with)."""
        attention = self.hidden * self.head_dim * (2 * self.heads + 2 * self.kv_heads) + self.hidden
        mlp = 3 * self.hidden * self.intermediate + self.hidden
        return [attention, mlp] * self.layers

    def head_weight(self) -> int:
        """The final norm and LM head: the last stage's on top of its half-layers."""
        return self.vocab * self.hidden + self.hidden
