// MoE decode gate/up (moe_decode_gate_up.metal) reading launch 1's outputs:
// the rows' normed activations xn [B, D] and picks inds [B, K].

#define LILY_ROWS(XN_SHAPE, H_SHAPE) XN_SHAPE[0]
#define LILY_GATE_UP_PROLOGUE
#define LILY_PICK(I) inds[(I)]
// XS[0..8) = row ROW's x at K0 .. K0 + 7 (zeros where not PRESENT).
#define LILY_X_CHUNK(XS, ROW, K0, PRESENT)                                               \
  {                                                                                      \
    const uint4 lily_xw = (PRESENT) ? lily_tile_load16(xn + (ROW) * uint(D) + (K0)) : no_words; \
    for (uint lily_i = 0; lily_i < 8; ++lily_i) {                                        \
      XS[lily_i] = lily_tile_unpack_as<T>(lily_xw, lily_i);                              \
    }                                                                                    \
  }
