"""Jobs: the overview, a job's page, goodput and the recovery timeline."""
