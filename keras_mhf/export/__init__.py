"""Export: TF SavedModel with token-id and text endpoints (`saved_model`)
and the Hugging Face `transformers` interchange (`transformers`). Models
reach these through `CausalLM.export` and `export_to_transformers`."""

from keras_mhf.export.saved_model import export_causal_lm
