// MoE routing on the GPU: the router's top-k expert ids of N tokens, turned
// into the row order and tile map of the grouped expert GEMMs, in one dispatch.
//
// Launcher: mlx_lily/kernels/moe_routing.py. Row i = token * K + slot of the
// N * K (token, slot) assignments goes to bucket e = indices[i] when e < E, and
// to bucket E ("invalid": an id from a NaN router row) otherwise, so that no id
// ever indexes past the expert weights. Within a bucket rows keep ascending i
// (by token, then slot): a stable counting sort, the same on every backend.
//
// Every threadgroup counts the whole histogram (threadgroup integer atomics:
// counts do not depend on the order of the additions) and scans it; then each
// SIMD group compacts one bucket's rows in ascending order with a SIMD prefix
// sum. Threadgroup 0 also writes the bucket offsets and the tile map.
//
// Template: E (experts), K (slots per token), TILE_M (rows per GEMM tile),
//           BUCKETS_PER_THREAD (= ceil((E + 1) / THREADS)).
// Inputs:   indices [N, K] uint32.
// Outputs:  order [N * K] uint32: the row i of each position, bucket by bucket;
//           offsets [E + 2] uint32: bucket b's rows are order[offsets[b] .. offsets[b + 1]);
//           tiles [MAX_TILES * 3] uint32: tile t is (bucket, first row, end row) of
//           order, at most TILE_M rows of one bucket; tiles past the last real one
//           are (NO_BUCKET, 0, 0). MAX_TILES = ceil(N * K / TILE_M) + E + 1.

constexpr uint SIMD_WIDTH = 32;
constexpr uint THREADS = 256;
constexpr uint SIMDS = THREADS / SIMD_WIDTH;
constexpr uint INVALID_BUCKET = E;
constexpr uint BUCKETS = E + 1;
constexpr uint NO_BUCKET = 0xFFFFFFFFu;

threadgroup atomic_uint counts[BUCKETS];
threadgroup uint row_start[BUCKETS + 1];
threadgroup uint tile_start[BUCKETS + 1];
threadgroup uint group_rows[SIMDS];
threadgroup uint group_tiles[SIMDS];

uint tid = thread_index_in_threadgroup;
uint lane = thread_index_in_simdgroup;
uint sg = simdgroup_index_in_threadgroup;
uint rows = indices_shape[0] * K;

// Histogram.
for (uint b = tid; b < BUCKETS; b += THREADS) {
  atomic_store_explicit(&counts[b], 0u, memory_order_relaxed);
}
threadgroup_barrier(mem_flags::mem_threadgroup);
for (uint i = tid; i < rows; i += THREADS) {
  uint e = indices[i];
  atomic_fetch_add_explicit(&counts[e < E ? e : INVALID_BUCKET], 1u, memory_order_relaxed);
}
threadgroup_barrier(mem_flags::mem_threadgroup);

// Exclusive scans of rows and of tiles per bucket. Thread t owns buckets
// [t * BUCKETS_PER_THREAD, (t + 1) * BUCKETS_PER_THREAD).
uint first_bucket = tid * BUCKETS_PER_THREAD;
uint my_rows = 0;
uint my_tiles = 0;
for (uint j = 0; j < BUCKETS_PER_THREAD; ++j) {
  uint b = first_bucket + j;
  uint c = b < BUCKETS ? atomic_load_explicit(&counts[b], memory_order_relaxed) : 0u;
  my_rows += c;
  my_tiles += (c + TILE_M - 1) / TILE_M;
}
uint rows_before = simd_prefix_exclusive_sum(my_rows);
uint tiles_before = simd_prefix_exclusive_sum(my_tiles);
if (lane == SIMD_WIDTH - 1) {
  group_rows[sg] = rows_before + my_rows;
  group_tiles[sg] = tiles_before + my_tiles;
}
threadgroup_barrier(mem_flags::mem_threadgroup);
for (uint s = 0; s < sg; ++s) {
  rows_before += group_rows[s];
  tiles_before += group_tiles[s];
}
for (uint j = 0; j < BUCKETS_PER_THREAD; ++j) {
  uint b = first_bucket + j;
  if (b < BUCKETS) {
    uint c = atomic_load_explicit(&counts[b], memory_order_relaxed);
    row_start[b] = rows_before;
    tile_start[b] = tiles_before;
    rows_before += c;
    tiles_before += (c + TILE_M - 1) / TILE_M;
  }
}
// The last thread's running sums are the totals (it may own no bucket).
if (tid == THREADS - 1) {
  row_start[BUCKETS] = rows_before;
  tile_start[BUCKETS] = tiles_before;
}
threadgroup_barrier(mem_flags::mem_threadgroup);

if (threadgroup_position_in_grid.x == 0) {
  for (uint b = tid; b <= BUCKETS; b += THREADS) {
    offsets[b] = row_start[b];
  }
  uint max_tiles = (rows + TILE_M - 1) / TILE_M + BUCKETS;
  uint real_tiles = tile_start[BUCKETS];
  for (uint t = tid; t < max_tiles; t += THREADS) {
    uint bucket = NO_BUCKET;
    uint begin = 0;
    uint end = 0;
    if (t < real_tiles) {
      // The last bucket whose first tile is at or before t; empty buckets
      // share their successor's start, so it is the one that holds t.
      uint lo = 0;
      uint hi = BUCKETS;  // tile_start[lo] <= t < tile_start[hi]
      while (hi - lo > 1) {
        uint mid = (lo + hi) / 2;
        if (tile_start[mid] <= t) {
          lo = mid;
        } else {
          hi = mid;
        }
      }
      bucket = lo;
      begin = row_start[lo] + (t - tile_start[lo]) * TILE_M;
      end = min(begin + TILE_M, row_start[lo + 1]);
    }
    tiles[3 * t + 0] = bucket;
    tiles[3 * t + 1] = begin;
    tiles[3 * t + 2] = end;
  }
}

// Scatter: SIMD group s of threadgroup g compacts bucket g * SIMDS + s. All
// lanes run every round (the trip count is the same for the whole group).
uint bucket = threadgroup_position_in_grid.x * SIMDS + sg;
bool owns = bucket < BUCKETS;
uint dst = owns ? row_start[bucket] : 0u;
for (uint base = 0; base < rows; base += SIMD_WIDTH) {
  uint i = base + lane;
  uint e = i < rows ? indices[i] : 0u;
  uint b = e < E ? e : INVALID_BUCKET;
  bool hit = owns && i < rows && b == bucket;
  if (simd_any(hit)) {
    uint rank = simd_prefix_exclusive_sum(hit ? 1u : 0u);
    if (hit) {
      order[dst + rank] = i;
    }
    dst += simd_sum(hit ? 1u : 0u);
  }
}
