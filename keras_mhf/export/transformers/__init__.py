"""Hugging Face `transformers` interchange: weight-name tables, the
checkpoint exporters (`export_multi_hash_former`, `export_qwen3`), the
SentencePiece tokenizer export and the stock-Qwen3 importer, mirroring
`keras_hub/src/utils/transformers/`. Nothing here imports `transformers`."""
