// MoE combine: out = sum over the K slots of score * y + sigmoid(gate) * shared,
// per token, the slots summed in slot order (deterministic: no atomics).
//
// Launcher: mlx_lily/kernels/moe.py. One thread per output element. Rounds as
// mlx-lm's Qwen3NextSparseMoeBlock does in T: each score * y product, the
// slot sum (accumulated in fp32), sigmoid(gate), its product with the shared
// expert's output, and the final sum.
//
// Template: T (activation dtype), K (slots), D (hidden size).
// Inputs:   y [N, K, D], scores [N, K], shared [N, D], gate [N] (the shared
//           expert gate's logit).
// Output:   out [N, D].

uint i = thread_position_in_grid.x;
uint n_tokens = shared_shape[0];
if (i < n_tokens * D) {
  uint token = i / D;
  uint d = i % D;
  float routed = 0.0f;
  for (uint s = 0; s < K; ++s) {
    float weighted = static_cast<float>(y[(token * K + s) * D + d]) *
                     static_cast<float>(scores[token * K + s]);
    routed += static_cast<float>(static_cast<T>(weighted));
  }
  float g = static_cast<float>(gate[token]);
  float open = static_cast<float>(static_cast<T>(1.0f / (1.0f + metal::exp(-g))));
  float gated = static_cast<float>(static_cast<T>(open * static_cast<float>(shared[i])));
  out[i] = static_cast<T>(static_cast<float>(static_cast<T>(routed)) + gated);
}
