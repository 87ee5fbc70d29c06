"""The Llama 3.1 decoder (transformer.py), its exact RoPE (rope.py) and chunked loss (loss.py)."""

from maxctx.model.transformer import GROUPED_REMATS, Transformer, head, logits, token_loss

__all__ = ["GROUPED_REMATS", "Transformer", "head", "logits", "token_loss"]
