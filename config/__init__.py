"""mopd.config: the one YAML config shared by `mopd precompute`, `mopd train` and `verify-manifest`
(DESIGN §9): its top-level model, its loading, and the sections of precompute, training and model
parallelism. The store's own section is `mopd.store.config`'s; the store needs nothing of this package."""
