// Gated DeltaNet decode step (one token for each of B rows) in one dispatch,
// from the projections' outputs to the gated RMSNorm's:
//
//   conv  = silu(causal depthwise conv1d over [conv_state; qkv])   (K rows)
//   q, k  = L2-normalised q, k (readout scale folded into q), v = conv's v
//   g     = exp(-exp(A_log) * softplus(a + dt_bias)),  beta = sigmoid(b)
//   S     = g * S;  d = (v - S k) * beta;  S = S + d k^T;  y = S q
//   out   = rms_norm(y, norm_weight, eps) * silu(z)
//
// and the new conv state (the last K-1 rows of [conv_state; qkv]).
//
// Padding (mask false for a row): qkv enters the convolution as zeros and out
// is computed from the updated state, as stock's layer does; the row's conv
// state and recurrent state are written back exactly as they were.
//
// Launcher: mlx_lily/kernels/gated_delta/decode.py. One threadgroup per
// (value head, row), NSG SIMD groups; a row's threadgroups read only that
// row's inputs and do the same arithmetic whatever B is, so a row's bits do
// not depend on B, on its position or on the other rows. The threadgroup first computes its channels of the
// convolution (its key head's q and k, its own v) into threadgroup memory;
// heads sharing a key head compute q and k again rather than synchronise
// (2 * Dk multiply-adds of K terms), and the first of them writes those
// channels' conv state. Each SIMD group then normalises q and k (again, no
// barrier: Dk / 32 squares a lane), and takes state rows dv = sg, sg + NSG,
// ...: lane l keeps S[dv, l + 32 i] in registers for the row, as in
// gated_delta.metal. The rows' y meet in threadgroup memory for the norm.
//
// Rounding: every step rounds where the reference's MLX ops round (InT after
// the convolution, after sigmoid and after SiLU's product; after rms_norm and
// the readout scale for q and k; the gates in SumT and BetaT as in
// gated_delta.metal; y in InT; rms_norm with the weight in NormT; the gated
// product in fp32, then InT). Sums are fp32, in another order than the
// reference's.
//
// Template: InT (bfloat16 or float16: qkv, z, conv state and weight, a, b, outputs),
//           SumT, BetaT (the gates' rounding, see gated_delta.metal), NormT
//           (rms_norm's output dtype: InT promoted with the norm weight's),
//           Dk (a multiple of 32, <= 256), Dv, Hk, Hv (a multiple of Hk),
//           CONV_K (the convolution's width, >= 2), NSG (SIMD groups),
//           HAS_STATE (false: the recurrent state starts at zero),
//           PAD_SHIFTS (a padding step's conv state: true shifts a zero row
//           in, as stock's cache without lengths; false keeps it, as stock's
//           cache with lengths keeps a row past its end), STEPS (1: B rows,
//           a step each; P > 1: the P rows are one stream's positions, with
//           conv_state [1, CONV_K - 1, C] and state_in [1, Hv, Dv, Dk], every
//           step real, grid (NSG * 32 * Hv, 1, 1); outputs per position).
// Inputs:   qkv [B, 1, C] (C = 2 Hk Dk + Hv Dv); z [B, 1, Hv, Dv];
//           a, b [B, 1, Hv]; conv_state [B, CONV_K - 1, C];
//           conv_weight [C, CONV_K, 1]; A_log, dt_bias [Hv];
//           state_in [B, Hv, Dv, Dk] fp32 (one element without HAS_STATE);
//           norm_weight [Dv]; scalars fp32 [4]: the L2 norm's rms eps, q's
//           and k's readout scales, the gated norm's eps; step_mask [B] bool
//           (false: a padding step; all true when the call has no mask).
// Outputs:  out [B, 1, Hv, Dv] InT; conv_state_out [B, CONV_K - 1, C] InT;
//           state_out [B, Hv, Dv, Dk] fp32.
// Grid:     (NSG * 32 * Hv, B, 1), threadgroup (NSG * 32, 1, 1).

constexpr uint SIMD_WIDTH = 32;
constexpr int KEYS_PER_LANE = Dk / 32;
constexpr uint VALUE_HEADS_PER_KEY_HEAD = Hv / Hk;
constexpr uint KEY_DIM = Hk * Dk;
constexpr uint CONV_DIM = 2 * KEY_DIM + Hv * Dv;
constexpr uint THREADS = NSG * SIMD_WIDTH;
constexpr uint HEAD_CHANNELS = 2 * Dk + Dv;

threadgroup float qk_act[2 * Dk];
threadgroup float v_act[Dv];
threadgroup float y_head[Dv];

uint tid = thread_index_in_threadgroup;
uint lane = thread_index_in_simdgroup;
uint sg = simdgroup_index_in_threadgroup;
uint head = threadgroup_position_in_grid.x;
uint key_head = head / VALUE_HEADS_PER_KEY_HEAD;
bool writes_qk_state = head % VALUE_HEADS_PER_KEY_HEAD == 0;

