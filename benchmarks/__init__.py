"""The measurement and check scripts of keras_mhf, and their results.

Run from the repository root (this package is not installed with the
library: it runs from a checkout); each module's `--help` gives its options,
its docstring the commands that wrote the committed results in
`benchmarks/results/`:

- `accumulation_memory`: peak training memory of gradient accumulation
  against the micro-batch's: `python -m benchmarks.accumulation_memory`.
- `accelerator_check`: MHF against Standard at the paper's 100M shape on a
  GPU or TPU (the accelerator run-book): `bash
  benchmarks/accelerator_check.sh`, which installs what is missing and runs
  `python -m benchmarks.accelerator_check`.
- `benchmark`: training, generation and scoring speed, memory and MFU of MHF
  against Standard: `python -m benchmarks.benchmark`.
- `benchmark_data`: the streaming data path's memory, throughput and resume
  time: `python -m benchmarks.benchmark_data`.
- `benchmark_evaluation`: the compiled scorer against the eager path:
  `python -m benchmarks.benchmark_evaluation`.
- `candidate_certificate`: when candidate decoding's certificate holds:
  `python -m benchmarks.candidate_certificate`.
- `check_transformers_versions`: a Hugging Face export loaded with several
  transformers releases: `python -m benchmarks.check_transformers_versions`.
- `checkpoint_blocking`: how long a checkpoint stops training:
  `python -m benchmarks.checkpoint_blocking`.
- `evaluation_at_scale`: `keras-mhf evaluate` on benchmark-sized task
  files: `python -m benchmarks.evaluation_at_scale --preset PRESET`.
- `head_blocking`: the fused head's compiled program at a device's shape:
  `python -m benchmarks.head_blocking`.
- `head_memory`: peak training memory of the fused head against the
  unchunked one and Standard: `python -m benchmarks.head_memory`.
- `multiprocess_check`: multi-process pre-training against one process:
  `python -m benchmarks.multiprocess_check`.
- `precision_curves`: bf16 against float32 loss curves:
  `python -m benchmarks.precision_curves`.
- `profile_step`: where a training step or a generated token spends its
  time (JAX profiler): `python -m benchmarks.profile_step`.
- `quantization_quality`: a quantized preset against its float32 self:
  `python -m benchmarks.quantization_quality --preset PRESET --data DATA`.
- `write_performance_docs`: docs/performance.md from the results:
  `python -m benchmarks.write_performance_docs` (`--check`: exit 1 if out of
  date).

Shared modules, not scripts: `common` (paths, worker processes, memory
readers, the models measured and their FLOP counts) and `result_tables`
(the Markdown tables of the results).
"""
