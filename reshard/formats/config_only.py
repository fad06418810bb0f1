"""An HF model known by its config.json alone, without weights: what `reshard convert --dry-run` plans from
when SOURCE is a config.json (a 671B model's plan, before downloading 690 GB).

Its tensors are the ones `HFReader` would present for that config: the family's mappings (`converters/`) and
`reshard.architecture.model_tensors`, never a second table. With a `quantization_config`, the tensors an fp8
export quantizes (`hf.FP8_LINEAR`) are taken to be stored as float8 blocks with their float32 scales, as
`HFReader` reads them (dequantized, float32). Reading a value is refused: there are none.
"""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np

from reshard import fp8_blocks, mxfp4
from reshard.architecture import model_tensors
from reshard.documents import read_json
from reshard.dtypes import itemsize
from reshard.errors import ReshardError
from reshard.formats.base import CheckpointReader, CommonState
from reshard.formats.hf import FP8_LINEAR, hf_tensors
from reshard.layout import Layout
from reshard.logical import describe
from reshard.sharding import Region


def is_config_file(path: Path) -> bool:
    return path.is_file() and path.suffix == ".json"


class ConfigOnlyReader(CheckpointReader):
    format_name = "hf"

    def __init__(self, path: Path):
        from reshard.converters import family_for_hf

        self.path = Path(path)
        self.hf_config = read_json(self.path)
        if not isinstance(self.hf_config, dict):
            raise ReshardError(f"{self.path} is not an HF config.json (not a JSON object)")
        family = family_for_hf(self.hf_config)
        try:
            config, extras = family.config_from_hf(self.hf_config)
        except KeyError as exc:
            raise ReshardError(f"{self.path} lacks {exc.args[0]!r}, which a {family.model_type} config needs") from None
        quantization = self.hf_config.get("quantization_config")
        # MXFP4 (reshard.mxfp4) is read dequantized: its bytes are counted unquantized, in the config's dtype
        block = fp8_blocks.block_size(quantization) if quantization and not mxfp4.is_config(quantization) else None
        self.layout, self.manifest, self.config = Layout(), None, config
        self.mappings = mappings = {m.megatron: m for m in family.mappings(config)}
        quantized = {name for name in mappings if block and FP8_LINEAR.match(name)}
        self.specs = {
            name: describe(name, shape, "float32" if name in quantized else config.params_dtype, config)
            for name, shape in model_tensors(config).items()
        }
        self.default_dtype = "bfloat16" if quantized else None  # as HFReader: an fp8 model converts to bf16
        # the bytes an HF directory of these weights holds: float8 values and their scales, the rest as config.json says
        self.stored_bytes, self.hf_tensor_count = 0, 0
        for name, spec, _, _, shape in hf_tensors(self.specs, mappings, config):
            numel = math.prod(shape)
            if name in quantized:
                self.stored_bytes += numel + 4 * math.prod(fp8_blocks.scale_shape(shape, block))
            else:
                self.stored_bytes += numel * itemsize(spec.dtype)
            self.hf_tensor_count += 1
        self.common = CommonState(args={**config.megatron_args(), **extras}, iteration="release", extra={"checkpoint_version": 3.0})

    def read_into(self, name: str, region: Region, out: np.ndarray) -> None:
        raise ReshardError(f"{self.path} is a config.json without weights: only --dry-run can plan from it")
