"""What the helper scripts (``helpers/*.py``) share (floor 6): their parser and flags
(:mod:`~torchtitan.scripts.cli`) and label crops read whole (:mod:`~torchtitan.scripts.label_crops`)."""
