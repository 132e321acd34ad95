"""mopd.config: the one YAML config shared by `mopd precompute`, `mopd train` and `verify-manifest`
(DESIGN §9): its top-level model, its loading, and its sections (store, precompute, training, model
parallelism, rollout). The store needs nothing of this package: it is handed the values it checks."""
