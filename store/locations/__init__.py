"""Where a store's files live and how they are committed: the `Location` interface every read and
write goes through (`location`), a POSIX folder (`folder`) and a prefix of an object-storage bucket
(`bucket`), with the thread pools their requests share. Nothing here knows what the files mean."""
