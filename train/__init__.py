"""mopd.train: divergence kernels and (later) the student trainer."""
