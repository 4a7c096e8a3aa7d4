"""Running an experiment: the Hydra app, one run (experiment, driver), its measurement window,
repeats and sweeps, progress lines and interruption handling."""
