"""What a run leaves on disk.

rundir        the run directory, its saved configuration, --resume
checkpoints   orbax checkpoints: written atomically, verified, the newest good one restored
runlog        the run log: its schema, its records, run.jsonl and TensorBoard
"""
