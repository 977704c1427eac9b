"""The run's life (floor 4), beside its checkpoints: ``lock`` holds one run per dump folder;
``launch_history`` keeps each launch's resolved config and checks that a resume continues the
same run; ``preemption`` turns a signal or the time limit into a save and a requeue, and names
the exit codes."""
