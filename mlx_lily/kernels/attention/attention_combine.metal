// Decode attention, second pass of the split: merge the NB key blocks'
// partial outputs of each query head by their log2-sum-exp2 weights.
//
// Launcher: mlx_lily/kernels/attention/sdpa.py. One threadgroup per query head,
// one thread per dim; every thread reads the head's NB weights (the same
// addresses: broadcast loads) and its column of the partial outputs.
//
// Blocks that saw no key (lse -inf: past a bounded length, or past a batch
// row's own blocks) are skipped, not weighed by 0, so a row's result is the
// same arithmetic on its own blocks however many the grid had; a row with
// one block takes that block's output as it is (the one-block decode's bits).
//
// GATED: the layer's output gate applied as the output is written, as
// attention_decode.metal applies it without the split (the output rounded to
// T, times sigmoid(gate) computed in T as the GEMV's gate prologue computed
// it, rounded again).
//
// Template: T (the output's dtype: bfloat16 or float16), D (head dim), GATED
//           (bool).
// Inputs:   part_o [H, NB, D] float (each block's normalised output),
//           part_lse [H, NB] float (each block's log2 of its sum of exp2);
//           H = B * Hq (the batch's query heads, row-major); gate [B, 1, Hq,
//           D] T (strided; read with GATED, left out of other launches).
// Outputs:  out [H, D] T.
// Grid: (D, H, 1), threadgroup (D, 1, 1).

const int head = int(threadgroup_position_in_grid.y);
const int d = int(thread_position_in_threadgroup.x);
const int n_blocks = int(part_lse_shape[1]);

// The grid is exactly D threads wide; the guard keeps a wider launch safe.
if (d < D) {
  float top = -INFINITY;
  int seen = 0;
  int only = 0;
  for (int b = 0; b < n_blocks; ++b) {
    const float lse = part_lse[head * n_blocks + b];
    top = max(top, lse);
    if (lse != -INFINITY) {
      seen += 1;
      only = b;
    }
  }
  float weight_sum = 0.0f;
  float total = 0.0f;
  for (int b = 0; b < n_blocks; ++b) {
    const float lse = part_lse[head * n_blocks + b];
    if (lse != -INFINITY) {
      const float w = exp2(lse - top);
      weight_sum += w;
      total = fma(w, part_o[(head * n_blocks + b) * D + d], total);
    }
  }
  const T o = static_cast<T>(seen == 1 ? part_o[(head * n_blocks + only) * D + d] : total / weight_sum);
  if (GATED) {
    const int heads = int(gate_shape[2]);  // Hq: head is row * Hq + its head in the row
    const int row = head / heads;
    const float gx = static_cast<float>(gate[int64_t(row) * gate_strides[0] + int64_t(head - row * heads) * gate_strides[2] +
                                             int64_t(d) * gate_strides[3]]);
    const float gate_exp = static_cast<float>(static_cast<T>(metal::precise::exp(metal::abs(gx))));
    const float sigmoid_neg = 1.0f / (1.0f + gate_exp);
    const float sig = static_cast<float>(static_cast<T>(gx < 0.0f ? sigmoid_neg : 1.0f - sigmoid_neg));
    out[head * D + d] = static_cast<T>(static_cast<float>(o) * sig);
  } else {
    out[head * D + d] = o;
  }
}
