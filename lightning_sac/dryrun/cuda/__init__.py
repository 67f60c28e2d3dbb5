"""A CUDA target on fake CPU tensors: CUDA's autocast policy, its attention kernels, its caching allocator."""
