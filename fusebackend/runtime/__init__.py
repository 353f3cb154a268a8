"""Runtime: the shape-keyed CUDA-graph cache and the counters. Knows nothing about fusion."""
