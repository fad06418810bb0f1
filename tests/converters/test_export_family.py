"""Which HF family a Megatron model is exported as, and what a refusal tells the user to do about it."""

from __future__ import annotations

import pytest
import torch

from fixtures.models import TINY_LLAMA, TINY_MOE
from fixtures.synthetic import write_synthetic
from reshard.converters import family_by_name
from reshard.errors import ReshardError
from reshard.layout import Layout
from tests.cli import refused_cli, run_cli


@pytest.mark.parametrize("config, recorded, differs, fits", [
    (TINY_LLAMA, "qwen2", "add_qkv_bias=False where HF qwen2 needs True", "llama"),
    (TINY_LLAMA, "qwen3", "qk_layernorm=False where HF qwen3 needs True", "llama"),
    (TINY_LLAMA, "mixtral", "moe=False where HF mixtral needs True", "llama"),
    (TINY_MOE, "llama", "moe=True where HF llama needs False", "mixtral"),
])
def test_args_naming_a_family_the_model_does_not_fit_are_refused_and_the_advice_works(
        tmp_path, monkeypatch, capsys, config, recorded, differs, fits):
    """The refusal names the arg and says what to do; doing it (deleting hf_model_type from common.pt's args, as
    a user would with torch) exports the model as the family that fits."""
    source = tmp_path / "src"
    write_synthetic(source, config, Layout(), "torch_dist", args={"hf_model_type": recorded})
    refused_cli(monkeypatch, capsys, ["convert", source, tmp_path / "out", "--to-format", "hf", "-q"],
                f"imported from HF {recorded} (hf_model_type)", differs, "keep it in a Megatron format",
                f"delete hf_model_type from its args to export it as HF {fits}", untouched=(source,))
    assert not (tmp_path / "out").exists()

    common = next(source.glob("iter_*/common.pt"))
    state = torch.load(common, weights_only=False)
    del state["args"].hf_model_type
    torch.save(state, common)
    code, lines = run_cli(monkeypatch, capsys, "convert", source, tmp_path / "out", "--to-format", "hf", "-q")
    assert code == 0, lines
    assert f'"model_type": "{fits}"' in (tmp_path / "out" / "config.json").read_text()


def test_a_family_asked_for_a_model_it_cannot_hold_names_those_that_can():
    with pytest.raises(ReshardError, match="add_qkv_bias=False where HF qwen2 needs True: it is not a qwen2 model; "
                                           "it fits HF llama and mistral$"):
        family_by_name("qwen2").check_megatron(TINY_LLAMA)
    with pytest.raises(ReshardError, match="it fits HF mixtral$"):
        family_by_name("qwen3_moe").check_megatron(TINY_MOE)
