"""A run's state on disk and its survival: ``manager`` saves and resumes DCP checkpoints
(atomic ``step-N`` folders, the best one, seeds); ``reading`` finds step folders and reads
weights out of them; ``launch_history`` keeps each launch's resolved config and checks that a
resume continues the same run; ``run_lock`` holds one run per dump folder; ``preemption``
turns a signal or time limit into a save and a requeue; ``train_state`` is the step, generator
and best score a checkpoint holds; ``convert`` turns Meta's DINOv3 ``.pth`` files into seed
checkpoints and back."""
