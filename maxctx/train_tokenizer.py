"""Trains a SentencePiece tokenizer on local text, for data.tokenizer.

  python -m maxctx.train_tokenizer --vocab-size 8192 --output tok.model 'corpus/**/*.txt'
  python -m maxctx.train_tokenizer --vocab-size 512 --output tok.model --stdlib      # the demo's corpus
  python -m maxctx.train_tokenizer --vocab-size 32000 --output tok.model --jsonl-field text data/*.jsonl

Text is kept as it is (whitespace, newlines and tabs survive a round trip), which suits code as well as prose.
Files are read whole, one document each; --max-sentences samples ~2 KB chunks for large corpora.
"""

from __future__ import annotations

import json
import logging
import sys

from maxctx.data import sources, tokenizers
from maxctx.errors import ArgumentParser, exit_code

log = logging.getLogger("maxctx.data")


def texts(files: list[str], jsonl_field: str | None):
  for path in files:
    if jsonl_field is None:
      yield sources.read_text(path)
      continue
    with open(path, encoding="utf-8", errors="replace") as f:
      for line in f:
        if line.strip():
          value = json.loads(line).get(jsonl_field)
          if isinstance(value, str):
            yield value


def main(argv: list[str] | None = None) -> int:
  ap = ArgumentParser(prog="python -m maxctx.train_tokenizer", description=__doc__.splitlines()[0])
  ap.add_argument("paths", nargs="*", help="files, directories or glob patterns (quote them)")
  ap.add_argument("--stdlib", action="store_true", help="train on the Python standard library's .py files")
  ap.add_argument("--vocab-size", type=int, required=True, help="must not exceed model.vocab_size")
  ap.add_argument("--output", required=True, help="the .model file to write")
  ap.add_argument("--model-type", default="bpe", choices=["bpe", "unigram"])
  ap.add_argument("--jsonl-field", help="read JSON Lines files and train on this field")
  ap.add_argument("--max-sentences", type=int, default=0, help="sample this many ~2 KB chunks; 0 = all")
  args = ap.parse_args(argv)
  if args.stdlib == bool(args.paths):
    ap.error("give input paths or --stdlib (one of the two)")
  logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s", datefmt="%H:%M:%S", force=True)

  def body():
    files = [str(f) for f in sources.stdlib_files()] if args.stdlib else sources.expand(",".join(args.paths))
    log.info("training on %d files", len(files))
    out = tokenizers.train_sentencepiece(texts(files, args.jsonl_field), args.output, args.vocab_size,
                                         model_type=args.model_type, max_sentences=args.max_sentences)
    tok = tokenizers.load(str(out))
    print(f"wrote {out}: {tok.vocab_size} tokens, BOS {tok.bos_id}, EOS {tok.eos_id}")

  return exit_code(body)


if __name__ == "__main__":
  sys.exit(main())
