"""What every job shares: timing, rows of data, their rendering, the frontier, plots, progress."""
