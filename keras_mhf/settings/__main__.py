"""Rewrites the settings tables of a Markdown page (docs/settings.md) from
`RUN_SETTINGS`, after a setting was added or changed.

Example:

```
python -m keras_mhf.settings docs/settings.md
```
"""

import argparse

from keras_mhf.settings.run_settings import with_current_tables
from keras_mhf.utils.files import write_atomically


def main(argv=None):
    parser = argparse.ArgumentParser(
        prog="python -m keras_mhf.settings",
        description=__doc__.split("\n\n")[0],
    )
    parser.add_argument("page", help="the Markdown page, e.g. docs/settings.md")
    page = parser.parse_args(argv).page
    with open(page, encoding="utf-8") as f:
        text = f.read()
    current = with_current_tables(text)
    if current != text:
        write_atomically(page, current.encode("utf-8"))
    print(f"{page}: {'rewritten' if current != text else 'already current'}")


if __name__ == "__main__":
    main()
