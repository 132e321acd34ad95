"""The fused divergence kernel: the chunk driver and its autograd function (`divergence`), the per-chunk
math (`chunk_chain`), the GEMMs of the precision policy (`gemm`) and the unfused reference the tests
compare with (`reference`). It imports nothing else of `mopd.train`."""
