// Full attention's prologue in one dispatch: q and k RMSNorm with their
// weights, then RoPE on the first DIMS values of every head row, written in
// [B, H, L, D] layout:
//
//   n      = OutT(OutT(w) * OutT(x * rsqrt(mean(x^2) + eps)))   (mx.fast.rms_norm)
//   theta  = (scale * (offset + l)) * exp2(-(i / (DIMS / 2)) * log2(base))
//   x1, x2 = the pair of rotation i (i and i + DIMS/2, or 2i and 2i + 1
//            when TRADITIONAL)
//   out    = x1 cos - x2 sin,  x1 sin + x2 cos   (fp32, one rounding to OutT)
//
// and the values from DIMS on passed through as normed. The frequencies,
// angles and products follow MLX's own rope kernels (mx.fast.rope with a base,
// rope.metal / rope.cu); cos and sin are the backend's default ones, as there.
//
// Launcher: mlx_lily/kernels/qk_norm_rope.py. One SIMD group per (batch,
// token, head) row: rows [0, B Hq L) are q's, then k's, each numbered
// (b * H + h) * L + l, which is also the row's place in its output. Lane
// `lane` owns the values lane + 32 j. The sum of squares meets in simd_sum;
// for a rotated value the lane normalises its partner itself (read again from
// the input, a hit in cache), so nothing is exchanged between lanes after the
// norm. Inputs are read through their strides (q is a view: half of each head
// of the q projection's output).
//
// Template: InT (q, k), WT (the norm weights), OutT (rms_norm's output dtype:
//           InT promoted with WT), D (head dim, a multiple of 32, <= 256),
//           DIMS (rotated values, even, <= D), HQ, HKV (heads), TRADITIONAL.
// Inputs:   q [B, L, HQ, D], k [B, L, HKV, D] (any strides); q_weight,
//           k_weight [D] (any stride); offsets int32 [1] or [B] (any stride);
//           scalars fp32 [3]: eps, rope scale, log2(base).
// Outputs:  q_out [B, HQ, L, D] OutT, k_out [B, HKV, L, D] OutT.
// Grid:     (32 * rows rounded up to whole threadgroups, 1, 1).

constexpr uint SIMD_WIDTH = 32;
constexpr int PER_LANE = D / 32;
constexpr int HALF = DIMS / 2;

uint lane = thread_index_in_simdgroup;
uint row = thread_position_in_grid.x / SIMD_WIDTH;
int B = q_shape[0];
int L = q_shape[1];
uint q_rows = uint(B) * uint(HQ) * uint(L);
uint rows = q_rows + uint(B) * uint(HKV) * uint(L);
bool active = row < rows;
bool is_q = row < q_rows;
uint r = is_q ? row : row - q_rows;
uint heads = is_q ? uint(HQ) : uint(HKV);
// Past the last row the lanes work on row 0 of k, and store nothing.
r = active ? r : 0u;
uint l = r % uint(L);
uint h = (r / uint(L)) % heads;
uint b = r / (uint(L) * heads);

int64_t base_at = 0;
if (is_q) {
  base_at = int64_t(b) * q_strides[0] + int64_t(l) * q_strides[1] + int64_t(h) * q_strides[2];
} else {
  base_at = int64_t(b) * k_strides[0] + int64_t(l) * k_strides[1] + int64_t(h) * k_strides[2];
}
int64_t step = is_q ? q_strides[3] : k_strides[3];

float x[PER_LANE];
float squares = 0.0f;
for (int j = 0; j < PER_LANE; ++j) {
  int64_t at = base_at + int64_t(lane + j * SIMD_WIDTH) * step;
  x[j] = is_q ? static_cast<float>(q[at]) : static_cast<float>(k[at]);
  squares += x[j] * x[j];
}
squares = simd_sum(squares);

float eps = scalars[0];
float scale = scalars[1];
float log2_base = scalars[2];
float inv_rms = metal::precise::rsqrt(squares / float(D) + eps);

int offset = offsets[(offsets_shape[0] == 1 ? 0 : int64_t(b)) * offsets_strides[0]];
float position = scale * static_cast<float>(offset + int(l));

if (active) {
  for (int j = 0; j < PER_LANE; ++j) {
    int i = int(lane) + j * int(SIMD_WIDTH);
    float w = is_q ? static_cast<float>(static_cast<OutT>(q_weight[int64_t(i) * q_weight_strides[0]]))
                   : static_cast<float>(static_cast<OutT>(k_weight[int64_t(i) * k_weight_strides[0]]));
    float n = static_cast<float>(static_cast<OutT>(w * static_cast<float>(static_cast<OutT>(x[j] * inv_rms))));
    float value = n;
    if (i < DIMS) {
      // This value's rotation (freq), its partner's index, and whether it is
      // the pair's first value.
      int freq = TRADITIONAL ? i / 2 : i % HALF;
      bool first = TRADITIONAL ? (i % 2 == 0) : (i < HALF);
      int partner = TRADITIONAL ? (first ? i + 1 : i - 1) : (first ? i + HALF : i - HALF);
      float xp = is_q ? static_cast<float>(q[base_at + int64_t(partner) * step])
                      : static_cast<float>(k[base_at + int64_t(partner) * step]);
      float wp = is_q ? static_cast<float>(static_cast<OutT>(q_weight[int64_t(partner) * q_weight_strides[0]]))
                      : static_cast<float>(static_cast<OutT>(k_weight[int64_t(partner) * k_weight_strides[0]]));
      float np = static_cast<float>(static_cast<OutT>(wp * static_cast<float>(static_cast<OutT>(xp * inv_rms))));
      float d = static_cast<float>(freq) / static_cast<float>(HALF);
      float inv_freq = exp2(-d * log2_base);
      float theta = position * inv_freq;
      float costheta = cos(theta);
      float sintheta = sin(theta);
      float x1 = first ? n : np;
      float x2 = first ? np : n;
      value = first ? x1 * costheta - x2 * sintheta : x1 * sintheta + x2 * costheta;
    }
    uint out_at = r * uint(D) + uint(i);
    if (is_q) {
      q_out[out_at] = static_cast<OutT>(value);
    } else {
      k_out[out_at] = static_cast<OutT>(value);
    }
  }
}
