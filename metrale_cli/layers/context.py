"""ForwardContext: the per-step batch metadata every layer reads (built once per step by the engine)."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch


@dataclass
class ForwardContext:
    """Metadata of one forward step.

    ``prefill``: T tokens of ONE sequence at positions ``start_pos .. start_pos+T-1``;
    ``block_table``: (MB,) int32. ``decode``: one token per sequence for B sequences;
    ``block_tables``: (B, MB) int32, ``seq_lens``: (B,) int32 including the new token.
    ``slot_mapping``: (T,) int32 cache slots to write (-1 = already cached, skip).
    ``states``: per sequence of the step (one for a prefill, B for a decode), its list of layer
    states (``Layer.alloc_state``), indexed by layer; empty where the caller keeps none (a padding
    row, a kernel test). ``ssm_slots``: a decode step's rows' slots of the model's recurrent-state
    pool (``SsmStatePool``) on the device, the scratch slot for a padding row; None where the
    layers take them from ``states``.
    """

    kind: str
    positions: torch.Tensor
    slot_mapping: torch.Tensor
    start_pos: int = 0
    block_table: torch.Tensor | None = None
    block_tables: torch.Tensor | None = None
    seq_lens: torch.Tensor | None = None
    states: list[list] = field(default_factory=list)
    ssm_slots: torch.Tensor | None = None  # decode: (B,) int32 each row's recurrent-state slot

    @property
    def is_prefill(self) -> bool:
        return self.kind == "prefill"

    def layer_states(self, layer: int) -> list:
        """Each sequence's state of one layer (None for a sequence that keeps none)."""
        return [s[layer] if s else None for s in self.states]
