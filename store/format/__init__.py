"""What the store's records say: the manifest, plan and part records and their I/O (`manifest`), the
pure task plan and the arrays each task kind writes (`layout`), teacher indices and lists
(`teachers`), checkpoint fingerprints (`fingerprint`), logit transforms (`transform`) and ingest records
(`provenance`)."""
