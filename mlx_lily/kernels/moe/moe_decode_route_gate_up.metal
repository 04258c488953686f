// MoE decode, route and gate/up as one launch: the threadgroup memory that
// this build puts before gate/up's body (moe_decode_gate_up.metal; its
// header, moe_decode_route_gate_up.metal.h, fills and reads it).
//
// Every row's picks, the norm's partial sums (one per SIMD group), every
// row's inverse rms, and every row's normed x (XN_ROWS >= B rows of D values
// in T, eight a word), made once a threadgroup: read where its loop needs a
// chunk, like launch 2's xn, it keeps the routed build's registers those of
// gate/up alone, so as many threadgroups stay resident.
threadgroup uint lily_picks[MAX_BATCH * K];
threadgroup float lily_partial[NSG];
threadgroup float lily_inv_rms[MAX_BATCH];
threadgroup uint4 lily_xn[XN_ROWS * (D / 8)];
