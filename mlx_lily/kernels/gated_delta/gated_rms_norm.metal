// Gated RMSNorm, the norm that closes each Gated DeltaNet layer, for any
// number of tokens in one dispatch:
//
//   out = rms_norm(x, weight, eps) * silu(z)      (per row of Dv values)
//
// Launcher: mlx_lily/kernels/norms.py. One SIMD group per row (a batch,
// token and head's Dv values); lane l takes values l + 32 i, so each row is
// read and written in coalesced runs and its sum of squares is one simd_sum.
// No threadgroup memory, no barriers; SIMD groups past the last row load and
// store nothing.
//
// Rounding, where MLX's ops round (as gated_delta_decode.metal's epilogue):
// rms_norm's x * rsqrt(mean(x^2) + eps) to NormT, times the weight to NormT;
// silu(z) and the product in fp32 (mlx-lm's precise_swiglu), then to InT.
//
// Template: InT (x, z, out: bfloat16 or float16), NormT (rms_norm's output: InT promoted with the
//           weight's dtype), Dv (a multiple of 32, <= 256).
// Inputs:   x, z [rows, Dv] InT (row-contiguous); weight [Dv]; scalars fp32
//           [1]: eps.
// Outputs:  out [rows, Dv] InT.
// Grid:     (32 * NSG * ceil(rows / NSG), 1, 1), threadgroup (32 * NSG, 1, 1).

constexpr uint SIMD_WIDTH = 32;
constexpr uint PER_LANE = Dv / SIMD_WIDTH;

const uint lane = thread_index_in_simdgroup;
const uint row = thread_position_in_grid.x / SIMD_WIDTH;
const bool active = row < uint(x_shape[0]);

float xs[PER_LANE];
float squares = 0.0f;
for (uint i = 0; i < PER_LANE; ++i) {
  xs[i] = active ? static_cast<float>(x[row * Dv + lane + i * SIMD_WIDTH]) : 0.0f;
  squares += xs[i] * xs[i];
}
const float inv_rms = metal::precise::rsqrt(simd_sum(squares) / float(Dv) + scalars[0]);
for (uint i = 0; i < PER_LANE; ++i) {
  const uint d = lane + i * SIMD_WIDTH;
  if (active) {
    float normed = static_cast<float>(static_cast<NormT>(xs[i] * inv_rms));
    normed = static_cast<float>(static_cast<NormT>(normed * static_cast<float>(weight[d])));
    float zf = static_cast<float>(z[row * Dv + d]);
    float silu_z = zf / (1.0f + metal::precise::exp(-zf));
    out[row * Dv + d] = static_cast<InT>(normed * silu_z);
  }
}
