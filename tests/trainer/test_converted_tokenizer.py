"""A run resumed from a checkpoint that `reshard convert` wrote tokenizes as the run that saved it: the
tokenizer.json the trainer keeps beside its iterations goes with the conversion. Without it the resumed
run trains a tokenizer on the corpus, whose token ids differ from a tokenizer the first run was given."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from fixtures.corpus import write_corpus
from fixtures.torchrun import REPO
from reshard.trainer.data import read_documents, train_tokenizer
from tests.launch import run

pytestmark = pytest.mark.slow  # every test trains with the trainer (Megatron-Core)


def _vocab(path) -> dict[str, int]:
    return json.loads(path.read_text())["model"]["vocab"]


def test_a_converted_checkpoint_resumes_with_the_tokenizer_it_was_trained_with(tmp_path):
    corpus = write_corpus(tmp_path / "corpus.txt", docs=100, seed=0)
    given = tmp_path / "given.json"
    train_tokenizer(read_documents(corpus), 256).save(str(given))
    saved = json.loads(given.read_text())
    vocab = saved["model"]["vocab"]
    vocab["the"], vocab["."] = vocab["."], vocab["the"]  # the ids of a tokenizer trained on the corpus, two swapped
    given.write_text(json.dumps(saved))
    common = ["--data", corpus, "--seq-length", 16, "--micro-batch-size", 2, "--global-batch-size", 4, "--lr", 3e-3,
              "--lr-warmup-iters", 1, "--seed", 7]
    run("reshard.trainer", [*common, "--tokenizer", given, "--train-iters", 2, "--save", tmp_path / "run"], nproc=1)
    proc = subprocess.run([sys.executable, "-m", "reshard", "convert", tmp_path / "run", tmp_path / "converted", "--to-format",
                           "zarr", "-q"], cwd=REPO, text=True, capture_output=True)
    assert proc.returncode == 0, proc.stderr
    proc = subprocess.run([sys.executable, "-m", "reshard", "convert", tmp_path / "converted", tmp_path / "back", "-q",
                           "--to-format", "torch_dist"], cwd=REPO, text=True, capture_output=True)
    assert proc.returncode == 0, proc.stderr
    run("reshard.trainer", [*common, "--train-iters", 3, "--load", tmp_path / "back", "--save", tmp_path / "resumed"], nproc=1)
    assert _vocab(tmp_path / "resumed" / "tokenizer.json") == vocab != train_tokenizer(read_documents(corpus), 256).get_vocab()
