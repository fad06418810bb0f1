"""`inspect`: what a checkpoint is — format, architecture, layout, tensors, bytes."""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from reshard.dtypes import itemsize
from reshard.formats import open_checkpoint
from reshard.optim.state import StoredForm, described
from reshard.plan import human_bytes
from reshard.torchfile.screen import screen

NO_ARCHITECTURE = "the tensors are global; pass --config with its HF config.json or Megatron args YAML to convert it"
# --config completes a torch_dist checkpoint only (as `plan` says when a conversion needs the architecture)
NO_ARCHITECTURE_ZARR = "the tensors are global; convert it to torch_dist and pass --config there to convert it further"


@dataclass(frozen=True)
class TensorRow:
    name: str
    shape: tuple[int, ...]
    dtype: str
    split: str
    bytes: int


DCP_FORMATS = ("torch_dist", "verl")  # read by TorchDistReader: its tree's iteration directory holds every .metadata


def optimizer_form(reader) -> StoredForm | None:
    """The optimizer form of an open `reader`, with the optimizer and the moments its args name; None without optimizer
    state, or where the format names none."""
    form = _stored_form(reader)
    return None if form is None else replace(form, optimizer=described(reader.common.args))


def _stored_form(reader) -> StoredForm | None:
    if reader.optimizer is not None:  # the reader presents it as fully_reshardable: name what is stored
        return reader.optimizer.form
    if reader.format_name not in DCP_FORMATS:
        return None
    dp = reader.common.args.get("data_parallel_size")
    common = reader.common.extra.get("optimizer") or {}
    common = common.get(0, common)  # an MoE model's chained optimizers: one entry each, by index
    recorded = common.get("param_state_sharding_type") if isinstance(common, dict) else None
    if recorded:
        return StoredForm(str(recorded), dp)
    if any(spec.is_optimizer for spec in reader.specs.values()):
        return StoredForm("plain", dp)
    return None


@dataclass(frozen=True)
class CheckpointInfo:
    path: Path
    format: str
    iteration: int | str
    config: dict[str, Any]
    layout: str
    tensors: list[TensorRow]
    dropped: list[str]
    has_manifest: bool
    optimizer: StoredForm | None = None
    optimizer_refused: str | None = None  # why the optimizer state found was not read

    @property
    def total_bytes(self) -> int:
        return sum(t.bytes for t in self.tensors)

    def to_json(self) -> dict[str, Any]:
        return {
            "path": str(self.path),
            "format": self.format,
            "iteration": self.iteration,
            "layout": self.layout,
            "config": self.config,
            "total_bytes": self.total_bytes,
            "dtypes": dict(Counter(t.dtype for t in self.tensors)),
            "has_checksums": self.has_manifest,
            "optimizer": self.optimizer.__dict__ if self.optimizer else None,
            "optimizer_refused": self.optimizer_refused,
            "not_tensors": self.dropped,
            "tensors": [t.__dict__ | {"shape": list(t.shape)} for t in self.tensors],
        }

    def render(self) -> str:
        c = self.config
        lines = [
            f"{self.path}: {self.format} checkpoint, iteration {self.iteration}, layout {self.layout}",
            (f"model: {c['num_layers']} layers, hidden {c['hidden_size']}, {c['num_attention_heads']} heads "
             f"({c['num_query_groups'] or c['num_attention_heads']} query groups), ffn {c['ffn_hidden_size']}, "
             f"vocab {c['vocab_size'] or '?'} (padded {c['padded_vocab_size']})"
             + (f", {c['num_experts']} experts top-{c['moe_router_topk']}" if c.get("num_experts") else "")
             + (f", {c['mtp_num_layers']} MTP layers" if c.get("mtp_num_layers") else ""))
            if c else f"model: architecture not recorded ({NO_ARCHITECTURE_ZARR if self.format == 'zarr' else NO_ARCHITECTURE})",
            f"{len(self.tensors)} tensors, {human_bytes(self.total_bytes)}, dtypes "
            + ", ".join(f"{k}: {v}" for k, v in Counter(t.dtype for t in self.tensors).items())
            + ("; checksums recorded" if self.has_manifest else "; no checksums recorded"),
        ]
        if self.optimizer:
            lines.append(self.optimizer.render())
        if self.optimizer_refused:
            lines.append(f"optimizer: not read: {self.optimizer_refused}")
        width = max((len(t.name) for t in self.tensors), default=0)
        for t in self.tensors:
            lines.append(f"  {t.name:<{width}}  {str(list(t.shape)):<22} {t.dtype:<9} {t.split:<10} {human_bytes(t.bytes)}")
        if self.dropped:
            lines.append(f"not tensors (not converted): {', '.join(self.dropped[:8])}{' ...' if len(self.dropped) > 8 else ''}")
        return "\n".join(lines)


def screen_objects(reader) -> None:
    """Read every pickle of a torch_dist checkpoint through the allow-list (`screen`): its reader reads the
    objects of the .distcp files only when a conversion carries them, and inspect and verify, which carry
    none, must refuse a hostile one rather than describe or vouch for the checkpoint holding it."""
    if reader.format_name in DCP_FORMATS:
        screen(reader.tree.iteration_dir)


def inspect(path: Path | str, config_file: Path | None = None) -> CheckpointInfo:
    """What the checkpoint at `path` is; `config_file` gives the architecture of one that records none."""
    with open_checkpoint(path, config_file=config_file, need_architecture=False) as reader:
        screen_objects(reader)
        rows = [
            TensorRow(name, spec.shape, spec.dtype, spec.split.value, spec.numel * itemsize(spec.dtype))
            for name, spec in sorted(reader.specs.items())
        ]
        return CheckpointInfo(
            path=Path(path),
            format=reader.format_name,
            iteration=reader.common.iteration,
            config=reader.config.to_dict() if reader.config else {},
            layout=str(reader.layout) if reader.config else "not recorded",
            tensors=rows,
            dropped=list(reader.common.dropped) + list(reader.unsupported_optimizer),
            has_manifest=reader.manifest is not None,
            optimizer=optimizer_form(reader),
            optimizer_refused=reader.optimizer_refusal.reason if reader.optimizer_refusal else None,
        )
