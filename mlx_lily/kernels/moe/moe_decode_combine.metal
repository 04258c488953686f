// MoE decode, launch 4 of 4: per row b and output element d, the weighted
// terms launch 3 left at the row's slots, summed in the row's own slot order
// (as moe_combine sums them), the gated shared term and the residual:
//
//   out[b, d] = bf16(h[b, d] + bf16(bf16(sum_j terms[b, j, d]) + terms[b, K, d]))
//
// the slot sum in fp32, then the MoE output and the residual sum rounded as
// stock's `h + (y + shared)`. Each thread's sequence of operations is fixed
// by row b's own inputs: the same bits whatever B is.
//
// RESIDUAL false (a tensor-parallel rank's partial sum, summed across ranks
// before the residual is added): out[b, d] is the rounded MoE output itself,
// bf16(bf16(sum_j terms[b, j, d]) + terms[b, K, d]), the same operations in
// the same order, and h is not read. So, element by element,
// out(RESIDUAL) == bf16(h + out(!RESIDUAL)) to the bit.
//
// "bf16" here stands for T, the activations' dtype (bfloat16 or float16).
//
// Launcher: mlx_lily/kernels/moe/decode.py.
// Template: T, K (top k), D (hidden size), RESIDUAL (bool).
// Inputs:   h [B, 1, D] bf16; terms [B, K + 1, D] bf16 (launch 3).
// Output:   out [B, 1, D] bf16.
// Grid:     (ceil(D / THREADS) * THREADS, B, 1), threadgroup (THREADS, 1, 1).

const uint d = thread_position_in_grid.x;
const uint b = thread_position_in_grid.y;

if (d < uint(D)) {
  const uint t_row = b * (uint(K) + 1u) * uint(D) + d;
  float routed = 0.0f;
  for (uint j = 0; j < uint(K); ++j) {
    routed += static_cast<float>(terms[t_row + j * uint(D)]);
  }
  const float moe = static_cast<float>(static_cast<T>(
      static_cast<float>(static_cast<T>(routed)) + static_cast<float>(terms[t_row + uint(K) * uint(D)])));
  if (RESIDUAL) {
    out[b * uint(D) + d] = static_cast<T>(static_cast<float>(h[b * uint(D) + d]) + moe);
  } else {
    out[b * uint(D) + d] = static_cast<T>(moe);
  }
}
