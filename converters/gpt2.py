"""GPT-2 (GPT2LMHeadModel): learned absolute positions, LayerNorm with biases, GELU MLP, biases everywhere,
and Conv1D weights stored [in, out] (transposed), with q/k/v fused in `c_attn`.

HF's default `gelu_new` (tanh approximation) is Megatron-LM's `openai_gelu`.
"""

from __future__ import annotations

from reshard.config import ModelConfig, pad_vocab
from reshard.converters.base import Family, FusedQKV, L, Rename, Transposed, check_values, hf_dtype, refuse

GELU_EXACT = ("gelu",)
GELU_TANH = ("gelu_new", "gelu_pytorch_tanh", "gelu_fast")


class GPT2(Family):
    model_type = "gpt2"
    architectures = ("GPT2LMHeadModel",)
    prefix = "transformer."
    tie_default = True
    ignored = (r"\.attn\.(masked_)?bias$",)  # causal-mask buffers saved by old GPT-2 checkpoints
    signature = {
        "normalization": "LayerNorm",
        "swiglu": False,
        "add_bias_linear": True,
        "add_qkv_bias": True,
        "qk_layernorm": False,
        "position_embedding_type": "learned_absolute",
        "moe": False,
    }

    def check_hf(self, hf):
        if hf.get("quantization_config"):
            raise refuse("quantization_config", "dequantize the model (save it unquantized) first")
        act = hf.get("activation_function", "gelu_new")
        if act not in GELU_EXACT + GELU_TANH:
            raise refuse(f"activation_function={act!r}", "GPT-2 converts with gelu or gelu_new only")
        if hf.get("scale_attn_by_inverse_layer_idx"):
            raise refuse("scale_attn_by_inverse_layer_idx=true", "Megatron-Core scales attention by 1/sqrt(head_dim) only")
        if not hf.get("scale_attn_weights", True):
            raise refuse("scale_attn_weights=false", "Megatron-Core always scales attention by 1/sqrt(head_dim)")
        if hf.get("add_cross_attention"):
            raise refuse("add_cross_attention=true", "decoder-only GPT-2 models only")

    def config_from_hf(self, hf):
        check_values(hf)
        self.check_hf(hf)
        hidden = int(hf["n_embd"])
        vocab = int(hf["vocab_size"])
        config = ModelConfig(
            num_layers=int(hf["n_layer"]),
            hidden_size=hidden,
            num_attention_heads=int(hf["n_head"]),
            kv_channels=hidden // int(hf["n_head"]),
            ffn_hidden_size=int(hf.get("n_inner") or 4 * hidden),
            vocab_size=vocab,
            padded_vocab_size=pad_vocab(vocab, 128, 1),
            make_vocab_size_divisible_by=128,
            max_position_embeddings=int(hf["n_positions"]),
            position_embedding_type="learned_absolute",
            normalization="LayerNorm",
            norm_epsilon=float(hf.get("layer_norm_epsilon", 1e-5)),
            swiglu=False,
            add_bias_linear=True,
            add_qkv_bias=True,
            untie_embeddings_and_output_weights=not bool(hf.get("tie_word_embeddings", True)),
            params_dtype=hf_dtype(hf) or "float32",
            openai_gelu=hf.get("activation_function", "gelu_new") in GELU_TANH,
        )
        return config, {"hf_activation_function": hf.get("activation_function", "gelu_new")}

    def config_to_hf(self, config, saved=None, extras=None):
        extras = extras or {}
        out = self.hf_config_base(config, saved)
        act = extras.get("hf_activation_function") or ("gelu_new" if config.openai_gelu else "gelu")
        out.update(
            architectures=[self.architectures[0]],
            model_type=self.model_type,
            n_embd=config.hidden_size,
            n_layer=config.num_layers,
            n_head=config.num_attention_heads,
            n_inner=config.ffn_hidden_size if config.ffn_hidden_size != 4 * config.hidden_size else out.get("n_inner"),
            n_positions=config.max_position_embeddings,
            vocab_size=config.vocab_rows,
            layer_norm_epsilon=config.norm_epsilon,
            activation_function=act,
            tie_word_embeddings=config.tied_embeddings,
            scale_attn_weights=True,
            scale_attn_by_inverse_layer_idx=False,
        )
        if config.head_dim * config.num_attention_heads != config.hidden_size or config.num_query_groups not in (None, config.num_attention_heads):
            raise refuse("grouped-query attention or kv_channels != hidden/heads", "HF GPT-2 has plain multi-head attention")
        return out

    def mappings(self, config):
        p = f"transformer.h.{L}."
        a, m = "decoder.layers.self_attention.", "decoder.layers.mlp."
        out = [
            Rename("embedding.word_embeddings.weight", "transformer.wte.weight"),
            Rename("embedding.position_embeddings.weight", "transformer.wpe.weight"),
            Rename(f"{a}linear_qkv.layer_norm_weight", f"{p}ln_1.weight"),
            Rename(f"{a}linear_qkv.layer_norm_bias", f"{p}ln_1.bias"),
            FusedQKV(f"{a}linear_qkv.weight", f"{p}attn.c_attn.weight", conv1d=True),
            FusedQKV(f"{a}linear_qkv.bias", f"{p}attn.c_attn.bias", conv1d=True),
            Transposed(f"{a}linear_proj.weight", f"{p}attn.c_proj.weight"),
            Rename(f"{a}linear_proj.bias", f"{p}attn.c_proj.bias"),
            Rename(f"{m}linear_fc1.layer_norm_weight", f"{p}ln_2.weight"),
            Rename(f"{m}linear_fc1.layer_norm_bias", f"{p}ln_2.bias"),
            Transposed(f"{m}linear_fc1.weight", f"{p}mlp.c_fc.weight"),
            Rename(f"{m}linear_fc1.bias", f"{p}mlp.c_fc.bias"),
            Transposed(f"{m}linear_fc2.weight", f"{p}mlp.c_proj.weight"),
            Rename(f"{m}linear_fc2.bias", f"{p}mlp.c_proj.bias"),
            Rename("decoder.final_layernorm.weight", "transformer.ln_f.weight"),
            Rename("decoder.final_layernorm.bias", "transformer.ln_f.bias"),
        ]
        if not config.tied_embeddings:
            out.append(Rename("output_layer.weight", "lm_head.weight"))
        return out
