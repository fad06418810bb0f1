"""gpt-oss-shaped conversion benchmark: HF MXFP4 release -> torch_dist EP4 -> HF bf16, against `cp -r`.

    python benchmarks/bench_gpt_oss.py --size 3 --out benchmarks/results_gpt_oss.json   # ~3 GB of bf16 weights
    python benchmarks/bench_gpt_oss.py --size 0.3                                       # smoke

The model is gpt-oss-20b's shape narrowed (hidden 1024 for 2880; 16 heads of 64, 4 KV groups, 32 experts of 768
with top-4, its 201,088-token vocabulary, sliding window 128 on alternate layers, YaRN), with layers added until
the weights are about --size GB in bf16. The source is written as openai/gpt-oss ships: safetensors shards with
an index, the experts' gate_up_proj and down_proj as MXFP4 (`*_blocks` uint8 [E, R, C/32, 16] and `*_scales` E8M0
[E, R, C/32]), everything else bf16 (random values; the tensor list is the one reshard's gpt_oss mapping gives for
the config). Steps (`bench_deepseek.run_release`): `cp -r` of each source at the start and the end, the import
to torch_dist EP4 (the experts dequantized to bf16, one expert's blocks and scales at a time), the export back
to HF MXFP4 as released (`--to-mxfp4`: each expert re-quantized, each value checked against MXFP4's bound), and to
HF bf16 (checked against the torch_dist checkpoint with `reshard verify`, untimed). Peak RSS against
1 GiB + 2 x the largest tensor (the 201,088 x 1024 embedding in bf16).
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_convert import rmtree, verify_step  # noqa: E402
from bench_deepseek import Release, Steps, config_reader, run_release, tensor_stats, write_release  # noqa: E402

# gpt-oss-20b's config.json (openai/gpt-oss-20b), narrowed; experts' inputs stay multiples of 32 (MXFP4 blocks)
SCALED = {
    "hidden_size": 1024,
    "intermediate_size": 768,
    "num_attention_heads": 16,
    "num_key_value_heads": 4,
    "head_dim": 64,
    "num_local_experts": 32,
    "num_experts_per_tok": 4,
}
BASE = {
    "architectures": ["GptOssForCausalLM"], "model_type": "gpt_oss", "attention_bias": True, "hidden_act": "silu",
    "vocab_size": 201088, "max_position_embeddings": 131072, "rms_norm_eps": 1e-05, "sliding_window": 128,
    "swiglu_limit": 7.0, "tie_word_embeddings": False, "router_aux_loss_coef": 0.9, "dtype": "bfloat16",
    "rope_parameters": {"rope_type": "yarn", "rope_theta": 150000.0, "factor": 32.0, "beta_fast": 32.0, "beta_slow": 1.0,
                        "original_max_position_embeddings": 4096, "truncate": False},
    "quantization_config": {"quant_method": "mxfp4", "modules_to_not_convert": ["model.layers.*.self_attn", "model.layers.*.mlp.router",
                                                                                "model.embed_tokens", "lm_head"]},
}
QUANTIZED = ("gate_up_proj", "down_proj")  # the experts' weights, not their biases


def hf_config(size_gb: float) -> dict:
    """gpt-oss at SCALED widths, with as many layers as make about `size_gb` GB in bf16 (alternating window)."""
    def config(layers: int) -> dict:
        kinds = ["sliding_attention", "full_attention"] * ((layers + 1) // 2)
        return BASE | SCALED | {"num_hidden_layers": layers, "layer_types": kinds[:layers]}

    def gigabytes(layers: int) -> float:
        return tensor_stats(config_reader(config(layers)).config)["logical_bytes"] / 1e9

    per_two = gigabytes(4) - gigabytes(2)  # layers come in (sliding, full) pairs
    return config(max(2, 2 + 2 * round((size_gb - gigabytes(2)) / per_two)))


def build_main(path: Path, size_gb: float) -> None:
    from reshard.formats.hf import hf_tensors

    hf = hf_config(size_gb)
    reader = config_reader(hf)
    tensors, seen = [], set()
    for *_, address, shape in hf_tensors(reader.specs, reader.mappings, reader.config):
        name = address.split("[", 1)[0]  # one expert's slice of a fused [E, ...] tensor names the whole one
        if name in seen:
            continue
        seen.add(name)
        experts = reader.config.num_experts
        if name.rsplit(".", 1)[-1] in QUANTIZED:  # [C, R] per expert, stored as blocks [E, R, C/32, 16] and scales
            columns, rows = shape
            tensors += [(f"{name}_blocks", "U8", (experts, rows, columns // 32, 16), "u8"),
                        (f"{name}_scales", "U8", (experts, rows, columns // 32), "e8m0")]
        else:
            whole = (experts, *shape) if address != name else shape
            tensors.append((name, "BF16", whole, "norm" if "norm" in name else "bf16"))
    write_release(path, hf, tensors)


def _steps(run: Steps) -> None:
    ep4, mxfp4_out, back = run.path("ep4"), run.path("back_mxfp4"), run.path("back_bf16")
    run.copy(run.source)
    run.convert("HF MXFP4 -> torch_dist EP4", run.source, ep4, "--to-format", "torch_dist", "--to-ep", "4")
    if ep4.exists():
        run.copy(ep4)
        run.convert("torch_dist EP4 -> HF MXFP4", ep4, mxfp4_out, "--to-format", "hf", "--to-mxfp4")
        rmtree(mxfp4_out)
        res = run.convert("torch_dist EP4 -> HF bf16", ep4, back, "--to-format", "hf")
        verify_step(res, back, ep4, "verified_against_torch_dist", run.env)
        rmtree(back)
        run.copy(ep4)
    run.copy(run.source)


GPT_OSS = Release("gpt_oss", "gpt-oss-shaped MoE, MXFP4 experts", __file__, hf_config, tuple(SCALED), _steps)


if __name__ == "__main__":
    if sys.argv[1:2] == ["--_build"]:
        build_main(Path(sys.argv[2]), float(sys.argv[3]))
        sys.exit(0)
    sys.exit(run_release(None, GPT_OSS))
