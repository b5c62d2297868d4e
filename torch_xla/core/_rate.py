"""`xm.RateTracker`: samples-per-second rates for training logs."""
