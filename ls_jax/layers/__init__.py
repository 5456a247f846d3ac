"""ls_jax.layers"""
