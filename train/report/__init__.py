"""What a run reports: metrics.jsonl, the step and eval lines and the plot (`metrics`), the trackers fed
the same records (`tracking`), and the memory estimate before step 1 (`memory`)."""
