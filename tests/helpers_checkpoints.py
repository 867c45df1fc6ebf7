"""Builders of tiny random checkpoints (HF folders and GGUF files) for tests.

``make_hf_checkpoint(tmp_path, "llama" | "mistral" | "phi3" | "qwen2" | "qwen3" | "qwen3_moe" | "qwen2_moe" | "qwen3_next", **overrides)`` saves a seeded random
model made by transformers itself (bf16 safetensors + a small trained BPE tokenizer with a ChatML
template), so model tests can compare metrale against HF on the very same files.
"""

from __future__ import annotations

import json
import math
import pathlib
import re

import numpy as np
import torch

CHATML_TEMPLATE = (
    "{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\n' + message['content']"
    " + '<|im_end|>' + '\n' }}{% endfor %}{% if add_generation_prompt %}"
    "{{ '<|im_start|>assistant\n' }}{% endif %}"
)
SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
CORPUS = [
    "The quick brown fox jumps over the lazy dog.",
    "Hello world! How are you today? I am fine, thank you.",
    "Tokenizers split text into pieces; models predict the next piece.",
    "Numbers like 12345 and 2024 appear, and so do symbols: #, @, %, &.",
    "Café, naïve, déjà vu, 日本語, and emoji 🤖 are unicode text.",
] * 4

FAMILIES = {
    "llama": ("LlamaConfig", {}),
    "mistral": ("MistralConfig", {"head_dim": 24, "sliding_window": None}),
    "phi3": ("Phi3Config", {"partial_rotary_factor": 0.5}),
    "qwen2": ("Qwen2Config", {}),
    "qwen3": ("Qwen3Config", {"head_dim": 16}),
    "qwen3_moe": ("Qwen3MoeConfig", {"head_dim": 16, "num_experts": 6, "num_experts_per_tok": 2,
                                     "moe_intermediate_size": 32, "norm_topk_prob": True}),
    "qwen2_moe": ("Qwen2MoeConfig", {"num_experts": 6, "num_experts_per_tok": 2, "moe_intermediate_size": 32,
                                     "shared_expert_intermediate_size": 48}),
    # layers 0-2 Gated DeltaNet, layer 3 gated full attention (full_attention_interval 4)
    "qwen3_next": ("Qwen3NextConfig", {"num_hidden_layers": 4, "head_dim": 32, "partial_rotary_factor": 0.5,
                                       "linear_num_key_heads": 2, "linear_num_value_heads": 4,
                                       "linear_key_head_dim": 16, "linear_value_head_dim": 8, "num_experts": 6,
                                       "num_experts_per_tok": 2, "moe_intermediate_size": 32,
                                       "shared_expert_intermediate_size": 48}),
}
TINY = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, max_position_embeddings=256, rms_norm_eps=1e-6,
            rope_theta=10000.0, tie_word_embeddings=False)


def make_tokenizer(folder: pathlib.Path, vocab_size: int = 320) -> "object":
    """Train a byte-level BPE on CORPUS and save it as an HF fast tokenizer into ``folder``."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    from transformers import PreTrainedTokenizerFast

    backend = Tokenizer(models.BPE())
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    backend.post_processor = processors.ByteLevel(trim_offsets=False)
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=SPECIAL_TOKENS,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    backend.train_from_iterator(CORPUS, trainer)
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=backend, bos_token="<|im_start|>",
                                        eos_token="<|im_end|>", pad_token="<|endoftext|>",
                                        unk_token=None)
    tokenizer.chat_template = CHATML_TEMPLATE
    tokenizer.save_pretrained(folder)
    return tokenizer


def _randomize(model: torch.nn.Module, seed: int) -> None:
    """Give norms and biases non-trivial values so a missing multiply or bias shows."""
    gen = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for name, param in model.named_parameters():
            noise = torch.randn(param.shape, generator=gen, dtype=torch.float32)
            if "norm" in name:
                param.copy_(1.0 + 0.1 * noise)
            elif name.endswith(".bias"):
                param.copy_(0.02 * noise)


def make_hf_checkpoint(tmp_path: pathlib.Path, family: str, *, seed: int = 0,
                       max_shard_size: str | int | None = None, **overrides) -> pathlib.Path:
    """A tiny random HF checkpoint folder of ``family`` (bf16 safetensors + tokenizer).

    ``overrides`` go to the transformers config (e.g. ``num_hidden_layers=4``,
    ``tie_word_embeddings=True``); ``max_shard_size`` (e.g. "40KB") saves it sharded.
    """
    import transformers

    class_name, family_defaults = FAMILIES[family]
    folder = pathlib.Path(tmp_path) / f"{family}-tiny-{seed}-{len(list(pathlib.Path(tmp_path).glob('*')))}"
    folder.mkdir(parents=True)
    tokenizer = make_tokenizer(folder)
    ids = {t: tokenizer.convert_tokens_to_ids(t) for t in SPECIAL_TOKENS}
    settings = {**TINY, **family_defaults, "vocab_size": len(tokenizer),
                "bos_token_id": ids["<|im_start|>"], "eos_token_id": ids["<|im_end|>"],
                "pad_token_id": ids["<|endoftext|>"], **overrides}
    config = getattr(transformers, class_name)(**settings)
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    _randomize(model, seed)
    save_kwargs = {"max_shard_size": max_shard_size} if max_shard_size else {}
    model.save_pretrained(folder, **save_kwargs)
    return folder


def hf_state_dict(folder: pathlib.Path) -> dict[str, torch.Tensor]:
    """The tensors an HF folder's safetensors files hold, read with safetensors directly."""
    from safetensors.torch import load_file

    tensors = {}
    for path in sorted(pathlib.Path(folder).glob("*.safetensors")):
        tensors.update(load_file(str(path)))
    return tensors