// STEPS > 1: the rows are one stream's consecutive positions (a speculative
// round's verification), taken in order by every threadgroup. Position p
// reads its conv window from the inputs (the conv state's rows, then the
// earlier positions' qkv), never from another threadgroup's outputs, and its
// recurrent state from the state this threadgroup wrote for p - 1 (each lane
// reads back the very elements it wrote). Each position does what a
// one-row call does with the outputs of the position before, so its outputs
// are the same bits as that call's.
for (uint step = 0; step < uint(STEPS); ++step) {
uint row = STEPS > 1 ? step : threadgroup_position_in_grid.y;
bool real_step = step_mask[row];
// This row's slices of the per-row inputs and outputs.
uint qkv_at = row * CONV_DIM;
uint conv_at = row * (CONV_K - 1) * CONV_DIM;
uint head_at = row * Hv + head;
uint row_state_at = row * Hv * Dv * Dk;
// Where this row's conv window and recurrent state come from: its own
// inputs, or (STEPS > 1) the stream's single conv state and state and the
// previous position's written state.
uint conv_in_at = STEPS > 1 ? 0u : conv_at;
uint state_in_at = STEPS > 1 ? 0u : row_state_at;

// -- convolution + SiLU, and the conv state's update ---------------------------
for (uint i = tid; i < HEAD_CHANNELS; i += THREADS) {
  bool is_qk = i < 2 * Dk;
  uint channel = 2 * KEY_DIM + head * Dv + (i - 2 * Dk);
  if (i < Dk) {
    channel = key_head * Dk + i;
  } else if (is_qk) {
    channel = KEY_DIM + key_head * Dk + (i - Dk);
  }
  bool writes_state = !is_qk || writes_qk_state;
  float acc = 0.0f;
  for (int j = 0; j < CONV_K - 1; ++j) {
    // Window row j: the conv state's row step + j, or past its rows the
    // qkv of position step + j - (CONV_K - 1) (STEPS > 1 only).
    const uint w = step + uint(j);
    const InT held = w < uint(CONV_K - 1) ? conv_state[conv_in_at + w * CONV_DIM + channel]
                                          : qkv[(w - uint(CONV_K - 1)) * CONV_DIM + channel];
    float x = static_cast<float>(held);
    acc += x * static_cast<float>(conv_weight[channel * CONV_K + j]);
    if (writes_state) {
      // A real step shifts the rows up by one; a padding step keeps them,
      // or shifts them too (PAD_SHIFTS).
      if (!real_step && !PAD_SHIFTS) {
        conv_state_out[conv_at + j * CONV_DIM + channel] = held;
      } else if (j > 0) {
        conv_state_out[conv_at + (j - 1) * CONV_DIM + channel] = held;
      }
    }
  }
  // A padding step's input enters the convolution as zero (stock's where).
  float x_new = real_step ? static_cast<float>(qkv[qkv_at + channel]) : 0.0f;
  acc += x_new * static_cast<float>(conv_weight[channel * CONV_K + CONV_K - 1]);
  if (writes_state && (real_step || PAD_SHIFTS)) {
    InT last_row = static_cast<InT>(0.0f);
    if (real_step) {
      last_row = qkv[qkv_at + channel];
    }
    conv_state_out[conv_at + (CONV_K - 2) * CONV_DIM + channel] = last_row;
  }
  // silu(x) = x * sigmoid(x), each rounded to InT as MLX's ops round it.
  float x = static_cast<float>(static_cast<InT>(acc));
  float exp_x = static_cast<float>(static_cast<InT>(metal::precise::exp(metal::abs(x))));
  float sigmoid_neg = 1.0f / (1.0f + exp_x);
  float sig = static_cast<float>(static_cast<InT>(x < 0.0f ? sigmoid_neg : 1.0f - sigmoid_neg));
  float act = static_cast<float>(static_cast<InT>(x * sig));
  if (is_qk) {
    qk_act[i] = act;
  } else {
    v_act[i - 2 * Dk] = act;
  }
}
threadgroup_barrier(mem_flags::mem_threadgroup);

// -- q, k L2 norm (every SIMD group for itself) -------------------------------
float l2_eps = scalars[0];
float q_scale = static_cast<float>(static_cast<InT>(scalars[1]));
float k_scale = static_cast<float>(static_cast<InT>(scalars[2]));
float norm_eps = scalars[3];

float q_lane[KEYS_PER_LANE];
float k_lane[KEYS_PER_LANE];
float q_squares = 0.0f;
float k_squares = 0.0f;
for (int i = 0; i < KEYS_PER_LANE; ++i) {
  q_lane[i] = qk_act[lane + i * SIMD_WIDTH];
  k_lane[i] = qk_act[Dk + lane + i * SIMD_WIDTH];
  q_squares += q_lane[i] * q_lane[i];
  k_squares += k_lane[i] * k_lane[i];
}
float q_inv_rms = metal::precise::rsqrt(simd_sum(q_squares) / float(Dk) + l2_eps);
float k_inv_rms = metal::precise::rsqrt(simd_sum(k_squares) / float(Dk) + l2_eps);
for (int i = 0; i < KEYS_PER_LANE; ++i) {
  float qn = static_cast<float>(static_cast<InT>(q_lane[i] * q_inv_rms));
  float kn = static_cast<float>(static_cast<InT>(k_lane[i] * k_inv_rms));
  q_lane[i] = static_cast<float>(static_cast<InT>(qn * q_scale));
  k_lane[i] = static_cast<float>(static_cast<InT>(kn * k_scale));
}

// -- gates (as gated_delta.metal computes and rounds them) --------------------
float decay_rate = metal::precise::exp(static_cast<float>(A_log[head]));
float gate_x = static_cast<float>(static_cast<SumT>(static_cast<float>(a[head_at]) + static_cast<float>(dt_bias[head])));
float gate_e = static_cast<float>(static_cast<SumT>(metal::precise::exp(-metal::abs(gate_x))));
float gate_w = 1.0f + gate_e;
float log1p_e = gate_w == 1.0f ? gate_e : metal::precise::log(gate_w) * (gate_e / (gate_w - 1.0f));
log1p_e = static_cast<float>(static_cast<SumT>(log1p_e));
float softplus = static_cast<float>(static_cast<SumT>(max(gate_x, 0.0f) + log1p_e));
float g = metal::precise::exp(-decay_rate * softplus);
float bx = static_cast<float>(b[head_at]);
float exp_b = static_cast<float>(static_cast<BetaT>(metal::precise::exp(metal::abs(bx))));
float beta_neg = 1.0f / (1.0f + exp_b);
float beta = static_cast<float>(static_cast<BetaT>(bx < 0.0f ? beta_neg : 1.0f - beta_neg));

// -- the recurrence, one state row per SIMD group at a time --------------------
for (uint dv = sg; dv < Dv; dv += NSG) {
  uint state_at = row_state_at + (head * Dv + dv) * Dk + lane;
  float S[KEYS_PER_LANE];
  float kv = 0.0f;
  for (int i = 0; i < KEYS_PER_LANE; ++i) {
    S[i] = 0.0f;
    if (step > 0) {
      S[i] = state_out[state_at - Hv * Dv * Dk + i * SIMD_WIDTH];
    } else if (HAS_STATE) {
      S[i] = state_in[state_in_at + (head * Dv + dv) * Dk + lane + i * SIMD_WIDTH];
    }
    S[i] = S[i] * g;
    kv += S[i] * k_lane[i];
  }
  kv = simd_sum(kv);
  float delta = (v_act[dv] - kv) * beta;
  float y = 0.0f;
  for (int i = 0; i < KEYS_PER_LANE; ++i) {
    S[i] = S[i] + k_lane[i] * delta;
    y += S[i] * q_lane[i];
    // A padding step keeps the state (y still reads the updated one, as stock's).
    float next = S[i];
    if (!real_step) {  // STEPS == 1 only (the launcher's rule)
      next = 0.0f;
      if (HAS_STATE) {
        next = state_in[state_at + i * SIMD_WIDTH];
      }
    }
    state_out[state_at + i * SIMD_WIDTH] = next;
  }
  y = simd_sum(y);
  if (lane == 0) {
    y_head[dv] = static_cast<float>(static_cast<InT>(y));
  }
}
threadgroup_barrier(mem_flags::mem_threadgroup);

// -- gated RMSNorm: rms_norm(y, weight) in NormT, times silu(z) in fp32 --------
float y_squares = 0.0f;
for (uint i = lane; i < Dv; i += SIMD_WIDTH) {
  y_squares += y_head[i] * y_head[i];
}
float y_inv_rms = metal::precise::rsqrt(simd_sum(y_squares) / float(Dv) + norm_eps);
for (uint i = tid; i < Dv; i += THREADS) {
  float normed = static_cast<float>(static_cast<NormT>(y_head[i] * y_inv_rms));
  normed = static_cast<float>(static_cast<NormT>(normed * static_cast<float>(norm_weight[i])));
  float zf = static_cast<float>(z[head_at * Dv + i]);
  float silu_z = zf / (1.0f + metal::precise::exp(-zf));
  out[head_at * Dv + i] = static_cast<InT>(normed * silu_z);
}
// The next position reuses the threadgroup arrays.
threadgroup_barrier(mem_flags::mem_threadgroup);
}
