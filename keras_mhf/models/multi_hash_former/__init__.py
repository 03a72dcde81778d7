"""The MultiHashFormer family (paper Sec. 3), one class or idea per file:
architectures (named presets), tokenizer and preprocessor, backbone
(signature lookup -> hash encoder -> Qwen3 trunk), causal LM task, inference
(Sec. 3.4: token scores, the vocabulary scan, candidate decoding), vocabulary
(table from a tokenizer, tokenizer checks, expansion) and the layout map."""
