"""The store's arrays on disk: zarr v3 shard files written one writer per array (`write`), read back
chunk by chunk with each chunk's checksum checked and decoded once (`read`), each file bound to the part
record that published it (`binding`), and tensors to and from their stored bit patterns (`dtypes`)."""
