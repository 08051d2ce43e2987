"""Measure a corpus's token counts offline, so that a training job never waits for them.

    python scripts/prepare_data.py --job.config_file train_configs/X.toml \\
        [--training.* ... as the job will run] [--num-proc N] [--pretokenize OUT]

Takes the job's own config (the dataset, tokenizer, streaming or map-style, bad-data
policy and ``training.length_index_dir``: the counts depend on them) and measures every
unit no process measured yet, in N processes (0: every core), into the folder the job
reads (torchtitan/data/prepare.py). Run it on as many CPU machines as you like with the
folder shared: they hand the units out among themselves, and with a job running alongside.

``--pretokenize OUT`` first tokenizes the (single) source into OUT
(scripts/pretokenize.py's format), then measures OUT: train with
``--training.dataset_path OUT``.

A job started without any of this works too: it measures the units as it reaches them.
"""

from __future__ import annotations

import argparse
import logging
import sys
from dataclasses import replace

from torchtitan.config import ConfigError, parse_args
from torchtitan.data.prepare import prepare
from torchtitan.data.sources import DataError
from torchtitan.data.tokenizer import TokenizerError, build_tokenizer


def main(argv=None) -> int:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--num-proc", type=int, default=0, help="processes (0: every core)")
    p.add_argument("--pretokenize", default="", help="tokenize the source into this folder first")
    args, rest = p.parse_known_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    try:
        cfg = parse_args(rest)
        tokenizer = build_tokenizer(cfg.model)
        training = cfg.training
        if args.pretokenize:
            training = _pretokenized(training, tokenizer, args.pretokenize, args.num_proc)
        done = prepare(training, tokenizer, args.num_proc)
    except (ConfigError, DataError, TokenizerError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    print(
        f"{done['units']:,} units, {done['missing']:,} without counts: {done['measured']:,} "
        f"measured here ({done['tokens']:,} tokens in {done['seconds']:.1f} s, "
        f"{done['tokens'] / max(done['seconds'], 1e-9):,.0f} tokens/s)"
    )
    return 0


def _pretokenized(training, tokenizer, output: str, workers: int):
    from torchtitan.data.plan import list_sources
    from torchtitan.data.pretokenized_write import pretokenize

    specs = list_sources(training)
    if len(specs) != 1:
        raise DataError(
            f"--pretokenize takes one source, the config has {len(specs)}; pretokenize each "
            "with scripts/pretokenize.py"
        )
    pretokenize(specs[0], tokenizer, output, text_field=training.text_field,
                id_field=training.id_field, workers=workers)  # fmt: skip
    return replace(training, dataset_path=output, datasets=[], dataset="")


if __name__ == "__main__":
    sys.exit(main())
