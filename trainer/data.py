"""Text data: tokenize a corpus, pack it into fixed-length samples, serve global batches in a seeded order.

* Corpus: a `.txt` file (one document per non-empty line) or `.jsonl` (field "text").
* Tokenizer: a `tokenizers` JSON file, or, when none is given, a word-level vocabulary built from the
  corpus deterministically (words ranked by count, then alphabetically) and saved as `tokenizer.json`.
* Packing: documents are joined with an end-of-document token into one stream; sample i is
  tokens[i*S : i*S + S + 1] (S = seq_length; inputs are the first S, labels the last S), as Megatron's
  GPTDataset does without document masking.
* Order: epoch e visits the samples in the permutation `default_rng([seed, e]).permutation(n)`; the
  global sample stream is these permutations one after another.
* Position: global batch i is stream samples [i*G, (i+1)*G) (G = global batch size); DP rank r of D
  takes the contiguous slice [r*G/D, (r+1)*G/D) of it, cut into micro-batches in order. The checkpoint
  records `consumed_samples`, so a resumed run at any DP size sees exactly the samples of the
  uninterrupted run.
"""

from __future__ import annotations

import hashlib
import json
from collections import Counter
from pathlib import Path

import numpy as np
import torch

from reshard.paths import confined

UNK, EOD = "[UNK]", "[EOD]"


def read_documents(path: Path) -> list[str]:
    path = Path(path)
    lines = path.read_text(encoding="utf-8").splitlines()
    if path.suffix == ".jsonl":
        docs = [json.loads(line)["text"] for line in lines if line.strip()]
    else:
        docs = [line for line in lines if line.strip()]
    if not docs:
        raise ValueError(f"{path} holds no documents")
    return docs


def _pre_tokenizer():
    from tokenizers import normalizers, pre_tokenizers

    return normalizers.Lowercase(), pre_tokenizers.Whitespace()


def train_tokenizer(docs: list[str], vocab_size: int):
    """A word-level `tokenizers.Tokenizer` over the corpus's `vocab_size - 2` most frequent words
    (ties broken alphabetically, so it is deterministic), plus [UNK] and [EOD]."""
    from tokenizers import Tokenizer
    from tokenizers.models import WordLevel

    normalizer, pre = _pre_tokenizer()
    counts: Counter[str] = Counter()
    for doc in docs:
        counts.update(word for word, _ in pre.pre_tokenize_str(normalizer.normalize_str(doc)))
    words = sorted(counts, key=lambda w: (-counts[w], w))[: max(0, vocab_size - 2)]
    vocab = {UNK: 0, EOD: 1, **{w: i + 2 for i, w in enumerate(words)}}
    tokenizer = Tokenizer(WordLevel(vocab, unk_token=UNK))
    tokenizer.normalizer = normalizer
    tokenizer.pre_tokenizer = pre
    return tokenizer


def load_tokenizer(path: Path):
    from tokenizers import Tokenizer

    return Tokenizer.from_file(str(path))


def eod_id(tokenizer) -> int:
    for name in (EOD, "</s>", "<|endoftext|>", "<eos>", "[SEP]"):
        token = tokenizer.token_to_id(name)
        if token is not None:
            return token
    raise ValueError("the tokenizer has no end-of-document token ([EOD], </s>, <|endoftext|>, <eos>)")


def tokenize(docs: list[str], tokenizer) -> np.ndarray:
    """One int32 token stream: every document followed by the end-of-document token."""
    eod = eod_id(tokenizer)
    parts = []
    for enc in tokenizer.encode_batch(docs, add_special_tokens=False):
        parts.append(np.asarray(enc.ids, dtype=np.int32))
        parts.append(np.asarray([eod], dtype=np.int32))
    return np.concatenate(parts)


class PackedDataset:
    """Fixed-length samples of seq_length + 1 tokens cut from one token stream."""

    def __init__(self, tokens: np.ndarray, seq_length: int):
        self.tokens = np.asarray(tokens, dtype=np.int32)
        self.seq_length = seq_length
        self.num_samples = (len(self.tokens) - 1) // seq_length
        if self.num_samples < 1:
            raise ValueError(f"the corpus has {len(self.tokens)} tokens, fewer than one sample of {seq_length + 1}")

    def __len__(self) -> int:
        return self.num_samples

    def __getitem__(self, i: int) -> np.ndarray:
        s = self.seq_length
        return self.tokens[i * s : i * s + s + 1]

    def fingerprint(self) -> str:
        h = hashlib.sha256(self.tokens.tobytes())
        h.update(str(self.seq_length).encode())
        return h.hexdigest()[:16]


class SampleOrder:
    """Global sample index -> dataset index: one seeded permutation per epoch."""

    def __init__(self, num_samples: int, seed: int):
        self.num_samples, self.seed = num_samples, seed
        self._perms: dict[int, np.ndarray] = {}

    def _perm(self, epoch: int) -> np.ndarray:
        if epoch not in self._perms:
            self._perms[epoch] = np.random.default_rng([self.seed, epoch]).permutation(self.num_samples)
        return self._perms[epoch]

    def __getitem__(self, g: int) -> int:
        epoch, pos = divmod(g, self.num_samples)
        return int(self._perm(epoch)[pos])


class BatchSource:
    """The micro-batches of one data-parallel rank, by position in the global sample stream."""

    def __init__(self, dataset: PackedDataset, seed: int, global_batch_size: int, micro_batch_size: int,
                 dp_rank: int, dp_size: int):
        if global_batch_size % (micro_batch_size * dp_size):
            raise ValueError(f"global batch {global_batch_size} is not a multiple of micro batch "
                             f"{micro_batch_size} x data-parallel size {dp_size}")
        self.dataset, self.order = dataset, SampleOrder(len(dataset), seed)
        self.gbs, self.mbs, self.dp_rank, self.dp_size = global_batch_size, micro_batch_size, dp_rank, dp_size
        self.num_microbatches = global_batch_size // (micro_batch_size * dp_size)

    def global_batch_indices(self, consumed_samples: int) -> list[int]:
        """Dataset indices of the global batch starting at `consumed_samples` (all DP ranks)."""
        return [self.order[g] for g in range(consumed_samples, consumed_samples + self.gbs)]

    def microbatches(self, consumed_samples: int) -> list[torch.Tensor]:
        """This rank's micro-batches (int64 [mbs, S+1] each) of the global batch at `consumed_samples`."""
        per_rank = self.gbs // self.dp_size
        start = consumed_samples + self.dp_rank * per_rank
        idx = [self.order[g] for g in range(start, start + per_rank)]
        rows = np.stack([self.dataset[i] for i in idx]).astype(np.int64)
        return [torch.from_numpy(rows[k : k + self.mbs]) for k in range(0, per_rank, self.mbs)]


def prepare(data: Path, seq_length: int, tokenizer_file: Path | None, vocab_size: int,
            search_dirs: list[Path]):
    """(tokenizer, dataset, tokenizer_path_or_None): a given tokenizer file, else a `tokenizer.json` found
    in `search_dirs` (the run's --load / --save directories, where a link may not lead outside: `confined`),
    else one trained on the corpus."""
    docs = read_documents(data)
    source = None
    if tokenizer_file is not None:
        source = Path(tokenizer_file)
    else:
        found = next((Path(d) for d in search_dirs if d and (Path(d) / "tokenizer.json").is_file()), None)
        source = confined(found, "tokenizer.json") if found is not None else None
    tokenizer = load_tokenizer(source) if source is not None else train_tokenizer(docs, vocab_size)
    return tokenizer, PackedDataset(tokenize(docs, tokenizer), seq_length), source
