// MoE router top-k over rows of logits: the top-k routine of
// router_topk.metal.h (the Kernel's header; see there for the ranking, ties,
// NaN rows and rounding) run by one SIMD group per row.
//
// The weights are the rounded probabilities, summed and divided in T's
// rounding as stock mlx-lm does, so that they are stock's to the bit whenever
// the chosen experts are.
//
// Launcher: mlx_lily/kernels/router.py. One SIMD group (32 lanes) per row.
//
// Template: T (logits and weights dtype), E (experts), K (experts per token),
//           VALS (= ceil(E / 32)), NORMALIZE (bool).
// Inputs:   logits [N, E]
// Outputs:  indices [N, K] uint32, weights [N, K] T, both by descending rank.

constexpr uint SIMD_WIDTH = 32;

uint lane = thread_index_in_simdgroup;
uint row = thread_position_in_grid.x / SIMD_WIDTH;
uint n_rows = logits_shape[0];

// Lanes of a row past the end (CUDA runs the whole last block) still take part
// in every SIMD collective; they read row 0 and write nothing.
bool live = row < n_rows;
uint src = live ? row * E : 0;

// Lane r keeps the r-th pick, so that the K results leave in one coalesced store.
uint my_index = 0;
float my_weight = 0.0f;
LILY_ROUTER_TOPK(T, E, K, VALS, NORMALIZE, logits, src, lane, my_index, my_weight);
if (live && lane < K) {
  indices[row * K + lane] = my_index;
  weights[row * K + lane] = static_cast<T>(my_weight);
}