# HF name part -> llama.cpp name part: the inverse of metrale's table, kept separate on purpose
# so that a wrong row there is caught here.
_TO_GGUF_LAYER = {
    "input_layernorm": "attn_norm", "self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k",
    "self_attn.v_proj": "attn_v", "self_attn.o_proj": "attn_output",
    "self_attn.q_norm": "attn_q_norm", "self_attn.k_norm": "attn_k_norm",
    "post_attention_layernorm": "ffn_norm", "mlp.gate_proj": "ffn_gate",
    "mlp.up_proj": "ffn_up", "mlp.down_proj": "ffn_down", "mlp.gate": "ffn_gate_inp",
    "mlp.shared_expert.gate_proj": "ffn_gate_shexp", "mlp.shared_expert.up_proj": "ffn_up_shexp",
    "mlp.shared_expert.down_proj": "ffn_down_shexp", "mlp.shared_expert_gate": "ffn_gate_inp_shexp",
}
_EXPERT = re.compile(r"model\.layers\.(\d+)\.mlp\.experts\.(\d+)\.(gate|up|down)_proj\.weight")
# HF model_type -> llama.cpp general.architecture where they differ
_TO_GGUF_ARCH = {"qwen3_moe": "qwen3moe", "qwen2_moe": "qwen2moe"}
_TO_GGUF_GLOBAL = {"model.embed_tokens": "token_embd", "model.norm": "output_norm", "lm_head": "output"}


def gguf_name(hf: str) -> str:
    stem, kind = hf.rsplit(".", 1)
    if stem.startswith("model.layers."):
        _, _, layer, part = stem.split(".", 3)
        return f"blk.{layer}.{_TO_GGUF_LAYER[part]}.{kind}"
    return f"{_TO_GGUF_GLOBAL[stem]}.{kind}"


