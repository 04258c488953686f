"""Where a prefill is cut, and which cuts change its bits (mlx_lily/prefill_cuts.py).

The rules themselves; that the model keeps its bits across the cuts they
drop is checked on the emulated kernels in test_prefix_reuse.py and on the
H200 by ``bench.diagnostics.prefill.cut_invariance``.
"""

from __future__ import annotations

import random

import pytest

from mlx_lily import prefill_cuts as pc


def test_cold_cuts_split_segments_in_steps_and_the_last_token_off():
    assert pc.cold_cuts(47, [9, 35, 3], 8) == [8, 9, 17, 25, 33, 41, 44, 46]
    assert pc.cold_cuts(5000, None, 2048) == [2048, 4096, 4999]
    assert pc.cold_cuts(1, None, 2048) == []
    # Segments that do not add up to the prompt count as one.
    assert pc.cold_cuts(10, [3, 3], 4) == [4, 8, 9]


def test_resumed_cuts_chunk_the_rest_from_the_resume_point():
    # The server drops the reused tokens from the front of the segments.
    assert pc.resumed_cuts(5000, None, 2048, 4032) == [4999]
    assert pc.resumed_cuts(9000, None, 2048, 1000) == [3048, 5096, 7144, 8999]
    assert pc.resumed_cuts(47, [9, 35, 3], 8, 12) == [20, 28, 36, 44, 46]
    assert pc.resumed_cuts(47, [9, 35, 3], 8, 9) == [17, 25, 33, 41, 44, 46]


def test_visible_cuts_merge_whole_chunk_calls_of_a_chunk_or_more():
    assert pc.visible_cuts([2048, 4096, 5999]) == (5999,)
    assert pc.visible_cuts([2048, 4032, 5999]) == (5999,)
    # A call under a chunk, or one starting inside a chunk of its run, stays.
    assert pc.visible_cuts([2048, 4096, 4140, 5999]) == (4096, 4140, 5999)
    assert pc.visible_cuts([2048, 4100, 5999]) == (4100, 5999)
    assert pc.visible_cuts([100, 2148, 4999]) == (100, 4999)
    assert pc.visible_cuts([8, 16, 24]) == (8, 16, 24)
    # Without merging every cut counts.
    assert pc.visible_cuts([2048, 4096, 5999], merge=False) == (2048, 4096, 5999)


def test_on_piece_grid():
    assert pc.on_piece_grid((2048, 4032))
    assert not pc.on_piece_grid((2048, 4999))
    assert pc.on_piece_grid((100, 2148))  # 2048 after the run that starts at 100
    assert not pc.on_piece_grid((2048,), merge=False)


def test_exact_from_a_checkpoint_inside_the_previous_prompt_s_last_call():
    # The previous prompt (6000 tokens) ran [0, 2048), [2048, 4096),
    # [4096, 5999): its last call kept the states at 5952.
    cuts = (2048, 4096, 5952)
    # A follow-up of 7300 tokens: cold [.., 6144, 7299]; resumed [5952, 7299].
    assert pc.exact_from(cuts, 5952, 7300, None, 2048, merge=True)
    assert not pc.exact_from(cuts, 5952, 7300, None, 2048, merge=False)
    # The cold prefill's last call under a chunk (6144 -> 6190) stays a cut
    # the resumed prefill does not make.
    assert not pc.exact_from(cuts, 5952, 6191, None, 2048, merge=True)
    # The resumed prefill's own last call under a chunk (8000 -> 8030).
    assert not pc.exact_from(cuts, 5952, 8031, None, 2048, merge=True)
    # Unknown history, or a position that is not the checkpoint's last cut.
    assert not pc.exact_from(None, 5952, 7300, None, 2048, merge=True)
    assert not pc.exact_from(cuts, 5900, 7300, None, 2048, merge=True)


@pytest.mark.parametrize("seed", range(5))
def test_a_checkpoint_on_the_cold_grid_is_exact_as_before(seed):
    # Without merging, exact_from is the earlier rule: the checkpoint's cuts
    # are the cold prefill's up to it.
    rng = random.Random(seed)
    step = rng.choice([8, 16, 64, 2048])
    length = rng.randrange(2, 5000)
    segments = None if rng.random() < 0.5 else [rng.randrange(1, length), 0]
    if segments:
        segments[1] = length - segments[0]
    cold = pc.cold_cuts(length, segments, step)
    for i, p in enumerate(cold):
        assert pc.exact_from(tuple(cold[: i + 1]), p, length, segments, step, merge=False)
        assert pc.exact_from(tuple(cold[: i + 1]), p, length, segments, step, merge=True)


def test_thinning_drops_checkpoints_off_the_chunk_grid_first():
    # A history's checkpoints (100 bytes each): the chunk ends, a prompt's
    # end (off the grid) and the last whole chunk before it. Over the budget
    # the prompt's end goes first, the latest always stays.
    import mlx.core as mx

    from mlx_lily import prefix_reuse as pr

    def ck(position, cuts):
        return pr.Checkpoint(position, cuts, 2048, {0: (mx.zeros((25,), mx.float32),)})

    history = [ck(2048, (2048,)), ck(4096, (2048, 4096)), ck(4992, (2048, 4096, 4992)),
               ck(4999, (2048, 4096, 4999)), ck(6144, (2048, 4096, 4992, 6144))]
    kept = pr.thin(history, 400)
    assert [c.position for c in kept] == [2048, 4096, 4992, 6144]
    kept = pr.thin(history, 200)
    assert kept[-1].position == 6144 and len(kept) == 2
