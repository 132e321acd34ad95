"""Training checkpoints: their state and files (`state`), where a run starts and every refusal of a
resume (`resume`), what a run was trained on (`run_record`), and the student as a transformers
checkpoint (`export`)."""
