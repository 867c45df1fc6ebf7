"""Random-weight models at real models' shapes, so GPU timing needs no download."""

from __future__ import annotations

import torch

from metrale_cli.layers.parallel import SINGLE, TensorParallel
from metrale_cli.models import family_of, model_config
from metrale_cli.models.decoder import packed_views
from metrale_cli.models.sharding import shard_config


def _qwen3(hidden, inter, layers, heads, kv, tie) -> dict:
    return {"model_type": "qwen3", "hidden_size": hidden, "intermediate_size": inter,
            "num_hidden_layers": layers, "num_attention_heads": heads, "num_key_value_heads": kv,
            "head_dim": 128, "vocab_size": 151936, "rms_norm_eps": 1e-6, "rope_theta": 1e6,
            "max_position_embeddings": 40960, "tie_word_embeddings": tie, "hidden_act": "silu",
            "eos_token_id": 151645}


def _llama31(hidden, inter, layers, heads) -> dict:
    return {"model_type": "llama", "hidden_size": hidden, "intermediate_size": inter,
            "num_hidden_layers": layers, "num_attention_heads": heads, "num_key_value_heads": 8,
            "vocab_size": 128256, "rms_norm_eps": 1e-5, "max_position_embeddings": 131072,
            "rope_scaling": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                             "high_freq_factor": 4.0, "original_max_position_embeddings": 8192},
            "rope_theta": 500000.0, "tie_word_embeddings": False, "hidden_act": "silu"}


PRESETS: dict[str, dict] = {
    "smollm2": {"model_type": "llama", "hidden_size": 576, "intermediate_size": 1536,
                "num_hidden_layers": 30, "num_attention_heads": 9, "num_key_value_heads": 3,
                "vocab_size": 49152, "rms_norm_eps": 1e-5, "rope_theta": 100000.0,
                "max_position_embeddings": 8192, "tie_word_embeddings": True, "hidden_act": "silu",
                "eos_token_id": 2},
    "qwen3-0.6b": _qwen3(1024, 3072, 28, 16, 8, True),
    "qwen3-1.7b": _qwen3(2048, 6144, 28, 16, 8, True),
    "qwen3-4b": _qwen3(2560, 9728, 36, 32, 8, True),
    "qwen3-8b": _qwen3(4096, 12288, 36, 32, 8, False),
    "qwen3-14b": _qwen3(5120, 17408, 40, 40, 8, False),
    "llama3.1-8b": _llama31(4096, 14336, 32, 32),
    # 141 GB in bf16: more than one H200 holds with a KV cache; for --tensor-parallel-size 2 and up
    "llama3.1-70b": _llama31(8192, 28672, 80, 64),
    # Mixtures of experts: every layer's FFN is 128 (60) routed SwiGLU experts, 8 (4) per token;
    # Qwen1.5-MoE adds a shared expert behind a sigmoid gate.
    "qwen3-30b-a3b": {"model_type": "qwen3_moe", "hidden_size": 2048, "intermediate_size": 6144,
                      "moe_intermediate_size": 768, "num_experts": 128, "num_experts_per_tok": 8,
                      "norm_topk_prob": True, "decoder_sparse_step": 1, "mlp_only_layers": [],
                      "num_hidden_layers": 48, "num_attention_heads": 32, "num_key_value_heads": 4,
                      "head_dim": 128, "vocab_size": 151936, "rms_norm_eps": 1e-6, "rope_theta": 1e6,
                      "max_position_embeddings": 40960, "tie_word_embeddings": False, "hidden_act": "silu",
                      "eos_token_id": 151645},
    "qwen1.5-moe-a2.7b": {"model_type": "qwen2_moe", "hidden_size": 2048, "intermediate_size": 5632,
                          "moe_intermediate_size": 1408, "shared_expert_intermediate_size": 5632,
                          "num_experts": 60, "num_experts_per_tok": 4, "norm_topk_prob": False,
                          "decoder_sparse_step": 1, "mlp_only_layers": [], "num_hidden_layers": 24,
                          "num_attention_heads": 16, "num_key_value_heads": 16, "vocab_size": 151936,
                          "rms_norm_eps": 1e-6, "rope_theta": 1e6, "max_position_embeddings": 8192,
                          "tie_word_embeddings": False, "hidden_act": "silu", "eos_token_id": 151643},
    # Mistral-Nemo-12B: the model card's shapes (40 layers, dim 5120, head dim 128 against 5120 / 32 =
    # 160, 32 heads on 8 KV heads, 2^17 vocabulary, RoPE theta 1e6, no sliding window;
    # https://huggingface.co/mistralai/Mistral-Nemo-Instruct-2407) and NVIDIA NeMo's
    # MistralNeMoConfig12B for the FFN width, 14336 (the card's "14,436" is a typo for it): 24.5 GB.
    "mistral-nemo-12b": {"model_type": "mistral", "hidden_size": 5120, "intermediate_size": 14336,
                         "num_hidden_layers": 40, "num_attention_heads": 32, "num_key_value_heads": 8,
                         "head_dim": 128, "vocab_size": 131072, "rms_norm_eps": 1e-5, "rope_theta": 1e6,
                         "max_position_embeddings": 1024000, "sliding_window": None,
                         "tie_word_embeddings": False, "hidden_act": "silu"},
    "qwen2.5-7b": {"model_type": "qwen2", "hidden_size": 3584, "intermediate_size": 18944,
                   "num_hidden_layers": 28, "num_attention_heads": 28, "num_key_value_heads": 4,
                   "vocab_size": 152064, "rms_norm_eps": 1e-6, "rope_theta": 1e6,
                   "max_position_embeddings": 32768, "tie_word_embeddings": False, "hidden_act": "silu"},
    # Hybrids: three Gated DeltaNet layers, then gated full attention (full_attention_interval 4).
    # Qwen3.5-27B's text model (the text_config of https://huggingface.co/Qwen/Qwen3.5-27B/blob/main/config.json,
    # read from stored copies of it; no vision tower, no MTP head): 53.8 GB in bf16.
    "qwen3.5-27b": {"model_type": "qwen3_5_text", "hidden_size": 5120, "intermediate_size": 17408,
                    "num_hidden_layers": 64, "full_attention_interval": 4, "num_attention_heads": 24,
                    "num_key_value_heads": 4, "head_dim": 256, "linear_num_key_heads": 16,
                    "linear_num_value_heads": 48, "linear_key_head_dim": 128, "linear_value_head_dim": 128,
                    "linear_conv_kernel_dim": 4, "vocab_size": 248320, "rms_norm_eps": 1e-6,
                    "max_position_embeddings": 262144, "tie_word_embeddings": False, "hidden_act": "silu",
                    "attention_bias": False, "eos_token_id": 248044,
                    "rope_parameters": {"rope_type": "default", "rope_theta": 1e7, "partial_rotary_factor": 0.25,
                                        "mrope_section": [11, 11, 10], "mrope_interleaved": True}},
    # Qwen3-Next-80B-A3B (https://huggingface.co/Qwen/Qwen3-Next-80B-A3B-Instruct/blob/main/config.json)
    # cut from 48 layers to 36: 4 layers (3 GDN + 1 attention, each with 512 experts) are 13.18 GB
    # in bf16, the embedding and LM head 1.24 GB, so 48 layers are 159.3 GB, 40 are 133.0 GB
    # (8 GB left of an H200's 141 GB) and 36 are 119.8 GB, leaving 21 GB for KV, recurrent state
    # and activations.
    "qwen3-next-80b-a3b-36l": {"model_type": "qwen3_next", "hidden_size": 2048, "intermediate_size": 5120,
                               "num_hidden_layers": 36, "full_attention_interval": 4, "num_attention_heads": 16,
                               "num_key_value_heads": 2, "head_dim": 256, "linear_num_key_heads": 16,
                               "linear_num_value_heads": 32, "linear_key_head_dim": 128,
                               "linear_value_head_dim": 128, "linear_conv_kernel_dim": 4, "num_experts": 512,
                               "num_experts_per_tok": 10, "moe_intermediate_size": 512,
                               "shared_expert_intermediate_size": 512, "norm_topk_prob": True,
                               "decoder_sparse_step": 1, "mlp_only_layers": [], "vocab_size": 151936,
                               "rms_norm_eps": 1e-6, "max_position_embeddings": 262144, "rope_theta": 1e7,
                               "partial_rotary_factor": 0.25, "tie_word_embeddings": False, "hidden_act": "silu",
                               "attention_bias": False, "eos_token_id": 151645},
}
# What a preset's name alone does not say, printed with it by the bench.
DESCRIPTIONS: dict[str, str] = {
    "llama3.1-70b": "Llama-3.1-70B's shapes, 141.1 GB in bf16: --tensor-parallel-size 2 or more",
    "qwen3.5-27b": "Qwen3.5-27B's text model, 53.8 GB in bf16",
    "qwen3-next-80b-a3b-36l": "Qwen3-Next-80B-A3B cut to 36 of its 48 layers (27 GDN + 9 attention, "
                              "119.8 GB in bf16 of the whole model's 159.3 GB) to fit one H200",
}


