"""The job's configuration (floor 1): ``job_config`` is the schema, ``JobConfig``, one
documented dataclass per TOML section; ``manager`` holds ``ConfigManager``, which reads TOML
and ``--section.key value`` into it;
``parsing`` turns text into typed values with errors that name the key; ``checks`` holds the
rules across options. Nothing here imports the rest of the project but the ground floor
(``errors``, ``choices``)."""
