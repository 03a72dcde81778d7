"""Checks of arguments that need no Keras (the data pipeline and the
command line import them without loading a backend).

Example:

>>> check_positive_ints("window_dataset", batch_size=8)
>>> check_positive_ints("window_dataset", batch_size=0)
Traceback (most recent call last):
...
ValueError: window_dataset: `batch_size` must be >= 1; got 0.
"""

import numpy as np


def check_positive_ints(owner, **values):
    """Raises a clear `ValueError` unless every value is an int >= 1."""
    for name, value in values.items():
        if isinstance(value, bool) or not isinstance(value, (int, np.integer)):
            raise ValueError(
                f"{owner}: `{name}` must be an int; got {value!r}."
            )
        if value < 1:
            raise ValueError(f"{owner}: `{name}` must be >= 1; got {value}.")
