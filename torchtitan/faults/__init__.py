"""Job faults: what happens when a process, a launcher or a replica group stops.

One home for the three ways a job meets a fault: ``preemption`` (a signal to any rank
stops every rank at the same step, after its checkpoint), ``launcher`` (a rank whose
torchrun died takes that as a SIGTERM) and ``fault_tolerance`` (live recovery of replica
groups with torchft: quorum, split, commit, heal, which group saves).

Never: write checkpoints itself (the loop asks the checkpoint manager) or read data
beyond the loader's position it moves.
"""
