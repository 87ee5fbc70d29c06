"""Convert Llama checkpoints between Hugging Face and maxctx.

  python -m maxctx.convert import <hf_dir> <out_dir> [--unscanned]
  python -m maxctx.convert export <params_dir> <model.yml or run config> <hf_out_dir> [--dtype bfloat16]
                                  [section.key=value ...]
"""

from __future__ import annotations

import argparse
import sys

from maxctx import convert
from maxctx.errors import ArgumentParser, exit_code


def main(argv: list[str] | None = None) -> int:
  parser = ArgumentParser(prog="python -m maxctx.convert", description=__doc__.split("\n\n")[0],
                          formatter_class=argparse.RawDescriptionHelpFormatter,
                          epilog=__doc__.split("\n\n", 1)[1] + "\n" + convert.__doc__.split("\n\n", 1)[1])
  commands = parser.add_subparsers(dest="command", required=True)
  p = commands.add_parser("import", help="HF directory → Orbax params + model.yml")
  p.add_argument("hf_dir")
  p.add_argument("out_dir")
  p.add_argument("--unscanned", action="store_true", help="one subtree per layer, for model.scan_layers=false")
  p = commands.add_parser("export", help="Orbax params + config → HF directory")
  p.add_argument("params_dir")
  p.add_argument("config", help="model.yml from import, or the run's config file")
  p.add_argument("hf_out_dir")
  p.add_argument("overrides", nargs="*", help="section.key=value, as for maxctx.train")
  p.add_argument("--dtype", choices=("float32", "bfloat16"), help="cast the tensors (default: keep the params' dtype)")
  args = parser.parse_args(argv)

  def body():
    if args.command == "import":
      path = convert.import_hf(args.hf_dir, args.out_dir, scan_layers=not args.unscanned)
      print(f"wrote {path} and {path.parent / 'model.yml'}")
    else:
      path = convert.export_hf(args.params_dir, args.config, args.hf_out_dir, args.overrides, args.dtype)
      print(f"wrote {path}")

  return exit_code(body)


if __name__ == "__main__":
  sys.exit(main())
