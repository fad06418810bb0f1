"""What ms-swift (Megatron-SWIFT, on its mcore-bridge) saves: `<output_dir>/v<N>-<time>/checkpoint-<step>/` holding
`args.json` (swift's arguments), Megatron-LM's tracker and `iter_<step>/` in torch_dist (swift/megatron/utils/
megatron_lm_utils.py `save_mcore_checkpoint`); `megatron export --to_mcore` writes the same into its output directory.

Its common.pt `args` are swift's arguments, not Megatron-LM's: the parallel sizes are there under Megatron-LM's
names, the architecture is not (mcore-bridge builds the model from the HF config of `--model`). So the architecture
comes from an HF config.json inside the checkpoint (swift writes one beside `--save_safetensors` weights) or from
`--config`. The HF model's directory that args.json names lies outside the checkpoint: it is named, never followed.
ms-swift 3's checkpoints (Megatron-LM's own training loop) hold Megatron-LM's args and need nothing here.

A `--tuner_type lora` save holds the adapter's weights only (`save_mcore_checkpoint(peft_format=True)`: the
`.lora_A.` / `.lora_B.` tensors of mcore-bridge's LoraParallelLinear): a LoRA source merged into `--base` by
`reshard.lora`, its rank and alpha from args.json (`is_lora`); an MoE model's routed experts' adapters too. A `lora_llm`
save holds the model without its LoRA (`peft_format=False` drops it): refused.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

from reshard.documents import read_json
from reshard.errors import ReshardError
from reshard.layout import Layout

ARGS_FILE = "args.json"
HF_CONFIG = "config.json"
_CHECKPOINT = re.compile(r"checkpoint-(\d+)")  # not `checkpoint-N-merged`: swift's merged-LoRA HF weights
# what reshard's merge (`W + lora_alpha / lora_rank * B @ A`) does not compute, refused by name: (field, merged value, why)
_UNMERGED = (("use_rslora", False, "its scale is lora_alpha / sqrt(lora_rank)"),
             ("lora_bias", "none", "its lora_B has a bias"),
             ("modules_to_save", [], "it saves whole modules beside the adapter"))


def checkpoint_dir(path: Path) -> Path:
    """The newest `checkpoint-N` of an ms-swift run directory `path`; `path` itself otherwise."""
    if not path.is_dir() or (path / ARGS_FILE).is_file():
        return path
    saved = [(int(m.group(1)), p) for p in path.iterdir() if (m := _CHECKPOINT.fullmatch(p.name)) and (p / ARGS_FILE).is_file()]
    return max(saved)[1] if saved else path


def saved_by_swift(args: dict[str, Any]) -> bool:
    """Whether a checkpoint's args are swift's (its own fields, no Megatron-LM architecture) rather than Megatron-LM's."""
    return "num_layers" not in args and "tuner_type" in args


def saved_args(root: Path) -> dict[str, Any] | None:
    """swift's args.json in the save directory `root`, None where there is none or it is not swift's."""
    file = root / ARGS_FILE
    if not file.is_file():
        return None
    try:
        args = read_json(file)  # the project's screen: a hostile file nested too deep is refused, not a RecursionError
    except (OSError, ReshardError):
        return None  # another tool's file of that name; a swift LoRA save without its args is refused by its tensors (`convert`)
    return args if isinstance(args, dict) and saved_by_swift(args) else None


def _refuse_lora_llm(args: dict[str, Any], source: Path) -> None:
    if args.get("tuner_type") == "lora_llm":  # read as a model, it would be the base without its LoRA
        raise ReshardError(f"{source} is an ms-swift lora_llm save, which holds the model without its LoRA: convert the "
                           "merged weights swift wrote beside it (`checkpoint-N-merged`, --merge_lora)")


def is_lora(args: dict[str, Any], root: Path) -> bool:
    """Whether the swift save in `root` is a LoRA adapter's (its lora_rank and lora_alpha in `args`); refusing what
    reshard does not merge."""
    _refuse_lora_llm(args, root)
    tuner = args.get("tuner_type")
    for field, merged, why in _UNMERGED if tuner == "lora" else ():
        if args.get(field, merged) not in (merged, None):
            raise ReshardError(f"{root / ARGS_FILE}: {field} is {args[field]!r} ({why}), which reshard does not merge; merge it with "
                               "ms-swift (`megatron export --mcore_adapter ... --merge_lora true --to_mcore true`)")
    return tuner == "lora"


def architecture_file(args: dict[str, Any], root: Path, config_file: Path | None, source: Path) -> Path | None:
    """Where the architecture of the swift checkpoint at `source` (save directory `root`) is written: `--config`,
    else the HF config.json swift saved beside it, else None."""
    _refuse_lora_llm(args, source)
    if config_file is not None:
        return config_file
    found = root / HF_CONFIG
    return found if found.is_file() else None


def architecture_hint(args: dict[str, Any]) -> str:
    """What to do about a swift checkpoint whose architecture is nowhere inside it."""
    model = args.get("model_dir") or args.get("model") or "its base model"
    return f"an ms-swift checkpoint names the HF model it was trained from ({model}): pass --config with that model's {HF_CONFIG}"


def layout_args(args: dict[str, Any]) -> dict[str, Any]:
    """The Megatron-LM arguments of the layout swift saved at (its parallel sizes carry Megatron-LM's names)."""
    return {key: value for key, value in Layout.from_megatron_args(args).megatron_args().items() if value is not None}
