"""The final model's validation: calibration of a MultiHashFormer's scoring
temperature on the first half of the run's validation windows, and
perplexity, accuracy and ECE on the second half, so that the reported
calibrated numbers are held out from the fit.

The paper's rule scores a token by the sum of the `H` heads' log-probs; the
heads are near-copies, so the sum counts the evidence about `H` times and the
renormalised distribution is over-sharpened. `keras_mhf.evaluation.calibrate`
fits one temperature `tau` (`log_softmax_V(s(w) / tau)`) that fixes most of
it (see `keras_mhf.evaluation.calibration`). Greedy output never changes.

Every run, calibrated or not, reports the same windows, so a Standard run, an
MHF run and an MHF run without calibration (`calibrate=False`) of the same
settings are compared on identical text.
"""

import os
import warnings

from keras_mhf.evaluation import perplexity
from keras_mhf.evaluation.calibration import MIN_TOKENS
from keras_mhf.evaluation.calibration import calibrate
from keras_mhf.pretraining.config import is_primary
from keras_mhf.utils.files import read_json
from keras_mhf.utils.files import write_json

# Predicted positions of the temperature fit, at most (the first windows of
# the fit half). The fit caches `tokens x V` float32 raw scores: 4096 tokens
# of a 32,768-piece vocabulary are 0.5 GiB.
CALIBRATION_MAX_TOKENS = 4096

# A fine-tuning run's scores of its preset before the first step.
INITIAL_VALIDATION = "before.json"


def split_validation_windows(count):
    """`(fit, reported)`: the half-open ranges of window indices that fit the
    temperature (the first half) and that the summary reports (the rest).

    Example:

    >>> split_validation_windows(64)
    ((0, 32), (32, 64))
    >>> split_validation_windows(1)
    ((0, 0), (0, 1))
    """
    middle = count // 2
    return (0, middle), (middle, count)


def validate_final_model(config, lm, data):
    """Calibrates `lm` (an MHF model of a run with `config.calibrate`) on the
    fit half of `data.validation_blocks` and scores the reported half.

    The temperature is set on `lm`, so a preset saved afterwards stores it.
    Nothing else of the model changes. Calibration is skipped, with a
    warning, when the fit half holds fewer than
    `keras_mhf.evaluation.calibration.MIN_TOKENS` predicted tokens.

    Returns:
        dict for the run's summary:
        - `validation`: perplexity, loss, accuracy, ece and tokens of the
          reported windows under the model's final rule (for a calibrated
          model also its nested `paper_rule` and `scoring_temperature`, as
          `keras_mhf.evaluation.perplexity` returns them);
        - `validation_paper_rule` (MHF only): the same under the paper's
          rule (`tau = 1`);
        - `scoring_temperature`: the model's `tau` (`None` for Standard);
        - `calibration`: `applied`, and either the report of
          `keras_mhf.evaluation.calibrate` (its metrics are those of the
          fit windows, in-sample) with `fit_windows`, or the `reason` it was
          not applied;
        - `validation_windows`: which windows fit and which are reported.

    Example:

    ```python
    results = validate_final_model(config, lm, data)
    results["validation"]["perplexity"], results["scoring_temperature"]
    ```
    """
    blocks = data.validation_blocks
    (fit_start, fit_end), (start, end) = split_validation_windows(len(blocks))
    is_mhf = config.model == "mhf"
    calibration = _calibrate(config, lm, blocks[fit_start:fit_end])
    validation = perplexity(lm, blocks[start:end], config.batch_size)
    results = {"validation": validation}
    if is_mhf:
        results["validation_paper_rule"] = dict(
            validation.get("paper_rule", validation)
        )
        results["validation_paper_rule"].pop("paper_rule", None)
        results["validation_paper_rule"].pop("scoring_temperature", None)
    results["scoring_temperature"] = lm.scoring_temperature if is_mhf else None
    if calibration["applied"]:
        calibration["fit_windows"] = [fit_start, fit_end]
        calibration["note"] = (
            "paper_rule, before and after are metrics of the fit windows "
            "(in-sample); validation holds the held-out ones"
        )
    results["calibration"] = calibration
    results["validation_windows"] = {
        "windows": len(blocks),
        "sequence_length": config.sequence_length,
        "calibration_fit": [fit_start, fit_end],
        "reported": [start, end],
        "note": (
            f"validation and validation_paper_rule score windows {start}.."
            f"{end - 1} of the validation split; the scoring temperature "
            f"is fit on windows {fit_start}..{fit_end - 1} only (when "
            "calibration applies), so the calibrated numbers are held out "
            f"from the fit. log.csv scores all {len(blocks)} windows under "
            "the paper's rule (scoring temperature 1.0)."
        ),
    }
    return results


