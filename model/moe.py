"""The sparse mixture-of-experts block: the MLP of Mixtral's, Qwen2-MoE's and Qwen3-MoE's sparse
layers, and the names its weights have in their checkpoints.

A router (`gate`, a linear of `num_experts` outputs) scores each token; the softmax of its scores
in float32 picks the token's `experts_per_token` best experts, whose probabilities are
renormalised to sum to 1 when `norm_topk_prob` (always for Mixtral); each chosen expert, a SwiGLU
MLP, computes the token's output and the block returns their sum weighted by those probabilities,
plus (Qwen2-MoE) a shared expert's output scaled by sigmoid(`shared_expert_gate`(x)).

NOTE: the arithmetic mirrors transformers' default experts implementation (`grouped_mm`): the
step's (token, choice) pairs sorted by expert, one matmul per expert that has tokens, outputs
weighted per pair (in float32 for Mixtral, whose weights stay float32; in the model dtype after a
cast for Qwen), then each token's choices summed in choice order and cast back. So fp32 logits
agree to ~1e-6 and bf16 greedy tokens exactly.
"""

from __future__ import annotations

import re

import torch
import torch.nn.functional as F
from torch import nn

from pagedserve.model.activations import activation
from pagedserve.model.config import ModelConfig
from pagedserve.model.llama import MLP, Linear


class Experts(nn.Module):
    """Every expert's weights stacked: `gate_up_proj` [E, 2 x inner, hidden] (each expert's gate
    rows, then its up rows) and `down_proj` [E, hidden, inner], as transformers holds them."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        experts, inner, size = (
            config.num_experts,
            config.moe_intermediate_size,
            config.hidden_size,
        )
        self.gate_up_proj = nn.Parameter(torch.empty(experts, 2 * inner, size))
        self.down_proj = nn.Parameter(torch.empty(experts, size, inner))
        self.act_fn = activation(config.hidden_act)

    def forward(self, rows: torch.Tensor, counts: list[int]) -> torch.Tensor:
        """rows [S, hidden], grouped by expert (`counts[e]` rows for expert e, in order) ->
        each row's expert output [S, hidden]: one matmul pair per expert with rows."""
        out = torch.empty_like(rows)
        start = 0
        for expert, count in enumerate(counts):
            if count == 0:
                continue
            stop = start + count
            gate, up = F.linear(rows[start:stop], self.gate_up_proj[expert]).chunk(2, dim=-1)
            out[start:stop] = F.linear(self.act_fn(gate) * up, self.down_proj[expert])
            start = stop
        return out


class SparseMoeBlock(nn.Module):
    """The MoE MLP (module names as transformers': `gate`, `experts`, `shared_expert`,
    `shared_expert_gate`). x [T, hidden] -> [T, hidden]."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.top_k = config.experts_per_token
        self.num_experts = config.num_experts
        self.norm_topk_prob = config.norm_topk_prob
        self.float32_weights = config.float32_routing_weights
        self.gate = Linear(config.hidden_size, config.num_experts, bias=False)
        self.experts = Experts(config)
        self.shared_expert: MLP | None = None
        self.shared_expert_gate: Linear | None = None
        if config.shared_expert_intermediate_size:
            self.shared_expert = MLP(config, config.shared_expert_intermediate_size)
            self.shared_expert_gate = Linear(config.hidden_size, 1, bias=False)

    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(weights [T, k], expert ids [T, k]) of each token's top-k experts, best first."""
        # NOTE: F.linear as transformers' router, not the native linear: a near tie between two
        # experts must break as it breaks there
        logits = F.linear(x, self.gate.weight)
        probs = torch.softmax(logits.float(), dim=-1)
        weights, ids = torch.topk(probs, self.top_k, dim=-1)
        if self.norm_topk_prob:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        if not self.float32_weights:
            weights = weights.to(logits.dtype)
        return weights, ids

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weights, ids = self.route(x)
        flat = ids.reshape(-1)
        order = torch.argsort(flat, stable=True)
        counts = torch.bincount(flat, minlength=self.num_experts).tolist()
        out = self.experts(x[order // self.top_k], counts)
        weighted = torch.empty(
            out.shape, dtype=torch.promote_types(out.dtype, weights.dtype), device=out.device
        )
        weighted[order] = out * weights.reshape(-1)[order, None]
        # NOTE: each token's k outputs summed in choice order (in float32 for Mixtral), then cast
        y = weighted.view(x.shape[0], self.top_k, -1).sum(dim=1).to(x.dtype)
        if self.shared_expert is not None and self.shared_expert_gate is not None:
            y = y + F.sigmoid(self.shared_expert_gate(x)) * self.shared_expert(x)
        return y


# Per-expert checkpoint names: Mixtral's `block_sparse_moe.experts.{i}.w1|w3|w2` (gate, up, down),
# Qwen's `mlp.experts.{i}.gate_proj|up_proj|down_proj`
_EXPERT = re.compile(
    r"^(?P<layer>.*)\.(?:block_sparse_moe|mlp)\.experts\.(?P<expert>\d+)\."
    r"(?P<part>w1|w2|w3|gate_proj|up_proj|down_proj)\.weight$"
)
_PARTS = {"w1": "gate", "w3": "up", "w2": "down", "gate_proj": "gate", "up_proj": "up",
          "down_proj": "down"}  # fmt: skip


def checkpoint_name(name: str) -> str:
    """Mixtral's `block_sparse_moe.` checkpoint names as the module's `mlp.` ones."""
    return name.replace(".block_sparse_moe.", ".mlp.")


def expert_part(name: str, params: dict[str, torch.Tensor]) -> tuple[str, torch.Tensor] | None:
    """(the part's own key, the slice of the stacked parameter it fills) for a per-expert
    checkpoint tensor `name`; None for any other name. Its key is one of `part_keys`'."""
    match = _EXPERT.match(name)
    if match is None:
        return None
    layer, expert, part = match["layer"], int(match["expert"]), _PARTS[match["part"]]
    stacked = params.get(f"{layer}.mlp.experts.{'down_proj' if part == 'down' else 'gate_up_proj'}")
    if stacked is None or expert >= stacked.shape[0]:
        return None
    target = stacked[expert]
    if part != "down":
        inner = target.shape[0] // 2
        target = target[:inner] if part == "gate" else target[inner:]
    return f"{layer}.mlp.experts.{expert}.{part}", target


STACKED = ("gate_up_proj", "down_proj")  # `Experts`' parameters


def part_keys(name: str, param: torch.Tensor) -> list[str]:
    """The keys of the per-expert parts that fill stacked parameter `name` (`[name]` for any
    other parameter): the loader expects every one."""
    layer, sep, stacked = name.rpartition(".mlp.experts.")
    if not sep or stacked not in STACKED:
        return [name]
    parts = ("down",) if stacked == "down_proj" else ("gate", "up")
    return [f"{layer}.mlp.experts.{e}.{p}" for e in range(param.shape[0]) for p in parts]


def sparse_mlp_elements(config: ModelConfig) -> int:
    """Weights of every sparse layer's MoE block (router, experts, shared expert and its gate)
    minus those of the dense MLP `weight_bytes` counts for each layer (model/runner.py)."""
    h = config.hidden_size
    shared = config.shared_expert_intermediate_size
    block = h * config.num_experts * (1 + 3 * config.moe_intermediate_size)
    block += (3 * shared + 1) * h if shared else 0
    dense = 3 * h * config.intermediate_size
    return sum(block - dense for sparse in config.sparse_layers if sparse)
