"""The settings of a run, declared once, without Keras (so that `--help`
answers at once): `Setting`, the table `RUN_SETTINGS` of every setting of
`keras-mhf pretrain` and `finetune`, and settings files (`--config FILE`,
`OUTPUT/config.toml`).

| module | holds |
|---|---|
| `setting` | `Setting`: name, type, defaults, rule, help, flag, recorded |
| `rules` | the value checks the table names, `parse_mesh`, `preset_directory` |
| `run_settings` | `RUN_SETTINGS`, `settings_of`, `settings_table` |
| `settings_file` | `read_settings_file`, `write_settings_file` |

Example:

```python
from keras_mhf.settings import read_settings_file

read_settings_file("runs/mhf/config.toml")  # {"data": [...], "steps": 300, ...}
```
"""

from keras_mhf.settings.rules import DISTRIBUTIONS
from keras_mhf.settings.rules import MODELS
from keras_mhf.settings.rules import OPTIMIZERS
from keras_mhf.settings.rules import PRECISIONS
from keras_mhf.settings.rules import SIGNATURE_RULES
from keras_mhf.settings.rules import parse_mesh
from keras_mhf.settings.run_settings import RUN_SETTINGS
from keras_mhf.settings.run_settings import command_defaults
from keras_mhf.settings.run_settings import finetune_defaults
from keras_mhf.settings.run_settings import settings_of
from keras_mhf.settings.run_settings import settings_table
from keras_mhf.settings.setting import Setting
from keras_mhf.settings.settings_file import CONFIG_FILE
from keras_mhf.settings.settings_file import SettingsFileError
from keras_mhf.settings.settings_file import read_settings_file
from keras_mhf.settings.settings_file import write_settings_file
