"""The 2026 families' layouts at scale: a Gated DeltaNet hybrid resharded TP2 -> TP4 and exported (#35), a vision-language
model exported from TP2 PP2 (#36), against `cp -r` and a parallel copy of the same bytes.

    python benchmarks/bench_families.py qwen3_next --size 3 --out benchmarks/results_qwen3_next.json
    python benchmarks/bench_families.py qwen3_vl --size 3 --out benchmarks/results_qwen3_vl.json
    python benchmarks/bench_families.py qwen3_next --size 0.5                                  # smoke

Each model is its family's transformers config (defaults of transformers 5.24) narrowed (hidden 1024 for Qwen3-Next,
2048 for Qwen3-VL's language model), with decoder layers added until the weights are about --size GB in bf16; its HF source is written as a
release ships (safetensors shards with an index, config.json; random bf16 values, the tensor list the family's own mapping gives).
- qwen3_next: Qwen3-Next's pattern (three Gated DeltaNet layers, then gated attention; 4 KV groups, not its 2, so
  that TP4 divides them), 64 experts of 256 with top-8 and a gated shared expert. Steps: HF -> torch_dist TP2,
  TP2 -> TP4, TP4 -> HF (checked with `reshard verify`).
- qwen3_vl: Qwen3-VL's language model beside a 12-block vision tower in Bridge's Megatron form (split over TP) with
  three DeepStack mergers. Steps: HF -> torch_dist TP2 PP2, TP2 PP2 -> HF (verified).
The engine is `bench_deepseek.run_release`'s: each step in a fresh process after a page-cache drop, `cp -r` and the
parallel copy of each source at the start and the end, peak RSS against 1 GiB + 2 x the largest tensor.
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_convert import rmtree, verify_step  # noqa: E402
from bench_deepseek import Release, Steps, config_reader, run_release, tensor_stats, write_release  # noqa: E402

_QWEN3_NEXT = {
    "hidden_size": 1024, "num_attention_heads": 8, "num_key_value_heads": 4, "head_dim": 128, "linear_num_key_heads": 8,
    "linear_num_value_heads": 16, "linear_key_head_dim": 64, "linear_value_head_dim": 64, "num_experts": 64,
    "num_experts_per_tok": 8, "moe_intermediate_size": 256, "shared_expert_intermediate_size": 256, "intermediate_size": 2816,
}
_QWEN3_VL_TEXT = {"hidden_size": 2048, "num_attention_heads": 16, "num_key_value_heads": 4, "head_dim": 128, "intermediate_size": 6144,
                  "rope_parameters": {"rope_type": "default", "rope_theta": 5000000.0, "mrope_interleaved": True, "mrope_section": [24, 20, 20]}}
_QWEN3_VL_VISION = {"depth": 12, "hidden_size": 768, "intermediate_size": 3072, "num_heads": 12, "out_hidden_size": 2048,
                    "deepstack_visual_indexes": [3, 7, 11]}


def _qwen3_next(layers: int) -> dict:
    import transformers

    kinds = (["linear_attention"] * 3 + ["full_attention"]) * (layers // 4 + 1)
    config = transformers.Qwen3NextConfig(**_QWEN3_NEXT, num_hidden_layers=layers, layer_types=kinds[:layers], tie_word_embeddings=False)
    return config.to_dict() | {"architectures": ["Qwen3NextForCausalLM"], "torch_dtype": "bfloat16"}


def _qwen3_vl(layers: int) -> dict:
    import transformers

    config = transformers.Qwen3VLConfig(text_config=_QWEN3_VL_TEXT | {"num_hidden_layers": layers}, vision_config=_QWEN3_VL_VISION,
                                        tie_word_embeddings=False)
    return config.to_dict() | {"architectures": ["Qwen3VLForConditionalGeneration"], "torch_dtype": "bfloat16"}


_CONFIGS = {"qwen3_next": (_qwen3_next, 4), "qwen3_vl": (_qwen3_vl, 2)}  # the config at N layers; layers come in steps of (PP2 splits them)


def hf_config(tag: str, size_gb: float) -> dict:
    """Family `tag`'s config with as many decoder layers as make about `size_gb` GB in bf16."""
    config, step = _CONFIGS[tag]

    def gigabytes(layers: int) -> float:
        return tensor_stats(config_reader(config(layers)).config)["logical_bytes"] / 1e9

    per_step = gigabytes(2 * step) - gigabytes(step)
    return config(max(step, step * round(1 + (size_gb - gigabytes(step)) / per_step)))


def build_main(path: Path, size_gb: float, tag: str) -> None:
    from reshard.formats.hf import hf_tensors, whole_tensors

    hf = hf_config(tag, size_gb)
    reader = config_reader(hf)
    tensors = [(name, "BF16", shape, "norm" if "norm" in name else "bf16")
               for name, shape in whole_tensors(hf_tensors(reader.specs, reader.mappings, reader.config))]
    write_release(path, hf, tensors)


def _qwen3_next_steps(run: Steps) -> None:
    tp2, tp4, back = run.path("tp2"), run.path("tp4"), run.path("back")
    run.copy(run.source)
    run.convert("HF -> torch_dist TP2", run.source, tp2, "--to-format", "torch_dist", "--to-tp", "2")
    if tp2.exists():
        run.copy(tp2)
        run.convert("torch_dist TP2 -> TP4", tp2, tp4, "--to-tp", "4")
        rmtree(tp2)
    if tp4.exists():
        res = run.convert("torch_dist TP4 -> HF", tp4, back, "--to-format", "hf")
        verify_step(res, back, tp4, "verified_against_torch_dist", run.env)
        rmtree(back)
        run.copy(tp4)
    run.copy(run.source)


def _qwen3_vl_steps(run: Steps) -> None:
    tp2pp2, back = run.path("tp2pp2"), run.path("back")
    run.copy(run.source)
    run.convert("HF -> torch_dist TP2 PP2", run.source, tp2pp2, "--to-format", "torch_dist", "--to-tp", "2", "--to-pp", "2")
    if tp2pp2.exists():
        run.copy(tp2pp2)
        res = run.convert("torch_dist TP2 PP2 -> HF", tp2pp2, back, "--to-format", "hf")
        verify_step(res, back, tp2pp2, "verified_against_torch_dist", run.env)
        rmtree(back)
        run.copy(tp2pp2)
    run.copy(run.source)


RELEASES = {
    "qwen3_next": Release("qwen3_next", "Qwen3-Next-shaped hybrid (Gated DeltaNet and gated attention, MoE)", __file__,
                          lambda size: hf_config("qwen3_next", size), tuple(_QWEN3_NEXT), _qwen3_next_steps),
    "qwen3_vl": Release("qwen3_vl", "Qwen3-VL-shaped vision-language model", __file__, lambda size: hf_config("qwen3_vl", size),
                        ("text_config", "vision_config"), _qwen3_vl_steps),
}


if __name__ == "__main__":
    if sys.argv[1:2] == ["--_build"]:
        build_main(Path(sys.argv[2]), float(sys.argv[3]), sys.argv[4])
        sys.exit(0)
    if len(sys.argv) < 2 or sys.argv[1] not in RELEASES:
        sys.exit(f"usage: bench_families.py {{{','.join(RELEASES)}}} [--size GB] [--out JSON]")
    sys.exit(run_release(sys.argv[2:], RELEASES[sys.argv[1]]))
