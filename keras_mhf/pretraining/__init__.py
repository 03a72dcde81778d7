"""Pre-training with `model.fit`: the engine behind `keras-mhf pretrain`.

`pretrain` runs named steps:

1. `RunConfig.validate` checks every setting before anything is written
   (the settings are declared once, in `keras_mhf.settings.RUN_SETTINGS`),
   and `check_devices` checks them against the devices and processes.
2. `run_scope` installs the process-wide state of the run (the
   distribution, a dtype policy, on JAX a persistent compilation cache) and
   restores it afterwards.
3. `load_data` opens a prepared corpus (a directory with `index.json`, see
   `keras_mhf.data.prepare_data`), or first prepares raw text into
   `OUTPUT/data/` (training a SentencePiece tokenizer on a bounded sample of
   it when none is given), checks the tokenizer against the corpus and reads
   the fixed validation windows.
4. `build_run_model` builds the seeded model and its optimizer.
5. `RunCheckpoints.resume` loads the newest complete checkpoint, if any,
   and returns the global step to continue from (the run's checkpoints are
   one `RunCheckpoints`, kept on its `RunConfig`).
6. For each chunk of `checkpoint_every` optimizer steps: `train_chunk` (one
   `fit` call on the windows of those steps, drawn from `(seed, step)`, see
   `keras_mhf.data.window_dataset`), `write_log_row` (validation perplexity,
   a line of `log.csv`) and `RunCheckpoints.save`.
7. `finish`, for a finished run: an MHF model's scoring temperature is
   calibrated on the first half of the validation windows (`calibrate`,
   default on; never for the Standard baseline) and the second half is
   scored under the paper's rule and calibrated (`validate_final_model`);
   then the preset (with the temperature), `summary.json` and `loss.png` are
   written. Calibration comes after the last checkpoint and changes no
   weight; `log.csv` scores under the paper's rule.

Checkpoints are directories `OUTPUT/checkpoints/step_NNNNNN/` holding the
variables (model weights and optimizer state, written with Orbax: each
process its own shards, while training goes on) and the run state
(`state.json`: step, chunk, the settings that must not change, the size and
sha256 of every file, the sha256 of its own fields). Each is written under a
temporary name and renamed in one atomic step once every process has written
its part; older ones are pruned only after that (the last `KEEP_CHECKPOINTS`
are kept). Training data is a pure function of the seed and the global step,
so a run killed at any point and rerun with the same settings resumes from
the newest complete checkpoint, reads nothing it already read, and ends with
the same weights, to the bit, as an uninterrupted run.

A run stops at the first non-finite training loss (`NonFiniteLossError`) and
never writes a checkpoint, preset or summary from non-finite weights; a
checkpoint is written only when its weights, optimizer state and validation
loss are finite, so the one a stopped run keeps can be resumed.

One run writes to an output at a time (`OUTPUT/.keras_mhf.lock`, released
when the process ends however it ends); `OUTPUT/run.json` records the
settings a resumed run must match and `OUTPUT/config.toml` all of its
resolved settings (`keras-mhf pretrain --config OUTPUT/config.toml` reruns
it); the prepared corpus is verified (sha256, token ids) when a run starts
or resumes; a full disk stops the run with a one-line `DiskFullError` and no
temporary files; `summary.json` is written on every exit (`status`,
`reason`, `last_good_step`).

The modules, in the order a run uses them:

| module | holds |
|---|---|
| `errors` | `RunConfigError`, `CheckpointError`, `NonFinite*Error` |
| `hooks` | `event`, the instrumentation point (faults, timing, `Stop`) |
| `config` | `RunConfig`, process layout, `check_devices`, `run_scope` |
| `data` | tokenizer sample and training, `RunData`, `load_data` |
| `logs` | `log.csv` rows (`write_log_row`, `trim_log`), `plot_log` |
| `checkpoint_store` | Orbax: the variables written and read, `state.json` |
| `checkpoints` | `RunCheckpoints`: a run's checkpoints (resume, save) |
| `training` | optimizer, models, `train_chunk` and its non-finite stop |
| `validation` | the final calibration and held-out validation |
| `run` | `finish` (preset, summary) and `pretrain` |
| `presets` | runs from a preset: its model, tokenizer, sha256 (LoRA) |
| `finetune` | `finetune`: `pretrain` from a preset (`keras-mhf finetune`) |

`DiskFullError` and `OutputLockedError` (from `keras_mhf.utils`) are
re-exported here too. The run's API is re-exported here; the helpers the
modules share (e.g.
`config.is_primary`, `checkpoints.variable_bytes`, `keras_mhf.utils.files`) are
imported from their module. To replace something for a test or a tool,
patch the module that defines it, which is where the run looks it up
(e.g. `keras_mhf.pretraining.hooks.event`, the same module as
`keras_mhf.utils.hooks`,
`keras_mhf.pretraining.training.train_chunk`,
`keras_mhf.pretraining.checkpoints.KEEP_CHECKPOINTS`); rebinding a name of
this package changes nothing.

Example:

```python
from keras_mhf.pretraining import pretrain

lm, summary = pretrain(
    "prepared/openstax", "runs/mhf", architecture="tiny_h3b512", steps=100
)
```
"""

