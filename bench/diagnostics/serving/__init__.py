"""Serving diagnostics: how mlx_lm.server with lily takes requests."""
