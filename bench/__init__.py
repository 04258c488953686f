"""mlx-lily's A/B benchmark: lily vs stock mlx-lm on the same weights.

Run it from the repository root: ``python -m bench --help``. See README.md
in this folder for the method and how to read the output.
"""

# Before any bench tool touches the GPU: importing lily sets MLX's graph byte
# bound on CUDA (mlx_lily/graph_commits.py), which MLX reads at its first GPU
# use; every engine and diagnostic then runs under the same setting.
import mlx_lily  # noqa: E402,F401
