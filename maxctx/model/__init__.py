"""The Llama 3.1 decoder (transformer.py), its exact RoPE (rope.py) and chunked loss (loss.py)."""

from maxctx.model.transformer import Transformer

__all__ = ["Transformer"]
