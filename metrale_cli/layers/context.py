"""ForwardContext: the per-step batch metadata every layer reads (built once per step by the engine)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from metrale_cli.layers.host_timing import HostTiming


@dataclass
class ForwardContext:
    """Metadata of one forward step.

    ``prefill``: T tokens of ONE sequence at positions ``start_pos .. start_pos+T-1``;
    ``block_table``: (MB,) int32. ``decode``: one token per sequence for B sequences;
    ``block_tables``: (B, MB) int32, ``seq_lens``: (B,) int32 including the new token.
    ``slot_mapping``: (T,) int32 cache slots to write (-1 = already cached, skip).
    """

    kind: str
    positions: torch.Tensor
    slot_mapping: torch.Tensor
    start_pos: int = 0
    block_table: torch.Tensor | None = None
    block_tables: torch.Tensor | None = None
    seq_lens: torch.Tensor | None = None
    timing: HostTiming | None = None  # prefill host-phase timer (METRALE_PREFILL_HOST_TIMING=1)

    @property
    def is_prefill(self) -> bool:
        return self.kind == "prefill"
