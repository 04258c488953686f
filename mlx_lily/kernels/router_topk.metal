// MoE router top-k: softmax over all E experts of a row of logits, in fp32,
// then the K experts ranked as stock mlx-lm ranks them: by the probability
// rounded to T (stock takes the top k of the softmax in the activation dtype),
// the higher expert index first among equal rounded probabilities (the order
// of MLX's CPU argpartition). Their rounded probabilities are the weights,
// renormalised to sum 1 (in T's rounding, as stock) when NORMALIZE is set.
//
// A row whose softmax is NaN (NaN or infinite logits) still yields K distinct
// experts in [0, E): NaN probabilities rank below every number, so such a
// row's picks are its highest indices; their weights are NaN, as stock's.
//
// Launcher: mlx_lily/kernels/router.py. One SIMD group (32 lanes) per row.
// Lane l holds experts l, l + 32, l + 64, ... in registers (VALS of them), so
// the loads of a row are coalesced and the softmax needs one simd_max and one
// simd_sum. Each of the K rounds is a SIMD argmax: the largest rank, then the
// largest expert index holding it.
//
// Template: T (logits and weights dtype), E (experts), K (experts per token),
//           VALS (= ceil(E / 32)), NORMALIZE (bool).
// Inputs:   logits [N, E]
// Outputs:  indices [N, K] uint32, weights [N, K] T, both by descending rank.

constexpr uint SIMD_WIDTH = 32;
// Ranks: a probability's rounded value (>= 0); below them NaN's rank, then
// TAKEN, which marks experts already picked and the padding slots of lanes
// past E, so that neither is picked again.
constexpr float NAN_RANK = -0.5f;
constexpr float TAKEN = -1.0f;

uint lane = thread_index_in_simdgroup;
uint row = thread_position_in_grid.x / SIMD_WIDTH;
uint n_rows = logits_shape[0];

// Lanes of a row past the end (CUDA runs the whole last block) still take part
// in every SIMD collective below; they read row 0 and write nothing.
bool live = row < n_rows;
uint src = live ? row * E : 0;

// Softmax in fp32: the row max, then exp and the row sum.
float rank[VALS];
float row_max = -INFINITY;
for (int j = 0; j < VALS; ++j) {
  uint e = j * SIMD_WIDTH + lane;
  rank[j] = e < E ? static_cast<float>(logits[src + e]) : -INFINITY;
  row_max = max(row_max, rank[j]);
}
row_max = simd_max(row_max);

float row_sum = 0.0f;
for (int j = 0; j < VALS; ++j) {
  uint e = j * SIMD_WIDTH + lane;
  rank[j] = e < E ? metal::exp(rank[j] - row_max) : 0.0f;
  row_sum += rank[j];
}
row_sum = simd_sum(row_sum);

// Rank = the probability rounded to T; a NaN fails the comparison and takes
// NAN_RANK, so every rank below is an ordered number.
for (int j = 0; j < VALS; ++j) {
  uint e = j * SIMD_WIDTH + lane;
  float p = static_cast<float>(static_cast<T>(rank[j] / row_sum));
  rank[j] = e < E ? (p >= 0.0f ? p : NAN_RANK) : TAKEN;
}

// K rounds of SIMD argmax. Lane r keeps the r-th pick, so that the K results
// leave in one coalesced store.
uint my_index = 0;
float my_weight = 0.0f;
for (int r = 0; r < K; ++r) {
  // This lane's best; >= keeps its highest expert among equal ranks. A lane
  // may end on a TAKEN slot; K <= E leaves a better one in some lane.
  float best = -INFINITY;
  uint best_expert = 0;
  for (int j = 0; j < VALS; ++j) {
    if (rank[j] >= best) {
      best = rank[j];
      best_expert = j * SIMD_WIDTH + lane;
    }
  }
  float top = simd_max(best);
  uint pick = simd_max(best == top ? best_expert : 0u);
  // Retire the pick. The loop compares instead of indexing rank[pick / 32] so
  // that rank stays in registers.
  for (int j = 0; j < VALS; ++j) {
    if (j * SIMD_WIDTH + lane == pick) {
      rank[j] = TAKEN;
    }
  }
  if (lane == uint(r)) {
    my_index = pick;
    my_weight = top >= 0.0f ? top : NAN;
  }
}

// The weights are the rounded probabilities, summed and divided in T's
// rounding as stock mlx-lm does, so that they are stock's to the bit whenever
// the chosen experts are.
float kept = simd_sum(lane < K ? my_weight : 0.0f);
if (NORMALIZE) {
  my_weight = my_weight / static_cast<float>(static_cast<T>(kept));
}
if (live && lane < K) {
  indices[row * K + lane] = my_index;
  weights[row * K + lane] = static_cast<T>(my_weight);
}
