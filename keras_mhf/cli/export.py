"""Export a saved MHF or Standard model (preset directory) as a TF SavedModel
or as a Hugging Face transformers checkpoint.

    keras-mhf export --preset runs/mhf/preset \\
        --output runs/mhf/saved_model
    keras-mhf export --format transformers --preset runs/mhf/preset \\
        --output runs/mhf/hf

`--format saved_model` (the default): endpoints (see `keras_mhf.export`)
`serve`, `score` and `generate` on token ids, and `generate_text` /
`score_text` on strings (SentencePiece in the graph; `--ids-only` leaves them
out). Load it with TensorFlow (plus `tensorflow_text` for the string
endpoints):

    import tensorflow as tf, tensorflow_text  # noqa: F401
    model = tf.saved_model.load("runs/mhf/saved_model")
    model.generate_text(prompts=tf.constant(["The cell"]),
                        max_new_tokens=tf.constant(20))["completion"]
    model.score_text(texts=tf.constant(["The cell is small."]))

`--format transformers`: `config.json`, `model.safetensors`,
`generation_config.json` and the tokenizer files. An MHF model is written in
the authors' format (their `Qwen3ForCausalLM`, GitHub HUIYINXUE/MHF, loads
it); the Standard baseline as a stock `Qwen3ForCausalLM`
(`transformers.AutoModelForCausalLM` loads it). Both load back with
`from_preset(OUTPUT)`.
"""

from keras_mhf.cli.common import parser_from_doc
from keras_mhf.cli.common import refuse_existing_output
from keras_mhf.cli.common import refuse_output_over_input
from keras_mhf.settings.rules import preset_directory


def main(argv=None, prog=None):
    parser = parser_from_doc(__doc__, prog)
    parser.add_argument(
        "--preset",
        required=True,
        type=preset_directory,
        help="preset directory",
    )
    parser.add_argument("--output", required=True, help="directory to write")
    parser.add_argument(
        "--format",
        choices=("saved_model", "transformers"),
        default="saved_model",
        help="TF SavedModel or Hugging Face transformers",
    )
    parser.add_argument(
        "--overwrite", action="store_true", help="replace an existing OUTPUT"
    )
    parser.add_argument(
        "--ids-only",
        action="store_true",
        help="saved_model only: no string endpoints (the SavedModel loads "
        "with TensorFlow alone)",
    )
    args = parser.parse_args(argv)
    if args.ids_only and args.format != "saved_model":
        parser.error("--ids-only applies to --format saved_model only")
    refuse_output_over_input(parser, args.output, args.preset)
    refuse_existing_output(parser, args)
    # Importing keras_mhf registers its classes for from_preset.
    from keras_mhf.export import export_causal_lm
    from keras_mhf.models.preset_loading import load_causal_lm

    model = load_causal_lm(args.preset)
    if args.format == "transformers":
        path = model.export_to_transformers(
            args.output, overwrite=args.overwrite
        )
        print(f"Hugging Face checkpoint written to {path}")
        return
    path = export_causal_lm(
        model,
        args.output,
        overwrite=args.overwrite,
        include_text_endpoints=not args.ids_only,
    )
    print(f"SavedModel written to {path}")


if __name__ == "__main__":
    main()
