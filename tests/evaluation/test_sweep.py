"""evaluation/sweep.py: the order the sweep decodes in (its decoding in that order, end to end:
test_eval.py's test_eval_decodes_in_the_interleaved_order)."""

from dflash_train.evaluation.sweep import sweep_order


def test_sweep_order_interleaves_and_rotates():
    methods = [("ar", 0), ("dflash", 7), ("ddtree", 4)]
    order = sweep_order([2, 1], methods, repeats=2)
    assert len(order) == 2 * 3 * 3
    A, C, T = methods
    # (repeat, suite, prompt) blocks of all three methods, each rotated one further than the last
    assert order == [(0, 0, 0, A), (0, 0, 0, C), (0, 0, 0, T),
                     (0, 0, 1, C), (0, 0, 1, T), (0, 0, 1, A),
                     (0, 1, 0, T), (0, 1, 0, A), (0, 1, 0, C),
                     (1, 0, 0, A), (1, 0, 0, C), (1, 0, 0, T),
                     (1, 0, 1, C), (1, 0, 1, T), (1, 0, 1, A),
                     (1, 1, 0, T), (1, 1, 0, A), (1, 1, 0, C)]
