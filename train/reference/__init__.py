"""The plain Flax baselines: models written as a JAX user (and Hugging Face's Flax models) write them, with no
ls_jax code, the same architectures and FLOPs as ls_jax's models.

  transformer   the WMT encoder-decoder Transformer
  zoo           BERT and GPT-2
"""
