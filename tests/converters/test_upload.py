"""`reshard upload` against a Hub-compatible server on 127.0.0.1, through huggingface_hub's real HfApi."""

from __future__ import annotations

import pytest
from click.testing import CliRunner

from reshard.cli import main
from reshard.convert import convert
from reshard.errors import ReshardError
from reshard.request import Target
from reshard.upload import upload

from hf_models import build
from hub_server import Hub


@pytest.fixture
def export(tmp_path):
    source = build("qwen2", tmp_path / "src")
    convert(source, tmp_path / "export", Target(format="hf"))
    return tmp_path / "export"


def test_upload_verifies_writes_card_and_commits(export, monkeypatch):
    with Hub() as hub:
        monkeypatch.setenv("HF_TOKEN", hub.token)
        result = CliRunner().invoke(main, ["upload", str(export), "user/tiny", "--private", "--revision", "v1", "--endpoint", hub.url],
                                    standalone_mode=False)
        assert result.exception is None, result.exception
        repo = hub.repos["user/tiny"]
        assert repo["private"]
        files = repo["branches"]["v1"]
        assert {"config.json", "model.safetensors", "reshard_manifest.json", "README.md", "tokenizer_config.json"} <= set(files)
        assert files["model.safetensors"] == (export / "model.safetensors").read_bytes()
        card = files["README.md"].decode()
        assert "source layout" in card and "Qwen2ForCausalLM" in card and "checksums" in card.lower()
        assert not (export / "README.md").exists()  # the card was written for the upload only
        # exist_ok: a second upload to the same repo works; another repo gets a card of its own
        upload(export, "user/tiny", endpoint=hub.url, token=hub.token)
        assert "model.safetensors" in hub.repos["user/tiny"]["branches"]["main"]
        upload(export, "user/other", endpoint=hub.url, token=hub.token)
        assert "# other\n" in hub.repos["user/other"]["branches"]["main"]["README.md"].decode()


def test_upload_refuses_a_corrupted_export(export):
    data = bytearray((export / "model.safetensors").read_bytes())
    data[-3] ^= 0x40  # one flipped bit in the last tensor
    (export / "model.safetensors").write_bytes(bytes(data))
    with Hub() as hub:
        with pytest.raises(ReshardError, match="refusing to upload"):
            upload(export, "user/bad", endpoint=hub.url, token=hub.token)
        assert not hub.repos


def test_upload_reports_bad_token(export):
    with Hub() as hub:
        with pytest.raises(ReshardError, match="token"):
            upload(export, "user/x", endpoint=hub.url, token="wrong")


def test_upload_needs_a_reshard_export(tmp_path):
    source = build("gpt2", tmp_path / "src")
    with pytest.raises(ReshardError, match="reshard_manifest"):
        upload(source, "user/x", endpoint="http://127.0.0.1:9", token="t")


@pytest.mark.parametrize("repo_id,endpoint,message", [
    ("not a repo/../x", "http://127.0.0.1:9", "is not a Hub repository id"),
    ("user/x", "http://127.0.0.1:9", "cannot reach the Hub at http://127.0.0.1:9"),
])
def test_upload_refuses_what_cannot_work_in_one_line(export, repo_id, endpoint, message):
    with pytest.raises(ReshardError, match=message):
        upload(export, repo_id, endpoint=endpoint, token="t")
    assert not (export / "README.md").exists()
