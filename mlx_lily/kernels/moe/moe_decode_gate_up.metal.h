// MoE decode gate/up (moe_decode_gate_up.metal) reading launch 1's outputs:
// the rows' normed activations xn [B, D] and picks inds [B, K].

#define LILY_ROWS(XN_SHAPE, H_SHAPE) XN_SHAPE[0]
#define LILY_GATE_UP_PROLOGUE
#define LILY_PICK(I) inds[(I)]
// A chunk of x: row ROW's values K0 .. K0 + 7, one 16-byte word of xn, loaded
// into W[AT] (zeros where not PRESENT), then unpacked to XS[0..8).
#define LILY_X_WORDS 1
#define LILY_X_LOAD(W, AT, ROW, K0, PRESENT) \
  W[(AT)] = (PRESENT) ? lily_tile_load16(xn + (ROW) * uint(D) + (K0)) : no_words;
#define LILY_X_VALUES(XS, W, AT, ROW)                                                    \
  for (uint lily_i = 0; lily_i < 8; ++lily_i) {                                          \
    XS[lily_i] = lily_tile_unpack_as<T>(W[(AT)], lily_i);                                \
  }
