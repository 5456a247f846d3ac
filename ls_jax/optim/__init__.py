"""ls_jax.optim"""
