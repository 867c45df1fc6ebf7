"""The one-shot collectives (kernels_cu/all_reduce.cu) on a GPU: N ranks in one process, each on
its own stream over buffers of one device (the protocol is the ranks' own: flags published at
system scope, epochs counted on the device, two halves a buffer), eagerly and as captured graphs
replayed again and again. The sum is every rank's part summed in rank order in fp32 and rounded
once to bf16; the gather is the parts side by side; both bit for bit, on every rank.
"""

from __future__ import annotations

import pytest
import torch

from metrale_cli.kernels.cuda_collectives import OneShot
from metrale_cli.kernels.table import ONE_SHOT_SIGNAL_BYTES

pytestmark = pytest.mark.gpu

CAPACITY = 1 << 20  # bytes a half


def _ranks(n: int) -> tuple[list[OneShot], list]:
    """n ranks' collectives over buffers of cuda:0 (kept alive in the returned list)."""
    device = torch.device("cuda", 0)
    data = [torch.zeros(2 * CAPACITY, dtype=torch.uint8, device=device) for _ in range(n)]
    signals = [torch.zeros(ONE_SHOT_SIGNAL_BYTES, dtype=torch.uint8, device=device) for _ in range(n)]
    ptrs = ([t.data_ptr() for t in data], [t.data_ptr() for t in signals])
    return [OneShot(r, n, *ptrs, CAPACITY, device) for r in range(n)], data + signals


def _parts(n: int, shape, dtype, seed: int) -> list[torch.Tensor]:
    g = torch.Generator(device="cuda").manual_seed(seed)
    return [(torch.randn(*shape, generator=g, device="cuda") * (r + 1)).to(dtype) for r in range(n)]


def _expected_sum(parts: list[torch.Tensor]) -> torch.Tensor:
    total = parts[0].float()
    for p in parts[1:]:
        total = total + p.float()
    return total.to(torch.bfloat16)


def _together(ranks: list[OneShot], work) -> list:
    """work(rank, collectives) on every rank at once, each on its own stream; their results."""
    streams = [torch.cuda.Stream() for _ in ranks]
    torch.cuda.synchronize()
    out = []
    for r, (one, stream) in enumerate(zip(ranks, streams)):
        with torch.cuda.stream(stream):
            out.append(work(r, one))
    torch.cuda.synchronize()
    return out


@pytest.mark.parametrize("n", [2, 3, 4])  # streams in turn from torch's pool: each on its own of the 8 hardware queues
@pytest.mark.parametrize("numel", [8, 512, 4096, 8 * 1001, 40960 * 3, CAPACITY // 2])
def test_the_sum_is_every_rank_s_part_in_rank_order_on_every_rank(n, numel):
    ranks, _keep = _ranks(n)
    for call in range(3):  # epochs 1-3: both halves of the buffers, and one again
        parts = _parts(n, (numel,), torch.bfloat16, seed=numel + call)
        want = _expected_sum(parts)
        got = _together(ranks, lambda r, one: one.sum_(parts[r]))
        for r in range(n):
            assert torch.equal(got[r], want), f"rank {r}, call {call}"


@pytest.mark.parametrize("n", [2, 4])
@pytest.mark.parametrize("rows, cols", [(1, 4), (1, 2048), (3, 75968 // 4), (16, 1028)])
def test_the_gather_puts_the_ranks_parts_side_by_side(n, rows, cols):
    ranks, _keep = _ranks(n)
    for call in range(3):
        parts = _parts(n, (rows, cols), torch.float32, seed=rows * cols + call)
        got = _together(ranks, lambda r, one: one.gather_columns(parts[r]))
        for r in range(n):
            assert torch.equal(got[r], torch.cat(parts, dim=-1)), f"rank {r}, call {call}"


def test_sums_and_gathers_in_turns_replay_from_captured_graphs():
    """Each rank captures a sum, a gather and a second sum into one graph; the graphs replay
    together five times on new inputs (the epochs advance on the device, the addresses stay)."""
    n = 2
    ranks, _keep = _ranks(n)
    xs = [torch.zeros(4096, dtype=torch.bfloat16, device="cuda") for _ in range(n)]
    ys = [torch.zeros(8, dtype=torch.bfloat16, device="cuda") for _ in range(n)]
    logits = [torch.zeros(2, 1024, dtype=torch.float32, device="cuda") for _ in range(n)]
    _together(ranks, lambda r, one: (one.sum_(xs[r]), one.gather_columns(logits[r]), one.sum_(ys[r])))  # warm
    graphs, gathered = [], []
    for r, one in enumerate(ranks):  # captured one rank at a time: capture launches nothing
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            one.sum_(xs[r])
            gathered.append(one.gather_columns(logits[r]))
            one.sum_(ys[r])
        graphs.append(graph)
    for replay in range(5):
        x_parts = _parts(n, (4096,), torch.bfloat16, seed=10 * replay)
        y_parts = _parts(n, (8,), torch.bfloat16, seed=10 * replay + 1)
        l_parts = _parts(n, (2, 1024), torch.float32, seed=10 * replay + 2)
        for r in range(n):
            xs[r].copy_(x_parts[r]), ys[r].copy_(y_parts[r]), logits[r].copy_(l_parts[r])
        _together(ranks, lambda r, one: graphs[r].replay())
        for r in range(n):
            assert torch.equal(xs[r], _expected_sum(x_parts)), f"replay {replay}, rank {r}"
            assert torch.equal(ys[r], _expected_sum(y_parts)), f"replay {replay}, rank {r}"
            assert torch.equal(gathered[r], torch.cat(l_parts, dim=-1)), f"replay {replay}, rank {r}"


def test_what_the_collectives_serve():
    (one, _), _keep = _ranks(2)
    bf16 = lambda *s: torch.zeros(*s, dtype=torch.bfloat16, device="cuda")  # noqa: E731
    f32 = lambda *s: torch.zeros(*s, dtype=torch.float32, device="cuda")  # noqa: E731
    assert one.sums(bf16(1, 4096)) and one.sums(bf16(CAPACITY // 2))
    assert not one.sums(bf16(CAPACITY // 2 + 8)) and not one.sums(bf16(12)) and not one.sums(f32(8))
    assert not one.sums(bf16(2, 16)[:, :8])  # not contiguous
    assert one.gathers(f32(4, 2048)) and not one.gathers(f32(4, 2046)) and not one.gathers(bf16(4, 2048))
    assert not one.gathers(f32(1, CAPACITY // 4 + 4))
