"""Prefill diagnostics: a prompt chunk's kernels (Gated DeltaNet, MoE) and memory."""
