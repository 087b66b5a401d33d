"""``replace_row``: one chunk of a table of latest updates (GSGM's table, ACE)."""

import numpy as np

from flwr_gsgm.core.base import replace_row


def test_a_new_row_is_added_to_the_sum_and_an_old_one_replaced_in_it():
    row = np.zeros(3, np.float32)
    total = np.array([10.0, 20.0, 30.0], np.float32)
    scratch = np.full(8, 99.0, np.float32)
    replace_row(row, total, np.array([1.0, 2.0, 3.0], np.float32), scratch, new=True)
    assert row.tolist() == [1.0, 2.0, 3.0]
    assert total.tolist() == [11.0, 22.0, 33.0]
    # the same node again: the sum loses its old row (1, 2, 3) and gains (4, 4, 4)
    replace_row(row, total, np.array([4.0, 4.0, 4.0], np.float32), scratch, new=False)
    assert row.tolist() == [4.0, 4.0, 4.0]
    assert total.tolist() == [14.0, 24.0, 34.0]
