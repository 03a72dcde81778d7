"""Kept for scripts written before the command line: the same as
`keras-mhf export` (`keras_mhf/cli/export.py`)."""

import os
import sys

os.environ.setdefault("KERAS_MHF_QUIET_STARTUP", "1")

from keras_mhf.cli.main import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main(["export"] + sys.argv[1:]))
