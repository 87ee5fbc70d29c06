"""maxctx: train Llama-3.1-style decoders on millions of tokens per sequence with JAX context parallelism.

Every command is `python -m maxctx.<command>` (train, eval, compile, plan, bench, convert, launch, train_tokenizer).
Importing the package loads nothing else: no JAX, no submodule.
"""


def __getattr__(name: str) -> str:
  # The version is pyproject.toml's, read from the installed metadata when first asked for, so `import maxctx` stays
  # free of importlib.metadata's own imports.
  if name == "__version__":
    from importlib import metadata
    try:
      return metadata.version("maxctx")
    except metadata.PackageNotFoundError:   # a checkout on PYTHONPATH that was never installed
      return "0+unknown"
  raise AttributeError(f"module 'maxctx' has no attribute {name!r}")
