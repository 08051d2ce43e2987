"""Train the bundled SentencePiece BPE tokenizer on the bundled corpus.

This script owns the tokenizer's training recipe: which text it sees (every
line of every document in data/corpus/, read through Hugging Face `datasets`),
the SentencePiece options, and the check that every corpus document survives
decode(encode(x)) == x byte for byte. It must never write a model that fails
that check.

    python scripts/train_tokenizer.py
    python scripts/train_tokenizer.py --vocab_size 8192 --output /tmp/tok.model
"""

from __future__ import annotations

import argparse
import io
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import datasets
import sentencepiece as spm

from torchtitan import REPO_ROOT

DEFAULT_CORPUS = REPO_ROOT / "data" / "corpus"
DEFAULT_OUTPUT = REPO_ROOT / "data" / "tokenizer" / "tokenizer.model"

# Lossless by construction: no normalization, no dummy prefix, no whitespace
# folding; "\n" is a fixed piece because training sentences are single lines
# (so BPE never sees it); anything unseen falls back to its UTF-8 bytes.
TRAINER_OPTIONS = dict(
    model_type="bpe",
    byte_fallback=True,
    character_coverage=1.0,
    normalization_rule_name="identity",
    add_dummy_prefix=False,
    remove_extra_whitespaces=False,
    allow_whitespace_only_pieces=True,
    split_digits=True,
    user_defined_symbols=["\n"],
    unk_id=0,
    bos_id=1,
    eos_id=2,
    pad_id=3,
    # Verses and prose paragraphs can be long lines; the default (4192 bytes)
    # would silently drop them from training.
    max_sentence_length=1 << 16,
    input_sentence_size=0,
    shuffle_input_sentence=False,
)


def load_corpus(corpus: Path) -> datasets.Dataset:
    """All documents of the parquet shards under `corpus`, in sorted file order."""
    files = sorted(str(path) for path in corpus.glob("*/*.parquet"))
    if not files:
        sys.exit(f"error: no parquet shards under {corpus}; run python scripts/build_corpus.py")
    return datasets.load_dataset("parquet", data_files=files, split="train")


def training_lines(texts: list[str]) -> Iterator[str]:
    """Every non-empty line of every document, in corpus order."""
    for text in texts:
        for line in text.split("\n"):
            if line:
                yield line


def train(texts: list[str], vocab_size: int, num_threads: int) -> bytes:
    """The serialized model trained on `texts`."""
    model = io.BytesIO()
    spm.SentencePieceTrainer.train(
        sentence_iterator=training_lines(texts),
        model_writer=model,
        vocab_size=vocab_size,
        num_threads=num_threads,
        minloglevel=2,
        **TRAINER_OPTIONS,
    )
    return model.getvalue()


def check_round_trip(model: bytes, texts: list[str]) -> int:
    """Total tokens over `texts`; exits naming the first document that does not round-trip."""
    sp = spm.SentencePieceProcessor(model_proto=model)
    ids = sp.encode(texts)
    for text, decoded in zip(texts, sp.decode(ids)):
        if decoded != text:
            sys.exit(f"error: decode(encode(x)) != x for the document starting {text[:80]!r}")
    return sum(map(len, ids))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--corpus", type=Path, default=DEFAULT_CORPUS)
    parser.add_argument("--vocab_size", type=int, default=4096)
    parser.add_argument("--output", type=Path, default=DEFAULT_OUTPUT)
    # The thread count is recorded in the model's trainer spec, so the file
    # is byte-identical only across runs with the same --num_threads.
    parser.add_argument("--num_threads", type=int, default=1)
    args = parser.parse_args()

    texts = list(load_corpus(args.corpus)["text"])
    start = time.perf_counter()
    model = train(texts, args.vocab_size, args.num_threads)
    seconds = time.perf_counter() - start
    tokens = check_round_trip(model, texts)
    args.output.parent.mkdir(parents=True, exist_ok=True)
    args.output.write_bytes(model)
    print(
        f"wrote {args.output} ({len(model)} bytes) in {seconds:.1f}s: {len(texts)} documents "
        f"round-trip exactly, {tokens} tokens, {tokens / len(texts):.1f} tokens/document, "
        f"{sum(len(t.encode()) for t in texts) / tokens:.2f} bytes/token"
    )


if __name__ == "__main__":
    main()
