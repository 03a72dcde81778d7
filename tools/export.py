"""Export a saved MHF or Standard model (preset directory) as a TF SavedModel
with `serve` (next-token log-probs) and `generate` (greedy) endpoints.

    python tools/export.py --preset runs/mhf/preset \\
        --output runs/mhf/saved_model

Load it anywhere with TensorFlow alone:

    import tensorflow as tf
    model = tf.saved_model.load("runs/mhf/saved_model")
    log_probs = model.serve(token_ids=ids, padding_mask=mask)        # [b, V]
    out = model.generate(token_ids=ids, padding_mask=prompt_mask)    # greedy
"""

import argparse
import os


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--preset", required=True, help="preset directory")
    parser.add_argument(
        "--output", required=True, help="SavedModel directory to write"
    )
    args = parser.parse_args(argv)
    import keras_hub

    from keras_mhf.export import export_causal_lm  # also registers the classes

    model = keras_hub.models.CausalLM.from_preset(args.preset)
    export_causal_lm(model, args.output)
    print(f"SavedModel written to {os.path.abspath(args.output)}")


if __name__ == "__main__":
    main()
