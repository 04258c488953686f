// Gated DeltaNet's prologue for a prompt chunk, in one dispatch: the causal
// depthwise convolution + SiLU over the projections' qkv, then the q/k L2 norm
// with the readout scale:
//
//   x[t, c] = sum_j w[c, j] in[t + j, c]       (in = [conv_state; qkv], K taps)
//   a[t, c] = silu(x[t, c])
//   q, k    = scale * a / sqrt(mean(a^2) + eps') per head; v = a
//
// Launcher: mlx_lily/kernels/conv.py. One SIMD group per (batch, token, head
// row): head rows 0..2Hk-1 are the q then k heads, 2Hk.. the v heads, in the
// channel order of qkv. Lane l takes channels l + 32 i of its head, so every
// read of a tap row and every write is one coalesced run; a q/k head's sum of
// squares is one simd_sum. No threadgroup memory, no barriers; SIMD groups past
// the last row (the last threadgroup's spare ones) load and store nothing.
//
// Rounding, where MLX's ops round (as gated_delta_decode.metal): the
// convolution's fp32 sum to InT; SiLU as x * sigmoid(x), the sigmoid and the
// product each rounded to InT; rms_norm's x * rsqrt(...) to InT, then the
// scale (rounded to InT) times it, to InT.
//
// Template: InT (bfloat16 or float16), Dk, Dv (multiples of 32, <= 256), Hk, Hv, CONV_K.
// Inputs:   qkv [B, T, C] (C = 2 Hk Dk + Hv Dv); conv_state [B, CONV_K - 1, C];
//           conv_weight [C, CONV_K, 1] (all row-contiguous); scalars fp32 [3]:
//           the norm's eps (added to the mean), q's and k's scales.
// Outputs:  q, k [B, T, Hk, Dk]; v [B, T, Hv, Dv] (InT).
// Grid:     (32 * ceil(B * T * (2 Hk + Hv) / NSG) * NSG, 1, 1), threadgroup (32 * NSG, 1, 1).

constexpr uint SIMD_WIDTH = 32;
constexpr uint KEY_DIM = Hk * Dk;
constexpr uint CONV_DIM = 2 * KEY_DIM + Hv * Dv;
constexpr uint HEAD_ROWS = 2 * Hk + Hv;
constexpr uint PER_LANE = (Dk > Dv ? Dk : Dv) / SIMD_WIDTH;
constexpr int HISTORY = CONV_K - 1;

const uint lane = thread_index_in_simdgroup;
const uint group = thread_position_in_grid.x / SIMD_WIDTH;
const uint B = uint(qkv_shape[0]);
const uint T = uint(qkv_shape[1]);
const bool active = group < B * T * HEAD_ROWS;
const uint head_row = group % HEAD_ROWS;
const uint bt = group / HEAD_ROWS;
const uint b = bt / T;
const uint t = bt - b * T;
const bool is_v = head_row >= 2 * Hk;
const uint D = is_v ? Dv : Dk;
// q heads, then k heads, then v heads: each head's channels are contiguous.
const uint c0 = is_v ? 2 * KEY_DIM + (head_row - 2 * Hk) * Dv : head_row * Dk;

float acts[PER_LANE];
float squares = 0.0f;
for (uint i = 0; i < PER_LANE; ++i) {
  const uint d = lane + i * SIMD_WIDTH;
  acts[i] = 0.0f;
  if (active && d < D) {
    const uint c = c0 + d;
    float acc = 0.0f;
    for (int j = 0; j < CONV_K; ++j) {
      // Tap j reads input row t + j of [conv_state; qkv].
      const int row = int(t) + j - HISTORY;
      float x = row >= 0 ? static_cast<float>(qkv[(b * T + uint(row)) * CONV_DIM + c])
                         : static_cast<float>(conv_state[(b * HISTORY + uint(HISTORY + row)) * CONV_DIM + c]);
      acc += x * static_cast<float>(conv_weight[c * CONV_K + j]);
    }
    // silu(x) = x * sigmoid(x), each step rounded to InT as MLX's ops round it.
    float x = static_cast<float>(static_cast<InT>(acc));
    float exp_x = static_cast<float>(static_cast<InT>(metal::precise::exp(metal::abs(x))));
    float sigmoid_neg = 1.0f / (1.0f + exp_x);
    float sig = static_cast<float>(static_cast<InT>(x < 0.0f ? sigmoid_neg : 1.0f - sigmoid_neg));
    acts[i] = static_cast<float>(static_cast<InT>(x * sig));
    squares += acts[i] * acts[i];
  }
}

if (is_v) {
  const uint at = ((b * T + t) * Hv + (head_row - 2 * Hk)) * Dv;
  for (uint i = 0; i < PER_LANE; ++i) {
    const uint d = lane + i * SIMD_WIDTH;
    if (active && d < Dv) {
      v[at + d] = static_cast<InT>(acts[i]);
    }
  }
} else {
  const bool is_q = head_row < Hk;
  const float inv_rms = metal::precise::rsqrt(simd_sum(squares) / float(Dk) + scalars[0]);
  const float scale = static_cast<float>(static_cast<InT>(is_q ? scalars[1] : scalars[2]));
  const uint at = ((b * T + t) * Hk + (is_q ? head_row : head_row - Hk)) * Dk;
  for (uint i = 0; i < PER_LANE; ++i) {
    const uint d = lane + i * SIMD_WIDTH;
    if (active && d < Dk) {
      float normed = static_cast<float>(static_cast<InT>(acts[i] * inv_rms));
      InT out = static_cast<InT>(normed * scale);
      if (is_q) {
        q[at + d] = out;
      } else {
        k[at + d] = out;
      }
    }
  }
}
