"""Kept for scripts written before the command line: the same as
`keras-mhf finetune` (`keras_mhf/cli/finetune.py`)."""

import os
import sys

os.environ.setdefault("KERAS_MHF_QUIET_STARTUP", "1")

from keras_mhf.cli.main import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main(["finetune"] + sys.argv[1:]))
