"""The data pipeline: tokenizer, packing, sample order and data position (unit tests, no torchrun)."""

from __future__ import annotations

import numpy as np
import pytest

from fixtures.corpus import documents, write_corpus
from reshard.trainer.data import (
    BatchSource,
    PackedDataset,
    SampleOrder,
    eod_id,
    load_tokenizer,
    prepare,
    read_documents,
    tokenize,
    train_tokenizer,
)


@pytest.fixture(scope="module")
def docs():
    return documents(200, seed=3)


def test_corpus_is_deterministic(tmp_path):
    a, b = write_corpus(tmp_path / "a.txt", 50, seed=1), write_corpus(tmp_path / "b.txt", 50, seed=1)
    assert a.read_bytes() == b.read_bytes()
    assert write_corpus(tmp_path / "c.txt", 50, seed=2).read_bytes() != a.read_bytes()
    j = write_corpus(tmp_path / "a.jsonl", 50, seed=1)
    assert read_documents(j) == read_documents(a) == documents(50, seed=1)


def test_tokenizer_is_deterministic_and_round_trips(docs, tmp_path):
    t1, t2 = train_tokenizer(docs, 250), train_tokenizer(list(docs), 250)
    assert t1.get_vocab() == t2.get_vocab()
    assert t1.get_vocab_size() <= 250 and eod_id(t1) == 1
    t1.save(str(tmp_path / "tokenizer.json"))
    again = load_tokenizer(tmp_path / "tokenizer.json")
    assert np.array_equal(tokenize(docs, again), tokenize(docs, t1))
    small = train_tokenizer(docs, 10)
    assert small.get_vocab_size() == 10
    assert small.token_to_id("[UNK]") in tokenize(docs, small)  # rare words fall back to [UNK]


def test_packing():
    tokens = np.arange(100, dtype=np.int32)
    ds = PackedDataset(tokens, seq_length=8)
    assert len(ds) == 12  # (100 - 1) // 8
    for i in range(len(ds)):
        assert list(ds[i]) == list(range(8 * i, 8 * i + 9))  # inputs + one shifted label
    assert ds[1][0] == ds[0][-1]
    with pytest.raises(ValueError):
        PackedDataset(np.arange(5), seq_length=8)
    assert PackedDataset(tokens, 8).fingerprint() == ds.fingerprint() != PackedDataset(tokens, 9).fingerprint()


def test_documents_are_separated_by_eod(docs):
    tok = train_tokenizer(docs, 250)
    stream = tokenize(docs[:3], tok)
    assert (stream == eod_id(tok)).sum() == 3 and stream[-1] == eod_id(tok)


def test_order_is_a_permutation_per_epoch():
    order = SampleOrder(37, seed=5)
    epoch0 = [order[g] for g in range(37)]
    epoch1 = [order[g] for g in range(37, 74)]
    assert sorted(epoch0) == sorted(epoch1) == list(range(37))
    assert epoch0 != epoch1 and epoch0 != list(range(37))
    assert [SampleOrder(37, seed=5)[g] for g in range(74)] == epoch0 + epoch1
    assert [SampleOrder(37, seed=6)[g] for g in range(37)] != epoch0


@pytest.mark.parametrize("dp", [1, 2, 4])
def test_dp_ranks_split_each_global_batch(dp):
    ds = PackedDataset(np.arange(1000, dtype=np.int32), seq_length=4)
    gbs, mbs = 8, 2
    for consumed in (0, 8, 240, 248):  # 248 crosses into the second epoch (249 samples)
        expected = [ds[i] for i in BatchSource(ds, 1, gbs, mbs, 0, 1).global_batch_indices(consumed)]
        got = []
        for rank in range(dp):
            source = BatchSource(ds, 1, gbs, mbs, rank, dp)
            micro = source.microbatches(consumed)
            assert len(micro) == source.num_microbatches == gbs // (mbs * dp)
            assert all(m.shape == (mbs, 5) for m in micro)
            got += [row.numpy() for m in micro for row in m]
        assert [list(r) for r in got] == [list(r) for r in expected]


def test_resumed_position_matches_uninterrupted_stream():
    """Global batch i is samples [i*G, (i+1)*G) of the stream, whatever DP size reads it."""
    ds = PackedDataset(np.arange(3000, dtype=np.int32), seq_length=8)
    one = BatchSource(ds, 9, 8, 2, 0, 1)
    stream = [one.order[g] for g in range(8 * 50)]
    for i in (0, 7, 49):
        assert one.global_batch_indices(i * 8) == stream[i * 8 : (i + 1) * 8]
    with pytest.raises(ValueError):
        BatchSource(ds, 9, 6, 2, 0, 4)  # 6 is not a multiple of 2 x 4


def test_prepare_prefers_given_then_saved_tokenizer(tmp_path, docs):
    corpus = write_corpus(tmp_path / "corpus.jsonl", 100)
    tok, ds, source = prepare(corpus, 16, None, 250, [None, tmp_path / "nowhere"])
    assert source is None and len(ds) > 10
    small = train_tokenizer(docs, 20)
    (tmp_path / "save").mkdir()
    small.save(str(tmp_path / "save" / "tokenizer.json"))
    tok2, ds2, source2 = prepare(corpus, 16, None, 250, [None, tmp_path / "save"])
    assert source2 == tmp_path / "save" / "tokenizer.json" and tok2.get_vocab_size() == 20
    assert ds2.fingerprint() != ds.fingerprint()
