// MoE decode's down projection, one unit at a time: the steps that down
// (moe_decode_down.metal, expert by expert) and down with the combine
// (moe_decode_down_combine.metal, one row's slots in turn) share as text, so
// that both builds make each term with the same operations and the same bits.
//
//   LILY_DOWN_UNIT_ACTIVATIONS(A, A_SUM, PTR)  A[0..16) = the 16 activations at
//       PTR (two 16-byte loads; lanes reading scalars would touch a cache line
//       per lane and value), A_SUM their sum in order.
//   LILY_DOWN_UNIT_ACC(ACC, A, A_SUM, WORDS, SCALE, OFFSET)  ACC += the unit's
//       scale * sum(q * a) + bias * sum(a): WORDS (a uint2) its 16 4-bit
//       weights, value n of word w in bits 4n..4n+3 (MLX's affine group-64
//       format: w = scale * q + bias).

#define LILY_DOWN_UNIT_ACTIVATIONS(A, A_SUM, PTR)                                        \
  {                                                                                    \
    const uint4 lily_lo = lily_tile_load16((PTR));                                     \
    const uint4 lily_hi = lily_tile_load16((PTR) + 8);                                 \
    A_SUM = 0.0f;                                                                      \
    for (uint lily_i = 0; lily_i < 16; ++lily_i) {                                     \
      A[lily_i] = lily_tile_unpack_as<T>(lily_i < 8 ? lily_lo : lily_hi, lily_i % 8);  \
      A_SUM += A[lily_i];                                                              \
    }                                                                                  \
  }

#define LILY_DOWN_UNIT_ACC(ACC, A, A_SUM, WORDS, SCALE, OFFSET)                          \
  {                                                                                    \
    const uint lily_words[2] = {(WORDS).x, (WORDS).y};                                 \
    float lily_dot = 0.0f;                                                             \
    for (uint lily_wi = 0; lily_wi < 2; ++lily_wi) {                                   \
      for (uint lily_n = 0; lily_n < 8; ++lily_n) {                                    \
        lily_dot += (A)[lily_wi * 8 + lily_n] *                                        \
                    static_cast<float>((lily_words[lily_wi] >> (4 * lily_n)) & 0xFu);  \
      }                                                                                \
    }                                                                                  \
    ACC += (SCALE) * lily_dot + (OFFSET) * (A_SUM);                                    \
  }
