"""Where a store's files live and how they are committed: the `Location` interface every read and
write goes through (`location`), a POSIX folder (`folder`), a prefix of an object-storage bucket
(`bucket`), and the temporaries stopped jobs leave (`temporaries`)."""
