"""Export a saved MHF or Standard model (preset directory) as a TF SavedModel.

    python tools/export.py --preset runs/mhf/preset \\
        --output runs/mhf/saved_model

Endpoints (see `keras_mhf.export`): `serve`, `score` and `generate` on token
ids, and `generate_text` / `score_text` on strings (SentencePiece in the graph;
`--ids-only` leaves them out). Load it with TensorFlow (plus `tensorflow_text`
for the string endpoints):

    import tensorflow as tf, tensorflow_text  # noqa: F401
    model = tf.saved_model.load("runs/mhf/saved_model")
    model.generate_text(prompts=tf.constant(["The cell"]),
                        max_new_tokens=tf.constant(20))["completion"]
    model.score_text(texts=tf.constant(["The cell is small."]))
"""

import argparse


def main(argv=None):
    parser = argparse.ArgumentParser(
        description=__doc__.splitlines()[0],
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog=__doc__.split("\n\n", 1)[1],
    )
    parser.add_argument("--preset", required=True, help="preset directory")
    parser.add_argument(
        "--output", required=True, help="SavedModel directory to write"
    )
    parser.add_argument(
        "--overwrite", action="store_true", help="replace an existing OUTPUT"
    )
    parser.add_argument(
        "--ids-only",
        action="store_true",
        help="no string endpoints: the SavedModel loads with TensorFlow alone",
    )
    args = parser.parse_args(argv)
    import keras_hub

    # Importing keras_mhf registers its classes for from_preset.
    from keras_mhf.export import export_causal_lm

    model = keras_hub.models.CausalLM.from_preset(args.preset)
    path = export_causal_lm(
        model,
        args.output,
        overwrite=args.overwrite,
        include_text_endpoints=not args.ids_only,
    )
    print(f"SavedModel written to {path}")


if __name__ == "__main__":
    main()
