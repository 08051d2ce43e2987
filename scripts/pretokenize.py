"""Tokenize a source once into a pretokenized folder that training reads without tokenizing.

    python scripts/pretokenize.py --source data/corpus/shakespeare \\
        --tokenizer data/tokenizer/tokenizer.model --output /data/shakespeare_tok [--workers N]
    python train.py ... --training.dataset_path /data/shakespeare_tok

--source is what training takes: a registry name, a Hub dataset id (owner/name, with
--config/--split), or a local file, folder or glob (a Hub-style or save_to_disk folder
with --config/--split). The output (parquet token shards and manifest.json, see
torchtitan/data/pretokenized_write.py) is the same whatever --workers is, and training on it
yields the same batches as training on the source with the same tokenizer.
"""

from __future__ import annotations

import argparse
import sys
import time

from torchtitan.data.pretokenized_write import pretokenize
from torchtitan.data.sources import DataError, resolve_any
from torchtitan.data.tokenizer import Tokenizer, TokenizerError


def main(argv=None) -> int:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--source", required=True, help="registry name, Hub id or local path")
    p.add_argument("--config", default="", help="config of a Hub dataset or Hub-style folder")
    p.add_argument("--split", default="train", help="split of a Hub or save_to_disk dataset")
    p.add_argument("--text-field", default="text", help="column holding the text")
    p.add_argument("--id-field", default="id", help="column holding the document id")
    p.add_argument("--tokenizer", required=True, help="SentencePiece .model or tokenizer.json")
    p.add_argument("--bos-token", default="", help="as model.bos_token in training")
    p.add_argument("--eos-token", default="", help="as model.eos_token in training")
    p.add_argument("--output", required=True, help="new or empty folder")
    p.add_argument("--workers", type=int, default=0, help="processes (0: every core)")
    args = p.parse_args(argv)
    start = time.perf_counter()
    try:
        tokenizer = Tokenizer(args.tokenizer, bos_token=args.bos_token, eos_token=args.eos_token)
        spec = resolve_any(args.source, args.config, args.split)
        manifest = pretokenize(spec, tokenizer, args.output, text_field=args.text_field,
                               id_field=args.id_field, workers=args.workers)  # fmt: skip
    except (DataError, TokenizerError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    seconds = time.perf_counter() - start
    unusable = sum(manifest["unusable_documents"].values())
    print(
        f"{manifest['documents']:,} documents ({unusable} unusable, stored as null), "
        f"{manifest['tokens']:,} tokens in {len(manifest['files'])} file(s) -> {args.output} "
        f"({seconds:.1f} s, {manifest['tokens'] / seconds:,.0f} tokens/s)"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
