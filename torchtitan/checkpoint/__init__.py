"""A run's state on disk: ``manager`` saves and resumes DCP checkpoints (atomic ``step-N``
folders, the best one, seeds); ``reading`` finds step folders and reads weights out of them;
``train_state`` is the step, generator and best score a checkpoint holds; ``convert`` turns
Meta's DINOv3 ``.pth`` files into seed checkpoints and back. The run's life around them (its
lock, launches and stops) is :mod:`torchtitan.run`."""
