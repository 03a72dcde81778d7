"""The Standard / Standard+kL baseline (paper Sec. 4.1): KerasHub's Qwen3 on
the same trunk as MultiHashFormer, and its vocabulary growth."""
