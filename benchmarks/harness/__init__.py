"""What every job shares: timing, compiled memory, the block stack, rows of data, their rendering,
the frontier, plots, progress."""
