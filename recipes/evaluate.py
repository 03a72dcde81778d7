"""Kept for scripts written before the command line: the same as
`keras-mhf evaluate` (`keras_mhf/cli/evaluate.py`)."""

import os
import sys

os.environ.setdefault("KERAS_MHF_QUIET_STARTUP", "1")

from keras_mhf.cli.main import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main(["evaluate"] + sys.argv[1:]))
