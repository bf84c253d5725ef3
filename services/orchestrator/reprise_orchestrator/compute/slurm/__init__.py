"""The slurm compute backend (backend.py): Reprise's agents run the ranks inside Slurm's allocations, Slurm owns the
nodes. Slurm's commands go through one typed adapter (cli.py; the values it takes and gives, models.py), the batch
script of an allocation starts the agents (batch.py), and Slurm's own failure signals come from two reads of its nodes
and jobs (signals.py)."""
