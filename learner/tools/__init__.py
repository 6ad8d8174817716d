"""Programs around a learner: seedrl-eval, the plots, a learner on a background thread."""