def llama_cpp_permute(weight: np.ndarray, n_heads: int) -> np.ndarray:
    """llama.cpp convert_hf_to_gguf's q/k permutation, written independently of metrale."""
    return (weight.reshape(n_heads, 2, weight.shape[0] // n_heads // 2, *weight.shape[1:])
            .swapaxes(1, 2).reshape(weight.shape))


def llama_cpp_tensors(folder: pathlib.Path, config: dict) -> dict[str, np.ndarray]:
    """The folder's tensors under llama.cpp's names as its converter writes them: q/k permuted for
    llama, each layer's experts stacked (E, ...) into ffn_{gate,up,down}_exps."""
    tensors, experts = {}, {}
    for name, tensor in hf_state_dict(folder).items():
        values = tensor.float().numpy()
        if config["model_type"] == "llama" and (".q_proj." in name or ".k_proj." in name):
            values = llama_cpp_permute(values, config["num_attention_heads" if ".q_proj." in name
                                                      else "num_key_value_heads"])
        if match := _EXPERT.fullmatch(name):
            layer, expert, kind = match.groups()
            experts.setdefault(f"blk.{layer}.ffn_{kind}_exps.weight", {})[int(expert)] = values
        else:
            tensors[gguf_name(name)] = values
    for name, by_expert in experts.items():
        tensors[name] = np.stack([by_expert[e] for e in range(len(by_expert))])
    return tensors


def write_gguf(folder: pathlib.Path, out: pathlib.Path, quant: str = "F32", squeezed: bool = False,
               sampling: dict | None = None) -> pathlib.Path:
    """Convert a tiny HF folder to GGUF as llama.cpp would: arch metadata (experts' too), gpt2
    tokenizer, q/k permuted for llama, experts stacked, matrices in ``quant`` ("F32" or "Q8_0";
    F16 where rows are no multiple of the block) except the MoE router, which llama.cpp keeps in
    F32, 1-D tensors in F32. ``squeezed``: unit dimensions dropped, as older converters did;
    ``sampling``: general.sampling.* values by their writer's name ({"temp": 0.6, "top_k": 20})."""
    import gguf

    config = json.loads((folder / "config.json").read_text())
    writer = gguf.GGUFWriter(str(out), _TO_GGUF_ARCH.get(config["model_type"], config["model_type"]))
    writer.add_block_count(config["num_hidden_layers"])
    writer.add_context_length(config["max_position_embeddings"])
    writer.add_embedding_length(config["hidden_size"])
    writer.add_feed_forward_length(config["intermediate_size"])
    writer.add_head_count(config["num_attention_heads"])
    writer.add_head_count_kv(config["num_key_value_heads"])
    writer.add_layer_norm_rms_eps(config["rms_norm_eps"])
    writer.add_rope_freq_base(config.get("rope_theta") or config["rope_parameters"]["rope_theta"])
    writer.add_vocab_size(config["vocab_size"])
    if config.get("head_dim"):
        writer.add_key_length(config["head_dim"])
        writer.add_value_length(config["head_dim"])
    if config.get("moe_intermediate_size"):
        writer.add_expert_count(config.get("num_experts") or config["num_local_experts"])
        writer.add_expert_used_count(config["num_experts_per_tok"])
        writer.add_expert_feed_forward_length(config["moe_intermediate_size"])
    if config.get("shared_expert_intermediate_size"):
        writer.add_expert_shared_feed_forward_length(config["shared_expert_intermediate_size"])
    _add_tokenizer(writer, folder)
    for key, value in (sampling or {}).items():
        getattr(writer, f"add_sampling_{key}")(value)
    rope = config.get("rope_parameters") or config.get("rope_scaling") or {}
    if rope.get("rope_type") == "llama3":
        writer.add_tensor("rope_freqs.weight", llama_cpp_rope_freqs(config))
    qtype = gguf.GGMLQuantizationType[quant]
    for name, values in llama_cpp_tensors(folder, config).items():
        values = values.squeeze() if squeezed else values
        if values.ndim < 2 or qtype == gguf.GGMLQuantizationType.F32 or ".ffn_gate_inp." in name:
            writer.add_tensor(name, np.ascontiguousarray(values, dtype=np.float32))
            continue
        try:
            writer.add_tensor(name, gguf.quants.quantize(values, qtype), raw_dtype=qtype)
        except gguf.QuantError:  # rows not a multiple of the block: the converter falls back to F16
            writer.add_tensor(name, values.astype(np.float16), raw_dtype=gguf.GGMLQuantizationType.F16)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return out


def llama_cpp_rope_freqs(config: dict) -> np.ndarray:
    """The divisors llama.cpp's converter writes as rope_freqs.weight for llama3 RoPE scaling."""
    rope = config.get("rope_parameters") or config["rope_scaling"]
    dim = config.get("head_dim") or config["hidden_size"] // config["num_attention_heads"]
    theta = rope.get("rope_theta", config.get("rope_theta", 10000.0))
    factor, low, high = rope["factor"], rope["low_freq_factor"], rope["high_freq_factor"]
    old = rope["original_max_position_embeddings"]
    factors = []
    for freq in 1.0 / (theta ** (np.arange(0, dim, 2, dtype=np.float64) / dim)):
        wavelen = 2 * math.pi / freq
        if wavelen < old / high:
            factors.append(1.0)
        elif wavelen > old / low:
            factors.append(factor)
        else:
            smooth = (old / wavelen - low) / (high - low)
            factors.append(1 / ((1 - smooth) / factor + smooth))
    return np.array(factors, dtype=np.float32)


def _add_tokenizer(writer, folder: pathlib.Path) -> None:
    spec = json.loads((folder / "tokenizer.json").read_text())
    tok_config = json.loads((folder / "tokenizer_config.json").read_text())
    vocab = spec["model"]["vocab"]
    for added in spec["added_tokens"]:
        vocab[added["content"]] = added["id"]
    tokens = sorted(vocab, key=vocab.get)
    specials = {a["content"] for a in spec["added_tokens"] if a["special"]}
    merges = [m if isinstance(m, str) else " ".join(m) for m in spec["model"]["merges"]]
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("default")
    writer.add_token_list(tokens)
    writer.add_token_types([3 if t in specials else 1 for t in tokens])
    writer.add_token_merges(merges)
    writer.add_bos_token_id(vocab["<|im_start|>"])
    writer.add_eos_token_id(vocab["<|im_end|>"])
    writer.add_add_bos_token(False)
    template = tok_config.get("chat_template")
    if template is None and (folder / "chat_template.jinja").is_file():
        template = (folder / "chat_template.jinja").read_text()
    writer.add_chat_template(template)
