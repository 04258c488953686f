// Decode attention, second pass of the split: merge the NB key blocks'
// partial outputs of each query head by their log2-sum-exp2 weights.
//
// Launcher: mlx_lily/kernels/attention.py. One threadgroup per query head,
// one thread per dim; every thread reads the head's NB weights (the same
// addresses: broadcast loads) and its column of the partial outputs.
//
// Template: T (the output's dtype: bfloat16 or float16), D (head dim).
// Inputs:   part_o [Hq, NB, D] float (each block's normalised output),
//           part_lse [Hq, NB] float (each block's log2 of its sum of exp2).
// Outputs:  out [Hq, D] T.
// Grid: (D, Hq, 1), threadgroup (D, 1, 1).

const int head = int(threadgroup_position_in_grid.y);
const int d = int(thread_position_in_threadgroup.x);
const int n_blocks = int(part_lse_shape[1]);

// The grid is exactly D threads wide; the guard keeps a wider launch safe.
if (d < D) {
  float top = -INFINITY;
  for (int b = 0; b < n_blocks; ++b) {
    top = max(top, part_lse[head * n_blocks + b]);
  }
  float weight_sum = 0.0f;
  float total = 0.0f;
  for (int b = 0; b < n_blocks; ++b) {
    const float w = exp2(part_lse[head * n_blocks + b] - top);
    weight_sum += w;
    total = fma(w, part_o[(head * n_blocks + b) * D + d], total);
  }
  out[head * D + d] = static_cast<T>(total / weight_sum);
}