def random_weights(raw: dict, device: torch.device, dtype: torch.dtype, seed: int = 0,
                   tp: TensorParallel = SINGLE) -> dict[str, torch.Tensor]:
    """HF-named tensors: N(0, 0.02) matrices, ones for norm weights, zeros for biases; a Gated
    DeltaNet's decay parameters as HF initialises them (A_log = log U(1, 16), dt_bias ones). With
    ``tp``: the shapes of that rank's shard (each rank draws its own, never the whole model).

    They are views of one allocation, in the family's order of names (decoder.packed_views): the
    tensors a build fuses (q / k / v, gate / up) lie one after the other, so the build takes them
    as views (decoder.fused_rows) and the bench, which keeps these tensors for every dtype's build
    and HF's, holds the weights once."""
    gen = torch.Generator(device=device).manual_seed(seed + tp.rank)
    cfg = shard_config(model_config(raw), tp)
    shapes = family_of(cfg.family).expected_tensors(cfg)
    tensors = packed_views({name: (shape, dtype) for name, shape in shapes.items()}, device)
    for name, t in tensors.items():
        if name.endswith(".A_log"):
            t.copy_(torch.empty(t.shape, dtype=torch.float32, device=device).uniform_(1.0, 16.0, generator=gen).log())
        elif name.endswith("norm.weight") or name.endswith(".dt_bias"):
            t.fill_(1)
        elif name.endswith(".bias"):
            t.zero_()
        else:
            t.normal_(0.0, 0.02, generator=gen)
    return tensors
