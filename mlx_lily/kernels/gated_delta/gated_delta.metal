// Gated DeltaNet recurrence (the gated delta rule), prefill and decode in one
// dispatch. Per value head h, token t, with the state S [Dv, Dk] in fp32:
//
//   g    = exp(-exp(A_log[h]) * softplus(a[t, h] + dt_bias[h]))
//   beta = sigmoid(b[t, h])
//   S    = g * S;   kv = S k_t;   d = (v_t - kv) * beta;   S = S + d k_t^T;
//   y_t  = S q_t
//
// q and k arrive L2-normalised (the readout scale folded into q); value head h
// reads key head h / (Hv / Hk).
//
// Launcher: mlx_lily/kernels/gated_delta.py. ROWS state rows per SIMD group,
// a row being one value dimension dv of one head of one batch entry (rows are
// numbered batch, head, dv, so a SIMD group's rows, and consecutive SIMD
// groups, share a head's q and k). Row r of a SIMD group takes its lanes
// r * LANES .. r * LANES + LANES - 1 (LANES = 32 / ROWS); its lane l keeps
// S[dv, l + LANES i] (i < Dk / LANES) in registers for the whole call and
// reads q and k at the same key positions, so every q/k/state access is one
// coalesced run. Each token needs two sums over a row's lanes: kv = S k (on
// the recurrence's critical path) and y = S q: simd_sum for one row per SIMD
// group, a log2(LANES)-step butterfly within each row's lanes for more. More
// rows per SIMD group mean more state per lane and shorter sums; one row keeps
// the most SIMD groups in flight. Which is faster depends on the GPU
// (bench/diagnostics/gated_delta_chunked.py times each).
//
// Gates: lane l computes g and beta of token t0 + l for a chunk of 32 tokens
// (a SIMD group's rows share one head, so one set serves them all), and token
// t0 + j takes lane j's with simd_shuffle: one exp/log/exp/exp per 32 tokens
// instead of per token. y works the same way backwards: lane j keeps token
// t0 + j's output of each of the SIMD group's rows, and the chunk's outputs
// leave in one store per row.
//
// Padding (HAS_MASK): a masked step leaves the state exactly as it was, as
// stock's does: its lane sets g = 1 and beta = 0, so S * 1 and S + k * 0 are
// S to the bit, with no branch around the SIMD-group sums. Its y is 0.
//
// Loads: q, k and v of token t + 1 are issued before token t's arithmetic, so
// their latency hides behind the dependent chain of the current token.
//
// Rounding: the reference computes a + dt_bias and softplus in the promoted
// dtype of a and dt_bias (SumT), and sigmoid(b) in b's dtype (BetaT), with
// MLX's formulas. The kernel computes in fp32 and rounds where MLX's CPU ops
// round, so its gates are the CPU reference's to the bit (bar exp's last fp32
// bit). That matters: one unit in the last place of a 16-bit beta moves a
// token's share of the state by up to 2**-7, enough to flip a later MoE
// router's pick. (MLX's CUDA sigmoid rounds every step to the 16-bit type;
// there a beta may differ by one unit, within gated_delta.py's tolerance.)
//
// Template: InT (q, k, v and y dtype), SumT, BetaT (see Rounding), Dk (a
//           multiple of 32 / ROWS), Dv (a multiple of ROWS), Hk, Hv (a
//           multiple of Hk), ROWS (1, 2 or 4; Dk * ROWS / 32 <= 8),
//           HAS_STATE (false: the state starts at zero; state_in is a dummy),
//           HAS_MASK (false: every step is real; mask is a dummy).
// Inputs:   q, k [B, T, Hk, Dk]; v [B, T, Hv, Dv]; a, b [B, T, Hv];
//           A_log, dt_bias [Hv]; state_in [B, Hv, Dv, Dk] fp32;
//           mask [B, T] bool (false: a padding step).
// Outputs:  y [B, T, Hv, Dv] InT; state_out [B, Hv, Dv, Dk] fp32.

