"""Checkpoint formats. Each reads into and writes from the one logical view (`reshard.logical`)."""

from __future__ import annotations

from pathlib import Path

from reshard.errors import ReshardError
from reshard.formats.base import CheckpointReader, CheckpointWriter
from reshard.formats.megatron_dist import TorchDistReader, TorchDistWriter, is_torch_dist
from reshard.formats.megatron_legacy import LegacyReader, LegacyWriter, is_legacy
from reshard.formats.verl import VerlReader, VerlWriter, is_verl
from reshard.formats.zarr_store import ZarrReader, ZarrWriter, is_zarr

READERS: dict[str, type[CheckpointReader]] = {"torch_dist": TorchDistReader, "legacy": LegacyReader, "zarr": ZarrReader, "verl": VerlReader}
WRITERS: dict[str, type[CheckpointWriter]] = {"torch_dist": TorchDistWriter, "legacy": LegacyWriter, "zarr": ZarrWriter, "verl": VerlWriter}
# verl before torch_dist: its run directory's tracker names a global_step_<N>, which Megatron-LM's would take for a missing iter_<N>
_DETECTORS = (("zarr", is_zarr), ("verl", is_verl), ("torch_dist", is_torch_dist), ("legacy", is_legacy))


def register(name: str, reader: type[CheckpointReader], writer: type[CheckpointWriter], detector) -> None:
    """Add a format (the HuggingFace format registers itself this way)."""
    READERS[name], WRITERS[name] = reader, writer
    global _DETECTORS
    _DETECTORS = _DETECTORS + ((name, detector),)


from reshard.formats.hf import HFReader, HFWriter, is_hf  # noqa: E402  (registers itself like any added format)

register("hf", HFReader, HFWriter, is_hf)

from reshard.formats.nemo_rl_writer import NemoRlWriter, source_step  # noqa: E402  (a TorchDistWriter, after its module)


def writer_for(reader: CheckpointReader, asked: str | None) -> type[CheckpointWriter]:
    """The writer of a conversion of `reader` to format `asked` (None: the source's): a NeMo-RL step's model is read as
    torch_dist and written back as a NeMo-RL step, unless a format is named."""
    if asked is None and reader.format_name == "torch_dist" and source_step(reader.tokenizer_dir) is not None:
        return NemoRlWriter
    return WRITERS[asked or reader.format_name]


def detect(path: Path) -> str:
    if not path.exists():
        raise ReshardError(f"{path} does not exist")
    if not path.is_dir():
        raise ReshardError(f"{path} is a file; give the checkpoint directory")
    _refuse_nemo2(path)
    for name, test in _DETECTORS:
        if test(path):
            return name
    raise ReshardError(
        f"{path} is not a checkpoint reshard knows (torch_dist, legacy mp_rank_*, zarr, HuggingFace, verl); "
        "point at the --save directory or an iter_NNNNNNN directory"
    )


def _refuse_nemo2(path: Path) -> None:
    """A NeMo 2 checkpoint (`context/` beside a torch_dist `weights/`), or its `weights/`: refused by name. Its
    architecture is a serialized NeMo object graph (`context/model.yaml`, NeMo classes by name, their defaults in
    NeMo) and no NeMo-written checkpoint was at hand to prove a reader against, so its torch_dist weights would
    be read as a bare directory only to be misnamed or refused further on."""
    root = path.parent if path.name == "weights" else path
    if (root / "context").is_dir() and (root / "weights" / ".metadata").is_file():
        raise ReshardError(
            f"{root} is a NeMo 2 checkpoint (context/ + weights/), which reshard does not read; export it to HF with "
            "NeMo (llm.export_ckpt) and convert that"
        )


def open_checkpoint(
    path: Path | str, format: str | None = None, config_file: Path | None = None, need_architecture: bool = True
) -> CheckpointReader:
    """The checkpoint at `path`, in `format` (default: detected). `config_file` gives the architecture of a
    torch_dist checkpoint that records none (`--config`); without `need_architecture` such a checkpoint
    opens with `config` None (enough to inspect and checksum its global tensors)."""
    path = Path(path)
    name = format or detect(path)
    if name not in READERS:
        raise ReshardError(f"unknown format {name!r}; choose one of {', '.join(sorted(READERS))}")
    if name == "torch_dist":
        return TorchDistReader(path, config_file, need_architecture)
    if config_file is not None:
        raise ReshardError(f"--config is for torch_dist checkpoints that record no architecture; {path} is {name}: drop it")
    return READERS[name](path)
