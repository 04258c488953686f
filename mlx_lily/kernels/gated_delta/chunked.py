"""The gated delta rule in chunks: a pure-MLX reference and its tile kernels.

Within a chunk of C tokens the new values the sequential rule writes solve a
unit lower-triangular system (the WY / UT form), so everything but the pass
over chunks, which carries only the state S, is independent across chunks.
``gated_delta_chunked_reference`` computes this in fp32 with MLX ops, with
stock's gates, y in q's dtype and the state fp32.

The derivation: docs/kernel-notes.md#gated-delta-chunked.
"""

from __future__ import annotations

from pathlib import Path
from typing import Optional

import mlx.core as mx
import mlx.nn as nn

from ...toolchain.kernel import Kernel, Launch

# Tokens per chunk: the rows of the triangular system and of each tile pass.
CHUNK = 64


def log_decay(A_log: mx.array, a: mx.array, dt_bias: mx.array) -> mx.array:
    """log g = -exp(A_log) * softplus(a + dt_bias), in fp32: the exponent of
    stock's ``compute_g`` (softplus in the promoted dtype of a and dt_bias)."""
    return -mx.exp(A_log.astype(mx.float32)) * nn.softplus(a + dt_bias)


def _chunks(x: mx.array, n_chunks: int, chunk: int) -> mx.array:
    """[B, T, H, ...] -> [B, H, n_chunks, chunk, ...], zero-padded in T."""
    T = x.shape[1]
    pad = n_chunks * chunk - T
    if pad:
        x = mx.pad(x, [(0, 0), (0, pad)] + [(0, 0)] * (x.ndim - 2))
    x = mx.moveaxis(x, 2, 1)
    return x.reshape(x.shape[0], x.shape[1], n_chunks, chunk, *x.shape[3:])


def unit_lower_inverse(L: mx.array) -> mx.array:
    """(I + L)^-1 for strictly lower-triangular L [..., C, C], by forward
    substitution: row t of the inverse is e_t - L[t, :t] @ (rows before t)."""
    C = L.shape[-1]
    inverse = mx.broadcast_to(mx.eye(C, dtype=L.dtype), L.shape)
    for t in range(1, C):
        row = inverse[..., t, :] - (L[..., t : t + 1, :t] @ inverse[..., :t, :])[..., 0, :]
        inverse[..., t, :] = row
    return inverse


