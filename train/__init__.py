"""Training entry points: wmt, imdb, bench, compare."""
