"""Cloud TPU VM launcher."""
