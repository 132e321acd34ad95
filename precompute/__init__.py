"""mopd.precompute: run teacher checkpoints over a dataset and fill the teacher store."""