constexpr uint SIMD_WIDTH = 32;
constexpr uint LANES = SIMD_WIDTH / ROWS;
constexpr int KEYS_PER_LANE = Dk / LANES;
constexpr uint VALUE_HEADS_PER_KEY_HEAD = Hv / Hk;
// Elements between consecutive tokens of q/k, of v/y, and of a/b.
constexpr uint QK_STEP = Hk * Dk;
constexpr uint V_STEP = Hv * Dv;
constexpr uint GATE_STEP = Hv;

uint lane = thread_index_in_simdgroup;
uint row_lane = lane % LANES;
uint row = (thread_position_in_grid.x / SIMD_WIDTH) * ROWS + lane / LANES;
uint n_batch = uint(q_shape[0]);
uint n_tokens = uint(q_shape[1]);
uint n_rows = n_batch * Hv * Dv;

// SIMD groups past the last row (CUDA runs the whole last block) still reach
// every simd_shuffle and simd_sum below; they compute row 0 and store nothing.
// (Dv is a multiple of ROWS: a SIMD group's rows are all live or all not.)
bool live = row < n_rows;
uint state_row = live ? row : 0;
uint dv = state_row % Dv;
uint head = (state_row / Dv) % Hv;
uint batch = state_row / (Dv * Hv);
uint key_head = head / VALUE_HEADS_PER_KEY_HEAD;

uint qk_at = batch * n_tokens * QK_STEP + key_head * Dk + row_lane;
uint v_at = batch * n_tokens * V_STEP + head * Dv + dv;
uint gate_at = batch * n_tokens * GATE_STEP + head;
uint mask_at = batch * n_tokens;
uint state_at = state_row * Dk + row_lane;

float S[KEYS_PER_LANE];
for (int i = 0; i < KEYS_PER_LANE; ++i) {
  S[i] = 0.0f;
  if (HAS_STATE) {
    S[i] = state_in[state_at + i * LANES];
  }
}

// Per-head gate constants, in fp32 as the reference has them.
float decay_rate = metal::precise::exp(static_cast<float>(A_log[head]));
float bias = static_cast<float>(dt_bias[head]);

// Token 0's operands (the launcher never sends T = 0).
float k_now[KEYS_PER_LANE];
float q_now[KEYS_PER_LANE];
for (int i = 0; i < KEYS_PER_LANE; ++i) {
  k_now[i] = static_cast<float>(k[qk_at + i * LANES]);
  q_now[i] = static_cast<float>(q[qk_at + i * LANES]);
}
float v_now = static_cast<float>(v[v_at]);

