"""lm-eval (0.4.x) model adapter: `keras_mhf` for MHF and Standard presets.

lm-eval discovers models only through its own built-in table (no plugin
entry points), so the stock `lm_eval` command cannot see this adapter. Use
the `keras-mhf-lm-eval` command (installed with the package; also
`python -m keras_mhf.evaluation.lm_eval_adapter`), which is lm-eval's own command line
with the `keras_mhf` model registered:

    keras-mhf-lm-eval --model keras_mhf --model_args preset=runs/mhf/preset \
        --tasks lambada_openai --include_path my_tasks/

From Python, `import keras_mhf.evaluation.lm_eval_adapter` registers it for
`lm_eval.simple_evaluate(model="keras_mhf", ...)`.

Log-likelihoods are computed from log-softmax over the real vocabulary
(MHF: paper Sec. 3.4, inference), with `<s>` before every context.
"""

import numpy as np
from lm_eval.api.model import LM
from lm_eval.api.registry import register_model
from lm_eval.utils import get_rolling_token_windows
from lm_eval.utils import make_disjoint_window

from keras_mhf import evaluation


@register_model("keras_mhf")
class KerasMHFLM(LM):
    """lm-eval `LM` over a KerasHub causal-LM preset (MHF or Standard).

    Args:
        preset: preset directory (`save_to_preset` output).
        batch_size: sequences per forward pass.
        max_length: context window for rolling log-likelihoods.
        max_gen_toks: default cap on generated tokens.
    """

    def __init__(
        self, preset, batch_size=8, max_length=512, max_gen_toks=64, **kwargs
    ):
        super().__init__()
        import keras_mhf  # noqa: F401 (registers the classes)
        from keras_mhf.models.preset_loading import load_causal_lm

        self.model = load_causal_lm(preset)
        self.tokenizer = self.model.preprocessor.tokenizer
        self.batch_size = int(batch_size)
        self.max_length = int(max_length)
        self.max_gen_toks = int(max_gen_toks)
        self.model.compile(sampler="greedy")

    def loglikelihood(self, requests, disable_tqdm=False):
        pairs = [tuple(r.args) for r in requests]
        return evaluation.loglikelihoods(
            self.model, self.tokenizer, pairs, self.batch_size
        )

    def loglikelihood_rolling(self, requests, disable_tqdm=False):
        results = []
        bos = self.tokenizer.start_token_id
        for request in requests:
            (text,) = request.args
            tokens = evaluation.encode_text(self.tokenizer, text)
            total = 0.0
            windows = map(
                make_disjoint_window,
                get_rolling_token_windows(
                    token_list=tokens,
                    prefix_token=bos,
                    max_seq_len=self.max_length,
                    context_len=1,
                ),
            )
            for context, target in windows:
                ids = np.array([context + target], "int32")
                lls = evaluation.token_log_likelihoods(
                    self.model, ids, batch_size=1
                )[0]
                total += float(lls[-len(target) :].sum())
            results.append(total)
        return results

    def generate_until(self, requests, disable_tqdm=False):
        outputs = []
        for request in requests:
            context, gen_kwargs = request.args
            until = gen_kwargs.get("until") or []
            if isinstance(until, str):
                until = [until]
            max_new = int(gen_kwargs.get("max_gen_toks", self.max_gen_toks))
            prompt_length = (
                len(evaluation.encode_text(self.tokenizer, context)) + 1
            )
            text = self.model.generate(
                context, max_length=prompt_length + max_new, strip_prompt=True
            )
            for stop in until:
                if stop and stop in text:
                    text = text[: text.index(stop)]
            outputs.append(text)
        return outputs


def main():
    """lm-eval's command line with the `keras_mhf` model registered."""
    from lm_eval.__main__ import cli_evaluate

    cli_evaluate()


if __name__ == "__main__":
    main()
