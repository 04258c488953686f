"""Model classes lily specializes, by mlx-lm model_type."""

SPECIALIZED = {"qwen3_5_moe": "mlx_lily.models.qwen3_5_moe"}
