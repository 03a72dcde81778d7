"""Settings files (no Keras): `keras-mhf pretrain --config FILE` reads a
TOML (or YAML) file of settings, which the flags given with it override,
and every run writes its resolved settings to `OUTPUT/config.toml`, so that
`keras-mhf pretrain --config OUTPUT/config.toml` reruns it.

A file is flat: one `name = value` per setting, named as the keywords of
`pretrain()` / `finetune()` (`learning_rate`, `output_dir`; the table in
`keras_mhf.settings.run_settings`), and optionally `command = "pretrain"`
(or `"finetune"`), which must be the command that reads it. Relative paths
are relative to the current directory, as on the command line.

Example:

```python
from keras_mhf.pretraining import pretrain
from keras_mhf.settings import read_settings_file

settings = read_settings_file("paper.toml")  # {"data": ..., "steps": ...}
pretrain(**settings | {"steps": 10})
```
"""

import difflib
import os
import tomllib

from keras_mhf.settings.run_settings import BY_NAME
from keras_mhf.settings.run_settings import settings_of
from keras_mhf.utils.files import write_atomically

CONFIG_FILE = "config.toml"
SUFFIXES = (".toml", ".yaml", ".yml")


class SettingsFileError(ValueError):
    """A settings file that cannot be read or holds a key no setting of its
    command has (one line naming the file and what to change)."""


def _load(path):
    """The file's mapping, parsed as TOML or YAML by its suffix."""
    suffix = os.path.splitext(os.fspath(path))[1].lower()
    if suffix not in SUFFIXES:
        raise SettingsFileError(
            f"{path}: a settings file is TOML (.toml) or YAML (.yaml, .yml)"
        )
    try:
        if suffix == ".toml":
            with open(path, "rb") as f:
                return tomllib.load(f)
        import yaml

        with open(path, encoding="utf-8") as f:
            return yaml.safe_load(f) or {}
    except OSError as error:
        raise SettingsFileError(
            f"cannot read the settings file {path}: {error.strerror or error}"
        ) from None
    except (tomllib.TOMLDecodeError, UnicodeDecodeError) as error:
        raise SettingsFileError(f"{path} is not valid TOML: {error}") from None
    except Exception as error:  # yaml.YAMLError; yaml is imported lazily
        if type(error).__module__.startswith("yaml"):
            first = str(error).strip().splitlines()[0]
            raise SettingsFileError(
                f"{path} is not valid YAML: {first}"
            ) from None
        raise


def _unknown(key, command):
    """Why `key` is not a setting of `command`, and what it may have
    meant."""
    if key in BY_NAME:
        other = next(iter(BY_NAME[key].commands))
        return f"{key!r} is a setting of keras-mhf {other}, not {command}"
    names = [s.name for s in settings_of(command)]
    close = difflib.get_close_matches(key.replace("-", "_"), names, n=1)
    hint = f" (did you mean {close[0]!r}?)" if close else ""
    return f"{key!r} is not a setting of keras-mhf {command}{hint}"


def read_settings_file(path, command="pretrain"):
    """The settings of a TOML or YAML file: `{name: value}`, for
    `pretrain(**settings)` / `finetune(**settings)` or a command's
    `--config`. Values are checked where every setting is checked
    (`RunConfig.validate`); here, that every key is a setting of `command`.

    Args:
        path: a `.toml`, `.yaml` or `.yml` file.
        command: `"pretrain"` or `"finetune"`.

    Raises:
        SettingsFileError: the file cannot be read or parsed, is for the
            other command, or holds a key that is not a setting of
            `command` (all such keys are named).

    Example:

    ```python
    read_settings_file("runs/mhf/config.toml")["steps"]  # 300
    ```
    """
    data = _load(path)
    if not isinstance(data, dict):
        raise SettingsFileError(
            f"{path} must hold settings as name = value, found "
            f"{type(data).__name__}"
        )
    data = dict(data)
    written_for = data.pop("command", command)
    if written_for != command:
        raise SettingsFileError(
            f"{path} holds settings of keras-mhf {written_for}; run "
            f"keras-mhf {written_for} --config {path}"
        )
    known = {s.name: s for s in settings_of(command)}
    unknown = [_unknown(str(key), command) for key in data if key not in known]
    if unknown:
        raise SettingsFileError(
            f"{path}: "
            + "; ".join(unknown)
            + f" (keras-mhf {command} --help lists the settings; a file "
            "names them with underscores, e.g. learning_rate)"
        )
    yaml_file = not os.fspath(path).lower().endswith(".toml")
    return {
        key: _from_yaml(known[key], value) if yaml_file else value
        for key, value in data.items()
    }


def _from_yaml(setting, value):
    """YAML 1.1 reads `2e-3` (no dot) as a string: a number setting takes
    it as the number it spells."""
    if setting.type is float and isinstance(value, str):
        try:
            return float(value)
        except ValueError:
            return value
    return value


def _for_file(value):
    """A value as TOML writes it (lists for tuples, plain numbers, paths
    as strings)."""
    if isinstance(value, (list, tuple)):
        return [_for_file(v) for v in value]
    if isinstance(value, os.PathLike):
        return os.fspath(value)
    if hasattr(value, "item") and not isinstance(value, (str, bytes)):
        return value.item()  # a NumPy scalar
    return value


def file_settings(values, command):
    """`{name: value}` of `values` (a `RunConfig`) as a settings file of
    `command` records them: every setting the command takes, in the table's
    order, but those only kept for older callers and the multi-host launch
    settings; `None` is left out, or spelled as the setting says where the
    default is not `None` (TOML has no null)."""
    settings = {}
    for setting in settings_of(command):
        if not (setting.written and setting.run_config):
            continue
        value = getattr(values, setting.name)
        if value is None:
            if setting.default_for(command) is None:
                continue
            value = setting.none_spelling
        settings[setting.name] = _for_file(value)
    return settings


def write_settings_file(path, values, command):
    """Writes `file_settings(values, command)` to `path` as TOML,
    atomically, with a header that says how to rerun it.

    Example:

    ```python
    write_settings_file("runs/mhf/config.toml", config, "pretrain")
    ```
    """
    import tomli_w

    from keras_mhf import __version__

    header = (
        f"# The settings of this run, resolved (keras_mhf {__version__}).\n"
        f"# Rerun or resume it with: keras-mhf {command} --config {path}\n"
        f"# Flags given after --config override these values; keras-mhf "
        f"{command} --help\n# describes each setting.\n"
    )
    body = tomli_w.dumps({"command": command} | file_settings(values, command))
    write_atomically(path, (header + body).encode("utf-8"))
