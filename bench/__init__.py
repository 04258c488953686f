"""mlx-lily's A/B benchmark: lily vs stock mlx-lm on the same weights.

Run it from the repository root: ``python -m bench --help``. See README.md
in this folder for the method and how to read the output.
"""
