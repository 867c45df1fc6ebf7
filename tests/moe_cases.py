"""MoE kernel cases shared by the host-emulation and GPU tests: router logits that make experts
chosen by no row, by one, by every row, and exact ties, with weights at odd sizes; and the same
with a shared expert folded in as chunk experts (``SHARED_CASES``)."""

from __future__ import annotations

import torch

from metrale_cli.kernels.ops import SharedExpert

# (rows, experts, top_k, hidden, inter, pattern)
CASES = [
    (1, 8, 2, 64, 24, "random"),
    (1, 128, 8, 136, 40, "random"),
    (7, 6, 1, 64, 24, "random"),
    (7, 60, 4, 72, 16, "all"),
    (7, 16, 4, 64, 24, "ties"),
    (1, 16, 4, 64, 24, "ties"),  # batch 1 ranks every expert at once
    (1, 512, 10, 64, 16, "ties"),
    (33, 12, 3, 64, 32, "few"),
    (64, 128, 8, 64, 24, "random"),
    (19, 1024, 2, 64, 8, "few"),
    (2, 8, 2, 1288, 784, "random"),  # rows of several 16-byte chunk batches per lane
    (9, 8, 2, 1288, 784, "all"),  # more rows than one pass stages
    (40, 8, 2, 200, 48, "all"),  # one expert's 40 pairs: three passes of the tensor-core kernels
]


# (rows, experts, top_k, hidden, inter, pattern, shared expert's width): one chunk of the experts'
# width, four, two with the last one short (40 over 24), three with the last 8 wide
SHARED_CASES = [
    (1, 8, 2, 64, 24, "random", 24),
    (1, 60, 4, 72, 16, "random", 64),  # Qwen1.5-MoE's four chunks
    (7, 16, 4, 64, 24, "ties", 40),
    (33, 12, 3, 64, 32, "few", 64),
    (64, 128, 8, 64, 24, "random", 24),
    (2, 8, 2, 1288, 784, "all", 1576),
]


def case_id(case) -> str:
    return "r{}-e{}-k{}-h{}-i{}-{}".format(*case) + ("-w{}".format(case[6]) if len(case) > 6 else "")


def moe_case(rows, experts, top_k, hidden, inter, pattern, seed=0, device="cpu"):
    """x (rows, hidden), logits (rows, experts), gate_up (E, 2I, H), down (E, H, I), residual:
    bf16. ``pattern``: random; ``all``: expert 0 tops every row; ``ties``: logits from four values
    (exact ties, broken by expert id); ``few``: only the first 2 * top_k experts can be chosen."""
    g = torch.Generator().manual_seed(seed)
    rnd = lambda *s, scale=1.0: (torch.randn(*s, generator=g) * scale).to(torch.bfloat16)
    logits = rnd(rows, experts, scale=2.0)
    if pattern == "all":
        logits[:, 0] = 20.0
    elif pattern == "ties":
        logits = torch.randint(0, 4, (rows, experts), generator=g).to(torch.bfloat16) * 0.5
    elif pattern == "few":
        logits[:, 2 * top_k:] = -30.0
    tensors = dict(x=rnd(rows, hidden), logits=logits, gate_up=rnd(experts, 2 * inter, hidden, scale=hidden**-0.5),
                   down=rnd(experts, hidden, inter, scale=inter**-0.5), residual=rnd(rows, hidden))
    return {k: v.to(device) for k, v in tensors.items()}


def shared_case(rows, experts, top_k, hidden, inter, pattern, width, seed=0, device="cpu"):
    """moe_case with a shared expert of ``width`` (``shared``: a SharedExpert, bf16 (2W, H) and (H,
    W)) and its gate's logit as one more column of logits, large enough that sigmoid spreads over
    (0, 1); ``chunks``: the experts it adds."""
    t = moe_case(rows, experts, top_k, hidden, inter, pattern, seed, device)
    g = torch.Generator().manual_seed(seed + 100)
    rnd = lambda *s, scale: (torch.randn(*s, generator=g) * scale).to(torch.bfloat16).to(device)
    t["logits"] = torch.cat([t["logits"], rnd(rows, 1, scale=2.0)], dim=1)
    t["shared"] = SharedExpert(rnd(2 * width, hidden, scale=hidden**-0.5), rnd(hidden, width, scale=width**-0.5))
    t["chunks"] = t["shared"].chunks(inter)
    return t


def stable_route(logits, top_k, normalize, shared=0):
    """moe_route with its tie rule spelled out: a stable descending sort (equal probabilities in
    expert-id order), which torch.topk follows on CUDA but not on the CPU; ``shared`` chunk slots
    after the row's top k, as moe_route gives them."""
    experts = logits.shape[1] - (shared > 0)
    probs = torch.softmax(logits[:, :experts], dim=-1, dtype=torch.float32)
    ids = torch.sort(probs, dim=-1, descending=True, stable=True).indices[:, :top_k]
    weights = probs.gather(1, ids)
    if normalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    if shared:
        rows = logits.shape[0]
        ids = torch.cat([ids, torch.arange(experts, experts + shared, device=ids.device).expand(rows, shared)], 1)
        weights = torch.cat([weights, torch.sigmoid(logits[:, experts:].float()).expand(rows, shared)], 1)
    return ids.to(torch.int32), weights


# (experts, top_k) of lane_heavy_logits: every count of experts a routing lane holds (1 to 32)
LANE_HEAVY = [(128, 8), (256, 10), (512, 32), (1024, 32), (40, 32)]


def lane_heavy_logits(experts, device="cpu"):
    """Three rows of router logits (bf16) whose largest sit in one routing lane (a warp's lane
    holds experts lane, lane + 32, ..): lane 0's experts in row 0, with some equal to expert 0's in
    row 1, lane 5's above them in row 2; the rest from seven values (ties). So one lane gives
    several slots in a row and may run out of experts."""
    logits = torch.full((3, experts), -4.0) + torch.arange(experts) % 7 * 0.125
    lane0 = torch.arange(0, experts, 32)
    logits[:, lane0] = 6.0 - torch.arange(len(lane0)) * 0.25
    logits[1, lane0[1::2]] = 6.0
    lane5 = torch.arange(5, experts, 32)
    logits[2, lane5] = 7.0 - torch.arange(len(lane5)) * 0.5
    return logits.bfloat16().to(device)
