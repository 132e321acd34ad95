"""mopd.base: what every layer uses and that is not about the teacher store — errors, file and JSON
helpers, completion markers, fault injection, devices, batching, the config sections' base, the version."""
