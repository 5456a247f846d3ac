"""What every input pipeline shares.

  stream      EpochStream (a resumable batch stream), epoch plans, host rows, tfds import
  tokenizer   the sentencepiece vocabulary: train, load, copy, decode
"""
