"""What each rank trains on: the data order, a pure function of the store's row lengths, the seed, the
epoch and the rank (`order`), and the loader that streams each step's rows and states (`loader`)."""