def gated_delta_chunked_reference(
    q, k, v, a, b, A_log, dt_bias, state=None, mask=None, chunk: int = CHUNK
):
    """q, k [B, T, Hk, Dk]; v [B, T, Hv, Dv]; a, b [B, T, Hv]; state
    [B, Hv, Dv, Dk] fp32; mask [B, T] (False: the token leaves the state as it
    was; its y is still read from the state it would have written, as stock's
    ops path does) -> (y [B, T, Hv, Dv] in q's dtype, state fp32)."""
    B, T, Hk, Dk = q.shape
    Hv, Dv = v.shape[2:]
    f32 = mx.float32
    if state is None:
        state = mx.zeros((B, Hv, Dv, Dk), f32)
    if T == 0:
        return mx.zeros((B, 0, Hv, Dv), q.dtype), state

    beta = mx.sigmoid(b).astype(f32)  # rounded in b's dtype, as stock's
    log_g = log_decay(A_log, a, dt_bias).astype(f32)
    g_token = mx.exp(log_g)
    if mask is not None:
        # A masked token neither decays nor writes the carried state.
        keep = mask.astype(mx.bool_)[..., None]
        beta_kept, log_g = mx.where(keep, beta, 0.0), mx.where(keep, log_g, 0.0)
    else:
        beta_kept = beta

    rep = Hv // Hk
    qf, kf = q.astype(f32), k.astype(f32)
    if rep > 1:
        qf, kf = mx.repeat(qf, rep, axis=2), mx.repeat(kf, rep, axis=2)
    n = -(-T // chunk)
    Q, K, V = (_chunks(x, n, chunk) for x in (qf, kf, v.astype(f32)))  # [B, Hv, n, C, D]
    # Padded tokens: k = v = 0, beta = 0, log g = 0: they change nothing.
    bt = _chunks(beta_kept, n, chunk)  # [B, Hv, n, C]
    G = mx.cumsum(_chunks(log_g, n, chunk), axis=-1)

    causal = mx.tril(mx.ones((chunk, chunk), mx.bool_))
    strict = mx.tril(mx.ones((chunk, chunk), mx.bool_), k=-1)
    gap = G[..., :, None] - G[..., None, :]  # G_t - G_j
    # exp only where j <= t (gap <= 0); above the diagonal it could overflow.
    decay = mx.where(causal, mx.exp(mx.where(causal, gap, 0.0)), 0.0)

    L = mx.where(strict, bt[..., :, None] * decay * (K @ K.swapaxes(-1, -2)), 0.0)
    A = unit_lower_inverse(L)
    W = (A * (bt * mx.exp(G))[..., None, :]) @ K  # [B, Hv, n, C, Dk]
    U = (A * bt[..., None, :]) @ V  # [B, Hv, n, C, Dv]
    P = (Q @ K.swapaxes(-1, -2)) * decay
    K_to_end = K * mx.exp(G[..., -1:] - G)[..., None]  # k_j decayed to the chunk's end

    ys = []
    S = state.astype(f32)
    for c in range(n):
        S_T = S.swapaxes(-1, -2)  # [B, Hv, Dk, Dv]
        D = U[:, :, c] - W[:, :, c] @ S_T
        Y = mx.exp(G[:, :, c])[..., None] * (Q[:, :, c] @ S_T) + P[:, :, c] @ D
        if mask is not None:
            # A masked token's y: the state it would have written, read along
            # q: g (S_prev q) + beta (v - g S_prev k) (k . q), with S_prev the
            # carried state, which (its own gates being neutral) Y read and
            # the same sum along k reads too.
            Kd = mx.exp(G[:, :, c])[..., None] * (K[:, :, c] @ S_T) + (
                K[:, :, c] @ K[:, :, c].swapaxes(-1, -2) * decay[:, :, c]
            ) @ D
            g_c = _chunks(g_token, n, chunk)[:, :, c][..., None]
            b_c = _chunks(beta, n, chunk)[:, :, c][..., None]
            kq = (K[:, :, c] * Q[:, :, c]).sum(-1, keepdims=True)
            written = g_c * Y + b_c * (V[:, :, c] - g_c * Kd) * kq
            masked = ~_chunks(mask.astype(mx.bool_)[..., None], n, chunk)[:, 0, c][:, None, :, None]
            Y = mx.where(masked, written, Y)
        ys.append(Y)
        S = mx.exp(G[:, :, c, -1])[..., None, None] * S + D.swapaxes(-1, -2) @ K_to_end[:, :, c]

    y = mx.stack(ys, axis=2).reshape(B, Hv, n * chunk, Dv)[:, :, :T]
    return mx.moveaxis(y, 1, 2).astype(q.dtype), S


# -- the tile kernels ----------------------------------------------------------
#
# Three passes (see the .metal files): prepare (every chunk in parallel: gates,
# the triangular solve, W, U, P), state (sequential over chunks, parallel over
# 16-row slices of each head's state) and output (every chunk in parallel).
# They take bf16 q, k and v (the tiles' operand type; the launcher converts
# others, which the op does not send them: see gated_delta.py).

# Threads per threadgroup of each pass (the bodies assume these).
PREPARE_THREADS, STATE_THREADS, OUTPUT_THREADS = 256, 128, 256
# State rows carried by one threadgroup of the state pass (one tile).
STATE_SLICE = 16
# Head sizes the bodies' block shapes take: Dk a multiple of 64, Dv of 32,
# both at most 128 (the staged blocks stay under 32 KiB of threadgroup memory).
MAX_HEAD_DIM = 128

_BF16 = mx.bfloat16


def chunked_supports(q, k, v, a, b, A_log, dt_bias, state=None) -> Optional[str]:
    """None when the chunked kernels take a call the sequential kernel takes."""
    Dk, Dv = q.shape[-1], v.shape[-1]
    if Dk % 64 or Dk > MAX_HEAD_DIM:
        return f"Dk={Dk} (chunked kernels: a multiple of 64, at most {MAX_HEAD_DIM})"
    if Dv % 32 or Dv > MAX_HEAD_DIM:
        return f"Dv={Dv} (chunked kernels: a multiple of 32, at most {MAX_HEAD_DIM})"
    return None


def _prepare_launch(q, k, v, a, b, A_log, dt_bias, lengths=None) -> Launch:
    B, T, Hk, Dk = q.shape
    Hv, Dv = v.shape[2:]
    n = -(-T // CHUNK)
    Tp = n * CHUNK
    row_lengths = lengths is not None
    return Launch(
        inputs=[q, k, v, a, b, A_log.reshape(Hv), dt_bias.reshape(Hv),
                lengths.astype(mx.int32) if row_lengths else mx.zeros((1,), mx.int32)],
        grid=(n * PREPARE_THREADS, Hv, B),
        threadgroup=(PREPARE_THREADS, 1, 1),
        output_shapes=[(B, Hv, Tp, Dk), (B, Hv, Tp, Dv), (B, Hv, n, Dk, CHUNK),
                       (B, Hv, n, CHUNK, CHUNK), (B, Hv, Tp)],
        output_dtypes=[_BF16, mx.float32, _BF16, _BF16, mx.float32],
        template=[
            ("SumT", mx.result_type(a.dtype, dt_bias.dtype)),
            ("BetaT", b.dtype),
            ("Dk", Dk), ("Dv", Dv), ("Hk", Hk), ("Hv", Hv), ("C", CHUNK),
            ("ROW_LENGTHS", row_lengths),
        ],
    )


def _state_launch(w, u, kd, gcum, state=None, capture: bool = False, lengths=None) -> Launch:
    B, Hv, Tp, Dk = w.shape
    Dv = u.shape[-1]
    n = Tp // CHUNK
    has_state = state is not None
    row_lengths = lengths is not None
    shapes = [(B, Hv, n, Dv, CHUNK), (B, Hv, n, Dv, Dk), (B, Hv, Dv, Dk)] + [(B, Hv, Dv, Dk)] * capture
    return Launch(
        inputs=[w, u, kd, gcum, state if has_state else mx.zeros((1,), mx.float32),
                lengths.astype(mx.int32) if row_lengths else mx.zeros((1,), mx.int32)],
        grid=(Dv // STATE_SLICE * STATE_THREADS, Hv, B),
        threadgroup=(STATE_THREADS, 1, 1),
        output_shapes=shapes,
        output_dtypes=[_BF16, _BF16, mx.float32, mx.float32][: len(shapes)],
        template=[("Dk", Dk), ("C", CHUNK), ("HAS_STATE", has_state), ("CAPTURE", capture),
                  ("ROW_LENGTHS", row_lengths)],
        absent=() if capture else ("piece_state_out",),
    )


def _output_launch(q, s0, d, p, gcum, out_dtype) -> Launch:
    B, T, Hk, Dk = q.shape
    Hv, n, Dv = s0.shape[1:4]
    return Launch(
        inputs=[q, s0, d, p, gcum],
        grid=(n * OUTPUT_THREADS, Hv, B),
        threadgroup=(OUTPUT_THREADS, 1, 1),
        output_shapes=[(B, T, Hv, Dv)],
        output_dtypes=[out_dtype],
        template=[("InT", out_dtype), ("Dk", Dk), ("Dv", Dv), ("Hk", Hk), ("Hv", Hv), ("C", CHUNK)],
        finish=lambda outputs: outputs[0],
    )


chunk_prepare_kernel = Kernel(
    name="gated_delta_chunk_prepare",
    input_names=("q", "k", "v", "a", "b", "A_log", "dt_bias", "lengths"),
    output_names=("w_out", "u_out", "kd_out", "p_out", "gcum_out"),
    body=Path(__file__).with_name("gated_delta_chunk_prepare.metal"),
    launch=_prepare_launch,
    tiles=True,
)
chunk_state_kernel = Kernel(
    name="gated_delta_chunk_state",
    input_names=("w", "u", "kd", "gcum", "state_in", "lengths"),
    output_names=("d_out", "s0_out", "state_out", "piece_state_out"),
    body=Path(__file__).with_name("gated_delta_chunk_state.metal"),
    launch=_state_launch,
    tiles=True,
    # Without capture the body never writes it.
    stand_ins={"piece_state_out": "auto piece_state_out = state_out;"},
)
chunk_output_kernel = Kernel(
    name="gated_delta_chunk_output",
    input_names=("q", "s0", "d", "p", "gcum"),
    output_names=("y",),
    body=Path(__file__).with_name("gated_delta_chunk_output.metal"),
    launch=_output_launch,
    tiles=True,
)
CHUNKED_KERNELS = (chunk_prepare_kernel, chunk_state_kernel, chunk_output_kernel)


def gated_delta_chunked_run(backend: str, q, k, v, a, b, A_log, dt_bias, state=None, capture: bool = False,
                            lengths=None):
    """The three passes on ``backend`` -> (y in q's dtype, state fp32); with
    ``capture`` also the fp32 state at the start of the last chunk (after
    ``piece_end(T)`` tokens when T is not a whole number of chunks). With
    ``lengths`` ([B] int32, each at most T), entry b is a right-padded row of
    lengths[b] tokens: its y up to its length, its state and its captured
    state (at the start of its own last chunk) are those of the row alone
    (the padding's y is not meaningful)."""
    qb, kb, vb = (x.astype(_BF16) for x in (q, k, v))
    w, u, kd, p, gcum = chunk_prepare_kernel.run_on(backend, qb, kb, vb, a, b, A_log, dt_bias, lengths)
    d, s0, state_out, *piece = chunk_state_kernel.run_on(backend, w, u, kd, gcum, state, capture, lengths)
    y = chunk_output_kernel.run_on(backend, qb, s0, d, p, gcum, q.dtype)
    return (y, state_out, piece[0]) if capture else (y, state_out)


def piece_end(T: int) -> int:
    """Tokens of a call of T in whole chunks (its last chunk boundary)."""
    return T - T % CHUNK
