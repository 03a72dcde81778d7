"""`Setting`: one setting of a run, declared once (no Keras).

A setting carries everything the places that use it need: its name (the
keyword of `pretrain()`, the field of `RunConfig`, the key of a settings
file), its type, its default per command, the rule its value must follow,
its help, its command-line flag and whether a resumed run must match it.
`keras_mhf.settings.run_settings.RUN_SETTINGS` is the table of them.

Example:

>>> steps = Setting("steps", int, 300, "optimizer steps", finetune_default=100)
>>> steps.flag, steps.default_for("finetune")
('--steps', 100)
"""

import argparse
import dataclasses

# `finetune_default` when fine-tuning starts from the same default.
SAME = object()
COMMANDS = ("pretrain", "finetune")
# The kinds of value a setting takes besides Python types: a path, or one
# path or several (`--data a.jsonl b.jsonl`). Paths are made absolute where
# a run is made (`RunConfig`).
PATH = "path"
PATHS = "paths"


@dataclasses.dataclass(frozen=True)
class Setting:
    """One setting of a run (see the module docstring).

    Args:
        name: the keyword of `pretrain()` / `finetune()`, the `RunConfig`
            field and the key in a settings file.
        type: `int`, `float`, `str`, `bool`, `PATH` or `PATHS` (one path
            or a list of them).
        default: the default of `pretrain` (and of `RunConfig`); `None`
            means "not given" (what that means is in `help`).
        help: one sentence for `--help`, the docs and `RunConfig`.
        finetune_default: `finetune`'s default where it differs.
        commands: the commands that take it.
        rule: `rule(setting, value, values)` -> a problem (a string), a
            list of them or `None`; `values` has every setting as an
            attribute (a `RunConfig`). `None`: any value of `type`.
        choices: the values allowed (also the flag's choices).
        flag: the command-line flag; `None`: `--name-with-dashes`; `""`:
            none (an API-only setting). A `bool` setting gets `--flag` and
            `--no-flag`.
        aliases: `{flag: value}`, more flags that set a value (`--quiet`
            sets `verbose` to 0).
        metavar: the flag's placeholder in `--help`.
        group: the `--help` section.
        recorded: `"value"` or `"fingerprint"`: a later run on the same
            output must have the same value (or file contents); recorded
            in `OUTPUT/run.json` and every checkpoint. `None`: may change
            on resume.
        required: `pretrain()` and the command line need a value.
        none_spelling: how a settings file writes `None` where the
            default is something else (TOML has no null), e.g. `"none"`.
        written: whether `OUTPUT/config.toml` records it (settings kept
            only for older callers are not).
        run_config: whether it is a field of `RunConfig` (the multi-host
            launch settings are the command line's alone).
        parse: the flag's `argparse` type, for a check that needs no Keras
            and is better made before the package loads (a usage error,
            exit status 2); the rule checks values from files and the API.
    """

    name: str
    type: object
    default: object
    help: str
    finetune_default: object = SAME
    commands: tuple = COMMANDS
    rule: object = None
    choices: tuple = None
    flag: str = None
    aliases: dict = dataclasses.field(default_factory=dict)
    metavar: str = None
    group: str = "training"
    recorded: str = None
    required: bool = False
    none_spelling: object = None
    written: bool = True
    run_config: bool = True
    parse: object = None

    def __post_init__(self):
        if self.flag is None:
            flag = "--" + self.name.replace("_", "-")
            object.__setattr__(self, "flag", flag)

    @property
    def label(self):
        """How error messages name it: its flag, or its name for a `bool`
        or a setting without a flag."""
        if self.type is bool or not self.flag:
            return self.name
        return self.flag

    def default_for(self, command):
        """The default of `command` (`"pretrain"` or `"finetune"`)."""
        if command == "finetune" and self.finetune_default is not SAME:
            return self.finetune_default
        return self.default

    def problems(self, value, values):
        """The problems of `value` (a list of strings, empty if none)."""
        if self.rule is None:
            return []
        found = self.rule(self, value, values)
        if found is None:
            return []
        return [found] if isinstance(found, str) else list(found)

    def shown_default(self, command):
        """The default as `--help` and the docs show it (`None` when there
        is nothing to show)."""
        default = self.default_for(command)
        if self.type is bool:
            return "on" if default else "off"
        if default is None or default == "":
            return None
        return default

    def add_flag(self, parser, command):
        """Adds the flag(s) of this setting for `command` to `parser`
        (`argparse`); a flag not given leaves no attribute (`SUPPRESS`), so
        that a settings file and the defaults fill what the flags do not
        say."""
        if self.flag:
            self._add_own_flag(parser, command)
        for alias, value in self.aliases.items():
            parser.add_argument(
                alias,
                dest=self.name,
                action="store_const",
                const=value,
                default=argparse.SUPPRESS,
                # A setting without a flag of its own is set by its alias.
                help=f"the same as {self.flag} {value}"
                if self.flag
                else self.help,
            )

    def _add_own_flag(self, parser, command):
        text = self.help
        shown = self.shown_default(command)
        if shown is not None:
            text += f" (default: {shown})"
        options = dict(dest=self.name, default=argparse.SUPPRESS, help=text)
        if self.type is bool:
            parser.add_argument(
                self.flag, action=argparse.BooleanOptionalAction, **options
            )
        else:
            if self.type is PATHS:
                options["nargs"] = "+"
            elif self.type in (int, float):
                options["type"] = self.type
            if self.parse is not None:
                options["type"] = self.parse
            if self.choices is not None:  # `None`: the flag left out
                options["choices"] = [c for c in self.choices if c is not None]
            else:
                options["metavar"] = self.metavar or (
                    self.flag[2:].upper().replace("-", "_")
                )
            parser.add_argument(self.flag, **options)
