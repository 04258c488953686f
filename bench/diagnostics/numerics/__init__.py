"""Numerics diagnostics: which op is not deterministic, which kernel instance a
first-use check turned off and who was right, how far results lie from fp32."""
