"""``python -m train.wmt``, translation: the encoder-decoder Transformer on parallel text (WMT14, local files, or the
embedded synthetic task).

task        one run's setup (`TASK`, run by `train.harness.training`)
config      the flags as one typed configuration, with their defaults
data        reading and batching the data
model       the model, its loss and FLOP count
synthetic   the embedded task a first run trains on, offline
evaluate    the validation and test scores
"""
