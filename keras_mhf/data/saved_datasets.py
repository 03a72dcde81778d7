"""Folders written by Hugging Face `datasets`' `save_to_disk` (standard
library only; reading them needs pyarrow, not `datasets`).

A `Dataset.save_to_disk` folder holds Arrow IPC stream files
(`data-00000-of-00002.arrow`, ...) listed in order in its `state.json`
(`_data_files`), next to `dataset_info.json`. A `DatasetDict.save_to_disk`
folder holds `dataset_dict.json` (`{"splits": [...]}`) and one such folder
per split. `dataset_files` gives the Arrow files of either (a dictionary
with one split reads that split), in the dataset's order; any other file in
the folder (e.g. `cache-*.arrow` files that `datasets` left there) is not
part of the dataset.

Example:

```python
from keras_mhf.data.saved_datasets import dataset_files

files = dataset_files("fineweb_edu_sample/")  # None: not a datasets folder
```
"""

import json
import os

STATE_FILE = "state.json"
INFO_FILE = "dataset_info.json"
DICT_FILE = "dataset_dict.json"


def is_saved_dataset(directory):
    """Whether `directory` is a `Dataset.save_to_disk` folder (`state.json`
    and `dataset_info.json`) or a `DatasetDict.save_to_disk` folder
    (`dataset_dict.json`).

    Example:

    >>> import tempfile
    >>> is_saved_dataset(tempfile.mkdtemp())
    False
    """
    directory = os.fspath(directory)
    return os.path.isfile(os.path.join(directory, DICT_FILE)) or (
        os.path.isfile(os.path.join(directory, STATE_FILE))
        and os.path.isfile(os.path.join(directory, INFO_FILE))
    )


def _read(path, what):
    try:
        with open(path, encoding="utf-8") as f:
            return json.load(f)
    except (OSError, ValueError) as error:
        raise ValueError(
            f"{path}: cannot read the {what} of this `datasets` folder "
            f"({error}); save the dataset again (save_to_disk)."
        ) from error


def _split_files(directory):
    """The Arrow files of one `Dataset.save_to_disk` folder, in order."""
    path = os.path.join(directory, STATE_FILE)
    state = _read(path, "list of files")
    entries = state.get("_data_files") if isinstance(state, dict) else None
    if not isinstance(entries, list) or not all(
        isinstance(e, dict) and isinstance(e.get("filename"), str)
        for e in entries
    ):
        raise ValueError(
            f"{path} does not list the dataset's files (_data_files); save "
            "the dataset again (save_to_disk)."
        )
    files = [os.path.join(directory, e["filename"]) for e in entries]
    for file in files:
        if not os.path.isfile(file):
            raise FileNotFoundError(
                f"{file}, listed in {path}, is missing; copy or save the "
                "whole dataset folder again."
            )
    return files


def dataset_files(directory):
    """The Arrow files of a `datasets` save_to_disk folder, in order.

    Args:
        directory: a `Dataset.save_to_disk` folder, or a
            `DatasetDict.save_to_disk` folder with exactly one split.

    Returns:
        The `.arrow` file paths in the dataset's order, or `None` when
        `directory` is not a `datasets` folder.

    Raises:
        ValueError: a dictionary with several splits (pass FOLDER/SPLIT),
            or a `state.json` / `dataset_dict.json` that cannot be read.
        FileNotFoundError: a file the dataset lists is missing.

    Example:

    ```python
    dataset_files("saved/")        # a Dataset, or a DatasetDict of one split
    dataset_files("saved/train")   # one split of a DatasetDict
    ```
    """
    directory = os.fspath(directory)
    if not is_saved_dataset(directory):
        return None
    dictionary = os.path.join(directory, DICT_FILE)
    if not os.path.isfile(dictionary):
        return _split_files(directory)
    found = _read(dictionary, "list of splits")
    splits = found.get("splits") if isinstance(found, dict) else None
    if not isinstance(splits, list) or not splits:
        raise ValueError(
            f"{dictionary} lists no splits; save the dataset again "
            "(save_to_disk)."
        )
    if len(splits) > 1:
        names = ", ".join(map(str, splits))
        raise ValueError(
            f"{directory} is a `datasets` DatasetDict with {len(splits)} "
            f"splits ({names}); pass one of them as FOLDER/SPLIT, e.g. "
            f"{os.path.join(directory, str(splits[0]))}."
        )
    split = os.path.join(directory, str(splits[0]))
    if not is_saved_dataset(split) or os.path.isfile(
        os.path.join(split, DICT_FILE)
    ):
        raise ValueError(
            f"{split}, the split {dictionary} lists, is not a saved "
            "`datasets` split (no state.json and dataset_info.json)."
        )
    return _split_files(split)