def _calibrate(config, lm, fit_blocks):
    """`{"applied": True, **report}` of `calibrate(lm, fit_blocks)`, or
    `{"applied": False, "reason": ...}`."""
    if config.model != "mhf":
        return {
            "applied": False,
            "reason": "the Standard baseline has one scoring rule (the "
            "softmax of its logits); only MultiHashFormer models are "
            "calibrated",
        }
    if not config.calibrate:
        return {
            "applied": False,
            "reason": "calibrate=False (--no-calibrate): the paper's rule, "
            "scoring temperature 1.0",
        }
    tokens = len(fit_blocks) * config.sequence_length
    if tokens < MIN_TOKENS:
        needed = 2 * -(-MIN_TOKENS // config.sequence_length)
        reason = (
            f"the calibration half of the validation windows holds {tokens} "
            f"predicted tokens ({len(fit_blocks)} windows of "
            f"{config.sequence_length}), fewer than the {MIN_TOKENS} a "
            f"reliable fit needs; use --validation-blocks {needed} or more "
            "to calibrate (or --no-calibrate to silence this)"
        )
        warnings.warn(
            f"The scoring temperature was not calibrated: {reason}. The "
            "preset keeps the paper's rule (scoring temperature 1.0).",
            stacklevel=3,
        )
        return {"applied": False, "reason": reason}
    report = calibrate(
        lm,
        fit_blocks,
        batch_size=config.batch_size,
        max_tokens=CALIBRATION_MAX_TOKENS,
    )
    return {"applied": True, **report}


def describe(results):
    """One line for the run's output: the reported windows' perplexity
    under the paper's rule and calibrated, and ECE.

    Example:

    ```python
    print(describe(validate_final_model(config, lm, data)))
    ```
    """
    windows = results["validation_windows"]
    start, end = windows["reported"]
    validation = results["validation"]
    calibration = results["calibration"]
    where = f"validation windows {start}..{end - 1}"
    if results["scoring_temperature"] is None:
        return (
            f"Final {where}: perplexity {validation['perplexity']:.2f}, "
            f"ECE {validation['ece']:.3f} (Standard: one scoring rule)."
        )
    paper = results["validation_paper_rule"]
    if not calibration["applied"]:
        return (
            f"Final {where}: perplexity {paper['perplexity']:.2f} under the "
            f"paper's rule, ECE {paper['ece']:.3f} (not calibrated: "
            f"{calibration['reason']})."
        )
    fit_start, fit_end = windows["calibration_fit"]
    return (
        f"Final {where} (held out from the calibration fit on windows "
        f"{fit_start}..{fit_end - 1}): perplexity "
        f"{paper['perplexity']:.2f} under the paper's rule, "
        f"{validation['perplexity']:.2f} calibrated (scoring temperature "
        f"{results['scoring_temperature']:.4g}); ECE {paper['ece']:.3f} -> "
        f"{validation['ece']:.3f}."
    )


def validate_initial_model(config, lm, data, step):
    """Scores the preset's model (`lm` before its first step: fresh
    adapters change nothing) like the final model, calibration included,
    and writes `OUTPUT/before.json` once; the model's scoring temperature is
    restored afterwards. A no-op for runs without a preset, when the file
    exists, and (with a warning) for a run resumed without one.
    """
    path = config.path(INITIAL_VALIDATION)
    if config.initial_preset is None or os.path.exists(path):
        return
    if step > 0:
        warnings.warn(
            f"{path} is missing: the preset's scores before fine-tuning "
            "cannot be computed from a resumed run (the summary will not "
            "have them).",
            stacklevel=2,
        )
        return
    temperature = getattr(lm, "scoring_temperature", None)
    results = validate_final_model(config, lm, data)
    if temperature is not None:
        lm.scoring_temperature = temperature
    if config.verbose:
        line = describe(results).replace("Final ", "", 1)
        print("Before fine-tuning, " + line)
    if is_primary():
        write_json(path, results)


def initial_validation(config):
    """The contents of `OUTPUT/before.json`, or `None`."""
    path = config.path(INITIAL_VALIDATION)
    if config.initial_preset is None or not os.path.exists(path):
        return None
    return read_json(path)
