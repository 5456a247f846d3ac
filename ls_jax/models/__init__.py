"""ls_jax.models"""
