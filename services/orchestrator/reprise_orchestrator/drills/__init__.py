"""Recovery drills: inject a fault into a running job and measure its recovery against the objective."""
