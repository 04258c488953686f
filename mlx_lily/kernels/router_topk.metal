// MoE router top-k: softmax over all E experts of a row of logits, in fp32,
// then the K most probable experts (ties go to the lower expert index), their
// probabilities rounded to T and renormalised to sum 1 when NORMALIZE is set.
//
// Launcher: mlx_lily/kernels/router.py. One SIMD group (32 lanes) per row.
// Lane l holds experts l, l + 32, l + 64, ... in registers (VALS of them), so
// the loads of a row are coalesced and the softmax needs one simd_max and one
// simd_sum. Each of the K rounds is a SIMD argmax: the largest probability,
// then the smallest expert index holding it.
//
// Template: T (logits and weights dtype), E (experts), K (experts per token),
//           VALS (= ceil(E / 32)), NORMALIZE (bool).
// Inputs:   logits [N, E]
// Outputs:  indices [N, K] uint32, weights [N, K] T, both by descending probability.

constexpr uint SIMD_WIDTH = 32;
// Below every probability: marks experts already picked, and the padding slots
// of lanes past E, so that neither is picked again.
constexpr float TAKEN = -1.0f;
constexpr uint NO_EXPERT = 0xFFFFFFFFu;

uint lane = thread_index_in_simdgroup;
uint row = thread_position_in_grid.x / SIMD_WIDTH;
uint n_rows = logits_shape[0];

// Lanes of a row past the end (CUDA runs the whole last block) still take part
// in every SIMD collective below; they read row 0 and write nothing.
bool live = row < n_rows;
uint src = live ? row * E : 0;

// Softmax in fp32: the row max, then exp and the row sum.
float prob[VALS];
float row_max = -INFINITY;
for (int j = 0; j < VALS; ++j) {
  uint e = j * SIMD_WIDTH + lane;
  prob[j] = e < E ? static_cast<float>(logits[src + e]) : -INFINITY;
  row_max = max(row_max, prob[j]);
}
row_max = simd_max(row_max);

float row_sum = 0.0f;
for (int j = 0; j < VALS; ++j) {
  uint e = j * SIMD_WIDTH + lane;
  prob[j] = e < E ? metal::exp(prob[j] - row_max) : 0.0f;
  row_sum += prob[j];
}
row_sum = simd_sum(row_sum);

for (int j = 0; j < VALS; ++j) {
  uint e = j * SIMD_WIDTH + lane;
  prob[j] = e < E ? prob[j] / row_sum : TAKEN;
}

// K rounds of SIMD argmax. Lane r keeps the r-th pick, so that the K results
// leave in one coalesced store.
uint my_index = 0;
float my_weight = 0.0f;
for (int r = 0; r < K; ++r) {
  // This lane's best; the strict > keeps its lowest expert among equals.
  float best = TAKEN;
  uint best_expert = NO_EXPERT;
  for (int j = 0; j < VALS; ++j) {
    if (prob[j] > best) {
      best = prob[j];
      best_expert = j * SIMD_WIDTH + lane;
    }
  }
  float top = simd_max(best);
  uint pick = simd_min(best == top ? best_expert : NO_EXPERT);
  // Retire the pick. The loop compares instead of indexing prob[pick / 32] so
  // that prob stays in registers.
  for (int j = 0; j < VALS; ++j) {
    if (j * SIMD_WIDTH + lane == pick) {
      prob[j] = TAKEN;
    }
  }
  if (lane == uint(r)) {
    my_index = pick;
    my_weight = top;
  }
}

// Round as stock mlx-lm does (its softmax output is in T, and it sums and
// divides in T), so that the weights are stock's to the bit whenever the
// chosen experts are.
my_weight = static_cast<float>(static_cast<T>(my_weight));
float kept = simd_sum(lane < K ? my_weight : 0.0f);
if (NORMALIZE) {
  my_weight = my_weight / static_cast<float>(static_cast<T>(kept));
}
if (live && lane < K) {
  indices[row * K + lane] = my_index;
  weights[row * K + lane] = static_cast<T>(my_weight);
}