for (uint t0 = 0; t0 < n_tokens; t0 += SIMD_WIDTH) {
  // This lane's token of the chunk; lanes past the end read the chunk's first
  // token (in bounds) and their gates go unused.
  uint my_token = t0 + lane;
  bool token_live = my_token < n_tokens;
  uint my_gate = gate_at + (token_live ? my_token : t0) * GATE_STEP;

  // softplus(x) = max(x, 0) + log1p(exp(-|x|)) as MLX computes it in SumT:
  // x, exp, log1p and the sum each rounded to SumT (the casts through SumT;
  // no-ops when it is float). log1p(e) is log(w) * e / (w - 1), w = 1 + e:
  // fp32-accurate even for e far below 1, where log(1 + e) alone loses it.
  float x = static_cast<float>(static_cast<SumT>(static_cast<float>(a[my_gate]) + bias));
  float e = static_cast<float>(static_cast<SumT>(metal::precise::exp(-metal::abs(x))));
  float w = 1.0f + e;
  float log1p_e = w == 1.0f ? e : metal::precise::log(w) * (e / (w - 1.0f));
  log1p_e = static_cast<float>(static_cast<SumT>(log1p_e));
  float softplus = static_cast<float>(static_cast<SumT>(max(x, 0.0f) + log1p_e));
  float my_g = metal::precise::exp(-decay_rate * softplus);
  // sigmoid as MLX's CPU and Metal ops compute it: sigmoid(-|x|) =
  // 1 / (1 + exp(|x|)) with exp(|x|) rounded to BetaT, mirrored for x >= 0,
  // then rounded to BetaT.
  float bx = static_cast<float>(b[my_gate]);
  float exp_b = static_cast<float>(static_cast<BetaT>(metal::precise::exp(metal::abs(bx))));
  float sigmoid_neg = 1.0f / (1.0f + exp_b);
  float my_beta = bx < 0.0f ? sigmoid_neg : 1.0f - sigmoid_neg;
  my_beta = static_cast<float>(static_cast<BetaT>(my_beta));
  bool my_step_real = true;
  if (HAS_MASK) {
    my_step_real = mask[mask_at + (token_live ? my_token : t0)];
  }
  if (!my_step_real) {
    my_g = 1.0f;
    my_beta = 0.0f;
  }

  uint remaining = n_tokens - t0;
  uint chunk = remaining < SIMD_WIDTH ? remaining : SIMD_WIDTH;
  // my_y[r]: row r's output at this lane's token.
  float my_y[ROWS];
  for (uint r = 0; r < ROWS; ++r) {
    my_y[r] = 0.0f;
  }
  for (uint j = 0; j < chunk; ++j) {
    uint t = t0 + j;
    // Next token's operands first (the last token again at the very end:
    // in bounds, never used).
    uint next = t + 1 < n_tokens ? t + 1 : t;
    float k_next[KEYS_PER_LANE];
    float q_next[KEYS_PER_LANE];
    for (int i = 0; i < KEYS_PER_LANE; ++i) {
      k_next[i] = static_cast<float>(k[qk_at + next * QK_STEP + i * LANES]);
      q_next[i] = static_cast<float>(q[qk_at + next * QK_STEP + i * LANES]);
    }
    float v_next = static_cast<float>(v[v_at + next * V_STEP]);

    float g = simd_shuffle(my_g, j);
    float beta = simd_shuffle(my_beta, j);

    // Decay, then what the state predicts for v from k.
    float kv = 0.0f;
    for (int i = 0; i < KEYS_PER_LANE; ++i) {
      S[i] = S[i] * g;
      kv += S[i] * k_now[i];
    }
    if (ROWS == 1) {
      kv = simd_sum(kv);
    } else {
      for (uint m = LANES / 2; m > 0; m /= 2) {
        kv += simd_shuffle_xor(kv, m);
      }
    }

    // Write the correction along k, then read out along q.
    float delta = (v_now - kv) * beta;
    float out = 0.0f;
    for (int i = 0; i < KEYS_PER_LANE; ++i) {
      S[i] = S[i] + k_now[i] * delta;
      out += S[i] * q_now[i];
    }
    if (ROWS == 1) {
      out = simd_sum(out);
    } else {
      for (uint m = LANES / 2; m > 0; m /= 2) {
        out += simd_shuffle_xor(out, m);
      }
    }
    for (uint r = 0; r < ROWS; ++r) {
      float row_out = ROWS == 1 ? out : simd_shuffle(out, r * LANES);
      if (lane == j) {
        my_y[r] = row_out;
      }
    }

    for (int i = 0; i < KEYS_PER_LANE; ++i) {
      k_now[i] = k_next[i];
      q_now[i] = q_next[i];
    }
    v_now = v_next;
  }
  if (live && token_live) {
    // The SIMD group's rows are consecutive dv of one head.
    uint y_at = v_at - lane / LANES + my_token * V_STEP;
    for (uint r = 0; r < ROWS; ++r) {
      y[y_at + r] = static_cast<InT>(my_step_real ? my_y[r] : 0.0f);
    }
  }
}

if (live) {
  for (int i = 0; i < KEYS_PER_LANE; ++i) {
    state_out[state_at + i * LANES] = S[i];
  }
}
