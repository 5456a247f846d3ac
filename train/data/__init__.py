"""What every input pipeline shares.

files       data files read as UTF-8 text, one line naming a file that is not
stream      EpochStream (a resumable batch stream), epoch plans, host rows, tfds import
tokenizer   the sentencepiece vocabulary: train, load, copy, decode
"""
