"""torchtitan/data/packing.py: a document becomes the tokens of tokenizing it whole; a
long one may be tokenized line by line only where the tokenizer proves that gives the
same tokens."""

from __future__ import annotations

from helpers import bundled_documents

from torchtitan.data import packing
from torchtitan.data.tokenizer import Tokenizer

LONG_TEXT = ("  Leading spaces,\ttabs \u2028 and\r\nCRLF;\n\n\n" * 4000) + "no final newline"


def test_long_documents_tokenize_as_one_string_would(tokenizer):

    assert len(LONG_TEXT) > packing.LONG_DOCUMENT_CHARS
    assert tokenizer.splits_at_newlines, "the bundled tokenizer takes the fast path"
    expected = tokenizer.encode(LONG_TEXT, bos=True, eos=True)
    assert packing.encode_document(tokenizer, LONG_TEXT).tolist() == expected


def test_a_dummy_prefix_tokenizer_never_takes_the_line_by_line_path(tmp_path):
    """A Llama-2-style SentencePiece model (dummy prefix on) would tokenize each line as a
    new input; the tokenizer refuses the fast path and the tokens match the whole text.
    Negative control: forcing the fast path on this model changes the tokens."""
    import sentencepiece as spm

    text = "\n".join(d["text"] for d in bundled_documents("shakespeare", 40))
    spm.SentencePieceTrainer.train(
        sentence_iterator=iter(text.splitlines()), model_prefix=str(tmp_path / "llama2ish"),
        vocab_size=400, model_type="bpe", add_dummy_prefix=True, byte_fallback=True,
        bos_id=1, eos_id=2, unk_id=0, user_defined_symbols=["\n"], minloglevel=2,
    )  # fmt: skip
    tok = Tokenizer(tmp_path / "llama2ish.model")
    assert not tok.splits_at_newlines
    whole = tok.encode(LONG_TEXT, bos=True, eos=True)
    assert packing.encode_document(tok, LONG_TEXT).tolist() == whole
    tok.splits_at_newlines = True  # the old behaviour, for this model
    assert packing.encode_document(tok, LONG_TEXT).tolist() != whole
