"""Export a checkpoint's model as a Hugging Face ``LlamaForCausalLM`` folder.

    python scripts/export_hf.py --checkpoint outputs/debug/checkpoint/step-50 --output hf/ \\
        [--tokenizer data/tokenizer/tokenizer.model] [--flavor debugmodel]

The folder loads with ``transformers.AutoModelForCausalLM.from_pretrained(DIR)`` and
``AutoTokenizer.from_pretrained(DIR)``. See ``torchtitan/hf.py``. Needs safetensors
(``pip install -e ".[dev]"``). Exit status 1, with one error line, when it cannot export.
"""

import argparse
import sys

from torchtitan.hf import HFError, export


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--checkpoint", required=True, help="a finished step-N checkpoint folder")
    parser.add_argument("--output", required=True, help="the folder to write the model into")
    parser.add_argument(
        "--tokenizer",
        help="tokenizer.model or tokenizer.json (default: the run's, from its config)",
    )
    parser.add_argument("--flavor", help="model flavor (default: the one the checkpoint records)")
    opts = parser.parse_args(argv)
    try:
        args = export(opts.checkpoint, opts.output, opts.tokenizer, opts.flavor)
    except HFError as e:
        print(f"export_hf: error: {e}", file=sys.stderr)
        return 1
    print(f"exported {opts.checkpoint} (flavor {args.flavor}) to {opts.output}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
