"""``python -m train.gpt``, causal language modelling: GPT-2 on text (local files, tfds, or the embedded synthetic
corpus).

task        one run's setup (`TASK`, run by `train.harness.training`)
config      the flags as one typed configuration, with their defaults
data        reading and batching the data
model       the model, its loss and FLOP count
synthetic   the embedded task a first run trains on, offline
samples     the texts the model generates at the end of a run
"""
