"""mopd.rollout: the student samples its own rows (`mopd rollout`), and rounds of sample, score, train."""