from keras_mhf.pretraining.checkpoints import CHECKPOINT_FORMAT
from keras_mhf.pretraining.checkpoints import CHECKPOINT_VERSION
from keras_mhf.pretraining.checkpoints import CHECKPOINTS
from keras_mhf.pretraining.checkpoints import KEEP_CHECKPOINTS
from keras_mhf.pretraining.checkpoints import STATE_FILE
from keras_mhf.pretraining.checkpoints import WEIGHTS_FILE
from keras_mhf.pretraining.checkpoints import RunCheckpoints
from keras_mhf.pretraining.checkpoints import read_checkpoint
from keras_mhf.pretraining.checkpoints import record_run
from keras_mhf.pretraining.checkpoints import run_settings
from keras_mhf.pretraining.config import RunConfig
from keras_mhf.pretraining.config import backbone_config
from keras_mhf.pretraining.config import check_devices
from keras_mhf.pretraining.config import compilation_cache_directory
from keras_mhf.pretraining.config import process_layout
from keras_mhf.pretraining.config import run_scope
from keras_mhf.pretraining.data import TOKENIZER_SAMPLE_CHARACTERS
from keras_mhf.pretraining.data import TOKENIZER_SAMPLE_DOCUMENTS
from keras_mhf.pretraining.data import RunData
from keras_mhf.pretraining.data import corpus_fingerprint
from keras_mhf.pretraining.data import is_prepared_directory
from keras_mhf.pretraining.data import load_data
from keras_mhf.pretraining.data import tokenizer_training_sample
from keras_mhf.pretraining.data import train_sentencepiece
from keras_mhf.pretraining.errors import CheckpointError
from keras_mhf.pretraining.errors import NonFiniteLossError
from keras_mhf.pretraining.errors import NonFiniteTrainingError
from keras_mhf.pretraining.errors import NonFiniteWeightsError
from keras_mhf.pretraining.errors import RunConfigError
from keras_mhf.pretraining.finetune import FINETUNE_DEFAULTS
from keras_mhf.pretraining.finetune import finetune
from keras_mhf.pretraining.logs import LOG_FIELDS
from keras_mhf.pretraining.logs import plot_log
from keras_mhf.pretraining.logs import write_log_row
from keras_mhf.pretraining.run import finish
from keras_mhf.pretraining.run import pretrain
from keras_mhf.pretraining.run import save_preset
from keras_mhf.pretraining.training import StopOnNonFiniteLoss
from keras_mhf.pretraining.training import build_model
from keras_mhf.pretraining.training import build_run_model
from keras_mhf.pretraining.training import chunk_steps
from keras_mhf.pretraining.training import data_order
from keras_mhf.pretraining.training import fit_blocks
from keras_mhf.pretraining.training import loader_options
from keras_mhf.pretraining.training import make_optimizer
from keras_mhf.pretraining.training import train_chunk
from keras_mhf.pretraining.validation import CALIBRATION_MAX_TOKENS
from keras_mhf.pretraining.validation import split_validation_windows
from keras_mhf.pretraining.validation import validate_final_model
from keras_mhf.settings.rules import DISTRIBUTIONS
from keras_mhf.settings.rules import MODELS
from keras_mhf.settings.rules import SIGNATURE_RULES
from keras_mhf.utils import hooks
from keras_mhf.utils.disk_space import DiskFullError
from keras_mhf.utils.output_lock import OutputLockedError
