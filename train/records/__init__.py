"""What a run leaves on disk.

rundir        the run directory, its saved configuration, --resume
lock          one run per run directory: the directory's file lock
checkpoints   orbax checkpoints: written atomically, verified, the newest good one restored
runlog        the run log: its schema, its records, run.jsonl and TensorBoard
"""
